"""Shared helpers: run real `rankwatch run` jobs (gloo, CPU) and read their report."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train.py"
SCRIPTS = Path(__file__).resolve().parent / "scripts"


@dataclass
class Job:
    exit_code: int
    report: dict
    output: str
    elapsed: float
    run_dir: Path

    def verdicts(self, kind: str | None = None) -> list[dict]:
        return [v for v in self.report.get("verdicts", []) if kind is None or v["kind"] == kind]

    def only(self, kind: str) -> dict:
        found = self.verdicts(kind)
        assert found, f"no {kind} verdict; report:\n{json.dumps(self.report, indent=1)[:3000]}\n{self.output[-3000:]}"
        return found[0]


@pytest.fixture(autouse=True)
def _restore_environment():
    """Every test leaves os.environ as it found it: a test that sets
    MASTER_PORT (or RANK...) in-process once leaked it into every later job
    this process started (the Slurm jobs inherited a port already in use and
    all failed with EADDRINUSE in CI, never when run alone)."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


# CI runs a diagonal of the costly job matrices (each value of each axis
# once); RANKWATCH_FULL_MATRIX=1 runs every combination.
FULL_MATRIX = bool(os.environ.get("RANKWATCH_FULL_MATRIX"))


def matrix(combinations: list, diagonal: list) -> list:
    """The combinations a test runs: all of them with RANKWATCH_FULL_MATRIX=1,
    else those in ``diagonal``."""
    return [c for c in combinations if FULL_MATRIX or c in diagonal]


def worker_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.pop("RANKWATCH_RUN_ID", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_job(tmp_path: Path, args: list[str], timeout: float = 180, env: dict | None = None,
            run_dir: Path | None = None) -> Job:
    run_dir = run_dir or (tmp_path / "run")
    cmd = [sys.executable, "-m", "rankwatch.cli", "run", "--run-dir", str(run_dir), *args]
    started = time.time()
    proc = subprocess.run(cmd, cwd=tmp_path, env=worker_env(env), capture_output=True, text=True, timeout=timeout)
    elapsed = time.time() - started
    report_file = run_dir / "report.json"
    output = proc.stdout + proc.stderr
    assert report_file.is_file(), f"no report.json (exit {proc.returncode}):\n{output[-4000:]}"
    return Job(proc.returncode, json.loads(report_file.read_text()), output, elapsed, run_dir)


# torch 2.13's gloo sometimes aborts a process in teardown, after the script
# is done ("terminate called without an active exception", SIGABRT), when a
# DDP model still holds the process group after destroy_process_group: its
# destructor then runs during interpreter finalization. Measured here on a
# 2-rank DDP script under plain torchrun: 2 of 20 runs, with or without a
# barrier; 0 of 20 with the model deleted before destroy_process_group.
TORCH_TEARDOWN_ABORT = "terminate called without an active exception"


_HEADER = """\
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
"""


def ddp_script(tmp_path: Path, name: str, body: str) -> Path:
    """A small plain DDP training script (no rankwatch import) around ``body``."""
    import textwrap

    path = tmp_path / name
    path.write_text(_HEADER + textwrap.dedent(body) + _FOOTER)
    return path


# Drop the script's DDP models before destroy_process_group (TORCH_TEARDOWN_ABORT).
# Some DDP models are freed only by a cyclic collection, under plain torch too
# (with BatchNorm, DDP's own closures make a cycle: tests/test_agent_lifetime.py),
# so one runs before the process group goes.
_FOOTER = """\
for _name in [n for n, v in list(globals().items()) if isinstance(v, DDP)]:
    del globals()[_name]
import gc as _gc
_gc.collect()
dist.destroy_process_group()
"""


def attached_agent(run_id: str, **config):
    """The agent attached inside this test process, as rank 0 of a gloo world
    of size 1 (the ``world`` fixture), installed; the caller uninstalls it."""
    from rankwatch import config as config_mod
    from rankwatch import wire
    from rankwatch.agent.runtime import Agent

    identity = wire.RankIdentity(run_id=run_id, rank=0, local_rank=0, world_size=1, node_rank=0,
                                 host="localhost", pid=os.getpid(), attempt=0)
    agent = Agent(config_mod.Config(**config), identity, None)
    agent.install()
    return agent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def train_script() -> Path:
    return TRAIN


@pytest.fixture(scope="module")
def world():
    """A gloo world of size 1 in this test process (the agent attached in
    process); one per test module."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
