"""Culprit rules in real multi-process DDP jobs (gloo, CPU), and the pure
rules behind them: one fault gives one verdict, its consequences go into
that verdict's ``evidence.consequences``.

Multi-process tests are heavy: run them alone, under the shared lock, e.g.
    flock /tmp/rankwatch-heavy.lock python -m pytest -q tests/test_verdict_rules.py -k uneven
"""

from __future__ import annotations

import datetime as dt
import json

import pytest

from conftest import SCRIPTS, ddp_script, run_job
from rankwatch import wire
from rankwatch.collector.analyses import explain_away, hang
from rankwatch.collector.analyses.common import iso
from rankwatch.collector.evidence import RankEvidence
from rankwatch.collector.state import Incident, RunState


def _t(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def _time_to_verdict(v: dict) -> float:
    return round(_t(v["detected_at"]) - _t(v["first_seen_at"]), 2)


def _one(job, kind: str) -> dict:
    verdicts = job.verdicts()
    assert len(verdicts) == 1, f"one fault, one verdict: {json.dumps(verdicts, indent=1)[:4000]}\n{job.output[-3000:]}"
    assert verdicts[0]["kind"] == kind, json.dumps(verdicts, indent=1)[:4000]
    _same_offline(job)
    return verdicts[0]


def _same_offline(job) -> None:
    """`rankwatch analyze` on the run dir gives the verdicts of the live run."""
    from rankwatch.collector.offline import analyze_path

    offline = wire.to_dict(analyze_path(job.run_dir))
    live = [(v["kind"], v["ranks"], v["step"]) for v in job.verdicts()]
    assert [(v["kind"], v["ranks"], v["step"]) for v in offline["verdicts"]] == live, offline["verdicts"]


# -- 1. uneven endings -------------------------------------------------------------------

_UNEVEN = """
import sys, time
from torch.utils.data import DataLoader, Dataset

MODE = {mode!r}
rank = dist.get_rank()


class Shard(Dataset):
    # Each rank reads its own shard; rank 1's is shorter (uneven data), or
    # holds a corrupt record.
    def __init__(self, n):
        self.x = torch.randn(n, 32, generator=torch.Generator().manual_seed(rank))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if MODE == "loader_exception" and rank == 1 and i == 8 * 16 + 3:
            raise ValueError(f"corrupt record {{i}} in shard {{rank}}")
        return self.x[i]


def main():
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = 8 if (MODE == "return" and rank == 1) else 40
    loader = DataLoader(Shard(batches * 16), batch_size=16, num_workers=1 if MODE == "loader_exception" else 0)
    for step, x in enumerate(loader):
        if MODE == "sys_exit" and rank == 1 and step == 8:
            print("rank 1: early stopping", flush=True)
            sys.exit(0)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.05)
    # the data ran out ("return"): this rank leaves while its peers train on


main()
"""


@pytest.mark.parametrize("mode", ["sys_exit", "return", "loader_exception"])
def test_uneven_ending_names_the_rank_that_left(tmp_path, mode):
    script = ddp_script(tmp_path, "uneven.py", _UNEVEN.format(mode=mode))
    job = run_job(tmp_path, ["--nproc-per-node", "3", str(script)])
    assert job.exit_code != 0, "the peers failed"
    if mode == "return":
        # Uneven data is named at the first step, from the loaders' lengths
        # (issue 18); the hang that comes when rank 1 runs out is its consequence.
        v = _one(job, "config_divergence")
        assert (v["ranks"], v["step"]) == ([1], 0), v
        assert "Rank 1 had 8 batches per epoch, ranks 0, 2 had 40" in v["summary"], v["summary"]
        consequences = v["evidence"]["consequences"]
        hang = next(c for c in consequences if c["kind"] == "hang")
        assert (hang["ranks"], hang["step"]) == ([1], 8), hang
        assert "exit code 0" in hang["summary"] and "left the training loop" in hang["summary"], hang["summary"]
        assert {c["ranks"][0] for c in consequences if c["kind"] == "crash"} >= {0, 2}, consequences
        return
    kind = "crash" if mode == "loader_exception" else "hang"
    v = _one(job, kind)
    assert v["ranks"] == [1], v
    assert v["step"] == 8, v
    consequences = v["evidence"]["consequences"]
    assert {c["ranks"][0] for c in consequences if c["kind"] == "crash"} >= {0, 2}, consequences
    if kind == "hang":
        assert "exit code 0" in v["summary"] and "left the training loop" in v["summary"], v["summary"]
    else:
        assert "ValueError" in v["summary"] and "corrupt record" in v["summary"], v["summary"]
    print(f"\n[{mode}] {v['kind']} on {v['ranks']} step {v['step']}: time to verdict {_time_to_verdict(v)} s; "
          f"job {job.elapsed:.1f} s\n  {v['summary']}")


# -- 2. consequences, not new verdicts --------------------------------------------------------

_NAN_THEN_RAISE = """
import time
rank = dist.get_rank()
torch.manual_seed(0)
policy = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)))
opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(rank)
for step in range(40):
    obs = torch.randn(32, 16, generator=g)
    pi = torch.distributions.Categorical(logits=policy(obs))  # raises on NaN logits
    actions = pi.sample()
    advantage = torch.randn(32, generator=g)
    if rank == 1 and step == 6:
        advantage[5] = float("nan")  # a NaN reward on one rank's rollout
    loss = -(pi.log_prob(actions) * advantage).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.05)
"""


def test_nan_then_crash_on_every_rank_is_one_nonfinite_verdict(tmp_path):
    script = ddp_script(tmp_path, "ppo_nan.py", _NAN_THEN_RAISE)
    job = run_job(tmp_path, ["--nproc-per-node", "3", str(script)])
    assert job.exit_code != 0, "the NaN weights made the script raise"
    v = _one(job, "nonfinite")
    assert v["ranks"] == [1] and v["step"] == 6, v
    crashes = [c for c in v["evidence"]["consequences"] if c["kind"] == "crash"]
    assert crashes and "ValueError" in json.dumps(crashes), v["evidence"]["consequences"]
    print(f"\nnonfinite on {v['ranks']} step {v['step']}: time to verdict {_time_to_verdict(v)} s\n  {v['summary']}")


def test_mismatch_then_the_culprits_own_abort_is_one_verdict(tmp_path, train_script):
    """gloo aborts the rank with the extra small collective (SIGABRT): that
    abort is the mismatch's consequence, not a second verdict."""
    job = run_job(tmp_path, ["--nproc-per-node", "3", "--hang-timeout", "8", str(train_script),
                             "--steps", "30", "--fault", "extra_small", "--fault-size", "8",
                             "--fault-rank", "1", "--fault-step", "5"])
    assert job.exit_code != 0
    v = _one(job, "collective_mismatch")
    assert v["ranks"] == [1] and v["step"] == 5, v
    kinds = {c["kind"] for c in v["evidence"].get("consequences", [])}
    assert kinds & {"crash", "hang"}, v["evidence"]
    print(f"\ncollective_mismatch on {v['ranks']}: time to verdict {_time_to_verdict(v)} s; "
          f"consequences {sorted(kinds)}\n  {v['summary']}")


_LEAK_SLOWS = """
import time
rank = dist.get_rank()
torch.manual_seed(rank)  # each rank its own data
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
replay = []  # rank 0 keeps every batch of observations and never drops one: the leak
for step in range(70):
    x = torch.randn(64, 256)
    if rank == 0:
        replay.append(torch.randn(1024, 1024))  # 4 MiB a step
        mean = torch.cat(replay).mean(0)  # a normaliser over the whole buffer: slower as it grows
        x = x - mean[:256] * 0
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.02)
"""


def test_slowdown_caused_by_a_leak_is_the_leaks_consequence(tmp_path):
    script = ddp_script(tmp_path, "leak_slows.py", _LEAK_SLOWS)
    job = run_job(tmp_path, ["--nproc-per-node", "3", str(script)])
    assert job.exit_code == 0, job.output[-3000:]
    v = _one(job, "memory_growth")
    assert v["ranks"] == [0], v
    consequences = v["evidence"].get("consequences", [])
    assert [c["ranks"] for c in consequences if c["kind"] == "straggler"] == [[0]], consequences
    print(f"\nmemory_growth on {v['ranks']}: time to verdict {_time_to_verdict(v)} s; "
          f"consequences {[c['kind'] for c in consequences]}\n  {v['summary']}")


# -- 3. a rank frozen in C code with the GIL held --------------------------------------------

_FROZEN = """
import ctypes, time
rank = dist.get_rank()
torch.manual_seed(rank)  # each rank its own data
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
libc = ctypes.PyDLL(None)  # PyDLL: the call keeps the GIL, as a C extension that never releases it
mutex = ctypes.create_string_buffer(64)  # a zeroed pthread mutex (glibc's static initializer)


def native_update(tensor):
    libc.pthread_mutex_lock(mutex)
    if rank == 1 and step == 6:
        if {how!r} == "deadlock":
            # A C routine that deadlocks on its own (non-recursive) lock: no
            # signal ends the wait, and every other Python thread stops too.
            libc.pthread_mutex_lock(mutex)
        else:
            # A long C call holding the GIL. The supervisor's faulthandler
            # signal ends it early: the rank then goes on ahead of the peers'
            # snapshots, and its own Flight Recorder shows a higher sequence
            # number than the peers that waited for it.
            libc.sleep(600)
    libc.pthread_mutex_unlock(mutex)


for step in range(200):
    x = torch.randn(16, 32)
    loss = model(x).pow(2).mean()
    native_update(loss)
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.05)
"""


@pytest.mark.parametrize("how", ["deadlock", "sleep"])
def test_rank_frozen_holding_the_gil_is_the_hung_rank(tmp_path, how):
    script = ddp_script(tmp_path, "frozen.py", _FROZEN.format(how=how))
    job = run_job(tmp_path, ["--nproc-per-node", "3", "--hang-timeout", "8", str(script)])
    assert job.exit_code != 0, "rankwatch ends a hung job"
    v = _one(job, "hang")
    assert v["ranks"] == [1], v
    assert v["step"] == 6, v
    assert "frozen in its own code" in v["summary"] and "heartbeat thread stopped" in v["summary"], v["summary"]
    if how == "deadlock":  # py-spy's own view (still frozen when the verdict is made) says who holds the GIL
        assert "holding the GIL" in v["summary"], v["summary"]
    assert "frozen.py" in v["summary"], v["summary"]
    assert ("pthread_mutex_lock" if how == "deadlock" else "sleep") in v["summary"], v["summary"]
    assert _time_to_verdict(v) <= 8 + 5
    seqs = {r: (info["collective_seq"] or {}).get("0") for r, info in v["evidence"]["ranks"].items()}
    print(f"\n[{how}] sequence numbers seen: {seqs}")
    print(f"\n[{how}] hang on {v['ranks']} step {v['step']}: time to verdict {_time_to_verdict(v)} s\n  {v['summary']}")


_FROZEN_ON_THE_WAY_OUT = """
import ctypes, time
rank = dist.get_rank()
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(10):
    loss = model(torch.randn(16, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.05)
del model
if rank == 1:
    dist.destroy_process_group()
    # As torch 2.13's gloo teardown deadlock does now and then: the main
    # thread blocks in C holding the GIL (there, joining a worker thread
    # that waits for the GIL). A second lock of a plain mutex never returns.
    libc, mutex = ctypes.PyDLL(None), ctypes.create_string_buffer(64)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)
"""


def test_a_rank_frozen_on_its_way_out_is_named_and_the_one_that_exited_is_not(tmp_path):
    """Every rank trained to the end; rank 0 exited cleanly and rank 1 froze
    in teardown. Plain torchrun would wait forever. The hang is rank 1's, on
    its way out; rank 0, which nobody waits for, is not named."""
    script = ddp_script(tmp_path, "frozen_at_exit.py", _FROZEN_ON_THE_WAY_OUT)
    job = run_job(tmp_path, ["--nproc-per-node", "2", "--hang-timeout", "5", str(script)])
    assert job.exit_code != 0, "rankwatch ends a job that cannot end"
    v = _one(job, "hang")
    assert (v["ranks"], v["step"]) == ([1], 10), v
    assert "stuck on its way out (in destroy_process_group or after it)" in v["summary"], v["summary"]
    assert "rank 0 finished too and exited cleanly" in v["summary"], v["summary"]
    assert "pthread_mutex_lock" in v["summary"], v["summary"]
    assert v["evidence"]["ranks"]["0"]["exit_code"] == 0
    # What rank 1 recorded went out before its teardown froze it (with its
    # heartbeat thread): every step's record, the last one included.
    from rankwatch.collector.offline import load

    run, _ = load(job.run_dir)
    assert max(run.ranks[1].steps, default=None) == 9, sorted(run.ranks[1].steps)
    print(f"\nfrozen on the way out: {v['ranks']} step {v['step']}, job {job.elapsed:.1f} s\n  {v['summary']}")


# -- the pure rules (no processes) ------------------------------------------------------------


def _verdict(kind, ranks, at, step=None, detected=None, evidence=None, summary="x"):
    return wire.Verdict(kind=kind, ranks=ranks, step=step, first_seen_at=iso(at),
                        detected_at=iso(detected if detected is not None else at + 1), summary=summary,
                        evidence=evidence or {})


T = 1_700_000_000.0


def test_explain_away_nonfinite_absorbs_a_later_crash_on_every_rank():
    nan = _verdict("nonfinite", [1], T, step=6)
    crash = _verdict("crash", [0, 1, 2], T + 2, step=7, summary="ValueError: ... found invalid values")
    out = explain_away([crash, nan])
    assert [v.kind for v in out] == ["nonfinite"]
    assert out[0].evidence["consequences"][0]["kind"] == "crash"
    again = explain_away(out + [crash])  # idempotent: a re-run adds nothing twice
    assert len(again) == 1 and len(again[0].evidence["consequences"]) == 1
    assert again[0].summary == out[0].summary


def test_explain_away_a_nonfinite_step_announced_with_the_first_ranks_is_the_fuller_ones():
    """Found by bench/sensitivity_jobs.py: a NaN that reached every rank at step
    46 was announced with the three ranks whose records came first, then found
    with all four; the report held both. The fuller one is the verdict."""
    early = _verdict("nonfinite", [0, 1, 3], T, step=46)
    full = _verdict("nonfinite", [0, 1, 2, 3], T + 0.01, step=46)
    out = explain_away([full, early])
    assert [(v.kind, v.ranks) for v in out] == [("nonfinite", [0, 1, 2, 3])]
    assert out[0].evidence["consequences"][0]["ranks"] == [0, 1, 3]
    other_step = _verdict("nonfinite", [0, 1], T + 5, step=50)  # not a subset at the same step: kept apart
    assert len(explain_away([early, other_step])) == 2


def test_explain_away_keeps_an_unrelated_crash_on_one_rank():
    nan = _verdict("nonfinite", [1], T, step=6)
    crash = _verdict("crash", [2], T + 30, step=40, summary="FileNotFoundError: checkpoint.pt")
    assert sorted(v.kind for v in explain_away([nan, crash])) == ["crash", "nonfinite"]


def test_explain_away_mismatch_absorbs_the_culprits_own_abort_and_the_hang():
    mismatch = _verdict("collective_mismatch", [2], T, step=5)
    abort = _verdict("crash", [2], T + 0.5, step=5, summary="killed by SIGABRT")
    hang_v = _verdict("hang", [2], T - 0.2, step=5, detected=T + 9)
    out = explain_away([hang_v, abort, mismatch])
    assert [v.kind for v in out] == ["collective_mismatch"]
    assert sorted(c["kind"] for c in out[0].evidence["consequences"]) == ["crash", "hang"]


def test_explain_away_a_crash_that_made_peers_wait_is_the_root_of_the_hang():
    crash = _verdict("crash", [3], T + 1, step=9)
    hang_v = _verdict("hang", [3], T, step=9, detected=T + 30,
                      evidence={"ranks": {"3": {"exited": True, "exited_at": T + 1}}})
    out = explain_away([hang_v, crash])
    assert [v.kind for v in out] == ["crash"]


def test_explain_away_a_hang_absorbs_its_victims_crash():
    hang_v = _verdict("hang", [1], T, step=8, evidence={"ranks": {"1": {"exited": True, "exited_at": T}}})
    crash = _verdict("crash", [0], T + 0.3, step=8, summary="Connection closed by peer")
    out = explain_away([crash, hang_v])
    assert [v.kind for v in out] == ["hang"]


def test_explain_away_leak_absorbs_its_own_slowdown_not_a_peers():
    growth = _verdict("memory_growth", [0], T, step=3)
    own = _verdict("straggler", [0], T + 5, step=10)
    other = _verdict("straggler", [2], T + 5, step=10)
    assert [v.kind for v in explain_away([own, growth])] == ["memory_growth"]
    assert sorted(v.kind for v in explain_away([other, growth])) == ["memory_growth", "straggler"]


def _frozen_run(frozen_seq: int, waiting_seq: int) -> tuple[RunState, Incident]:
    run = RunState(run_id="r", world_size=3)
    incident = Incident(id="hang-1", kind="hang", opened_at=T + 20, last_progress_at=T, ready=True,
                        details={"diagnosed_at": T + 22})
    run.incidents.append(incident)
    waiting = [{"file": "/x/train.py", "line": 30, "name": "main", "code": "loss.backward()"},
               {"file": "/usr/lib/python3/site-packages/torch/autograd/graph.py", "line": 5, "name": "_engine_run_backward"}]
    frozen = [{"file": "/x/train.py", "line": 28, "name": "main", "code": "native_update(loss)"},
              {"file": "/x/train.py", "line": 12, "name": "native_update", "code": "libc.pthread_mutex_lock(mutex)"}]
    for r in range(3):
        state = run.rank(r)
        state.step, state.phase = 6, "forward"
        state.last_heartbeat_at = T + 19.5 if r != 1 else T + 1
        is_frozen = r == 1
        ev = RankEvidence(rank=r, reason="hang", created_at=T + 21, source="supervisor" if is_frozen else "agent",
                          stacks=[{"main": True, "frames": frozen if is_frozen else waiting,
                                   "owns_gil": True if is_frozen else None}],
                          pg_enqueued={"0": frozen_seq if is_frozen else waiting_seq})
        if is_frozen:
            ev.native_stacks = ('Thread 7 (idle): "MainThread"\n    __lll_lock_wait (libc.so.6)\n'
                                '    pthread_mutex_lock (libc.so.6)\n    ffi_call (libffi.so.8)\n'
                                '    native_update (train.py:12)\n')
        state.evidence["hang-1"] = ev
    return run, incident


def test_frozen_rank_outranks_the_sequence_numbers():
    """The frozen rank's last report is ahead of the peers that wait for it
    (it enqueued an asynchronous collective before it froze): the frozen
    rank, not a waiting peer, is the hung rank."""
    run, incident = _frozen_run(frozen_seq=41, waiting_seq=40)
    v = hang.diagnose(run, incident)
    assert v.ranks == [1], v.summary
    assert "GIL" in v.summary and "pthread_mutex_lock" in v.summary, v.summary


def test_a_stale_rank_waiting_in_a_collective_is_not_frozen():
    run, incident = _frozen_run(frozen_seq=39, waiting_seq=40)
    ev = run.ranks[1].evidence["hang-1"]
    ev.stacks = [{"main": True, "owns_gil": False, "frames": [
        {"file": "/x/train.py", "line": 30, "name": "main", "code": "loss.backward()"},
        {"file": "/site-packages/torch/autograd/graph.py", "line": 5, "name": "_engine_run_backward"}]}]
    v = hang.diagnose(run, incident)
    assert v.ranks == [1]  # still the rank behind, by the sequence numbers
    assert "never reached collective #40" in v.summary, v.summary


# -- 3b. a rank stuck on its way out, after every rank finished ----------------------------------

_GLOO_TEARDOWN = ('Thread 7 (idle): "MainThread"\n    std::thread::join (libstdc++.so.6.0.30)\n'
                  '    c10d::ProcessGroupGloo::~ProcessGroupGloo (libtorch_cpu.so)\n'
                  '    c10d::Reducer::~Reducer (libtorch_cpu.so)\n    pybind11_object_dealloc (libtorch_python.so)\n'
                  '    <module> (train.py:81)\n')


def _ended_run(*, left_step: int, left_forwards: int, peer_forwards: int, peer_phase: str,
               left_seq: int = 7, peer_seq: int = 6) -> tuple[RunState, Incident]:
    """Rank 0 exited cleanly; rank 1's heartbeat stopped (its native stack
    as the supervisor took it: torch 2.13's gloo teardown deadlock, the
    main thread joining a worker that waits for the GIL)."""
    run = RunState(run_id="r", world_size=2)
    incident = Incident(id="hang-1", kind="hang", opened_at=T + 5, last_progress_at=T, ready=True,
                        details={"diagnosed_at": T + 6})
    run.incidents.append(incident)
    left, peer = run.rank(0), run.rank(1)
    left.step, left.forwards, left.phase, left.enqueued = left_step, left_forwards, "exited", {"0": left_seq}
    left.exit_code, left.exited_at = 0, T
    peer.step, peer.forwards, peer.phase, peer.enqueued = 10, peer_forwards, peer_phase, {"0": peer_seq}
    peer.last_heartbeat_at = T - 0.5
    ev = RankEvidence(rank=1, reason="hang", created_at=T + 6, source="supervisor",
                      stacks=[{"main": True, "owns_gil": True, "frames": [
                          {"file": "/x/train.py", "line": 81, "name": "<module>", "code": "main()"}]}])
    ev.native_stacks = _GLOO_TEARDOWN
    peer.evidence["hang-1"] = ev
    return run, incident


@pytest.mark.parametrize("phase", ["teardown", "data"])
def test_a_rank_stuck_after_every_rank_finished_is_named_not_the_one_that_exited(phase):
    """Both ranks finished step 10; rank 0 exited cleanly, rank 1 froze on
    its way out (a CI run named rank 0, "left the training loop ... while
    the others still wait for it", and ended a job that had trained to the
    end). Nobody waits for rank 0: rank 1 is the hang, in teardown. With the
    agent's teardown phase, or without it (a script that never calls
    destroy_process_group)."""
    run, incident = _ended_run(left_step=10, left_forwards=10, peer_forwards=10, peer_phase=phase)
    v = hang.diagnose(run, incident)
    assert v.ranks == [1], v.summary
    assert "finished training (step 10) and is stuck on its way out" in v.summary, v.summary
    assert "rank 0 finished too and exited cleanly" in v.summary, v.summary
    assert "~ProcessGroupGloo" in v.summary, v.summary
    assert "waits for it" not in v.summary and "left the training loop" not in v.summary, v.summary
    assert v.evidence["teardown"] is True


def test_every_rank_stuck_in_teardown_is_named_on_its_way_out():
    """NCCL's destroy can hang on every rank at once: no rank stands out,
    every rank finished its training, and the summary says where they are."""
    run, incident = _ended_run(left_step=10, left_forwards=10, peer_forwards=10, peer_phase="teardown", peer_seq=7)
    gone = run.ranks[0]
    gone.exit_code, gone.exited_at, gone.phase = None, None, "teardown"
    gone.last_heartbeat_at = run.ranks[1].last_heartbeat_at = T + 4.5  # both beating, waiting in C
    run.ranks[1].evidence.clear()
    v = hang.diagnose(run, incident)
    assert v.ranks == [0, 1], v.summary
    assert v.summary.startswith("Ranks 0, 1 finished training (step 10) and are stuck on their way out "
                                "(in destroy_process_group or after it)"), v.summary
    assert v.evidence["teardown"] is True


@pytest.mark.parametrize("how", ["a_step_further", "mid_step", "a_collective_further"])
def test_a_rank_that_left_before_its_peers_is_still_the_one_they_wait_for(how):
    """The same shapes, but the peer went on past where rank 0 left: into
    the next forward, in the middle of a step, or into a collective rank 0
    never enqueued (an evaluation barrier after the loop)."""
    shape = {"a_step_further": dict(left_step=10, left_forwards=10, peer_forwards=11, peer_phase="backward"),
             "mid_step": dict(left_step=10, left_forwards=10, peer_forwards=10, peer_phase="optimizer"),
             "a_collective_further": dict(left_step=10, left_forwards=10, peer_forwards=10, peer_phase="data",
                                          peer_seq=8)}[how]
    run, incident = _ended_run(**shape)
    v = hang.diagnose(run, incident)
    assert v.ranks == [0], v.summary
    assert "left the training loop and exited (exit code 0)" in v.summary, v.summary
    assert "Rank 1 waits for it" in v.summary, v.summary


# -- 4. the hang summary always quotes the source line -------------------------------------------


def test_stacks_taken_from_outside_carry_the_source_line(train_script):
    """py-spy and faulthandler give file and line only; when the agent's own
    bundle misses the evidence window (a loaded machine), the summary is
    built from them and must still quote the line."""
    from rankwatch.collector.analyses.common import where
    from rankwatch.collector.evidence import fill_source
    from rankwatch.node.supervisor import _pyspy_to_stacks, with_source

    lines = train_script.read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if "time.sleep(3600)" in text and "compute" in text)
    pyspy = [{"thread_name": "MainThread", "os_thread_id": 7, "frames": [
        {"name": "main", "filename": str(train_script), "line": line},
        {"name": "<module>", "filename": str(train_script), "line": len(lines) - 1}]}]
    stacks = _pyspy_to_stacks(pyspy, 7)
    assert "time.sleep(3600)" in where(stacks[0]["frames"])
    fault = [{"main": True, "frames": [{"file": str(train_script), "line": line, "name": "main", "code": ""}]}]
    assert "time.sleep(3600)" in where(with_source(fault)[0]["frames"])
    # The collector's own fallback: the same file and line seen in any other evidence.
    bare = [{"file": "/elsewhere/train.py", "line": 94, "name": "main", "code": ""}]
    donor = RankEvidence(rank=0, reason="hang", created_at=T, source="agent", stacks=[{"main": True, "frames": [
        {"file": "/elsewhere/train.py", "line": 94, "name": "main", "code": "time.sleep(3600)"}]}])
    assert "time.sleep(3600)" in where(fill_source(bare, [donor]))


