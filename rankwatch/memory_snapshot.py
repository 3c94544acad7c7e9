"""CUDA memory snapshots: the plain-dict form of ``torch.cuda.memory._snapshot()``
(the format torch's own ``torch/cuda/_memory_viz.py`` reads) summarised into
what a person needs after an OOM: how much is allocated, reserved and free,
and the allocation sites (Python frames) that hold the most memory.

The agent converts the snapshot dict to JSON inside the rank (trusted); the
collector only ever reads that JSON. The pickle torch writes with
``_dump_snapshot`` travels as an opaque file for pytorch.org/memory_viz.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

TOP = 10


def to_jsonable(snapshot: dict[str, Any], max_blocks: int = 20000, max_trace: int = 2000) -> dict[str, Any]:
    """Bound a snapshot's size for a bundle (blocks and trace entries are capped)."""
    out = {"segments": [], "device_traces": []}
    blocks_left = max_blocks
    for seg in snapshot.get("segments", []):
        blocks = seg.get("blocks", [])[: max(0, blocks_left)]
        blocks_left -= len(blocks)
        out["segments"].append({**{k: v for k, v in seg.items() if k != "blocks"}, "blocks": blocks})
    for trace in snapshot.get("device_traces", []):
        out["device_traces"].append(list(trace)[-max_trace:])
    return _plain(out)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _site(frames: list[dict[str, Any]]) -> str:
    """The innermost frame outside torch: where the user's code allocated."""
    for frame in frames:  # snapshot frames are innermost first
        filename = str(frame.get("filename", ""))
        if f"{os.sep}torch{os.sep}" not in filename and not filename.startswith("??"):
            return f"{os.path.basename(filename)}:{frame.get('line')} in {frame.get('name')}"
    if frames:
        f = frames[0]
        return f"{os.path.basename(str(f.get('filename', '?')))}:{f.get('line')} in {f.get('name')}"
    return "<no stack recorded: enable memory_history>"


def summarize(snapshot: dict[str, Any]) -> dict[str, Any]:
    reserved = allocated = active = 0
    by_site: dict[str, int] = defaultdict(int)
    counts: dict[str, int] = defaultdict(int)
    largest = []
    for seg in snapshot.get("segments", []) or []:
        reserved += int(seg.get("total_size", 0) or 0)
        for block in seg.get("blocks", []) or []:
            size = int(block.get("size", 0) or 0)
            state = block.get("state")
            if state in ("active_allocated", "active_pending_free"):
                allocated += size
                site = _site(block.get("frames") or [])
                by_site[site] += size
                counts[site] += 1
                largest.append((size, site))
            if state != "inactive":
                active += size
    largest.sort(reverse=True)
    top = sorted(by_site.items(), key=lambda kv: kv[1], reverse=True)[:TOP]
    return {
        "reserved_bytes": reserved,
        "allocated_bytes": allocated,
        "free_in_reserved_bytes": max(0, reserved - allocated),
        "top_sites": [{"site": s, "bytes": b, "blocks": counts[s]} for s, b in top],
        "largest_blocks": [{"bytes": b, "site": s} for b, s in largest[:TOP]],
    }


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
