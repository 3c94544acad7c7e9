"""A user's bug on one rank, switched on from the environment.

    FAULT=hang|crash|nan|perturb|leak|sigkill  FAULT_RANK=k  FAULT_STEP=s

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


# Faults that follow the optimizer, injected from outside the training code
# through torch's global optimizer hooks (the way a bug in a wrapper, a
# callback or a node would meet the job): FAULT=perturb|leak|sigkill.
_OPTIMIZER_STEPS = {"n": 0}
_LEAKED: list = []


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    import signal

    import torch

    step = _OPTIMIZER_STEPS["n"]
    _OPTIMIZER_STEPS["n"] += 1
    if _rank() != RANK:
        return
    if KIND == "perturb" and step == STEP:
        with torch.no_grad():  # this replica's weights drift from the others'
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.add_(1e-3 * torch.randn_like(p))
    elif KIND == "leak" and step >= STEP:
        _LEAKED.append(torch.ones(4 << 20, dtype=torch.uint8))  # 4 MiB a step, never freed
    elif KIND == "sigkill" and step == STEP:
        os.kill(os.getpid(), signal.SIGKILL)


if KIND in ("perturb", "leak", "sigkill"):
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(_after_optimizer_step)
