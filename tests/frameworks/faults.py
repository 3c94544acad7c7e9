"""A user's bug on one rank, switched on from the environment.

    FAULT=hang|crash|nan  FAULT_RANK=k  FAULT_STEP=s

The framework scripts call `due(step)` where a real bug would sit (a
callback, a forward hook, a dataset) and act on its answer; with no FAULT set
nothing happens and the script is a plain training script.
"""

from __future__ import annotations

import os
import time
from typing import Optional

KIND = os.environ.get("FAULT", "")
RANK = int(os.environ.get("FAULT_RANK") or -1)
STEP = int(os.environ.get("FAULT_STEP") or -1)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def due(step: int, kinds: tuple[str, ...] = ("hang", "crash", "nan")) -> Optional[str]:
    """The fault to inject now, if this rank is the faulty one at this step."""
    if KIND in kinds and _rank() == RANK and step == STEP:
        return KIND
    return None


def hang_or_crash(kind: Optional[str]) -> None:
    if kind == "hang":
        while True:  # a stuck rank: a deadlocked data source, a lost lock...
            time.sleep(1)
    if kind == "crash":
        raise RuntimeError(f"bad batch on rank {_rank()}")
