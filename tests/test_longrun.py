"""A long healthy run: 8 ranks, thousands of steps, the embedded collector.
No verdict, and the launcher (torchrun + rankwatch's collector, supervisor
and relay in one process) costs little more CPU than plain torchrun's.

The launcher's own CPU (all its threads, not its workers) is sampled from
/proc/<pid>/stat while it runs; the same job under plain torchrun is the
baseline. Figures go to the test output (-s) and to
$RANKWATCH_LONGRUN_OUT (JSON) when set."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import TORCH_TEARDOWN_ABORT, worker_env

RANKS = 8
STEPS = int(os.environ.get("RANKWATCH_LONGRUN_STEPS", "2500"))  # ~80 s for both runs here
# Target: < 2% of a core above plain torchrun over a long run. Asserted with
# margin (a shared 2-core machine); the measured figure is printed.
MAX_EXTRA_CORE_PERCENT = 6.0
LAUNCH_TIMEOUT = 90 + 0.05 * STEPS  # seconds per launch (~65 steps/s here with 8 ranks on 2 cores)

SCRIPT = """\
import sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(dist.get_rank())  # each rank its own batch
x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
for step in range(int(sys.argv[1])):
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
# Nothing may hold DDP at destroy_process_group (conftest.TORCH_TEARDOWN_ABORT).
# Under torch 2.13 even DDP(Linear) is freed only by a cyclic collection: without
# gc.collect() plain torchrun aborted in 5 of 8 runs here, with it in 0 of 8.
del model
import gc; gc.collect()
dist.destroy_process_group()
"""


def _cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime (all threads)


def _launch(cmd: list[str], cwd: Path, timeout: float) -> tuple[int, float, float, str]:
    """Run the launcher; return (exit code, its CPU seconds, wall seconds, output)."""
    log = cwd / f"out-{int(time.time() * 1000)}.txt"
    with open(log, "w") as out:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=cwd, env=worker_env({"OMP_NUM_THREADS": "1"}), stdout=out,
                                stderr=subprocess.STDOUT)
        cpu = 0.0
        deadline = started + timeout
        while proc.poll() is None:
            sample = _cpu_seconds(proc.pid)
            if sample is not None and proc.poll() is None:
                cpu = sample
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise AssertionError(f"launcher still running after {timeout}s:\n{log.read_text()[-3000:]}")
            time.sleep(0.05)
        wall = time.monotonic() - started
    return proc.returncode, cpu, wall, log.read_text()


@pytest.mark.timeout(900)  # two launches of up to LAUNCH_TIMEOUT each; ~240 s on a slow machine
def test_long_healthy_run_no_verdict_and_cheap_launcher(tmp_path):
    script = tmp_path / "tiny.py"
    script.write_text(textwrap.dedent(SCRIPT))
    run_dir = tmp_path / "run"
    code, rw_cpu, rw_wall, output = _launch(
        [sys.executable, "-m", "rankwatch.cli", "run", "--run-dir", str(run_dir), "--nproc-per-node", str(RANKS),
         str(script), str(STEPS)], tmp_path, timeout=LAUNCH_TIMEOUT)
    assert code == 0, output[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "healthy" and report["verdicts"] == [], json.dumps(report)[:3000]
    for attempt in range(3):
        code, tr_cpu, tr_wall, output = _launch(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), str(script), str(STEPS)],
            tmp_path, timeout=LAUNCH_TIMEOUT)
        # The baseline only measures plain torchrun's launcher. Torch's own gloo
        # teardown abort hit one of its 8 ranks in a CI run (SIGABRT after the
        # training, no rankwatch anywhere): that run is measured again.
        if code == 0 or TORCH_TEARDOWN_ABORT not in output:
            break
    assert code == 0, output[-3000:]
    rw_percent, tr_percent = 100 * rw_cpu / rw_wall, 100 * tr_cpu / tr_wall
    figures = {"ranks": RANKS, "steps": STEPS,
               "rankwatch": {"launcher_cpu_s": round(rw_cpu, 2), "wall_s": round(rw_wall, 2),
                             "core_percent": round(rw_percent, 2)},
               "torchrun": {"launcher_cpu_s": round(tr_cpu, 2), "wall_s": round(tr_wall, 2),
                            "core_percent": round(tr_percent, 2)},
               "extra_core_percent": round(rw_percent - tr_percent, 2)}
    print("\nlong run:", json.dumps(figures))
    if os.environ.get("RANKWATCH_LONGRUN_OUT"):
        Path(os.environ["RANKWATCH_LONGRUN_OUT"]).write_text(json.dumps(figures, indent=1) + "\n")
    assert rw_percent - tr_percent < MAX_EXTRA_CORE_PERCENT, figures
