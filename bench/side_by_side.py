"""Side-by-side runs, shared by the benches that compare two launches of the
same job (plain torchrun against `rankwatch run`; rankwatch with some checks
off against on): interleaved, A B A B ..., so that machine noise hits both
alike, and each job's printed figure read back."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional, TypeVar

T = TypeVar("T")


def launcher(watched: bool, run_dir: Optional[Path] = None) -> list[str]:
    """`rankwatch run --run-dir DIR` or plain `torchrun` (as this Python's modules)."""
    if watched:
        return [sys.executable, "-m", "rankwatch.cli", "run", "--run-dir", str(run_dir)]
    return [sys.executable, "-m", "torch.distributed.run"]


def job_env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", **extra)


def figures(cmd: list[str], env: dict[str, str], pattern: str, label: str, timeout: float = 900) -> tuple[str, ...]:
    """Run a job and return the groups of the first match of ``pattern`` in
    its output; a failed job or a missing line ends the bench with its output."""
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    match = re.search(pattern, out.stdout + out.stderr)
    if out.returncode != 0 or not match:
        raise SystemExit(f"benchmark job failed ({label}):\n{(out.stdout + out.stderr)[-3000:]}")
    return match.groups()


def interleaved(repeats: int, first: Callable[[int], T], second: Callable[[int], T]) -> tuple[list[T], list[T]]:
    """``first(i)`` and ``second(i)`` for i in range(repeats), alternating."""
    a: list[T] = []
    b: list[T] = []
    for i in range(repeats):
        a.append(first(i))
        b.append(second(i))
    return a, b
