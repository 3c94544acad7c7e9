"""bench/gpu_acceptance.py without a GPU: the dry run checks its own matrix
(and runs the FSDP2 nan_grad job on 2 CPU ranks: ~15 s); without
``--dry-run`` and without GPUs it says so and fails; the parts that judge a
GPU run (syncs added, processes per GPU, killing a hung launcher's group)
are checked on outputs and processes of their own."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_acceptance.py"


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_acceptance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_dry_run_checks_and_prints_the_matrix():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "40 cases; matrix OK" in proc.stdout
    for fault in ("hang", "crash", "nan_loss", "nan_grad", "straggler", "leak", "oom", "oom_caught", "mismatch",
                  "healthy"):
        assert f" {fault} " in proc.stdout
    assert "fsdp2   bfloat16" in proc.stdout
    # the NaN is injected where fully_shard's own parameters get it (the hook on the
    # pre-fully_shard parameter never fired): the job ran on CPU ranks and it fired
    assert "nan_grad fires on the parameters fully_shard creates" in proc.stdout


def test_without_enough_gpus_it_says_so_and_fails():
    """It used to print the dry run and exit 0: a node without GPUs passed."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--only", "healthy"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0, proc.stdout
    assert "the matrix needs 1" in proc.stdout and "nothing was run" in proc.stdout, proc.stdout


def test_the_job_makes_no_sync_of_its_own_and_counts_every_sync():
    job = _bench().JOB
    loop = job[job.index("for step in range(STEPS):"):job.index("torch.cuda.set_sync_debug_mode(0)")]
    assert "synchronize(" not in loop and ".item()" not in loop and "print(f\"step" not in loop
    assert 'torch.cuda.set_sync_debug_mode("warn")' in loop


def test_a_sync_rankwatch_adds_is_a_miss():
    bench = _bench()
    plain = "SYNCS rank 0 0\nSYNCS rank 1 0\nSTEP_MEDIAN 0.01\n"
    assert bench.judge_syncs("SYNCS rank 0 0\nSYNCS rank 1 0\n", plain) is None
    watched = "SYNCS rank 0 2\nSYNC_AT rank 0\n  File \"agent/checks/update_checks.py\", line 365\nSYNCS rank 1 0\n"
    problem = bench.judge_syncs(watched, plain)
    assert problem is not None and "added 2" in problem and "update_checks.py" in problem
    assert bench.judge_syncs("crashed\n", plain) is not None  # no count: never a pass


def test_a_second_process_on_a_gpu_is_a_miss():
    bench = _bench()
    one_each = 'GPU_PROCS {"0": {"all": 1, "job": 1}, "1": {"all": 1, "job": 1}}'
    assert bench.judge_gpu_processes(one_each, 2) is None
    on_zero = 'GPU_PROCS {"0": {"all": 2, "job": 2}, "1": {"all": 1, "job": 1}}'
    assert "GPU(s) {'0': 2}" in bench.judge_gpu_processes(on_zero, 2)
    namespaced = 'GPU_PROCS {"0": {"all": 2, "job": 0}, "1": {"all": 1, "job": 0}}'  # PIDs not visible
    assert bench.judge_gpu_processes(namespaced, 2) is not None
    assert bench.judge_gpu_processes("no line", 2) is not None
    assert bench.judge_gpu_processes('GPU_PROCS {"error": "FileNotFoundError"}', 2) is not None


@pytest.mark.parametrize("own_session", [False, True], ids=["worker_in_the_group", "worker_in_its_own_session"])
def test_a_launcher_past_its_timeout_is_killed_with_its_workers(tmp_path, own_session):
    """A hung plain-torchrun job: killing torchrun alone left its workers
    running. torch's elastic agent starts each worker in a session of its
    own (start_new_session=True): killing the launcher's process group left
    a hung worker holding the output pipe, and the script stalled (an H200,
    2026-11-26)."""
    pid_file = tmp_path / "worker.pid"
    launcher = (f"import subprocess, sys, time\n"
                f"worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
                f"start_new_session={own_session})\n"
                f"open({str(pid_file)!r}, 'w').write(str(worker.pid))\n"
                f"time.sleep(120)\n")
    code, out, seconds = _bench().run([sys.executable, "-c", launcher], {}, 3.0)
    assert code == -9 and "workers killed" in out and seconds < 60
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{worker}/stat") as f:  # killed but not yet reaped by init: a zombie is gone
            if f.read().split()[2] == "Z":
                break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the launcher's worker {worker} still runs")


def test_its_docstring_says_which_gpu_runs_were_made():
    text = " ".join(SCRIPT.read_text().split())
    assert "GPU sessions have run it" in text and "have never run on GPUs" in text


def test_stream_stall_bench_job_compiles_and_its_judge_names_each_miss():
    """bench/gpu_stream_stall.py runs only on a GPU: here its job must at
    least compile, and its judgement must pass a run like the one seen on
    an H200 and name each way a run can go wrong."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import gpu_stream_stall as bench

    compile(bench.JOB, "stall_job.py", "exec")
    seen = {"none": {"exit": 0, "device_ms": 3.56, "compute_ms": 2.94, "syncs": 1, "verdicts": []},
            "own": {"exit": 0, "device_ms": 20.13, "compute_ms": 21.08, "syncs": 1, "verdicts": []},
            "stall": {"exit": 0, "device_ms": 19.08, "compute_ms": 2.97, "syncs": 1, "verdicts": []}}
    assert bench.judge(seen, 20.0) == []
    stall_counted = {**seen, "stall": {**seen["stall"], "compute_ms": 18.9}}
    assert any(m.startswith("stall: compute_s") for m in bench.judge(stall_counted, 20.0))
    own_lost = {**seen, "own": {**seen["own"], "compute_ms": 3.0}}
    assert any(m.startswith("own:") for m in bench.judge(own_lost, 20.0))
    synced = {**seen, "stall": {**seen["stall"], "syncs": 5}}
    assert any("syncs differ" in m for m in bench.judge(synced, 20.0))
    alarmed = {**seen, "none": {**seen["none"], "verdicts": ["straggler"]}}
    assert any("verdicts" in m for m in bench.judge(alarmed, 20.0))
    failed = {**seen, "own": {"exit": 1, "error": "Traceback"}}
    assert bench.judge(failed, 20.0)
