"""The agent never hurts the job it watches: a full or read-only run dir, and
a NaN, leave the job's exit code and output as they are without rankwatch.

Heavy: real 2-rank gloo DDP jobs (torchrun, and `rankwatch run`).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ddp_script, free_port, run_job, worker_env

_TRAIN = """
import os
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(dist.get_rank())
NAN_STEP = int(os.environ.get("NAN_STEP", "-1"))
first = model.module[0].weight
for step in range(30):
    handle = None
    if step == NAN_STEP and dist.get_rank() == 1:
        # A bad sample's backward on one rank: its loss is finite, a whole
        # weight gradient is not.
        handle = first.register_hook(lambda grad: grad * float("nan"))
    opt.zero_grad()
    loss = model(torch.randn(8, 8, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    if handle is not None:
        handle.remove()
    if step % 10 == 0:
        torch.save(model.state_dict(), os.devnull)  # a checkpoint write (wrapped by the agent)
print(f"RESULT rank {dist.get_rank()} loss {loss.item():.6f}", flush=True)
# DDP (and the last loss's graph) hold the process group: released before destroy (conftest TORCH_TEARDOWN_ABORT)
del model, opt, first, loss
import gc; gc.collect()
"""


def _torchrun(script: Path, cwd: Path, bootstrap: bool, env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    cmd += ["-m", "rankwatch.agent.bootstrap", str(script)] if bootstrap else [str(script)]
    return subprocess.run(cmd, cwd=cwd, env=worker_env(env), capture_output=True, text=True, timeout=180)


def _results(proc: subprocess.CompletedProcess) -> list[str]:
    # Two ranks share the stdout pipe: their lines may run together.
    return sorted(re.findall(r"RESULT rank \d+ loss -?[\d.]+", proc.stdout))


@pytest.fixture
def small_fs(tmp_path):
    """A tiny tmpfs, mounted as the test asks (root only)."""
    mounts = []

    def mount(options: str) -> Path:
        point = tmp_path / f"fs{len(mounts)}"
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounts.append(point)
        return point

    yield mount
    for point in mounts:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def _fill(folder: Path) -> None:
    with open(folder / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


@pytest.mark.parametrize("kind", ["full", "read_only"])
def test_unwritable_run_dir_leaves_the_job_unchanged(tmp_path, small_fs, kind):
    script = ddp_script(tmp_path, "train.py", _TRAIN)
    if kind == "full":
        run_dir = small_fs("size=64k")
        _fill(run_dir)
    else:
        run_dir = small_fs("size=64k,ro")
    plain = _torchrun(script, tmp_path, bootstrap=False, env={})
    watched = _torchrun(script, tmp_path, bootstrap=True, env={"RANKWATCH_RUN_DIR": str(run_dir)})
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert watched.returncode == plain.returncode, watched.stderr[-3000:]
    assert _results(watched) == _results(plain) and len(_results(plain)) == 2
    assert "Traceback" not in watched.stderr, watched.stderr[-3000:]
    # Said once per rank, one line each, not per step.
    assert watched.stderr.count("black box not written") == 2, watched.stderr[-3000:]
    assert watched.stderr.count("stack files cannot be written") == 2, watched.stderr[-3000:]
    assert watched.stderr.count("[rankwatch]") <= 6, watched.stderr[-3000:]


def test_blackbox_on_a_full_disk_is_in_memory(tmp_path, small_fs):
    from rankwatch.node import blackbox

    folder = small_fs("size=64k")
    _fill(folder)
    box = blackbox.BlackBox(folder / "stacks" / "rank-00000.blackbox")
    assert not box.on_disk and "No space left" in box.problem
    box.write(1, 2, "forward", 3.0)  # no SIGBUS: anonymous memory
    box.enter_collective("all_reduce", 4, 5.0, "train.py:1")
    assert not (folder / "stacks" / "rank-00000.blackbox").exists()


def test_blackbox_blocks_are_allocated(tmp_path):
    from rankwatch.node import blackbox

    path = tmp_path / "rank-00000.blackbox"
    box = blackbox.BlackBox(path)
    assert box.on_disk
    assert path.stat().st_blocks * 512 >= blackbox.SIZE, "not a sparse file"
    box.write(7, 8, "backward", 1.5)
    assert blackbox.read(path)["step"] == 7


def test_nan_in_one_ranks_gradients_keeps_the_exit_code_and_is_named(tmp_path):
    script = ddp_script(tmp_path, "train.py", _TRAIN)
    env = {"NAN_STEP": "13"}
    plain = _torchrun(script, tmp_path, bootstrap=False, env=env)
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(script)], env=env)
    assert job.exit_code == plain.returncode == 0, job.output[-3000:]
    nonfinite = job.only("nonfinite")
    assert nonfinite["ranks"] == [1] and nonfinite["step"] == 13, nonfinite
    assert "0.weight" in nonfinite["summary"]
    assert [v["kind"] for v in job.verdicts()] == ["nonfinite"], job.verdicts()
    assert "anomaly" not in job.output.lower(), "anomaly mode is the user's choice, not the default"
