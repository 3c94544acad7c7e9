"""The per-rank agent: attaches to torch, beats, answers the collector.

One `Agent` per worker process. `Agent.install()` is called by the bootstrap
before the user's script runs; it patches nothing the user can see the effect
of: it wraps ``init_process_group`` and ``DistributedDataParallel.__init__`` to
learn when the process group and the model appear, registers torch's global
optimizer hooks, and starts the heartbeat thread.
"""

from __future__ import annotations

import faulthandler
import functools
import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from rankwatch import config as config_mod
from rankwatch import wire

from . import bundle as bundle_mod
from .collectives import CollectiveTracker
from .progress import Progress
from .safety import guarded, log
from .stacks import format_exception
from .transport import CollectorUnreachable, Transport

FAULTHANDLER_SIGNAL = signal.SIGUSR2

_current: Optional["Agent"] = None


def current() -> Optional["Agent"]:
    return _current


def identity_from_env(env=os.environ) -> wire.RankIdentity:
    def as_int(name: str, default: int) -> int:
        try:
            return int(env.get(name, default))
        except ValueError:
            return default

    return wire.RankIdentity(
        run_id=env.get("RANKWATCH_RUN_ID") or env.get("TORCHELASTIC_RUN_ID") or "local",
        rank=as_int("RANK", 0),
        local_rank=as_int("LOCAL_RANK", 0),
        world_size=as_int("WORLD_SIZE", 1),
        node_rank=as_int("GROUP_RANK", 0),
        host=env.get("RANKWATCH_HOST") or socket.gethostname(),
        pid=os.getpid(),
        attempt=as_int("TORCHELASTIC_RESTART_COUNT", 0),
    )


