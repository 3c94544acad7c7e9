"""What a stalled rank's process is doing, read from /proc: the CPU time of
its threads and child processes and the bytes its threads moved through
files, rankwatch's own threads left out (the heartbeat thread keeps beating
while the training thread is stuck; counting it would make every stuck rank
look busy), and the communication libraries' polling threads.

The collector reads these to tell a rank that works through a stall (a
checkpoint upload, a long rank-0 evaluation: CPU or I/O moves) from one that
is stuck (asleep, blocked in a collective the others never join, waiting on a
lock: nothing moves). See collector/stuck.py for the rule.

Sampled by the heartbeat thread only while the rank has made no progress
for a while, so a healthy job never pays for it. Linux only; elsewhere (or
without /proc) nothing is sampled and the collector falls back to its
longer bound.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

PROC = "/proc"
# CPU: /proc/<pid>/task/<tid>/schedstat's first field is the thread's run
# time in nanoseconds (exact); /proc/.../stat's utime+stime count 10 ms
# ticks, too coarse for a rank that uploads slowly. stat is the fallback.
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def own_thread_ids() -> set[int]:
    """Native ids of rankwatch's threads in this process (named rankwatch-*)."""
    return {t.native_id for t in threading.enumerate()
            if t.name.startswith("rankwatch") and t.native_id is not None}


def python_thread_ids() -> set[int]:
    """Native ids of the threads that run Python code in this process."""
    return {t.native_id for t in threading.enumerate() if t.native_id is not None}


def sample(pid: Optional[int] = None, skip_threads: Optional[set[int]] = None,
           python_threads: Optional[set[int]] = None) -> Optional[tuple[float, int, int]]:
    """(CPU seconds, file bytes read + written, context switches) of process
    `pid` (default: this one) without the threads in `skip_threads`, plus
    its child processes' CPU (DataLoader workers, a compiler). None without
    /proc. Context switches count a thread that waits on the network and
    wakes as bytes go out (an upload at 2 MB/s: ~3 a second, 0.04 % of a
    core): a thread asleep or blocked for good never wakes.

    Threads that run no Python (`python_threads` given, or this process's)
    count with their CPU alone: a rank's own work through a stall (an
    upload, an evaluation, a checkpoint) runs in Python threads or child
    processes, while native library threads wake on timers of their own
    whether the rank works or not (OpenMP's pool, a tokenizer's), and some
    read an eventfd as they wake, which /proc counts as bytes read. Such a
    poller's wake-ups had a CUDA rank asleep in time.sleep() never judged
    idle (an H200, 2026-11-26: named as hung in 5 s, still not ended 60 s
    later). A native thread that does real work shows by its CPU. The
    communication libraries' and CUDA's own threads (MACHINERY_THREADS) are
    left out altogether."""
    own = pid is None or pid == os.getpid()
    pid = os.getpid() if pid is None else pid
    skip = own_thread_ids() if skip_threads is None and own else (skip_threads or set())
    python = python_threads if python_threads is not None else (python_thread_ids() if own else None)
    try:
        tids = os.listdir(f"{PROC}/{pid}/task")
    except OSError:
        return None
    cpu = 0.0
    io = 0
    switches = 0
    for entry in tids:
        if not entry.isdigit() or int(entry) in skip:
            continue
        base = f"{PROC}/{pid}/task/{entry}"
        if _machinery(base):
            continue
        cpu += _cpu_seconds(base)
        if python is None or int(entry) in python:
            io += _io_bytes(base)
            switches += _switches(base)
    for child in _children(pid):
        cpu += _cpu_seconds(f"{PROC}/{child}")
    return cpu, io, switches


# Threads of the communication libraries and of CUDA itself (by the names
# they give their OS threads): they poll and keep connections alive whether
# or not the rank works (gloo's loop thread: ~5 ms a second in a rank asleep;
# NCCL's proxy and torch's NCCL watchdog poll), and the work done through
# them shows as collectives and kernels completing, which is progress
# already. CUDA's runtime starts "cuda-EvtHandlr" and the driver threads
# named "cuda" + hex in every CUDA process: on an H200 (Linux 6.18, torch
# 2.11+cu130, 2026-11-27) the event handler alone used 0.8 ms a second in a
# rank asleep in time.sleep(), 80 % of the idle bound (collector/stuck.py),
# and one DDP rank in two runs was never judged idle (not ended in 90 s).
MACHINERY_THREADS = ("rankwatch", "gloo", "pt_nccl", "NCCL", "nccl", "cuda")


def _machinery(base: str) -> bool:
    try:
        with open(f"{base}/comm") as f:
            return f.read().strip().startswith(MACHINERY_THREADS)
    except OSError:
        return False


def _cpu_seconds(base: str) -> float:
    try:
        with open(f"{base}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"{base}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14, 15)
    except (OSError, ValueError, IndexError):
        return 0.0


def _switches(base: str) -> int:
    total = 0
    try:
        with open(f"{base}/status") as f:
            for line in f:
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    total += int(line.split(":")[1])
    except (OSError, ValueError, IndexError):
        return 0
    return total


def _io_bytes(base: str) -> int:
    total = 0
    try:
        with open(f"{base}/io") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("rchar", "wchar"):
                    total += int(value)
    except (OSError, ValueError):
        return 0
    return total


def _children(pid: int) -> list[int]:
    """Every process below `pid`, from the kernel's children lists
    (/proc/<pid>/task/<tid>/children)."""
    found: list[int] = []
    frontier = [pid]
    while frontier and len(found) < 4096:
        parent = frontier.pop()
        try:
            tids = os.listdir(f"{PROC}/{parent}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"{PROC}/{parent}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except (OSError, ValueError):
                continue
            found.extend(kids)
            frontier.extend(kids)
    return found
