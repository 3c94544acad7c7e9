"""The DataLoaders a rank draws its training batches from.

Each epoch of a DataLoader is a new iterator (``DataLoader.__iter__``, which
the agent's runtime already wraps for its `loader_epoch` events); here each
iterator is tied to what its loader promised when it started: batches per
epoch (``len(loader)``) and samples (``len(sampler)``). A wrap of the
iterators' ``__next__`` (one dictionary lookup per batch) says which loader
yielded last, and counts the epochs a loader finished (its iterator ran
out), so the other checks can tell:

- the batches per epoch of the loader that feeds the training forwards
  (ranks that draw a different number are certain to hang or mismatch at
  the epoch's end unless ``Join`` is used);
- a batch seen again because an epoch ended (a small dataset, many epochs)
  from the same batch drawn again without an epoch ending (a new iterator
  made every step: ``next(iter(loader))``).

Nothing here reads a batch.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Optional

from rankwatch.config import Config

from ..core.patching import Patches
from ..core.safety import guarded

MAX_ITERATORS = 64


@dataclass
class LoaderInfo:
    batches: Optional[int]  # len(loader) when its epoch started (None: no length)
    samples: Optional[int]  # len(sampler)
    sampler: str  # the sampler's class name
    dataset: str
    epochs_completed: int = 0  # iterators that ran out
    iterators: int = 0  # epochs started


class LoaderTracker:
    def __init__(self, *, patches: Patches) -> None:
        self.patches = patches
        self.last: Optional[LoaderInfo] = None  # the loader that yielded last
        self.join_used = False
        self._loaders: dict[int, tuple[Any, LoaderInfo]] = {}
        self._iterators: dict[int, tuple[Any, LoaderInfo]] = {}

    def install(self) -> None:
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        tracker = self

        def make_next(original):
            @functools.wraps(original)
            def __next__(*args, **kwargs):
                try:
                    batch = original(*args, **kwargs)
                except StopIteration:
                    if args:
                        tracker._ran_out(args[0])
                    raise
                if args:
                    tracker._yielded(args[0])
                return batch

            return __next__

        self.patches.apply(_BaseDataLoaderIter, "__next__", make_next)
        try:
            from torch.distributed.algorithms.join import Join
        except Exception:
            return

        def make_enter(original):
            @functools.wraps(original)
            def __enter__(*args, **kwargs):
                tracker.join_used = True  # uneven inputs are handled: not a divergence
                return original(*args, **kwargs)

            return __enter__

        self.patches.apply(Join, "__enter__", make_enter)

    @guarded("loaders")
    def on_iter(self, loader: Any, iterator: Any) -> None:
        """DataLoader.__iter__ returned ``iterator``: a new epoch of ``loader``."""
        entry = self._loaders.get(id(loader))
        info = entry[1] if entry is not None and entry[0]() is loader else None
        try:
            batches: Optional[int] = len(loader)
        except TypeError:
            batches = None
        sampler = getattr(loader, "sampler", None)
        try:
            samples: Optional[int] = len(sampler) if sampler is not None else None
        except TypeError:
            samples = None
        if info is None or info.batches != batches or info.samples != samples:
            previous = info
            info = LoaderInfo(batches=batches, samples=samples, sampler=type(sampler).__name__,
                              dataset=type(getattr(loader, "dataset", None)).__name__)
            if previous is not None:
                info.epochs_completed, info.iterators = previous.epochs_completed, previous.iterators
            if len(self._loaders) >= MAX_ITERATORS:
                self._loaders = {k: v for k, v in self._loaders.items() if v[0]() is not None}
            if len(self._loaders) < MAX_ITERATORS:
                self._loaders[id(loader)] = (weakref.ref(loader), info)
        info.iterators += 1
        if len(self._iterators) >= MAX_ITERATORS:
            self._iterators = {k: v for k, v in self._iterators.items() if v[0]() is not None}
        if len(self._iterators) < MAX_ITERATORS:
            try:
                self._iterators[id(iterator)] = (weakref.ref(iterator), info)
            except TypeError:
                pass

    def _info(self, iterator: Any) -> Optional[LoaderInfo]:
        entry = self._iterators.get(id(iterator))
        if entry is None or entry[0]() is not iterator:
            return None
        return entry[1]

    @guarded("loaders")
    def _yielded(self, iterator: Any) -> None:
        info = self._info(iterator)
        if info is not None:
            self.last = info

    @guarded("loaders")
    def _ran_out(self, iterator: Any) -> None:
        info = self._info(iterator)
        if info is not None:
            info.epochs_completed += 1


def attach(*, config: Config, patches: Patches) -> Optional[LoaderTracker]:
    if not config.silent_checks:
        return None
    tracker = LoaderTracker(patches=patches)
    tracker.install()
    return tracker
