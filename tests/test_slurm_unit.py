"""rankwatch.slurm's pure parts: what an allocation fills in for torchrun,
the run id, and how Slurm's job states become report.json's `termination`.
scontrol is replaced by its recorded answers here; the real one runs in
test_slurm.py. Cost: well under a second."""

from __future__ import annotations


import pytest

from rankwatch import slurm, wire
from rankwatch.node import launcher

STEP_ENV = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURMD_NODENAME": "gpu08",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_GPUS": "0,1,2,3",
}


def fake_scontrol(args):
    if args[:2] == ["show", "hostnames"]:
        assert args[2] == "gpu[07-08]"
        return "gpu07\ngpu08\n"
    if args[:2] == ["show", "node"]:
        return f"NodeName={args[3]} Arch=x86_64 NodeAddr=10.0.0.{args[3][-1]} NodeHostName={args[3]} State=ALLOCATED\n"
    raise AssertionError(args)


def parse(argv):
    return launcher.build_parser().parse_args(argv)


def test_srun_rankwatch_run_fills_nodes_rank_rendezvous_and_gpus(monkeypatch):
    task = slurm.task_from_env(STEP_ENV)
    argv = ["train.py"]
    args = parse(argv)
    given = launcher._given_options(argv)
    assert given == set()
    filled = slurm.fill_launch(args, given, task, runner=fake_scontrol)
    assert args.nnodes == "2" and args.node_rank == 1 and args.nproc_per_node == "4"
    assert args.rdzv_backend == "c10d"
    host, port = args.rdzv_endpoint.rsplit(":", 1)
    assert host == "10.0.0.7"  # the first node's NodeAddr, not its name
    assert slurm.RDZV_PORT_BASE <= int(port) < slurm.RDZV_PORT_BASE + slurm.RDZV_PORT_SPAN
    assert args.rdzv_id == "slurm-4242.0"
    assert len(filled) == 5
    # Every node derives the same endpoint and id.
    other = parse(argv)
    slurm.fill_launch(other, set(), slurm.task_from_env(dict(STEP_ENV, SLURMD_NODENAME="gpu07", SLURM_PROCID="0")),
                      runner=fake_scontrol)
    assert (other.rdzv_endpoint, other.rdzv_id, other.node_rank) == (args.rdzv_endpoint, args.rdzv_id, 0)


def test_explicit_flags_and_pet_variables_win(monkeypatch):
    task = slurm.task_from_env(STEP_ENV)
    argv = ["--nnodes=1:2", "--node_rank", "0", "--rdzv-endpoint", "h:1", "--nproc-per-node", "2", "train.py"]
    args = parse(argv)
    given = launcher._given_options(argv)
    assert {"nnodes", "node_rank", "rdzv_endpoint", "nproc_per_node"} <= given
    slurm.fill_launch(args, given, task, runner=fake_scontrol)
    assert (args.nnodes, args.node_rank, args.rdzv_endpoint, args.nproc_per_node) == ("1:2", 0, "h:1", "2")
    assert args.rdzv_backend == "static"  # torchrun's default stays: the user chose the rendezvous
    monkeypatch.setenv("PET_NNODES", "3")
    assert "nnodes" in launcher._given_options(["train.py"])


def test_one_node_gets_a_free_port_rendezvous_and_many_tasks_per_node_are_refused():
    env = dict(STEP_ENV, SLURM_STEP_NODELIST="gpu07", SLURMD_NODENAME="gpu07", SLURM_STEP_NUM_NODES="1",
               SLURM_STEP_NUM_TASKS="1", SLURM_PROCID="0")
    args = parse(["train.py"])
    slurm.fill_launch(args, set(), slurm.task_from_env(env), runner=lambda a: "gpu07\n")
    assert args.standalone and args.nnodes == "1" and args.node_rank == 0
    many = slurm.task_from_env(dict(STEP_ENV, SLURM_STEP_NUM_TASKS="8"))
    with pytest.raises(slurm.SlurmError, match="ntasks-per-node=1"):
        slurm.fill_launch(parse(["train.py"]), set(), many, runner=fake_scontrol)


def test_run_id_is_the_job_and_step_and_a_requeue_is_a_new_attempt(monkeypatch):
    for name in ("RANKWATCH_RUN_ID", "RANKWATCH_SLURM"):
        monkeypatch.delenv(name, raising=False)
    for key, value in STEP_ENV.items():
        monkeypatch.setenv(key, value)
    args = parse(["--standalone", "train.py"])
    assert launcher.make_run_id(args) == "slurm-4242.0"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert launcher.make_run_id(args) == "slurm-4242.0.r2"
    monkeypatch.setenv("RANKWATCH_SLURM", "0")
    assert not launcher.make_run_id(args).startswith("slurm-")
    assert slurm.task_from_env({}) is None


def test_gpus_and_task_counts():
    assert slurm.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert slurm.visible_gpus({"SLURM_STEP_GPUS": "NoDevFiles"}) == []
    assert slurm.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]


def state(job_state, **kw):
    return lambda job_id: slurm.JobState(state=job_state, **kw)


