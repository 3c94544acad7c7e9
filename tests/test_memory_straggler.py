"""Stragglers and memory, in real multi-rank DDP jobs (gloo, CPU)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from conftest import run_job, free_port
from rankwatch import wire
from rankwatch.bundles import pack
from rankwatch.memory_snapshot import summarize

DATA = Path(__file__).parent / "data"


def test_slow_rank_is_a_straggler_with_profiler_evidence(tmp_path, train_script):
    # 90 steps of >= 0.2 s: named after ~5 s of them, then a 3-step profile
    # read and sent while the job still runs (45 steps left ~4 s for it).
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(train_script), "--steps", "90",
                             "--fault", "slow", "--fault-rank", "1", "--fault-step", "0", "--fault-size", "200"])
    assert job.exit_code == 0, "a straggler is reported, not killed"
    straggler = job.only("straggler")
    assert straggler["ranks"] == [1]
    assert straggler["evidence"]["ranks"]["1"]["score"] > 5
    assert straggler["evidence"]["phase"] == "data loading"
    assert straggler["step"] <= 20, "found while the job runs, not only at the end"
    profile = straggler["evidence"].get("profile")
    assert profile and profile["slow_rank"] == 1 and "sleep" in profile["operations"][0]["name"]
    assert len(job.verdicts()) == 1



def test_a_requested_profile_is_read_on_the_training_thread(monkeypatch):
    """torch's profiler is started, stopped and read on the thread that steps
    the optimizer; only the finished summary and trace go to a thread to be
    sent (read in a thread while the job runs ops, a with_stack profile broke
    the process: agent/evidence/profiler.py)."""
    import threading
    from types import SimpleNamespace

    from rankwatch.agent.evidence import profiler as profiler_mod

    readers, shipped = [], []
    real_summarize = profiler_mod.summarize
    real_export = torch.profiler.profile.export_chrome_trace
    monkeypatch.setattr(profiler_mod, "summarize",
                        lambda p, **kw: readers.append(threading.get_ident()) or real_summarize(p, **kw))
    monkeypatch.setattr(torch.profiler.profile, "export_chrome_trace",
                        lambda self, path: readers.append(threading.get_ident()) or real_export(self, path))
    step_profiler = profiler_mod.StepProfiler(progress=SimpleNamespace(step_extras=[]), memory=None,
                                              send_bundle=lambda *a, **k: "collector")
    monkeypatch.setattr(step_profiler, "_ship", lambda summary, trace, command: shipped.append((summary, trace)))
    step_profiler.on_command(wire.Command(kind="action", incident="profile-1", reason="straggler",
                                          details={"action": "profile", "steps": 2}))
    model = torch.nn.Linear(8, 8)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        step_profiler._on_step_end(None)
    deadline = time.time() + 10
    while not shipped and time.time() < deadline:
        time.sleep(0.01)
    assert readers and set(readers) == {threading.get_ident()}, "results read off the training thread"
    summary, trace = shipped[0]
    assert summary["operations"] and json.loads(trace)["traceEvents"]

def test_a_profile_still_running_when_the_rank_exits_does_not_crash_it(tmp_path):
    """A profile requested near the end of training is still running when
    the script returns: torch's Python tracer torn down with the interpreter
    crashed the process (SIGSEGV, exit -11, a good job failed in CI). The
    agent stops it at exit."""
    script = tmp_path / "profile_at_exit.py"
    script.write_text(textwrap.dedent("""
        import os
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="0", WORLD_SIZE="1")
        import torch
        from rankwatch import config, wire
        from rankwatch.agent.evidence.profiler import StepProfiler
        from rankwatch.agent.runtime import Agent
        agent = Agent(config.Config(), wire.RankIdentity(run_id="p", rank=0, local_rank=0, world_size=1), None)
        agent.install()
        agent.watch_exit()  # as rankwatch.agent.attach() does (the bootstrap shuts down the same way)
        profiler = next(e for e in agent.extensions if isinstance(e, StepProfiler))
        profiler.on_command(wire.Command(kind="action", incident="profile-1", reason="straggler",
                                         details={{"action": "profile", "steps": 10}}))
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        assert profiler._profile is not None, "the profile runs as the script ends"
        print("script done", flush=True)
        """).format(port=free_port()))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "script done" in proc.stdout, (proc.returncode, proc.stderr[-2000:])


def test_leaking_rank_is_memory_growth(tmp_path, train_script):
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(train_script), "--steps", "40",
                             "--fault", "leak", "--fault-rank", "0", "--fault-step", "0", "--fault-size", "20"])
    growth = job.only("memory_growth")
    assert growth["ranks"] == [0]
    per_step = growth["evidence"]["ranks"]["0"]["bytes_per_step"]
    assert 15 * 2**20 < per_step < 25 * 2**20
    assert growth["evidence"]["seconds_to_exhaustion"] > 0
    # Allocating 20 MB a step may also make the rank measurably slower; nothing else is allowed.
    assert all(v["ranks"] == [0] and v["kind"] in ("memory_growth", "straggler") for v in job.verdicts())


def test_failed_host_allocation_is_oom_not_crash(tmp_path, train_script):
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(train_script), "--steps", "30",
                             "--fault", "oom", "--fault-rank", "1", "--fault-step", "4"])
    assert job.exit_code != 0
    oom = job.only("oom")
    assert oom["ranks"] == [1] and oom["step"] == 4
    assert "can't allocate memory" in oom["summary"]
    assert not job.verdicts("crash"), "the peer's 'Connection closed' is a consequence"


def test_snapshot_fixture_is_the_format_torch_reads():
    """No GPU is lent here: the snapshot is a recorded-format fixture. torch's
    own reader (torch/cuda/_memory_viz.py) must accept it, so the summariser is
    tested on what real snapshots look like."""
    from torch.cuda import _memory_viz

    snapshot = json.loads((DATA / "cuda_snapshot.json").read_text())
    text = _memory_viz.segsum(snapshot)
    assert "Summary of segments" in text
    out = io.StringIO()
    with redirect_stdout(out):
        _memory_viz.trace(snapshot)
    summary = summarize(snapshot)
    assert summary["reserved_bytes"] == 3 * 2**30 + 20 * 2**20
    assert summary["top_sites"][0]["site"] == "train.py:57 in cache_activations"
    assert summary["top_sites"][0]["bytes"] == 2 * 2**30
    assert summary["allocated_bytes"] == 2 * 2**30 + 512 * 2**20 + 20 * 2**20


def test_analyze_summarises_an_oom_bundle_without_a_gpu(tmp_path):
    snapshot = json.loads((DATA / "cuda_snapshot.json").read_text())
    manifest = wire.BundleManifest(run_id="gpu-job", rank=3, local_rank=3, world_size=4, host="gpu7", pid=9,
                                   step=120, created_at=time.time(), reason="oom", incident="oom-r3-abc")
    folder = tmp_path / "bundles"
    folder.mkdir()
    (folder / "rank-00003.tar.gz").write_bytes(pack(manifest, {
        "memory_snapshot.json": {"summary": {"forged": True}, "snapshot": snapshot},
        "memory_snapshot.pickle": b"\x80\x04opaque",
        "metrics.json": {"events": [{"kind": "oom", "at": time.time(), "step": 120,
                                     "details": {"requested_bytes": 4 * 2**30}}]},
    }))
    out = subprocess.run([sys.executable, "-m", "rankwatch.cli", "analyze", str(folder), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    oom = [v for v in json.loads(out.stdout)["verdicts"] if v["kind"] == "oom"]
    assert oom and oom[0]["ranks"] == [3]
    assert "train.py:57 in cache_activations" in oom[0]["summary"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no accelerator is lent to this project")
def test_cuda_oom_observer_dumps_a_snapshot(tmp_path):
    from rankwatch.agent.checks.memory import snapshot_members

    torch.cuda.memory._record_memory_history(max_entries=1000)
    x = torch.empty(1 << 20, device="cuda")
    members = snapshot_members(str(tmp_path), 0)
    assert members["memory_snapshot.json"]["summary"]["allocated_bytes"] >= x.numel() * 4


def test_waiting_for_a_slow_peer_in_a_per_step_broadcast_is_not_the_waiters_data_time(tmp_path):
    """Frameworks issue a small collective at every step start (Lightning
    broadcasts its SIGTERM flag). A rank slow after its optimizer step (rank
    1: end-of-step work) makes the others wait there, before their forward:
    that wait is not their data loading, and they are not the straggler."""
    from conftest import ddp_script

    script = ddp_script(tmp_path, "broadcast_each_step.py", """
        import time
        torch.manual_seed(0)
        model = DDP(torch.nn.Linear(32, 32))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(dist.get_rank()))  # each rank its own batch
        for step in range(100):  # a slow rank is persistent after 5 s
            flag = torch.zeros(1)
            dist.broadcast(flag, 0)  # every step, every rank
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            if dist.get_rank() == 1 and step >= 5:
                time.sleep(0.08)  # slow end-of-step work on rank 1 only
        """)
    job = run_job(tmp_path, ["--nproc-per-node", "3", str(script)])
    assert job.exit_code == 0, job.output[-3000:]
    assert all(0 not in v["ranks"] and 2 not in v["ranks"] for v in job.verdicts()), job.verdicts()
    straggler = job.only("straggler")
    assert straggler["ranks"] == [1]


def test_memory_a_requested_profile_takes_is_not_the_jobs(tmp_path):
    """issue 23: after a straggler verdict the collector asks the slow rank and
    one healthy rank for a profile; torch's profiler and reading its results
    keep ~30 MiB of RSS (glibc does not give it back), and the profiled rank
    was called leaking (`memory_growth` on a rank that only waits). The job's
    RSS in the step records leaves rankwatch's profile out: no jump.

    In a fresh process: the profiler's first use is what takes the memory
    (an earlier test in the same interpreter would already have paid it, and
    the test would show nothing, as it once did in CI)."""
    script = tmp_path / "profile_memory.py"
    script.write_text(textwrap.dedent("""
        import json, os, threading
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="0", WORLD_SIZE="1")
        import torch
        import torch.distributed as dist
        from rankwatch import config, wire
        from rankwatch.agent.checks.memory import rss_bytes
        from rankwatch.agent.evidence.profiler import StepProfiler
        from rankwatch.agent.runtime import Agent
        agent = Agent(config.Config(), wire.RankIdentity(run_id="t", rank=0, local_rank=0, world_size=1), None)
        agent.install()
        dist.init_process_group("gloo")
        profiler = next(e for e in agent.extensions if isinstance(e, StepProfiler))
        reported, raw = [], []
        agent.progress.step_extras.append(lambda record: (reported.append(record.rss_bytes), raw.append(rss_bytes())))
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(32, 64)
        for step in range(30):
            if step == 10:
                profiler.on_command(wire.Command(kind="action", incident="profile-1", reason="straggler",
                                                 details={{"action": "profile", "steps": 3}}))
            if step == 16:  # read at step 13's end, then packed and sent in a thread
                for thread in [t for t in threading.enumerate() if t.name == "rankwatch-profile"]:
                    thread.join(30)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        agent.uninstall()
        dist.destroy_process_group()
        print("RESULT " + json.dumps({{"reported": reported, "raw": raw}}), flush=True)
        """).format(port=free_port()))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    reported, raw = result["reported"], result["raw"]
    before, after = reported[9], reported[20:]
    assert raw[25] - raw[9] > 8 << 20, f"the profile took memory (else this test shows nothing): {raw[9]} -> {raw[25]}"
    assert all(r is not None for r in after)
    assert max(after) - before < 4 << 20, [(r or 0) >> 20 for r in reported]