def test_healthy_uneven_finish_is_no_verdict():
    """Ranks that finish at different times, none failing: nothing to say."""
    from rankwatch.collector.analyses import run_all

    run = RunState(run_id="r", world_size=3)
    for r in range(3):
        state = run.rank(r)
        state.step, state.exit_code, state.exited_at = 40, 0, T + r * 5
    assert hang.left_the_loop(run, T + 20) is None
    assert run_all(run, T + 20, True) == []


def test_all_to_all_with_per_rank_split_sizes_is_not_a_mismatch():
    from rankwatch.collector.analyses import collective_mismatch
    from rankwatch.collector.evidence import CollectiveEntry

    run = RunState(run_id="r", world_size=3)
    for r in range(3):  # two ranks send 4 rows, one sends 6: a majority and a minority by size
        entries = [CollectiveEntry(pg="0", seq=1, op="all_reduce", input_sizes=[[10]], input_dtypes=["Float"],
                                   created_ns=1, retired=True),
                   CollectiveEntry(pg="0", seq=2, op="all_to_all", input_sizes=[[4 if r < 2 else 6, 8]],
                                   input_dtypes=["Float"], created_ns=2, retired=True)]
        run.rank(r).evidence["hang-1"] = RankEvidence(rank=r, reason="hang", created_at=T, source="agent",
                                                      collectives=entries)
    assert collective_mismatch.detect(run, T, True) == []


