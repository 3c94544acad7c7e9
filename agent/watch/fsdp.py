"""FSDP2 (``fully_shard``): a model is known when it is sharded, so step 0 is
watched.

DDP's constructor tells the agent about a model as it is built; FSDP2 has no
constructor, and a model it shards was found only at the first optimizer
step (models.py discovery): the first forward, its memory and its OOM (where
many OOMs happen) went unwatched. ``fully_shard`` is wrapped instead: after
it returns, the topmost module the registration hooks saw built around the
sharded one is a root (forward timing, training forwards) and its device's
memory is watched. The gradient checks still wait for the first optimizer
step: when the first layer is sharded the others still hold their plain
parameters.

rankwatch never imports torch.distributed.fsdp (slow, and most jobs never
use it): the wrapper goes in when the job's own import completes
(agent/core/imports.py). The homes ``fully_shard`` is exported from (torch
2.4-2.13): ``torch.distributed.fsdp`` and its ``_fully_shard`` (2.6+),
``torch.distributed._composable.fsdp`` (2.4+; from 2.6 it re-exports the
former). NEVER RAN ON A GPU: tested on CPU (gloo), where the memory part has
nothing to watch.
"""

from __future__ import annotations

import types
from typing import Any, Callable

from ..core.imports import ImportWatch
from ..core.patching import Patches, after_call
from ..core.safety import guarded

HOMES = ("torch.distributed.fsdp._fully_shard", "torch.distributed.fsdp", "torch.distributed._composable.fsdp")


class FullyShardWatch:
    """``on_sharded(module)``: told of each module ``fully_shard`` returned."""

    def __init__(self, *, patches: Patches, on_sharded: Callable[[Any], None]) -> None:
        self.patches = patches
        self.on_sharded = on_sharded
        self._wrappers: dict[int, Any] = {}  # id(original) -> its wrapper: one wrapper under every name

    def patch(self, module: types.ModuleType) -> None:
        fn = getattr(module, "fully_shard", None)
        if fn is None or isinstance(fn, types.ModuleType) or not callable(fn):
            return
        if getattr(fn, "__rankwatch_wrapped__", False):  # imported from a home already patched
            self.patches.adopt(module, "fully_shard", getattr(fn, "__wrapped__", fn))
            return
        wrapper = self._wrappers.get(id(fn))
        if wrapper is not None:
            self.patches.alias(module, "fully_shard", fn, wrapper)
            return
        # functools.wraps keeps fully_shard.state (torch's contract decorator)
        made = self.patches.apply(module, "fully_shard", after_call(lambda result, *a, **k: self.sharded(result)))
        if made is not None:
            self._wrappers[id(fn)] = made

    @guarded("fsdp.sharded")
    def sharded(self, result: Any) -> None:
        modules = result if isinstance(result, (list, tuple)) else [result]
        for module in modules[:1024]:
            if hasattr(module, "parameters"):
                self.on_sharded(module)


def install(*, patches: Patches, imports: ImportWatch, on_sharded: Callable[[Any], None]) -> FullyShardWatch:
    watch = FullyShardWatch(patches=patches, on_sharded=on_sharded)
    for name in HOMES:
        imports.when_imported(name, watch.patch)
    return watch
