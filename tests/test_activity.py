"""agent/core/activity.py against a /proc laid out as Linux lays it out: what a
stalled rank's process counts as its own work."""

from __future__ import annotations

from pathlib import Path

from rankwatch.agent.core import activity


def _thread(root: Path, pid: int, tid: int, name: str, cpu_ns: int, io: int, switches: int) -> None:
    base = root / str(pid) / "task" / str(tid)
    base.mkdir(parents=True)
    (base / "comm").write_text(name + "\n")
    (base / "schedstat").write_text(f"{cpu_ns} 0 0\n")
    (base / "io").write_text(f"rchar: {io}\nwchar: 0\nsyscr: 0\nsyscw: 0\n")
    (base / "status").write_text(f"Name:\t{name}\nvoluntary_ctxt_switches:\t{switches}\nnonvoluntary_ctxt_switches:\t0\n")
    (base / "children").write_text("")


def test_native_threads_count_by_their_cpu_alone(tmp_path, monkeypatch):
    """A native poller (OpenMP's pool) wakes on a timer and reads an eventfd
    whether the rank works or not: its wake-ups and bytes are not the rank's.
    The Python threads' are; a native thread's CPU still counts."""
    monkeypatch.setattr(activity, "PROC", str(tmp_path))
    _thread(tmp_path, 7, 7, "python", cpu_ns=2_000_000_000, io=4096, switches=12)       # the training thread
    _thread(tmp_path, 7, 8, "omp_worker", cpu_ns=30_000_000, io=800, switches=900)      # a native poller
    _thread(tmp_path, 7, 9, "pt_nccl_watchdg", cpu_ns=5_000_000_000, io=0, switches=5000)  # machinery by name
    _thread(tmp_path, 7, 10, "rankwatch-heartbeat", cpu_ns=1_000_000_000, io=100, switches=100)
    cpu, io, switches = activity.sample(7, skip_threads={10}, python_threads={7, 10})
    assert (round(cpu, 3), io, switches) == (2.03, 4096, 12)


def test_cuda_threads_are_machinery(tmp_path, monkeypatch):
    """CUDA's own threads, as an H200 rank asleep in time.sleep() showed them
    over 25 s (2026-11-27): the runtime's event handler used 19.9 ms (0.8 ms
    a second, 80 % of stuck.py's idle bound by itself) and woke 250 times; a
    driver thread named "cuda" + hex. Neither is the rank's work."""
    monkeypatch.setattr(activity, "PROC", str(tmp_path))
    _thread(tmp_path, 7, 7, "python3", cpu_ns=120_000, io=0, switches=1)
    _thread(tmp_path, 7, 8, "cuda-EvtHandlr", cpu_ns=19_940_000, io=0, switches=250)
    _thread(tmp_path, 7, 9, "cuda00002c0000c", cpu_ns=1_000_000, io=0, switches=10)
    _thread(tmp_path, 7, 10, "pt_autograd_0", cpu_ns=0, io=0, switches=0)
    cpu, io, switches = activity.sample(7, skip_threads=set(), python_threads={7})
    assert (round(cpu, 6), io, switches) == (0.00012, 0, 1)


def test_without_knowing_the_python_threads_every_thread_counts(tmp_path, monkeypatch):
    """Another process's threads (no Python thread list): all of them count,
    as before (the conservative side: busy, not idle)."""
    monkeypatch.setattr(activity, "PROC", str(tmp_path))
    _thread(tmp_path, 7, 7, "python", cpu_ns=1_000_000_000, io=10, switches=1)
    _thread(tmp_path, 7, 8, "omp_worker", cpu_ns=0, io=8, switches=50)
    assert activity.sample(7) == (1.0, 18, 51)


def test_this_process_knows_its_python_threads():
    import threading

    assert threading.main_thread().native_id in activity.python_thread_ids()
    assert activity.sample() is not None