def _uneven_run(leaver_code: int, rank2_error: tuple = ()) -> RunState:
    run = RunState(run_id="r", world_size=3)
    for r in range(3):
        state = run.rank(r)
        state.step, state.phase = 8, "backward"
    leaver = run.ranks[1]
    leaver.exit_code, leaver.exited_at = leaver_code, T
    leaver.events.append(wire.Event(kind="exit", at=T, step=8, details={"exit_code": leaver_code, "phase": "data"}))
    for r in (0, 2):
        state = run.ranks[r]
        state.enqueued = {"0": 14}
        etype, message, at = (rank2_error if r == 2 and rank2_error else (
            "RuntimeError", "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.1]:123", T + 0.2))
        state.events.append(wire.Event(kind="exception", at=at, step=8, details={
            "type": etype, "message": message, "traceback": "", "phase": "backward"}))
        state.exit_code, state.exited_at = 1, T + 0.4
    return run


def test_clean_exit_before_peers_connection_errors_is_the_culprit():
    from rankwatch.collector.analyses import crash, run_all

    run = _uneven_run(0)
    assert crash.detect(run, T + 10, True) == [], "no victim is blamed"
    verdicts = run_all(run, T + 10, True)
    assert [(v.kind, v.ranks, v.step) for v in verdicts] == [("hang", [1], 8)]
    assert "collective #14" in verdicts[0].summary and "'Connection closed by peer'" in verdicts[0].summary
    assert sorted(c["ranks"][0] for c in verdicts[0].evidence["consequences"]) == [0, 2]


