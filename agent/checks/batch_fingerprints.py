"""Input batch fingerprints: which ranks train on the same data.

At every grad-enabled forward of a trained root (agent/watch/models.py), the first
floating or integer tensor among its inputs (positional, then keyword, a
few levels into tuples, lists and dicts) is sampled at fixed places: up to
8 rows spread over its first dimension, and in each the elements at
positions 1, 2, 3, 5, 8, 13, ... (dense near the start, where padded text
still differs) and the last. One gather kernel; on a GPU the few values
come back through the deferred device read (a pinned copy, read later: no
sync). The values are hashed with the shape and dtype into a 52-bit
fingerprint; the step's fingerprint (`StepRecord.batch_fp`) combines its
micro-batches'. The data itself never leaves the process. On a device the
sampled values are read with the step's other device values
(`Progress.defer`): the step's record is held until they are in, so the
fingerprint travels in the step row, never as an event of its own. That
path was never run on a GPU here: the tests run it through the device
adapter's GPU-like double (agent/core/device.py).

The collector compares ranks at each step (duplicates across ranks). A
rank that trains on the same batch step after step is judged here, where
the DataLoader is known (agent/watch/loaders.py): the same fingerprint on
REPEAT_STEPS consecutive steps from a loader that has more batches than
that and did not finish an epoch in between (a small dataset seen again
every epoch is fine) is a `batch_repeat` event.
"""

from __future__ import annotations

import array
import hashlib
import struct
from typing import TYPE_CHECKING, Any, Optional

import torch

from rankwatch.wire import StepRecord

from ..watch import models as models_mod
from ..watch.models import Forward, TrainedModels
from ..core.safety import guarded

if TYPE_CHECKING:
    from ..watch.loaders import LoaderInfo, LoaderTracker
    from ..core.ports import Emit, StepProgress

MASK = (1 << 52) - 1
ROWS = 8
POSITIONS = (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987, 1597, 2584, 4181)
REPEAT_STEPS = 4  # the same batch this many steps in a row, without an epoch ending
MAX_MICRO = 64
_DTYPES = {torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4, torch.int64: 5, torch.int32: 6,
           torch.int16: 7, torch.int8: 8, torch.uint8: 9}


def first_tensor(args: Any, kwargs: Any, depth: int = 0) -> Optional[torch.Tensor]:
    """The first floating or integer tensor of a call's inputs."""
    if depth == 0 and args and type(args) is tuple:
        head = args[0]
        if type(head) is torch.Tensor and head.dtype in _DTYPES and head.numel() > 0 and head.layout == torch.strided:
            return head  # model(x): the common case, without the walk
    if depth > 3:
        return None
    items: list[Any] = []
    if isinstance(args, (tuple, list)):
        items.extend(args[:8])
    elif isinstance(args, dict):
        items.extend(list(args.values())[:8])
    else:
        items.append(args)
    if isinstance(kwargs, dict):
        items.extend(list(kwargs.values())[:8])
    for item in items:
        if isinstance(item, torch.Tensor):
            if item.dtype in _DTYPES and item.numel() > 0 and item.layout == torch.strided:
                return item
        elif isinstance(item, (tuple, list, dict)):
            found = first_tensor(item, None, depth + 1)
            if found is not None:
                return found
        elif hasattr(item, "keys") and hasattr(item, "values"):  # a BatchEncoding-like mapping
            try:
                found = first_tensor(dict(item), None, depth + 1)
            except Exception:
                found = None
            if found is not None:
                return found
    return None


