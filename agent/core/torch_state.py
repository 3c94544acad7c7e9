"""What torch is doing on this thread, asked by hooks that must do nothing
inside a compile (Dynamo or compiled autograd traces them: nothing of
rankwatch's may enter a graph) or must tell a backward's own hooks apart.
One place, so every hook asks the same way."""

from __future__ import annotations

import torch


def compiling() -> bool:
    """Dynamo (or compiled autograd) is tracing this call.

    Dynamo traces this function itself (it is the first thing the agent's
    hooks ask), so it reads nothing another thread may change while the
    trace runs: an earlier version looked up ``"torch._dynamo" in
    sys.modules`` first, and Dynamo, iterating ``sys.modules`` to trace that,
    crashed the job ("dictionary changed size during iteration") when a
    DataLoader or logger thread imported a module meanwhile.
    ``torch.compiler.is_compiling()`` reads one module flag in eager (torch
    2.4-2.13) and is a constant inside a trace. It is called through the
    attribute, not a module-level alias: with an alias, the hooks compiled
    autograd traces read False (torch 2.13, test_compile_safety)."""
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
