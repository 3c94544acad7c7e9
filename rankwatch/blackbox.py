"""A rank's black box: a few bytes in a memory-mapped file, rewritten by the
agent at every phase change and step, read by the supervisor after the rank
died (SIGKILL, SIGABRT, host OOM-kill) when the rank could not say anything.

Layout (little-endian, 64 bytes): magic u32, version u32, step i64,
forwards i64, last_progress_at f64, phase 16 bytes (ASCII), pid i64.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Optional

MAGIC = 0x52574242  # "RWBB"
VERSION = 1
_FORMAT = "<IIqqd16sq"
SIZE = 64


class BlackBox:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._pid = os.getpid()

    def write(self, step: int, forwards: int, phase: str, last_progress_at: float) -> None:
        struct.pack_into(_FORMAT, self._map, 0, MAGIC, VERSION, step, forwards, last_progress_at,
                         phase.encode("ascii", "replace")[:16], self._pid)


def read(path: Path) -> Optional[dict]:
    try:
        data = path.read_bytes()[:SIZE]
    except OSError:
        return None
    if len(data) < struct.calcsize(_FORMAT):
        return None
    magic, version, step, forwards, last, phase, pid = struct.unpack_from(_FORMAT, data)
    if magic != MAGIC or version != VERSION:
        return None
    return {"step": step, "forwards": forwards, "last_progress_at": last,
            "phase": phase.rstrip(b"\0").decode("ascii", "replace"), "pid": pid}


def path_for(run_dir: Path | str, rank: int) -> Path:
    return Path(run_dir) / "stacks" / f"rank-{rank:05d}.blackbox"
