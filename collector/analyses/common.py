"""Helpers shared by the analyses: verdict construction, stack reading."""

from __future__ import annotations

import datetime as _dt
import os
import re
from typing import Any, Iterable, Optional

from rankwatch import wire

# Frames in these files are torch's or Python's machinery; the user's code is elsewhere.
_MACHINERY = (
    f"{os.sep}torch{os.sep}",
    f"{os.sep}rankwatch{os.sep}",
    # the agent's own folder (a source checkout: <repo>/agent next to <repo>/collector)
    os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "agent") + os.sep,
    "<frozen ",
    f"{os.sep}runpy.py",
    f"{os.sep}threading.py",
)

_WAIT_MARKERS = (
    ("torch/distributed/", "collective"),
    ("torch/nn/parallel/distributed.py", "DDP"),
    ("torch/autograd/", "backward"),
    ("torch/_tensor.py", "backward"),
)


def iso(t: Optional[float]) -> str:
    t = time_or_now(t)
    return _dt.datetime.fromtimestamp(t, tz=_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def time_or_now(t: Optional[float]) -> float:
    import time

    return t if t else time.time()


def verdict(kind: str, ranks: Iterable[int], step: Optional[int], first_seen: Optional[float],
            detected: Optional[float], summary: str, evidence: dict[str, Any]) -> wire.Verdict:
    assert kind in wire.VERDICT_KINDS, kind
    return wire.Verdict(
        kind=kind,
        ranks=sorted(set(int(r) for r in ranks)),
        step=step,
        first_seen_at=iso(first_seen),
        detected_at=iso(detected),
        summary=summary,
        evidence=evidence,
    )


# The standard library (not site-packages): select(), queue.get() and the like
# are where a stuck rank waits, not where its bug is.
_STDLIB = re.compile(r"[\\/]lib[\\/]python3\.\d+[\\/](?!site-packages|dist-packages)")


def is_machinery(filename: str) -> bool:
    return any(marker in filename for marker in _MACHINERY) or bool(_STDLIB.search(filename))


def user_frame(frames: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The innermost frame of the user's code (frames are outermost first)."""
    for frame in reversed(frames):
        if not is_machinery(str(frame.get("file", ""))):
            return frame
    return None


def innermost(frames: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    return frames[-1] if frames else None


def where(frames: list[dict[str, Any]]) -> str:
    """'train.py:41 in train_step -> time.sleep' style location."""
    frame = user_frame(frames)
    inner = innermost(frames)
    if frame is None and inner is None:
        return "unknown location"
    text = ""
    if frame is not None:
        text = f"{os.path.basename(str(frame.get('file')))}:{frame.get('line')} in {frame.get('name')}"
        code = str(frame.get("code") or "").strip()
        if code:
            text += f" ({code[:80]})"
    if inner is not None and inner is not frame:
        inner_text = f"{_short(str(inner.get('file')))}:{inner.get('line')} {inner.get('name')}"
        text = f"{text} -> {inner_text}" if text else inner_text
    return text


def waits_in_collective(frames: list[dict[str, Any]]) -> bool:
    """A main-thread stack parked in torch.distributed / DDP / backward (waiting for peers)."""
    for frame in frames[-12:]:
        name = str(frame.get("file", "")).replace(os.sep, "/")
        if any(marker in name for marker, _ in _WAIT_MARKERS):
            return True
    return False


def in_dataloader(frames: list[dict[str, Any]]) -> bool:
    return any("torch/utils/data/" in str(f.get("file", "")).replace(os.sep, "/") for f in frames[-15:])


def _short(path: str) -> str:
    parts = path.replace(os.sep, "/").split("/")
    if "torch" in parts:
        return "/".join(parts[parts.index("torch"):])
    return os.path.basename(path)


def located(run, ranks: Iterable[int]) -> str:
    """'rank 3 (host a, node 1)': where the culprit runs, for multi-node jobs."""
    ranks = sorted(ranks)
    places = []
    for r in ranks[:4]:
        state = run.ranks.get(r)
        if state is not None and state.host:
            places.append(f"rank {r} on {state.host}" + (f" node {state.node_rank}" if state.node_rank else ""))
    return "; ".join(places)


def verb(ranks, singular: str, plural: str) -> str:
    """'holds' for one rank, 'hold' for several."""
    return singular if len(list(ranks)) == 1 else plural


def ranks_text(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 8:
        return f"{len(ranks)} ranks ({', '.join(map(str, ranks[:8]))}, ...)"
    return "ranks " + ", ".join(map(str, ranks))


def majority(values: dict[int, Any]) -> tuple[Any, list[int]]:
    """(most common value, ranks that differ from it). Ties: no minority."""
    counts: dict[Any, int] = {}
    for value in values.values():
        counts[value] = counts.get(value, 0) + 1
    if not counts:
        return None, []
    best = max(counts.values())
    winners = [v for v, c in counts.items() if c == best]
    if len(winners) > 1:
        return None, []
    value = winners[0]
    return value, sorted(r for r, v in values.items() if v != value)