# What scontrol showed in the test cluster (Slurm 22.05) while a step's
# processes ran after a scancel and after a time limit: COMPLETING, and the
# Reason; the final states for completeness.
@pytest.mark.parametrize("job_state,said,sig,reason", [
    ("COMPLETING", "None", "SIGTERM", "cancelled"),
    ("COMPLETING", "TimeLimit", "SIGTERM", "time_limit"),
    ("COMPLETING", "Preemption", "SIGTERM", "preempted"),
    ("CANCELLED", "None", "SIGTERM", "cancelled"),
    ("TIMEOUT", "TimeLimit", "SIGTERM", "time_limit"),
    ("PREEMPTED", "None", "SIGTERM", "preempted"),
])
def test_slurm_job_states_become_the_termination_reason(job_state, said, sig, reason):
    task = slurm.task_from_env(STEP_ENV)
    ending = launcher._OutsideEnding()
    ending.signal, ending.at = sig, 1_700_000_000.25
    found = launcher.outside_ending(ending, task, {0: (-15, 1_700_000_000.3)},
                                    state_of=state(job_state, reason=said))
    assert found == wire.Termination(by="scheduler", reason=reason, signal=sig, at="2023-11-14T22:13:20.250Z",
                                     source=found.source)
    assert found.source.startswith("SLURM_JOB_ID 4242 step 0 (scontrol: JobState=" + job_state)


def test_a_signal_warning_before_the_time_limit_and_what_cannot_be_told():
    task = slurm.task_from_env(STEP_ENV)
    warned = launcher._OutsideEnding()
    warned.note(10)  # SIGUSR1
    found = launcher.outside_ending(warned, task, {}, state_of=state("RUNNING", time_limit="00:01:00"))
    assert (found.by, found.reason, found.signal) == ("scheduler", "time_limit", "SIGUSR1")
    # A SIGTERM while Slurm says the job runs on: someone else sent it.
    termed = launcher._OutsideEnding()
    termed.note(15)
    found = launcher.outside_ending(termed, task, {}, state_of=state("RUNNING", time_limit="00:01:00"))
    assert (found.by, found.reason) == ("signal", "unknown")
    # scontrol cannot answer: the scheduler is the likely sender, the reason unknown.
    found = launcher.outside_ending(termed, task, {}, state_of=lambda job_id: None)
    assert (found.by, found.reason) == ("scheduler", "unknown") and "could not tell" in found.source
    # A requeue: a new attempt follows.
    found = launcher.outside_ending(termed, task, {}, state_of=state("PENDING", restarts=1, reason="BeginTime"))
    assert found.by == "scheduler" and "slurm-4242.0.r1" in found.source


def test_no_signal_means_no_termination_and_a_killed_worker_is_a_crash_not_an_ending():
    task = slurm.task_from_env(STEP_ENV)
    quiet = launcher._OutsideEnding()
    assert launcher.outside_ending(quiet, None, {0: (0, 1.0)}) is None
    assert launcher.outside_ending(quiet, task, {0: (0, 1.0)}, state_of=state("CANCELLED")) is None
    # A worker killed while Slurm says the job runs: not an ending (crash names it).
    assert launcher.outside_ending(quiet, task, {1: (-9, 2.0)}, state_of=state("RUNNING")) is None
    # Outside Slurm: a signal to the launcher.
    termed = launcher._OutsideEnding()
    termed.note(15)
    found = launcher.outside_ending(termed, None, {})
    assert (found.by, found.reason, found.signal) == ("signal", "unknown", "SIGTERM")


def test_termination_is_validated_like_any_wire_input():
    good = {"by": "scheduler", "reason": "cancelled", "signal": "SIGTERM", "at": "2026-11-25T00:00:00.000Z",
            "source": "SLURM_JOB_ID 1"}
    assert wire.decode(wire.Termination, good).reason == "cancelled"
    for bad in ({"by": "god"}, {"reason": "bored"}, {"source": "x\ny"}, {"signal": "SIG TERM"}):
        with pytest.raises(wire.WireError):
            wire.decode(wire.Termination, dict(good, **bad))
    report = wire.Report(run_id="r", world_size=1, status="healthy")
    assert wire.to_dict(report)["termination"] is None


def test_a_warning_signal_while_rankwatch_starts_is_noted_not_fatal(monkeypatch):
    """A --signal=USR1@N warning that comes before the launcher installed its
    handlers (CI: the task died by SIGUSR1 with no report) is noted from the
    CLI's first lines and starts the launcher's record of outside signals."""
    import os
    import signal

    from rankwatch.node import launcher

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGUSR2)}
    monkeypatch.setattr(slurm, "early_warnings", [])
    try:
        # As in a fresh `rankwatch` process: no handler yet (an earlier test in
        # this process may have left one, which note_warnings_early would keep).
        for sig in previous:
            signal.signal(sig, signal.SIG_DFL)
        slurm.note_warnings_early({})  # outside Slurm: nothing changes
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
        slurm.note_warnings_early({"SLURM_JOB_ID": "42"})
        os.kill(os.getpid(), signal.SIGUSR1)  # the default action would end this test process
        assert [s for s, _ in slurm.early_warnings] == [signal.SIGUSR1]
        ending = launcher._OutsideEnding()
        assert ending.signal == "SIGUSR1" and ending.at == slurm.early_warnings[0][1]
        ending.note(signal.SIGTERM)  # the first signal is the one the report names
        assert ending.signal == "SIGUSR1"
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a handler already there (the user's) is kept
        slurm.note_warnings_early({"SLURM_JOB_ID": "42"})
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