def test_a_teardown_after_a_clean_exit_follows_from_it():
    """Ray Train ends the worker group when one worker's function returns
    (sys.exit(0) on a rank whose data ran out): its peer gets SIGTERM inside
    the next allreduce. The rank that left is the culprit, not the one the
    teardown killed first."""
    from rankwatch.collector.analyses import run_all

    run = RunState(run_id="r", world_size=2)
    for r in range(2):
        state = run.rank(r)
        state.step, state.phase = 4, "backward"
    leaver = run.ranks[1]
    leaver.exit_code, leaver.exited_at = 0, T
    leaver.events.append(wire.Event(kind="exit", at=T, step=4, details={"exit_code": 0, "phase": "forward"}))
    killed = run.ranks[0]
    killed.exit_code, killed.exited_at = -15, T + 0.5
    killed.events.append(wire.Event(kind="exit", at=T + 0.5, step=4, details={"exit_code": -15, "phase": "backward"}))
    assert [(v.kind, v.ranks, v.step) for v in run_all(run, T + 10, True)] == [("hang", [1], 4)]


def test_a_peers_own_error_after_a_clean_exit_is_still_its_crash():
    run = _uneven_run(0, rank2_error=("KeyError", "'labels'", T - 5))
    from rankwatch.collector.analyses import run_all

    assert [(v.kind, v.ranks) for v in run_all(run, T + 10, True)] == [("crash", [2])]


