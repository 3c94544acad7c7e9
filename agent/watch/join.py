"""DDP's `Join` with uneven inputs: a rank whose batches ran out shadows its
peers' collectives until every rank is done.

Inside `Join([ddp])`, a rank that leaves its loop early runs DDP's join hook
(`_DDPJoinHook.main_hook`) once per iteration its peers still take: the
buffer broadcast, the flag allreduce and one allreduce per gradient bucket,
all without a forward, a backward or an optimizer step. Counted by optimizer
steps alone, that rank falls one step behind its peers for every iteration
it shadowed, for the rest of the run: its step N is no longer their step N,
so every comparison by step (collective marks, weight fingerprints, learning
rates, batches) would compare different iterations, and did (the zoo's
join_uneven: `collective_mismatch [0]` then `weight_divergence [1]`, a
healthy job).

So each shadowed iteration that synchronizes gradients is a step of this
rank too, a *shadow step*: a record with no forward and no compute time
(`Progress.shadow_step`). An iteration under `no_sync` (gradient
accumulation) is a micro-batch, not a step, on the ranks that train and on
this one alike. Read against torch 2.13's `_DDPJoinHook` (not yet checked
against 2.4-2.12), whose `main_hook` sets `ddp.require_forward_param_sync`
to whether the iteration synchronized. Host-side only (no device work);
never ran on a GPU.

The first shadow step of each rank is also an event (`join_shadowed`): the
rank's optimizer skipped that step, so its state (momentum, Adam's moments
and step count) is no longer its peers', and its weights drift from theirs
between Join's re-syncs. weight_divergence stops comparing that rank and
the report says so (collector/analyses/weight_divergence.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ..core.patching import Patches, after_call
from ..core.safety import guarded

if TYPE_CHECKING:
    from .progress import Progress


def install(patches: Patches, progress: "Progress", emit: Callable[..., Any]) -> None:
    """Count each shadowed synchronizing iteration as a step of this rank;
    ``emit(kind, step=..., **details)`` records the first."""
    try:
        from torch.nn.parallel.distributed import _DDPJoinHook
    except ImportError:  # a torch without DDP's join hook: no Join to follow
        return

    first_seen: list[int] = []

    @guarded("join.shadowed")
    def shadowed(result: Any, hook: Any, *args: Any, **kwargs: Any) -> None:
        if not getattr(getattr(hook, "ddp", None), "require_forward_param_sync", True):
            return  # a no_sync micro-batch: part of the step to come
        if not first_seen:
            first_seen.append(progress.step)
            emit("join_shadowed", step=progress.step)
        progress.shadow_step()

    patches.apply(_DDPJoinHook, "main_hook", after_call(shadowed))
