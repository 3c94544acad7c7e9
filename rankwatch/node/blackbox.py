"""A rank's black box: a few hundred bytes in a memory-mapped file, rewritten
by the agent at every phase change and around every Python-API collective,
read by the supervisor after the rank died (SIGKILL, SIGABRT from a
collective abort, host OOM-kill), when the rank could not say anything.

Layout (little-endian, 512 bytes, version 2):
    magic u32, version u32, step i64, forwards i64, last_progress_at f64,
    phase 16s, pid i64,
    collective op 24s, collective numel i64, collective entered_at f64,
    collective call site 160s (empty op: not inside a Python-API collective)
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import sys
from pathlib import Path
from typing import Optional

MAGIC = 0x52574242  # "RWBB"
VERSION = 2
_PROGRESS = struct.Struct("<IIqqd16sq")
_COLLECTIVE = struct.Struct("<24sqd160s")
_COLLECTIVE_AT = 64
SIZE = 512


class BlackBox:
    """The file's blocks are allocated before it is mapped: a store through a
    mapping of a sparse file on a full disk is a SIGBUS that kills the rank.
    When the file cannot be made (disk full, read-only run dir, no
    permission), the black box lives in anonymous memory: the job runs as
    without rankwatch, only a silent death loses its last words (said once)."""

    def __init__(self, path: Path):
        self.path: Optional[Path] = path
        self.problem = ""
        try:
            self._map = _mapped_file(path)
        except OSError as exc:
            self.path = None
            self.problem = f"{type(exc).__name__}: {exc}"
            self._map = mmap.mmap(-1, SIZE)
            _say_once(f"black box not written to {path} ({self.problem}); kept in memory only: "
                      f"a rank that dies silently will not leave its last step and phase")
        self._pid = os.getpid()

    @property
    def on_disk(self) -> bool:
        return self.path is not None

    def write(self, step: int, forwards: int, phase: str, last_progress_at: float) -> None:
        _PROGRESS.pack_into(self._map, 0, MAGIC, VERSION, step, forwards, last_progress_at,
                            phase.encode("ascii", "replace")[:16], self._pid)

    def enter_collective(self, op: str, numel: int, at: float, callsite: str) -> None:
        _COLLECTIVE.pack_into(self._map, _COLLECTIVE_AT, op.encode("ascii", "replace")[:24], numel, at,
                              callsite.encode("utf-8", "replace")[-160:])

    def leave_collective(self) -> None:
        _COLLECTIVE.pack_into(self._map, _COLLECTIVE_AT, b"", 0, 0.0, b"")


def _mapped_file(path: Path) -> mmap.mmap:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _allocate(fd)
        return mmap.mmap(fd, SIZE)
    except BaseException:
        try:
            os.unlink(path)  # no half-made black box for the supervisor to misread
        except OSError:
            pass
        raise
    finally:
        os.close(fd)


def _allocate(fd: int) -> None:
    """Real blocks for the whole file (ENOSPC now, not SIGBUS later)."""
    try:
        os.posix_fallocate(fd, 0, SIZE)
        return
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    except AttributeError:  # no posix_fallocate on this platform
        pass
    # A filesystem without fallocate: write the zeros, then make them reach the disk.
    data = bytes(SIZE)
    written = 0
    while written < SIZE:
        written += os.pwrite(fd, data[written:], written)
    os.fsync(fd)


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message in _said:
        return
    _said.add(message)
    try:
        sys.stderr.write(f"[rankwatch] {message}\n")
        sys.stderr.flush()
    except Exception:
        pass


def read(path: Path) -> Optional[dict]:
    try:
        data = path.read_bytes()[:SIZE]
    except OSError:
        return None
    if len(data) < SIZE:
        return None
    magic, version, step, forwards, last, phase, pid = _PROGRESS.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION:
        return None
    op, numel, entered, site = _COLLECTIVE.unpack_from(data, _COLLECTIVE_AT)
    out = {"step": step, "forwards": forwards, "last_progress_at": last,
           "phase": phase.rstrip(b"\0").decode("ascii", "replace"), "pid": pid}
    op_text = op.rstrip(b"\0").decode("ascii", "replace")
    if op_text:
        out["collective"] = {"op": op_text, "numel": numel, "entered_at": entered,
                             "callsite": site.rstrip(b"\0").decode("utf-8", "replace")}
    return out


def path_for(run_dir: Path | str, rank: int) -> Path:
    return Path(run_dir) / "stacks" / f"rank-{rank:05d}.blackbox"