def test_a_teardown_collective_after_a_clean_exit_is_not_a_mismatch():
    """Lightning-shaped (faultbench lightning-early_exit-s1): rank 1 ran out of
    data and exited 0; its peers failed with "Connection closed by peer", and
    torchrun's SIGTERM made rank 3's handler (Lightning's
    _sigterm_notifier_fn) broadcast while it died. That broadcast is a
    consequence of the teardown, not a collective that met a wrong partner:
    the verdict is the rank that left, the teardown in its evidence."""
    from rankwatch.collector.analyses import run_all

    run = _uneven_run(0)
    run.world_size = 4
    late = run.rank(3)
    late.step, late.phase = 8, "backward"
    late.events.append(wire.Event(kind="exception", at=T + 1.9, step=8, details={
        "type": "RuntimeError", "message": "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.1]:9",
        "traceback": "", "phase": "backward"}))
    late.exit_code, late.exited_at = 1, T + 2.0
    for r in (0, 2, 3):
        progress = {"step": 8, "phase": "backward"}
        if r == 3:
            progress["collective"] = {"op": "broadcast", "callsite": "signal_connector.py:118 in _sigterm_notifier_fn",
                                      "numel": 1}
        run.ranks[r].evidence[f"crash-{r}"] = RankEvidence(rank=r, reason="crash", created_at=T + 2, source="supervisor",
                                                           progress=progress)
    assert [(v.kind, v.ranks, v.step) for v in run_all(run, T + 10, True)] == [("hang", [1], 8)]


