"""What torch is doing on this thread, asked by hooks that must do nothing
inside a compile (Dynamo or compiled autograd traces them: nothing of
rankwatch's may enter a graph) or must tell a backward's own hooks apart.
One place, so every hook asks the same way."""

from __future__ import annotations

import sys

import torch


def compiling() -> bool:
    """Dynamo (or compiled autograd) is tracing this call. Without
    torch._dynamo loaded nothing compiles, so a job that never compiles
    asks torch nothing (a dict lookup per hook)."""
    if "torch._dynamo" not in sys.modules:
        return False
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:
        return False


def in_backward() -> bool:
    """This thread is inside an autograd backward (a hook, a reentrant backward)."""
    current = getattr(torch._C, "_current_graph_task_id", None)  # -1 outside a backward
    try:
        return current is not None and current() != -1
    except Exception:
        return False