class Agent:
    def __init__(self, config: config_mod.Config, identity: wire.RankIdentity, collector_url: Optional[str]):
        self.config = config
        self.identity = identity
        self.run_dir = config.run_dir
        self.progress = Progress(window=config.metrics_window, mark_every=config.collective_mark_every)
        self.collectives = CollectiveTracker()
        self.transport = Transport(collector_url, token=config.token)
        self.events_log: list[wire.Event] = []
        self._unsent_events: list[wire.Event] = []
        self._unsent_fingerprints: list[dict[str, Any]] = []
        self._heartbeat_seq = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._dumped_incidents: set[str] = set()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._faulthandler_file = None
        self._fatal_file = None
        self.ddp_modules: list[Any] = []
        self.extensions: list[Any] = []  # parts that answer collector commands
        self.memory = None

    # -- lifecycle ---------------------------------------------------------------
    @classmethod
    def from_env(cls) -> "Agent":
        config = config_mod.load(env=os.environ)
        return cls(config, identity_from_env(), os.environ.get("RANKWATCH_COLLECTOR_URL"))

    def install(self) -> None:
        global _current
        _current = self
        self.progress.read_collective_seqs = self.collectives.enqueued_seqs
        self._install_blackbox()
        self._install_parts()
        self._install_faulthandler()
        self._install_torch_hooks()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="rankwatch-heartbeat", daemon=True)
        self._thread.start()

    @guarded("agent.parts")
    def _install_parts(self) -> None:
        from .memory import MemoryTracker
        from .profiler import StepProfiler

        self.memory = MemoryTracker(self)
        self.extensions.append(StepProfiler(self))

    @guarded("agent.blackbox")
    def _install_blackbox(self) -> None:
        if self.run_dir:
            from rankwatch import blackbox

            box = blackbox.BlackBox(blackbox.path_for(self.run_dir, self.identity.rank))
            self.progress.blackbox = box
            self.collectives.blackbox = box
            self.progress.set_phase("startup")

    @guarded("agent.faulthandler")
    def _install_faulthandler(self) -> None:
        # Two files the supervisor reads from outside: one for fatal signals
        # (SIGABRT from a gloo/NCCL abort, SIGSEGV), one for the signal it
        # sends a rank whose heartbeat stopped. faulthandler writes both even
        # while the GIL is held. A user's own PYTHONFAULTHANDLER wins.
        if not self.run_dir:
            return
        from rankwatch.faulttext import MAIN_MARK

        folder = Path(self.run_dir) / "stacks"
        folder.mkdir(parents=True, exist_ok=True)
        stem = f"rank-{self.identity.rank:05d}"
        header = f"{MAIN_MARK} {threading.main_thread().ident:#x}\n"
        self._faulthandler_file = open(folder / f"{stem}.faulthandler.txt", "w")
        self._faulthandler_file.write(header)
        self._faulthandler_file.flush()
        faulthandler.register(FAULTHANDLER_SIGNAL, file=self._faulthandler_file, all_threads=True, chain=False)
        if not os.environ.get("PYTHONFAULTHANDLER"):
            self._fatal_file = open(folder / f"{stem}.fatal.txt", "w")
            self._fatal_file.write(header)
            self._fatal_file.flush()
            faulthandler.enable(file=self._fatal_file, all_threads=True)

    def _install_torch_hooks(self) -> None:
        import torch
        import torch.distributed as dist

        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(self.progress.on_optimizer_pre)
        register_optimizer_step_post_hook(self.progress.on_optimizer_post)

        if dist.is_available():
            self.collectives.install()
            self._wrap_init_process_group()

        progress = self.progress
        original_backward = torch.Tensor.backward

        @functools.wraps(original_backward)
        def backward(tensor, *args, **kwargs):
            progress.on_backward(tensor)
            return original_backward(tensor, *args, **kwargs)

        torch.Tensor.backward = backward

        from torch.nn.parallel import DistributedDataParallel

        original_init = DistributedDataParallel.__init__
        agent = self

        @functools.wraps(original_init)
        def ddp_init(module, *args, **kwargs):
            original_init(module, *args, **kwargs)
            agent.on_ddp_created(module)

        DistributedDataParallel.__init__ = ddp_init
        self._wrap_checkpointing()

    def _wrap_checkpointing(self) -> None:
        """A checkpoint write is a long, legitimate pause: the phase tells the
        collector to allow for it before calling a hang."""
        import torch

        targets = [(torch, "save")]
        try:
            import torch.distributed.checkpoint as dcp

            targets += [(dcp, "save"), (dcp, "async_save")]
        except Exception:
            pass
        progress = self.progress
        for module, name in targets:
            original = getattr(module, name, None)
            if original is None or getattr(original, "__rankwatch_wrapped__", False):
                continue

            def make(original):
                @functools.wraps(original)
                def save(*args, **kwargs):
                    previous = progress.phase
                    progress.set_phase("checkpoint")
                    try:
                        return original(*args, **kwargs)
                    finally:
                        progress.set_phase(previous)

                save.__rankwatch_wrapped__ = True
                return save

            setattr(module, name, make(original))

    def _wrap_init_process_group(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        original = c10d.init_process_group
        progress = self.progress

        @functools.wraps(original)
        def init_process_group(*args, **kwargs):
            progress.set_phase("init_process_group")
            result = original(*args, **kwargs)
            progress.set_phase("setup")
            return result

        c10d.init_process_group = init_process_group
        if dist.init_process_group is original:
            dist.init_process_group = init_process_group

    @guarded("agent.ddp")
    def on_ddp_created(self, ddp) -> None:
        self.ddp_modules.append(ddp)
        ddp.register_forward_pre_hook(self.progress.on_forward)
        self.progress.set_phase("setup")
        from . import fingerprints, grad_checks, gradient_flow

        if self.memory is not None:
            self.memory.on_model(ddp)
        for attach in (grad_checks.attach, fingerprints.attach, gradient_flow.attach):
            ext = attach(self, ddp)
            if ext is not None:
                self.extensions.append(ext)

    # -- events --------------------------------------------------------------------
    def record_event(self, kind: str, step: Optional[int] = None, **details: Any) -> wire.Event:
        event = wire.Event(kind=kind, at=time.time(), step=self.progress.step if step is None else step,
                           details=details)
        with self._lock:
            self.events_log.append(event)
            self._unsent_events.append(event)
        return event

    def add_fingerprint(self, fingerprint: dict[str, Any]) -> None:
        with self._lock:
            self._unsent_fingerprints.append(fingerprint)
            del self._unsent_fingerprints[:-64]

    def on_exception(self, exc: BaseException) -> None:
        """The user's script raised: record it (as torchelastic's @record does),
        send a crash bundle, then let the exception continue."""
        try:
            info = format_exception(exc)
            details = {}
            unused = [n for ext in self.extensions if hasattr(ext, "never_received") for n in ext.never_received()]
            if unused and "finished reduction" in info["message"]:
                # DDP's error names no parameter: these never received a gradient.
                details["unused_parameters"] = unused
                info["unused_parameters"] = unused
            self.record_event("exception", type=info["type"], message=info["message"],
                              traceback=info["traceback"][-8000:], phase=self.progress.phase, **details)
            self._write_torchelastic_error_file(exc)
            incident = f"crash-r{self.identity.rank}-{uuid.uuid4().hex[:8]}"
            self.send_heartbeat(final=False)
            archive = bundle_mod.build(self, "crash", incident, exception=info)
            bundle_mod.deliver(self, archive, incident, timeout=3.0)
        except Exception as inner:
            log(f"could not record the exception: {type(inner).__name__}: {inner}")

    @staticmethod
    def _write_torchelastic_error_file(exc: BaseException) -> None:
        if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
            return
        try:
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(exc)
        except Exception:
            pass

    def shutdown(self, exit_code: int) -> None:
        try:
            self.record_event("exit", exit_code=exit_code, phase=self.progress.phase)
            self.progress.set_phase("exited")
            self._stop.set()
            self.send_heartbeat(final=True)
        except Exception:
            pass

    # -- heartbeat -----------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval
        while not self._stop.wait(interval):
            try:
                self.send_heartbeat()
            except Exception as exc:  # the thread must survive anything
                log(f"heartbeat error: {type(exc).__name__}: {exc}")

    def make_heartbeat(self) -> wire.Heartbeat:
        progress = self.progress
        steps, marks = progress.take_unsent()
        with self._lock:
            events, self._unsent_events = self._unsent_events, []
            fingerprints, self._unsent_fingerprints = self._unsent_fingerprints, []
        status = self.collectives.pg_status()
        self._heartbeat_seq += 1
        return wire.Heartbeat(
            identity=self.identity,
            sent_at=time.time(),
            seq=self._heartbeat_seq,
            step=progress.step,
            forwards=progress.forwards,
            phase=progress.phase,
            phase_since=progress.phase_since,
            last_progress_at=progress.last_progress_at,
            collectives_enqueued={pg: st["enqueued"] for pg, st in status.items()},
            collectives_completed={pg: st["completed"] for pg, st in status.items()},
            steps=steps,
            marks=marks,
            events=events,
            fingerprints=fingerprints,
            host_memory=self._host_memory(),
        )

    def _host_memory(self) -> dict[str, int]:
        from .memory import host_memory, rss_bytes

        out = host_memory()
        rss = rss_bytes()
        if rss is not None:
            out["RSS"] = rss
        return out

    def send_heartbeat(self, final: bool = False) -> None:
        if not self.transport.configured:
            return
        if not final and not self.transport.available():
            return
        with self._send_lock:
            heartbeat = self.make_heartbeat()
            try:
                reply = self.transport.post("/v1/heartbeat", wire.dumps(heartbeat), timeout=2.0)
            except CollectorUnreachable:
                self.progress.give_back(heartbeat.steps, heartbeat.marks)
                with self._lock:
                    self._unsent_events[:0] = heartbeat.events
                    self._unsent_fingerprints[:0] = heartbeat.fingerprints
                return
        if not final:
            self._handle_reply(reply)

    def _handle_reply(self, raw: Any) -> None:
        try:
            reply = wire.decode(wire.Reply, raw)
        except wire.WireError as exc:
            log(f"ignoring a malformed reply from the collector: {exc}")
            return
        for command in reply.commands:
            if command.kind == "dump" and command.incident not in self._dumped_incidents:
                self._dumped_incidents.add(command.incident)
                threading.Thread(target=self._dump, args=(command,), name="rankwatch-dump", daemon=True).start()
            elif command.kind == "action":
                for ext in self.extensions:
                    handler = getattr(ext, "on_command", None)
                    if handler:
                        handler(command)

    def _dump(self, command: wire.Command) -> None:
        try:
            archive = bundle_mod.build(self, command.reason or "request", command.incident)
            bundle_mod.deliver(self, archive, command.incident)
        except Exception as exc:
            log(f"bundle for {command.incident} failed: {type(exc).__name__}: {exc}")