@pytest.mark.parametrize("behind", [True, False])
def test_timeouts_with_a_rank_in_another_collective_are_one_verdict(behind):
    """Ranks 0 and 1 failed with the collective timeout inside an all_reduce;
    rank 2, alive, was inside a broadcast they never issued. Whether or not
    its count is behind theirs (counts in flight), the waited-out rule and
    the dying-call rule judge it with one predicate: one verdict, a
    mismatch on rank 2, without a "never reached" hang among its consequences."""
    from rankwatch.collector.analyses import run_all

    run = RunState(run_id="r", world_size=3)
    for r in range(3):
        state = run.rank(r)
        state.step, state.phase = 9, "backward"
        state.enqueued = {"0": 19 if (r == 2 and behind) else 20}
        progress = {"step": 9, "phase": "backward", "collective": (
            {"op": "broadcast", "callsite": "train.py:61 in sync_flags", "numel": 1} if r == 2 else
            {"op": "all_reduce", "callsite": "train.py:50 in train", "numel": 8})}
        state.evidence["hang-1"] = RankEvidence(rank=r, reason="hang", created_at=T + 1, source="supervisor",
                                                progress=progress)
    for r in (0, 1):
        state = run.ranks[r]
        state.events.append(wire.Event(kind="exception", at=T + 30, step=9, details={
            "type": "RuntimeError", "message": "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
            "Timed out waiting 30000ms for recv operation to complete", "traceback": "", "phase": "backward"}))
        state.exit_code, state.exited_at = 1, T + 30.2
    verdicts = run_all(run, T + 40, True)
    assert [(v.kind, v.ranks) for v in verdicts] == [("collective_mismatch", [2])]
    consequences = verdicts[0].evidence.get("consequences", [])
    assert all(c["kind"] != "hang" for c in consequences), consequences  # not also "never reached" it