class BatchFingerprints:
    def __init__(self, models: TrainedModels, loaders: Optional["LoaderTracker"], *, emit: "Emit",
                 progress: "StepProgress") -> None:
        self.emit = emit
        self.progress = progress
        self.models = models
        self.loaders = loaders
        self._index: dict[tuple, torch.Tensor] = {}
        self._columns_on: dict[torch.device, torch.Tensor] = {}
        # A slot per sampled micro-batch: [digest or None, device values to read or None, header].
        self._pending: list[list[Any]] = []  # this micro-batch's samples, before its backward
        self._step: list[list[Any]] = []  # committed by a backward this step
        self._loader: Optional["LoaderInfo"] = None
        self._loader_state: Optional[tuple[int, int]] = None
        self._history: list[tuple[int, Optional[int], Any, Optional[tuple[int, int]]]] = []
        self._reported = False
        models.on_training_forward.append(self._on_forward)
        models.on_training_backward.append(self._on_backward)
        progress.step_extras.append(self._on_step_end)

    # -- sampling -----------------------------------------------------------------------------
    def _positions(self, tensor: torch.Tensor) -> torch.Tensor:
        """Flat positions of the sampled elements: ROWS rows spread over the
        first dimension, and in each the columns 0, POSITIONS below the
        width, and the last. Built on the tensor's device from `arange` and
        one per-device constant, so a new input shape (dynamic padding: most
        steps of an NLP job) costs a few small kernels, not a blocking
        host-to-device copy (issue 25, finding 2)."""
        shape = tuple(tensor.shape)
        key = (shape, tensor.device)
        index = self._index.get(key)
        if index is not None:
            return index
        numel = tensor.numel()
        if tensor.dim() <= 1:
            rows_n, width = 1, numel
        else:
            rows_n, width = shape[0], numel // shape[0]
        count = min(ROWS, rows_n)
        # strictly increasing (rows_n - 1 >= count - 1): no duplicates to remove
        rows = torch.arange(count, dtype=torch.int64, device=tensor.device) * (rows_n - 1) // max(1, count - 1)
        base = self._columns(tensor.device)
        below = 1 + sum(1 for p in POSITIONS if p < width)  # column 0 and the POSITIONS inside the row
        cols = base[:below]
        if width - 1 not in (0, *POSITIONS[:below - 1]):
            cols = torch.cat([cols, torch.full((1,), width - 1, dtype=torch.int64, device=tensor.device)])
        index = (rows[:, None] * width + cols[None, :]).reshape(-1)
        if len(self._index) >= 16:
            self._index.clear()
        self._index[key] = index
        return index

    def _columns(self, device: torch.device) -> torch.Tensor:
        """(0, *POSITIONS) on ``device``, made once per device by fills (a
        fill takes its value as a kernel argument: no copy from the host)."""
        columns = self._columns_on.get(device)
        if columns is None:
            columns = torch.cat([torch.full((1,), p, dtype=torch.int64, device=device) for p in (0, *POSITIONS)])
            self._columns_on[device] = columns
        return columns

    @guarded("batch_fingerprints.forward")
    def _on_forward(self, forward: Forward) -> None:
        if not forward.training:
            return  # a forward in eval mode is not a training batch
        if len(self._pending) >= MAX_MICRO:
            return
        if self.loaders is not None and self._loader is None:
            self._loader = self.loaders.last
            self._loader_state = (self._loader.epochs_completed, self._loader.iterators) if self._loader else None
        tensor = first_tensor(forward.args, forward.kwargs)
        if tensor is None:
            return
        data = tensor.detach()
        if not data.is_contiguous():
            data = data.contiguous() if data.numel() <= (1 << 16) else None
            if data is None:
                return
        header = struct.pack(f"<{len(data.shape) + 2}q", len(data.shape), *data.shape, _DTYPES.get(data.dtype, 0))
        values = data.take(self._positions(data))
        if models_mod.on_host(values):
            self._pending.append([_digest(header, values.double().numpy().tobytes()), None, header])
        else:
            self._pending.append([None, values, header])  # a few values, read at the step's end

    @guarded("batch_fingerprints.backward")
    def _on_backward(self, forwards: list[Forward]) -> None:
        self._step.extend(self._pending)
        self._pending = []

    # -- step end ---------------------------------------------------------------------------------
    @guarded("batch_fingerprints.step")
    def _on_step_end(self, record: StepRecord) -> None:
        slots, self._step, self._pending = self._step, [], []
        loader, state = self._loader, self._loader_state
        self._loader = self._loader_state = None
        unread = [s for s in slots if s[0] is None]
        if not unread:
            record.batch_fp = _combine(slots) if slots else None
            self._judge(record.step, record.batch_fp, loader, state)
            return

        def consume(read: Optional[list[float]], record=record, slots=slots, loader=loader, state=state) -> None:
            if read is None:  # given up (a capture, a device far behind): no fingerprint this step
                self._judge(record.step, None, loader, state)
                return
            at = 0
            for slot in unread:
                size = int(slot[1].numel())
                slot[0] = _digest(slot[2], array.array("d", read[at: at + size]).tobytes())
                slot[1], at = None, at + size
            record.batch_fp = _combine(slots)
            self._judge(record.step, record.batch_fp, loader, state)

        self.progress.defer([s[1] for s in unread], guarded("batch_fingerprints.read")(consume))

    def _judge(self, step: int, fp: Optional[int], loader: Optional["LoaderInfo"],
               state: Optional[tuple[int, int]]) -> None:
        """The same batch, step after step, from a loader that did not end an epoch in between."""
        self._history.append((step, fp, loader, state))
        del self._history[:-REPEAT_STEPS]
        if self._reported or len(self._history) < REPEAT_STEPS or fp is None:
            return
        first = self._history[0]
        if any(h[1] != fp or h[2] is not loader for h in self._history):
            return
        if loader is None or loader.batches is None or loader.batches <= 1:
            return  # no loader (a fixed batch by design, a rollout reused), or one batch per epoch
        epochs = {h[3][0] for h in self._history if h[3] is not None}
        if len(epochs) != 1:
            return  # an epoch ended in between: a dataset seen again
        iterators = [h[3][1] for h in self._history if h[3] is not None]
        fresh = len(iterators) == len(self._history) and all(b > a for a, b in zip(iterators, iterators[1:]))
        self._reported = True
        self.emit("batch_repeat", step=first[0] + 1, repeats=len(self._history), first_step=first[0],
                  batches_per_epoch=loader.batches, new_iterator_every_step=fresh, sampler=loader.sampler,
                  dataset=loader.dataset)


def _digest(header: bytes, values: bytes) -> int:
    """52 bits of BLAKE2b over the shape, dtype and sampled values (float64):
    the same on every process (Python's own hash of a NaN is not)."""
    return int.from_bytes(hashlib.blake2b(header + values, digest_size=8).digest(), "little") & MASK


def _combine(slots: list[list[Any]]) -> int:
    if len(slots) == 1:
        return int(slots[0][0])  # type: ignore[arg-type]
    return hash(tuple(s[0] for s in slots)) & MASK


def attach(models: Optional[TrainedModels], loaders: Optional["LoaderTracker"], *, emit: "Emit",
           progress: "StepProgress") -> Optional[BatchFingerprints]:
    if models is None:
        return None
    return BatchFingerprints(models, loaders, emit=emit, progress=progress)
