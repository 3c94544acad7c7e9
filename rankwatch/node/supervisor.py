"""The node supervisor: runs in the launcher, watches the local ranks from
outside.

A rank whose Python is frozen (GIL held, stuck in C code) cannot answer its
collector; a rank killed by a signal cannot report its own death. The
supervisor sees both: it reads each worker's exit status without reaping it
(``waitid(WNOWAIT)``, so torchrun still gets it), and on request captures
stacks from outside with py-spy (``--json``, plus ``--native`` for a rank that
stopped beating) and faulthandler.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from rankwatch import __version__

from rankwatch import wire
from rankwatch.bundles import pack
from rankwatch.redact import redact_text

FAULTHANDLER_SIGNAL = signal.SIGUSR2
PYSPY_TIMEOUT = 8.0
SPOOL_RETRY_S = 5.0
MAX_CAPTURES = 1000  # incidents one launcher captures stacks for (a collector cannot make it spawn without end)
MAX_ANNOUNCED_LINES = 8  # verdict lines printed per reply at most
MAX_ANNOUNCED_KEPT = 1000  # distinct verdict lines printed per run at most (a lying collector)


@dataclass
class Worker:
    pid: int
    rank: int
    local_rank: int
    world_size: int
    alive: bool = True
    exit_code: Optional[int] = None
    exited_at: Optional[float] = None


def _children(parent: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent:
            out.append(int(entry))
    return out


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (DataLoader workers and the like)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found.extend(children)
        frontier.extend(children)
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key in (b"RANK", b"LOCAL_RANK", b"WORLD_SIZE", b"RANKWATCH_RUN_ID"):
            env[key.decode()] = value.decode(errors="replace")
    return env


class NodeSupervisor:
    def __init__(self, run_id: str, run_dir: Path, post: Callable[[str, bytes, str], Any],
                 node_rank: int, world_size: int, on_hang: str, hang_timeout: Optional[float],
                 host: Optional[str] = None, interval: float = 0.5, expected_workers: int = 0,
                 announce: bool = False):
        self.run_id = run_id
        # Behind a standalone collector: print the verdict lines its replies
        # carry, once each (the embedded collector logs them in this process).
        self.announce = announce
        self._announced: set[str] = set()
        self.run_dir = run_dir
        self.post = post  # (path, body, content type) -> decoded JSON reply; raises on failure
        self.node_rank = node_rank
        self.world_size = world_size
        self.on_hang = on_hang
        self.hang_timeout = hang_timeout
        self.host = host or socket.gethostname()
        self.interval = interval
        self.expected_workers = expected_workers
        self.workers: dict[int, Worker] = {}
        self.aborted = False
        self.abort_reason = ""  # why rankwatch ended the job (said after torchrun's "failed (exitcode: -15)")
        self._captured: set[str] = set()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._pyspy = shutil.which("py-spy")
        self._lock = threading.Lock()
        self._post_mortems: list[threading.Thread] = []
        self._spool_checked = 0.0

    # -- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="rankwatch-supervisor", daemon=True)
        self._thread.start()

    def report_now(self) -> None:
        """One report at once (the loop's first comes an interval after
        start): the collector knows the run from then on, so its page is
        there before the workers have started. Never raises."""
        self._report()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        deadline = time.time() + 5.0
        for thread in self._post_mortems:  # the dead ranks' evidence goes in before the report
            thread.join(max(0.0, deadline - time.time()))
        self._report(finished=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                # /proc is scanned until every local worker is known (and again
                # after torchrun restarts them).
                complete = self.expected_workers and sum(w.alive for w in self.workers.values()) >= self.expected_workers
                if not complete:
                    self.poll_workers()
                self._report()
            except Exception as exc:
                _log(f"supervisor error: {type(exc).__name__}: {exc}")

    def _wait_for_exit(self, worker: Worker) -> None:
        """Blocks until the worker exits (no polling, no CPU), reads its status
        without reaping it (torchrun reaps it and still gets the code), and
        reports at once."""
        try:
            result = os.waitid(os.P_PID, worker.pid, os.WEXITED | os.WNOWAIT)
        except (ChildProcessError, OSError):
            result = None
        code: Optional[int] = None
        if result is not None:
            code = result.si_status if result.si_code == os.CLD_EXITED else -result.si_status
        with self._lock:
            worker.alive, worker.exit_code, worker.exited_at = False, code, time.time()
        if code is None or code != 0:
            thread = threading.Thread(target=self.post_mortem, args=(worker,), daemon=True)
            thread.start()
            self._post_mortems.append(thread)
        try:
            self._report()
        except Exception:
            pass

    # -- watching ------------------------------------------------------------------
    def poll_workers(self) -> None:
        """Find new local workers (children of this launcher) and start a waiter for each."""
        with self._lock:
            for pid in _children(os.getpid()):
                if pid in self.workers:
                    continue
                env = _environ(pid)
                if env.get("RANKWATCH_RUN_ID") != self.run_id or "RANK" not in env:
                    continue
                try:
                    worker = Worker(pid=pid, rank=int(env["RANK"]), local_rank=int(env.get("LOCAL_RANK", 0)),
                                    world_size=int(env.get("WORLD_SIZE", 0)))
                except ValueError:
                    continue
                self.workers[pid] = worker
                threading.Thread(target=self._wait_for_exit, args=(worker,), name=f"rankwatch-wait-{worker.rank}",
                                 daemon=True).start()

    def _report(self, finished: bool = False) -> None:
        with self._lock:
            statuses = [wire.WorkerStatus(local_rank=w.local_rank, rank=w.rank, pid=w.pid, alive=w.alive,
                                          exit_code=w.exit_code, exited_at=w.exited_at)
                        for w in self.workers.values()]
        node = wire.NodeHeartbeat(run_id=self.run_id, host=self.host, node_rank=self.node_rank,
                                  world_size=self.world_size, sent_at=time.time(), hang_timeout=self.hang_timeout,
                                  on_hang=self.on_hang, workers=statuses, finished=finished,
                                  launcher_pid=os.getpid())
        try:
            raw = self.post("/v1/nodes", wire.dumps(node), "application/json")
            reply = wire.decode(wire.Reply, raw)
        except Exception:
            return  # the collector may be down (or answers garbage): the launcher still writes a report
        self._resend_spool()  # the collector answers: what could not be sent before goes now
        if self.announce:
            self._announce(reply.verdicts)
        for command in reply.commands:
            try:
                self._command(command, finished)
            except Exception as exc:  # a bad command never reaches the launcher
                _log(f"ignoring a command the supervisor cannot follow ({type(exc).__name__}: {exc})")

    def _announce(self, lines: list[str]) -> None:
        for line in lines[-MAX_ANNOUNCED_LINES:]:
            if line not in self._announced and len(self._announced) < MAX_ANNOUNCED_KEPT:
                self._announced.add(line)
                print(redact_text(line), file=sys.stderr, flush=True)  # validated: one line, no control characters

    def _command(self, command: wire.Command, finished: bool) -> None:
        if command.kind == "capture":
            # The incident id names a spool folder: the wire pattern (no "..",
            # no separators) is checked here too, not only by the decoder.
            if not wire.valid_id(command.incident):
                _log(f"ignoring a capture for an invalid incident id {command.incident!r:.80}")
                return
            if command.incident not in self._captured and len(self._captured) < MAX_CAPTURES:
                self._captured.add(command.incident)
                threading.Thread(target=self.capture, args=(command,), name="rankwatch-capture", daemon=True).start()
        elif command.kind == "abort" and not self.aborted and not finished:
            self.abort(redact_text(str(command.reason))[:500])

    def _spool_path(self, incident: str, rank: int) -> Optional[Path]:
        """Where an unsent bundle waits: always under <run-dir>/spool."""
        if not wire.valid_id(incident):
            return None
        root = (self.run_dir / "spool").resolve()
        path = (root / incident / f"rank-{rank:05d}.supervisor.tar.gz").resolve()
        if path.parent.parent != root:
            return None
        return path

    def _resend_spool(self) -> None:
        """Spooled supervisor bundles (collector down, or restarted) are sent
        once it answers again; at most every few seconds, a few at a time."""
        now = time.monotonic()
        if now - self._spool_checked < SPOOL_RETRY_S:
            return
        self._spool_checked = now
        spool = self.run_dir / "spool"
        try:
            files = sorted(spool.glob("*/rank-*.supervisor.tar.gz"))[:16]
        except OSError:
            return
        for path in files:
            if path.is_symlink():
                continue
            try:
                self.post("/v1/bundles", path.read_bytes(), "application/gzip")
            except Exception:
                return  # still down (or refused): try again later
            try:
                path.unlink()
            except OSError:
                pass

    # -- actions ---------------------------------------------------------------------
    def abort(self, reason: str, grace: float = 5.0) -> None:
        """End the job once the evidence is in: SIGTERM, then SIGKILL."""
        self.aborted = True
        self.abort_reason = reason
        _log(f"ending the job: {reason}")
        live = [w for w in self.workers.values() if w.alive]
        # A rank's own children (DataLoader workers stuck in a read) would
        # outlive it and hold the job's pipes open: they go too.
        below = [pid for w in live for pid in _descendants(w.pid)]
        for worker in live:
            _signal(worker.pid, signal.SIGTERM)
        for pid in below:
            _signal(pid, signal.SIGTERM)

        def escalate() -> None:
            deadline = time.time() + grace
            while time.time() < deadline:
                if not any(w.alive for w in live) and not any(_exists(p) for p in below):
                    return
                time.sleep(0.1)
            for worker in live:
                if worker.alive:
                    _signal(worker.pid, signal.SIGKILL)
            for pid in below:
                _signal(pid, signal.SIGKILL)

        threading.Thread(target=escalate, name="rankwatch-abort", daemon=True).start()

    def post_mortem(self, worker: Worker) -> None:
        try:
            self._post_mortem(worker)
        except Exception as exc:
            _log(f"post-mortem of rank {worker.rank} failed: {type(exc).__name__}: {exc}")

    def _post_mortem(self, worker: Worker) -> None:
        """A rank died: its black box (last step and phase) and what Python's
        faulthandler wrote on the fatal signal (SIGABRT from a collective
        abort, SIGSEGV) are what it could not report itself."""
        from rankwatch.node import blackbox
        from rankwatch.faulttext import MAIN_MARK, parse

        members: dict[str, Any] = {}
        box = blackbox.read(blackbox.path_for(self.run_dir, worker.rank))
        if box is not None:
            members["metrics.json"] = {"progress": box, "steps": [], "marks": [], "events": []}
        try:
            text = (self.run_dir / "stacks" / f"rank-{worker.rank:05d}.fatal.txt").read_text(errors="replace")
        except OSError:
            text = ""
        if any(line and not line.startswith(MAIN_MARK) for line in text.splitlines()):
            text = redact_text(text[-200_000:])
            members["faulthandler.txt"] = text
            members["stacks.json"] = with_source(parse(text))
        from rankwatch.agent.watch.collectives import timeout_dump_members, timeout_dump_prefix

        # A collective timeout: torch's watchdog wrote its Flight Recorder dump before the abort.
        members.update(timeout_dump_members(worker.rank, timeout_dump_prefix(self.run_dir)))
        if members:
            step = box["step"] if box else None
            self._send_bundle(worker, f"postmortem-r{worker.rank}", "crash", members, [], step=step)

    def _send_bundle(self, worker: Worker, incident: str, reason: str, members: dict[str, Any],
                     notes: list[str], step: Optional[int] = None) -> None:
        manifest = wire.BundleManifest(
            run_id=self.run_id, rank=worker.rank, local_rank=worker.local_rank, world_size=worker.world_size,
            host=self.host, pid=worker.pid, step=step, created_at=time.time(), reason=reason,
            incident=incident, source="supervisor", rankwatch_version=__version__,
            python_version=platform.python_version(), node_rank=self.node_rank, notes=notes)
        archive = pack(manifest, members)
        try:
            self.post("/v1/bundles", archive, "application/gzip")
        except Exception:
            spool = self._spool_path(incident, worker.rank)
            if spool is None:
                _log(f"bundle of rank {worker.rank} not kept: invalid incident id {incident!r:.80}")
                return
            try:
                spool.parent.mkdir(parents=True, exist_ok=True)
                tmp = spool.with_name(spool.name + ".tmp")
                tmp.write_bytes(archive)
                tmp.replace(spool)
            except OSError as exc:  # disk full, read-only run dir: the evidence is lost, the job goes on
                _log(f"bundle of rank {worker.rank} lost: cannot spool it ({type(exc).__name__}: {exc})")

    def capture(self, command: wire.Command) -> None:
        targets = [w for w in self.workers.values() if w.alive and (not command.ranks or w.rank in command.ranks)]
        raw_stale = command.details.get("stale", []) if isinstance(command.details, dict) else []
        stale = {r for r in raw_stale if isinstance(r, int)} if isinstance(raw_stale, list) else set()
        threads = [threading.Thread(target=self._capture_one, args=(w, command, w.rank in stale), daemon=True)
                   for w in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PYSPY_TIMEOUT + 2)

    def _worker_process_stacks(self, pid: int) -> list[dict[str, Any]]:
        try:
            return _worker_process_stacks_of(self._pyspy, pid) if self._pyspy else []
        except Exception as exc:  # evidence is best effort; the capture goes on
            _log(f"DataLoader worker stacks not captured ({type(exc).__name__}: {exc})")
            return []

    def _capture_one(self, worker: Worker, command: wire.Command, stale: bool) -> None:
        members: dict[str, Any] = {}
        notes = []
        if self._pyspy:
            stacks, native, note = pyspy_dump(self._pyspy, worker.pid, native=stale)
            if stacks is not None:
                members["stacks.json"] = stacks
            if native:
                members["native_stacks.txt"] = native
            if note:
                notes.append(note)
            workers = self._worker_process_stacks(worker.pid)
            if workers:
                members["worker_stacks.json"] = workers
        else:
            notes.append("py-spy not installed: no stacks from outside (pip install 'rankwatch[stacks]')")
        if stale:
            # The frozen rank's own last words (its heartbeat thread is stopped
            # too): read before faulthandler's signal, which may end a C call.
            from rankwatch.node import blackbox

            box = blackbox.read(blackbox.path_for(self.run_dir, worker.rank))
            if box is not None:
                members["metrics.json"] = {"progress": box, "steps": [], "marks": [], "events": []}
            text = faulthandler_dump(self.run_dir, worker)
            if text:
                members["faulthandler.txt"] = text
        self._send_bundle(worker, command.incident, command.reason or "capture", members, notes)


MAX_WORKER_PROCESSES = 8  # a rank's child processes (DataLoader workers) dumped per capture


def _worker_process_stacks_of(pyspy: str, pid: int) -> list[dict[str, Any]]:
    """The Python stacks of a rank's child processes (its DataLoader workers):
    a rank stuck in `next(loader)` waits for a worker, and the worker's stack
    has the line that is stuck (a read in `__getitem__`). Non-Python children
    are skipped (py-spy refuses them)."""
    out = []
    for child in sorted(_children(pid))[:MAX_WORKER_PROCESSES]:
        stacks, _native, _note = pyspy_dump(pyspy, child)
        if stacks:
            out.append({"pid": child, "threads": stacks})
    return out


def pyspy_dump(pyspy: str, pid: int, native: bool = False) -> tuple[Optional[list], str, str]:
    """(stacks in the bundle's format, native text, note)."""
    stacks = None
    note = ""
    try:
        out = subprocess.run([pyspy, "dump", "--pid", str(pid), "--json"], capture_output=True, text=True,
                             timeout=PYSPY_TIMEOUT)
        if out.returncode == 0:
            stacks = _pyspy_to_stacks(json.loads(out.stdout), pid)
        else:
            note = f"py-spy failed: {out.stderr.strip()[:300]}"
    except (subprocess.TimeoutExpired, ValueError, OSError) as exc:
        note = f"py-spy failed: {type(exc).__name__}: {exc}"
    native_text = ""
    if native:
        try:
            out = subprocess.run([pyspy, "dump", "--pid", str(pid), "--native"], capture_output=True, text=True,
                                 timeout=PYSPY_TIMEOUT)
            native_text = redact_text(out.stdout[-200_000:])
        except (subprocess.TimeoutExpired, OSError):
            pass
    return stacks, native_text, note


def _pyspy_to_stacks(threads: list[dict[str, Any]], pid: int) -> list[dict[str, Any]]:
    out = []
    for thread in threads:
        frames = [
            {"file": f.get("filename", ""), "line": f.get("line", 0), "name": f.get("name", ""),
             "code": source_line(f.get("filename", ""), f.get("line", 0))}
            for f in reversed(thread.get("frames") or [])  # py-spy lists innermost first
        ]
        out.append({
            "thread_id": thread.get("thread_id"),
            "name": thread.get("thread_name") or "",
            "daemon": False,
            "main": thread.get("os_thread_id") == pid or thread.get("thread_name") == "MainThread",
            "frames": frames,
            "owns_gil": thread.get("owns_gil"),
            "active": thread.get("active"),
        })
    if out and not any(t["main"] for t in out):
        out[0]["main"] = True
    return out


def source_line(filename: Any, line: Any) -> str:
    """The source text of a frame, read here (same host as the worker) as the
    worker's own traceback would: py-spy and faulthandler give only file and
    line, and a hang summary without the line is much less useful."""
    import linecache

    try:
        if not isinstance(filename, str) or not filename.endswith(".py") or not isinstance(line, int) or line <= 0:
            return ""
        return linecache.getline(filename, line).strip()[:200]
    except Exception:
        return ""


def with_source(threads: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for thread in threads:
        for frame in thread.get("frames") or []:
            if not frame.get("code"):
                frame["code"] = source_line(frame.get("file"), frame.get("line"))
    return threads


def faulthandler_dump(run_dir: Path, worker: Worker, wait: float = 1.0) -> str:
    path = run_dir / "stacks" / f"rank-{worker.rank:05d}.faulthandler.txt"
    if not path.exists():
        return ""
    before = path.stat().st_size
    _signal(worker.pid, FAULTHANDLER_SIGNAL)
    deadline = time.time() + wait
    while time.time() < deadline and path.stat().st_size == before:
        time.sleep(0.05)
    with open(path, "rb") as f:
        f.seek(before)
        return redact_text(f.read(200_000).decode(errors="replace"))


def _exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _log(message: str) -> None:
    import sys

    sys.stderr.write(f"[rankwatch] {message}\n")
    sys.stderr.flush()