def _uniform_hang(ranks: int, exit_codes: dict[int, int] | None = None) -> tuple[RunState, Incident]:
    """Every rank stalls at the same place: no rank stands out."""
    run = RunState(run_id="r", world_size=ranks)
    incident = Incident(id="hang-1", kind="hang", opened_at=T + 20, last_progress_at=T, ready=True,
                        details={"diagnosed_at": T + 22})
    run.incidents.append(incident)
    frames = [{"file": "/x/train.py", "line": 30, "name": "main", "code": "loss.backward()"}]
    for r in range(ranks):
        state = run.rank(r)
        state.step, state.phase = 6, "forward"
        state.last_heartbeat_at = T + 19.5
        state.evidence["hang-1"] = RankEvidence(rank=r, reason="hang", created_at=T + 21, source="agent",
                                                stacks=[{"main": True, "frames": frames}], pg_enqueued={"0": 40})
    for r, code in (exit_codes or {}).items():
        run.ranks[r].exit_code, run.ranks[r].exited_at = code, T + 60  # torn down after the hang
    return run, incident


def test_a_hang_where_no_rank_stands_out_reads_as_a_sentence():
    run, incident = _uniform_hang(4)
    v = hang.diagnose(run, incident)
    assert v.summary.startswith("Ranks 0, 1, 2, 3 all stopped making progress and no rank stands out"), v.summary
    assert "every rank" not in v.summary
    one, incident = _uniform_hang(1)
    v = hang.diagnose(one, incident)
    assert v.summary.startswith("Rank 0 stopped making progress, and no other rank's evidence"), v.summary


def test_hang_evidence_says_exited_when_it_gives_an_exit_code():
    run, incident = _uniform_hang(3, exit_codes={0: -15, 1: -15, 2: -15})
    v = hang.diagnose(run, incident)
    for rank, figures in v.evidence["ranks"].items():
        assert figures["exit_code"] == -15
        assert figures["exited"] is True and figures["exited_before_hang"] is False, figures


def test_every_verdict_in_a_report_has_an_id_unique_within_it():
    from rankwatch.collector import report
    from rankwatch.collector.analyses.common import verdict

    a = verdict("straggler", [3, 1], 7, 1.0, 2.0, "s", {})
    assert a.id == "straggler@7:r1-3"
    twin = verdict("straggler", [1, 3], 7, 5.0, 6.0, "s", {})
    legacy = wire.Verdict(kind="hang", ranks=[0], step=None, first_seen_at=iso(1.0), detected_at=iso(2.0),
                          summary="h")  # decoded from an older store: no id
    built = report.build(RunState(run_id="x", world_size=4), [a, twin, legacy])
    ids = [v.id for v in built.verdicts]
    assert ids == ["straggler@7:r1-3", "straggler@7:r1-3#2", "hang@none:r0"]
    assert json.loads(wire.dumps(built))["verdicts"][0]["id"] == ids[0]


def test_mismatch_summary_reads_as_english():
    """Issue 26: "ranks 0, 1 were not (phase backward)" and "1 elements"."""
    from rankwatch.collector.analyses import collective_mismatch

    run = RunState(run_id="r", world_size=3)
    for r in range(3):  # rank 2 died inside an extra 1-element all_reduce its peers never issued
        state = run.rank(r)
        state.step, state.phase = 5, "backward"
        state.exit_code, state.exited_at = (-6 if r == 2 else -15), T + 1
        progress = {"step": 5, "phase": "backward"}
        if r == 2:
            progress["collective"] = {"op": "all_reduce", "callsite": "train.py:40 in main", "numel": 1}
        state.evidence["crash-1"] = RankEvidence(rank=r, reason="crash", created_at=T + 1, source="supervisor",
                                                 progress=progress)
    [found] = collective_mismatch.detect(run, T + 5, True)
    assert "called all_reduce of 1 element at train.py:40" in found.summary
    assert "ranks 0, 1 were in no collective (phase backward)" in found.summary


def _losses_run(losses_by_step: list[tuple[float, float]]) -> RunState:
    from rankwatch.collector.analyses.common import tracker

    run = RunState(run_id="r", world_size=2)
    for r in range(2):
        run.rank(r)
    state = tracker(run, "nonfinite")
    for step, losses in enumerate(losses_by_step):
        records = {r: wire.StepRecord(step=step, started_at=T + step, ended_at=T + step + 0.5, loss=loss)
                   for r, loss in enumerate(losses)}
        state.on_step(run, step, records)
    return run


def test_dead_run_needs_every_rank_non_finite_at_consecutive_optimizer_steps():
    """A single non-finite step on every rank (an fp16 overflow whose step was
    not skipped, a bad batch everywhere) is not a dead run; nor is one rank's
    NaN, nor non-finite steps that are not consecutive; three in a row are."""
    from rankwatch.collector.analyses.common import tracker

    nan, ok = float("nan"), 1.0
    assert tracker(_losses_run([(ok, ok), (nan, nan), (ok, ok), (nan, nan), (ok, ok)]), "nonfinite").dead is None
    assert tracker(_losses_run([(ok, ok)] + [(nan, ok)] * 10), "nonfinite").dead is None
    assert tracker(_losses_run([(ok, ok), (nan, nan), (float("inf"), nan), (ok, ok)]), "nonfinite").dead is None
    dead = tracker(_losses_run([(ok, ok), (nan, ok), (nan, nan), (nan, float("inf")), (nan, nan), (nan, nan)]),
                   "nonfinite").dead
    assert dead is not None and (dead["since_step"], dead["confirmed_at_step"]) == (2, 4)
