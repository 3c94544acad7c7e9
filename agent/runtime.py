"""The per-rank agent: attaches to torch, beats, answers the collector.

One `Agent` per worker process. `Agent.install()` is called by the bootstrap
before the user's script runs; it patches nothing the user can see the effect
of: it wraps ``init_process_group`` and ``DistributedDataParallel.__init__`` to
learn when the process group and the model appear, registers torch's global
optimizer hooks, and starts the heartbeat thread.
"""

from __future__ import annotations

import collections
import faulthandler
import functools
import operator
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
from rankwatch.redact import redact_obj

from .evidence import bundle as bundle_mod
from .watch.collectives import CollectiveTracker
from .core.imports import ImportWatch
from .core.patching import Patches, after_call
from .watch.progress import Progress, _thin
from .core.safety import guarded, log, log_once
from .core import stacks
from .core.stacks import format_exception
from .core.transport import CollectorUnreachable, Transport
from .core.weakrefs import WeakList, when_dropped

FAULTHANDLER_SIGNAL = signal.SIGUSR2
EVENT_LOG_SIZE = 1024  # the agent's event log is a window (bundles carry it): the newest events ...
FIRST_EVENT_KINDS = 64  # ... and the first event of each kind
# Facts known at the first step, sent at once rather than with the next
# heartbeat: a job can fail within a second (a tiny model whose uneven epochs
# end in a collective mismatch, a gloo abort that leaves Python no last word),
# and the cause is in these (batches per epoch, the training configuration).
SENT_AT_ONCE = ("train_config", "loader_epoch")
UNSENT_EVENTS_MAX = 4096  # events kept for the collector while it cannot be reached

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


def _open_with_header(path: Path, header: str):
    handle = open(path, "w")
    try:
        handle.write(header)
        handle.flush()  # ENOSPC shows here, not when a fatal signal comes
    except OSError:
        handle.close()
        raise
    return handle


def collector_url_from_env(config: config_mod.Config, env=os.environ) -> Optional[str]:
    """RANKWATCH_COLLECTOR (the RANKWATCH_<KEY> rule for the key `collector`,
    already in config.collector), else the older RANKWATCH_COLLECTOR_URL."""
    return config.collector or env.get("RANKWATCH_COLLECTOR_URL") or None


def _fsdp2_unsharded(module: Any, names: dict[int, str]) -> list[tuple[str, Any]]:
    """FSDP2 (``fully_shard``): each sharded parameter's unsharded twin, the
    parameter autograd accumulates this rank's local gradient into before
    FSDP reduce-scatters it (FSDPParam._unsharded_param, created at the first
    all-gather and reused after: its storage is freed between uses, the
    object kept). A post-accumulate-grad hook there sees the local gradient,
    as DDP's bucket hook does. torch's private layout, read defensively for
    2.4-2.13 (``_fsdp_param_groups``, or ``_fsdp_param_group`` before 2.6);
    anything else (FSDP1, DeepSpeed, tensor parallel) gives nothing. Never run
    on a GPU here; on CPU with gloo in tests."""
    out: list[tuple[str, Any]] = []
    seen: set[int] = set()
    for sub in module.modules():
        get_state = getattr(sub, "_get_fsdp_state", None)
        if get_state is None:
            continue
        try:
            state = get_state()
        except Exception:
            continue
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            for fsdp_param in getattr(group, "fsdp_params", None) or []:
                unsharded = vars(fsdp_param).get("_unsharded_param")  # not the property: it checks the state
                sharded = getattr(fsdp_param, "sharded_param", None)
                if unsharded is None or id(unsharded) in seen or type(unsharded).__name__ == "DTensor":
                    continue
                seen.add(id(unsharded))
                out.append((names.get(id(sharded)) or getattr(fsdp_param, "_param_fqn", None) or
                            f"<{tuple(unsharded.shape)}>", unsharded))
    return out


class Agent:
    def __init__(self, config: config_mod.Config, identity: wire.RankIdentity, collector_url: Optional[str]):
        self.config = config
        self.identity = identity
        self.run_dir = config.run_dir
        self.progress = Progress(window=config.metrics_window, mark_every=config.collective_mark_every)
        self.collectives = CollectiveTracker()
        self.transport = Transport(collector_url, token=config.token)
        self.events_log: collections.deque[wire.Event] = collections.deque(maxlen=EVENT_LOG_SIZE)
        self.first_events: dict[str, wire.Event] = {}
        self._unsent_events: list[wire.Event] = []
        self._unsent_fingerprints: list[dict[str, Any]] = []
        self._heartbeat_seq = 0
        self._stop = threading.Event()
        self._beat_soon = threading.Event()  # set with _stop too: the heartbeat loop waits on this one
        self._beat_after_record = False
        self.progress.record_complete.append(self._after_record)
        # Parts of freed models that a cyclic collection on another thread left
        # for the training thread to retire, first thing at its next step end.
        self._to_retire: list[list[Any]] = []
        self.progress.step_extras.append(self._retire_waiting)
        self._thread: Optional[threading.Thread] = None
        self._dumped_incidents: set[str] = set()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._faulthandler_file = None
        self._fatal_file = None
        self.ddp_modules: WeakList[Any] = WeakList()  # never keeps a dropped DDP alive (agent/core/weakrefs.py)
        self.imports = ImportWatch()  # patches that wait for the job's own import (agent/core/imports.py)
        self._roots_attached: set[int] = set()  # ids of models without DDP given the device-facing parts
        self.extensions: list[Any] = []  # parts that answer collector commands
        self.memory = None
        self.models = None  # agent/watch/models.py: what this rank trains (silent-error checks, GPU checks)
        self.loaders = None
        self.train_config = None
        self.patches = Patches()
        self._hook_handles: list[Any] = []

    # -- lifecycle ---------------------------------------------------------------
    @classmethod
    def from_env(cls) -> "Agent":
        config = config_mod.load(env=os.environ)
        return cls(config, identity_from_env(), collector_url_from_env(config))

    def install(self) -> None:
        global _current
        _current = self
        self.progress.read_collective_seqs = self.collectives.enqueued_seqs
        self.collectives.on_call_done = self.progress.note_collective_wait
        self._install_blackbox()
        self._install_parts()
        self._install_faulthandler()
        self._install_torch_hooks()
        self._install_join()
        self._install_silent_checks()
        self._thread = threading.Thread(target=self._heartbeat_loop, name="rankwatch-heartbeat", daemon=True)
        self._thread.start()

    @guarded("agent.parts")
    def _install_parts(self) -> None:
        from .checks.memory import MemoryTracker
        from .evidence.profiler import StepProfiler

        self.memory = MemoryTracker(config=self.config, emit=self.record_event, progress=self.progress,
                                    run_dir=self.run_dir, rank=self.identity.rank)
        self.extensions.append(StepProfiler(progress=self.progress, memory=self.memory, send_bundle=self.send_bundle))

    @guarded("agent.join")
    def _install_join(self) -> None:
        from .watch import join

        join.install(self.patches, self.progress, self.record_event)

    @guarded("agent.silent_checks")
    def _install_silent_checks(self) -> None:
        """Silent errors (a job that runs but trains wrong): what is trained
        (models), how (train_config), on what data (batch_fingerprints, loaders),
        whether the step updates it (update_checks), replicas without DDP
        (fingerprints through the optimizers)."""
        from .checks import batch_fingerprints, fingerprints, train_config, update_checks
        from .watch import loaders, models

        emit, progress, patches = self.record_event, self.progress, self.patches
        self.models = models.attach(config=self.config, progress=progress, patches=patches,
                                    hook_handles=self._hook_handles, ddp_modules=self.ddp_modules)
        if self.models is not None:
            self.models.on_discovered.append(self._on_models_found)
        self.loaders = loaders.attach(config=self.config, patches=patches)
        self.train_config = train_config.attach(self.models, self.loaders, emit=emit, progress=progress,
                                                patches=patches, imports=self.imports)
        batch_fingerprints.attach(self.models, self.loaders, emit=emit, progress=progress)
        update_checks.attach(self.models, emit=emit, progress=progress, patches=patches)
        fingerprints.attach_optimizers(self.models, config=self.config, progress=progress,
                                       add_fingerprint=self.add_fingerprint, ddp_modules=self.ddp_modules)

    @guarded("agent.blackbox")
    def _install_blackbox(self) -> None:
        if self.run_dir:
            from rankwatch.node import blackbox

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
        stem = f"rank-{self.identity.rank:05d}"
        header = f"{MAIN_MARK} {threading.main_thread().ident:#x}\n"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._faulthandler_file = _open_with_header(folder / f"{stem}.faulthandler.txt", header)
            if not os.environ.get("PYTHONFAULTHANDLER"):
                self._fatal_file = _open_with_header(folder / f"{stem}.fatal.txt", header)
        except OSError as exc:
            # Disk full or read-only run dir: no stacks from outside, the job goes on.
            log_once("faulthandler", f"stack files cannot be written in {folder} ({type(exc).__name__}: {exc}); "
                                     f"a frozen or crashed rank's Python stack will not be captured from outside")
        if self._faulthandler_file is not None:
            faulthandler.register(FAULTHANDLER_SIGNAL, file=self._faulthandler_file, all_threads=True, chain=False)
        if self._fatal_file is not None:
            faulthandler.enable(file=self._fatal_file, all_threads=True)

    def _install_torch_hooks(self) -> None:
        import torch
        import torch.distributed as dist

        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        progress = self.progress
        compiled = progress.compiled_steps
        is_compiling = torch.compiler.is_compiling

        # Dynamo traces these hooks when optimizer.step is compiled. The
        # first thing they ask is whether it is tracing; then the post-hook
        # only marks the step (a store Dynamo replays after the compiled
        # code: no graph break, fullgraph=True works, see CompiledSteps) and
        # nothing of the recording is traced.
        def optimizer_pre_hook(optimizer, args, kwargs):
            if is_compiling():
                return None
            progress.on_optimizer_pre(optimizer, args, kwargs)
            return None

        def optimizer_post_hook(optimizer, args, kwargs):
            if is_compiling():
                compiled.pending = True
                return None
            progress.on_optimizer_post(optimizer, args, kwargs)
            return None

        self._hook_handles.append(register_optimizer_step_pre_hook(optimizer_pre_hook))
        self._hook_handles.append(register_optimizer_step_post_hook(optimizer_post_hook))

        if dist.is_available():
            self.collectives.install(self.patches)
            self._wrap_init_process_group()
            self._wrap_destroy_process_group()

        # Every wrapper takes (*args, **kwargs) and passes them on untouched, so
        # it accepts exactly the calls its original accepts (see patching.py).
        def make_backward(original):
            @functools.wraps(original)
            def backward(*args, **kwargs):
                if args:
                    progress.on_backward(args[0])
                return original(*args, **kwargs)

            return backward

        self.patches.apply(torch.Tensor, "backward", make_backward)

        from torch.nn.parallel import DistributedDataParallel

        # args[0] is the DistributedDataParallel being built
        self.patches.apply(DistributedDataParallel, "__init__",
                           after_call(lambda _, ddp, *a, **k: self.on_ddp_created(ddp)))
        from .watch import fsdp
        from .watch.stream_waits import StreamWaits

        fsdp.install(patches=self.patches, imports=self.imports, on_sharded=self.on_model_sharded)
        # The compute stream's stalls behind peers (FSDP2 on a GPU), taken out
        # of compute_s; patches a device's stream class when a step first runs on one.
        progress.waits = StreamWaits(patches=self.patches, budget=self.config.grad_check_budget)
        self._wrap_dataloader_epochs()
        self._wrap_checkpointing()

    def _wrap_dataloader_epochs(self) -> None:
        """Batches per epoch: each time a DataLoader starts an epoch (a new
        iterator), its length, recorded when it changes (one event per loader
        size, not per epoch). Uneven data per rank (hand-made sharding over a
        length the world size does not divide) shows as different lengths:
        the verdict can then say "ranks 2, 3 had 10 batches per epoch, ranks
        0, 1 had 11". Costs one len() per epoch."""
        from torch.utils.data import DataLoader

        agent = self
        seen: dict[int, int] = {}

        def make_iter(original):
            @functools.wraps(original)
            def dataloader_iter(*args, **kwargs):
                iterator = original(*args, **kwargs)
                if args:
                    agent._note_loader_epoch(args[0], seen)
                    if agent.loaders is not None:
                        agent.loaders.on_iter(args[0], iterator)
                return iterator

            return dataloader_iter

        self.patches.apply(DataLoader, "__iter__", make_iter)

    @guarded("dataloader_epochs")
    def _note_loader_epoch(self, loader: Any, seen: dict[int, int]) -> None:
        try:
            batches = len(loader)  # an IterableDataset without __len__ has no epoch length
        except TypeError:
            return
        if seen.get(id(loader)) == batches or len(seen) >= 64:
            return
        seen[id(loader)] = batches
        self.record_event("loader_epoch", batches=int(batches), dataset=type(getattr(loader, "dataset", None)).__name__)

    def _wrap_checkpointing(self) -> None:
        """A checkpoint write is a long, legitimate pause: the phase tells the
        collector to allow for it before calling a hang."""
        import torch

        progress = self.progress

        def make(original):
            @functools.wraps(original)
            def save(*args, **kwargs):
                previous = progress.phase
                progress.set_phase("checkpoint")
                try:
                    return original(*args, **kwargs)
                finally:
                    progress.set_phase(previous)

            return save

        self.patches.apply(torch, "save", make)

        def dcp_saves(dcp) -> None:  # once the job imports it (~1.3 s: never imported by rankwatch)
            for name in ("save", "async_save"):
                self.patches.apply(dcp, name, make)

        self.imports.when_imported("torch.distributed.checkpoint", dcp_saves)

    def _wrap_init_process_group(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        progress = self.progress

        def make(original):
            @functools.wraps(original)
            def init_process_group(*args, **kwargs):
                progress.set_phase("init_process_group")
                result = original(*args, **kwargs)
                progress.set_phase("setup")
                return result

            return init_process_group

        original = c10d.init_process_group
        wrapper = self.patches.apply(c10d, "init_process_group", make)
        if wrapper is not None:
            self.patches.alias(dist, "init_process_group", original, wrapper)

    def _wrap_destroy_process_group(self) -> None:
        """The script is done with distributed work: what this rank recorded
        goes out now, before torch's teardown runs. Teardown is where
        torch 2.13's gloo deadlocks now and then: a worker thread frees the
        last collective's tensors and waits for the GIL while the main thread
        holds it, joining that worker in ~ProcessGroupGloo. That froze this
        rank's heartbeat with the training's last second of records unsent
        (a NaN's origin among them). The phase tells the collector a stall
        from here on is on the way out, not in the training."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        progress = self.progress

        def make(original):
            @functools.wraps(original)
            def destroy_process_group(*args, **kwargs):
                group = args[0] if args else kwargs.get("group")
                # Only the default group's end is the job's: code that builds and
                # drops subgroups mid-training (a temporary TP group) goes on training.
                if group is None or group is getattr(c10d.GroupMember, "WORLD", None):
                    progress.set_phase("teardown")
                    self._flush_before_teardown()
                return original(*args, **kwargs)

            return destroy_process_group

        original = c10d.destroy_process_group
        wrapper = self.patches.apply(c10d, "destroy_process_group", make)
        if wrapper is not None:
            self.patches.alias(dist, "destroy_process_group", original, wrapper)

    TEARDOWN_FLUSH_S = 1.0  # the longest a teardown waits for the collector (once)

    @guarded("agent.teardown")
    def _flush_before_teardown(self) -> None:
        self.progress.finish(grace_s=self.TEARDOWN_FLUSH_S)
        self.send_heartbeat(final=True, timeout=self.TEARDOWN_FLUSH_S)

    def uninstall(self) -> None:
        """Undo install(): patches, hooks, heartbeat thread. For tests and for
        long-lived processes that detach (a Ray actor reused for another job)."""
        global _current
        self._stop_beating()
        self.imports.uninstall()
        self.patches.undo()
        for handle in self._hook_handles:
            try:
                handle.remove()
            except Exception:
                pass
        self._hook_handles.clear()
        from .checks import grad_checks

        grad_checks.unpatch()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if _current is self:
            _current = None

    @guarded("agent.ddp")
    def on_ddp_created(self, ddp) -> None:
        self.ddp_modules.append(ddp)
        ddp.register_forward_pre_hook(self.progress.forward_pre_hook)
        if self.models is not None:
            self.models.on_ddp(ddp)
        self.progress.set_phase("setup")
        from .checks import fingerprints, grad_checks, gradient_flow

        if self.memory is not None:
            self.memory.on_model(ddp)
        config, emit, progress = self.config, self.record_event, self.progress
        parts = [grad_checks.attach(ddp, config=config, emit=emit, progress=progress, collectives=self.collectives),
                 # The model's place among the job's DDP models (built in the same order on
                 # every rank): a job with two (a GAN) fingerprints each apart.
                 fingerprints.attach(ddp, config=config, progress=progress, add_fingerprint=self.add_fingerprint,
                                     model=self.ddp_modules.added - 1),
                 gradient_flow.attach(ddp, config=config, emit=emit, progress=progress)]
        self._extend_while(ddp, [part for part in parts if part is not None])

    def _extend(self, ext: Any) -> None:
        """A part that answers collector commands (or takes part in the exit), when one was made."""
        if ext is not None:
            self.extensions.append(ext)

    def _extend_while(self, model: Any, parts: list[Any]) -> None:
        """Parts built for one model, retired when the script frees it
        (agent/core/weakrefs.py: the agent never keeps a dropped model's
        memory)."""
        for part in parts:
            self._extend(part)
        when_dropped(model, self._model_freed, parts, id(model))

    def _model_freed(self, parts: list[Any], model_id: int) -> None:
        """On the thread that freed the model: the training thread at the
        script's ``del``, or any thread a cyclic collection ran on. Only the
        training thread unhooks (a hook removed from another thread could be
        in the middle of the backward's loop over them)."""
        self._roots_attached.discard(model_id)  # a new model may come at the same address
        training = stacks.training_thread_ident or threading.main_thread().ident
        if threading.get_ident() == training:
            self._retire(parts)
        else:
            self._to_retire.append(parts)

    def _retire_waiting(self, record: Any) -> None:
        while self._to_retire:
            self._retire(self._to_retire.pop())

    def _retire(self, parts: list[Any]) -> None:
        for part in parts:
            guarded("agent.retire")(part.retire)()
            try:
                self.extensions.remove(part)
            except ValueError:
                pass

    @guarded("agent.sharded")
    def on_model_sharded(self, module) -> None:
        """FSDP2's ``fully_shard`` returned (agent/watch/fsdp.py): its model is a
        root from now on, so step 0's forward is timed, and its device's
        memory and OOMs are watched before the first optimizer step."""
        if self.models is not None:
            top = self.models.on_sharded(module) or module
        else:
            top = module
        if self.memory is not None and id(top) not in self._roots_attached:
            self.memory.on_model(top)
        self.progress.set_phase("setup")

    @guarded("agent.models_found")
    def _on_models_found(self) -> None:
        """A model trained without DDP (FSDP2's ``fully_shard``, FSDP1,
        DeepSpeed, a hand-written data-parallel loop) gets the device-facing
        parts DDP's patch gives a DDP model: device memory statistics and the
        OOM observer (any model), step timing from its forwards (device time
        for ``compute_s``, through the root's forward pre-hook in
        agent/watch/models.py) and local gradient checks when its parameters are
        whole tensors. Sharded parameters (DTensor, FSDP1's flat parameter,
        DeepSpeed's empty partitioned ones) get no gradient checks: their
        gradients reach their hooks already reduced, and a norm of a DTensor
        may issue a collective. Found at the first optimizer step (models.py
        discovery); an FSDP2 model's root and memory come earlier, when
        ``fully_shard`` returns (on_model_sharded), so its step 0 is
        watched. The device side was never run
        on a GPU: tests run it through the adapter's GPU-like double."""
        from .checks import grad_checks
        from .checks.fingerprints import _plain

        if self.models is None:
            return
        in_ddp = {id(p) for ddp in self.ddp_modules for p in ddp.parameters()}
        for root in self.models.roots:
            if root.ddp is not None or id(root.module) in self._roots_attached:
                continue
            self._roots_attached.add(id(root.module))
            if self.memory is not None:
                self.memory.on_model(root.module)
            named = [(n, p) for n, p in root.module.named_parameters() if p.requires_grad and id(p) not in in_ddp]
            if named and not all(_plain(p) for _, p in named):
                named = _fsdp2_unsharded(root.module, dict((id(p), n) for n, p in named))
            if named and all(_plain(p) for _, p in named):
                checker = grad_checks.attach_parameters(named, config=self.config, emit=self.record_event,
                                                        progress=self.progress, collectives=self.collectives)
                self._extend_while(root.module, [checker] if checker is not None else [])

    # -- events --------------------------------------------------------------------
    def record_event(self, kind: str, step: Optional[int] = None, **details: Any) -> wire.Event:
        # Redacted before it leaves the process (exception texts may echo secrets: rankwatch.redact).
        event = wire.Event(kind=kind, at=time.time(), step=self.progress.step if step is None else step,
                           details=redact_obj(details))
        with self._lock:
            self.events_log.append(event)
            if kind not in self.first_events and len(self.first_events) < FIRST_EVENT_KINDS:
                self.first_events[kind] = event
                if kind in SENT_AT_ONCE:
                    self._beat_after_record = True  # with the step record that ends (or follows) it
            self._unsent_events.append(event)
            if len(self._unsent_events) > UNSENT_EVENTS_MAX:
                del self._unsent_events[UNSENT_EVENTS_MAX // 4: len(self._unsent_events) - UNSENT_EVENTS_MAX * 3 // 4]
        return event

    def recent_events(self) -> list[wire.Event]:
        """The event window, preceded by the first event of each kind that
        has left it (what a bundle carries)."""
        with self._lock:
            window = list(self.events_log)
            kept = {id(e) for e in window}
            first = sorted((e for e in self.first_events.values() if id(e) not in kept), key=lambda e: e.at)
        return first + window

    def add_fingerprint(self, fingerprint: dict[str, Any]) -> None:
        with self._lock:
            self._unsent_fingerprints.append(fingerprint)
            del self._unsent_fingerprints[:-64]

    # -- bundles -------------------------------------------------------------------
    def build_bundle(self, reason: str, incident: str, exception: Optional[dict] = None,
                     extra_members: Optional[dict[str, Any]] = None) -> bytes:
        """This rank's bundle now (agent/evidence/bundle.py), from the parts it reads."""
        return bundle_mod.build(reason, incident, exception, extra_members, identity=self.identity,
                                progress=self.progress, collectives=self.collectives,
                                recent_events=self.recent_events, memory=self.memory, run_dir=self.run_dir)

    def send_bundle(self, reason: str, incident: str, *, exception: Optional[dict] = None,
                    extra_members: Optional[dict[str, Any]] = None, timeout: float = 5.0) -> str:
        """Build this rank's bundle and deliver it (the collector, else the
        run dir's spool). Returns where it went."""
        archive = self.build_bundle(reason, incident, exception, extra_members)
        return bundle_mod.deliver(archive, incident, timeout, identity=self.identity, transport=self.transport,
                                  run_dir=self.run_dir, emit=self.record_event)

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
            oom = self.memory.oom_evidence(exc) if self.memory is not None else None
            reason, members = "crash", None
            if oom is not None:  # a device OOM ends this rank: `oom`, with the snapshot
                self.record_event("oom", **oom[0])
                reason, members = "oom", oom[1]
            incident = f"{reason}-r{self.identity.rank}-{uuid.uuid4().hex[:8]}"
            self.send_heartbeat(final=False)
            self.send_bundle(reason, incident, exception=info, extra_members=members, timeout=3.0)
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

    def watch_exit(self) -> None:
        """Attached from inside the script (no bootstrap around it): learn of
        an uncaught exception through sys.excepthook (chained, the user's hook
        still runs) and of the end through atexit. The exit code of a
        SystemExit is not visible from there: it is reported as unknown (the
        launcher or supervisor sees the real one)."""
        import atexit
        import sys

        previous = sys.excepthook
        failed: list[int] = []

        def excepthook(exc_type, exc, tb):
            if _current is self and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
                failed.append(1)
                self.on_exception(exc)
            previous(exc_type, exc, tb)

        sys.excepthook = excepthook
        atexit.register(lambda: _current is self and self.shutdown(1 if failed else None))

    def shutdown(self, exit_code: Optional[int]) -> None:
        try:
            self.progress.finish()  # the last steps' records go out, with what was read of them
        except Exception:
            pass
        self._oom_at_exit(exit_code)
        for ext in self.extensions:
            flush = getattr(ext, "flush", None)
            if flush is not None:
                try:
                    flush()
                except Exception:
                    pass
        try:
            self.record_event("exit", exit_code=exit_code, phase=self.progress.phase)
            self.progress.set_phase("exited")
            self._stop_beating()
            self.send_heartbeat(final=True)
        except Exception:
            pass

    def _oom_at_exit(self, exit_code: Optional[int]) -> None:
        """A device OOM the script caught, then exited non-zero with no step
        since: the OOM ended the rank."""
        if self.memory is None or self.memory.pending_oom is None or not exit_code:
            return
        try:
            oom = self.memory.oom_evidence(None)
            if oom is None:
                return
            self.record_event("oom", **oom[0])
            incident = f"oom-r{self.identity.rank}-{uuid.uuid4().hex[:8]}"
            self.send_bundle("oom", incident, extra_members=oom[1], timeout=3.0)
        except Exception as exc:
            log(f"could not record the OOM: {type(exc).__name__}: {exc}")

    # -- heartbeat -----------------------------------------------------------------
    # A beat carries what changed since the last acknowledged one: new step
    # records as compact rows (at most HEARTBEAT_STEP_CAP; at high step rates
    # every 2^k-th step, the same steps on every rank), new marks, events and
    # fingerprints (parameter names only when they changed), and the
    # collective counters and host memory only when they moved. Every
    # FULL_BEAT_EVERY-th beat, and the first after a failure, carries all of
    # it, so a collector that restarted is whole again within that many beats.
    # Encoding is plain tuples and dicts (no dataclasses.asdict per record).
    HEARTBEAT_STEP_CAP = 64
    FINGERPRINTS_PER_BEAT = 4
    FULL_BEAT_EVERY = 30

    def _stop_beating(self) -> None:
        self._stop.set()
        self._beat_soon.set()  # the loop waits on this one

    def _after_record(self, record: Any) -> None:
        """A step record is complete: if facts sent at once wait (SENT_AT_ONCE),
        the heartbeat goes now, with the record (the collector compares ranks
        only at steps they reported)."""
        if self._beat_after_record:
            self._beat_after_record = False
            self._beat_soon.set()

    def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval
        # The first beat goes at once: a rank that freezes early (holding the
        # GIL) has then beaten, and its silence is seen as such.
        try:
            self.send_heartbeat()
        except Exception as exc:
            log(f"heartbeat error: {type(exc).__name__}: {exc}")
        while True:
            self._beat_soon.wait(interval)
            if self._stop.is_set():
                break
            self._beat_soon.clear()
            try:
                self.send_heartbeat()
            except Exception as exc:  # the thread must survive anything
                log(f"heartbeat error: {type(exc).__name__}: {exc}")

    def _beat_state(self) -> "_BeatState":
        state = self.__dict__.get("_beats")
        if state is None:
            state = self.__dict__["_beats"] = _BeatState()
        return state

    def make_heartbeat(self) -> "_Beat":
        """The next beat's JSON body (and what it took, for a failed send)."""
        beats = self._beat_state()
        progress = self.progress
        steps, marks, skipped = progress.take_unsent(self.HEARTBEAT_STEP_CAP)
        with self._lock:
            events, self._unsent_events = self._unsent_events, []
            fingerprints, self._unsent_fingerprints = self._unsent_fingerprints, []
        if len(fingerprints) > self.FINGERPRINTS_PER_BEAT:
            every = max(1, self.config.fingerprint_every)
            fingerprints = _thin([f for f in fingerprints if isinstance(f.get("step"), int)],
                                 lambda f: (f["step"] + 1) // every, self.FINGERPRINTS_PER_BEAT)
        status = self.collectives.pg_status()
        enqueued = {pg: st["enqueued"] for pg, st in status.items()}
        completed = {pg: st["completed"] for pg, st in status.items()}
        host_memory = self._host_memory()
        full = beats.since_full >= self.FULL_BEAT_EVERY or beats.failed
        self._heartbeat_seq += 1
        body: dict[str, Any] = {
            "version": wire.WIRE_VERSION,
            "identity": beats.identity_dict(self.identity),
            "sent_at": time.time(),
            "seq": self._heartbeat_seq,
            "step": progress.step,
            "forwards": progress.forwards,
            "phase": progress.phase,
            "phase_since": progress.phase_since,
            "last_progress_at": progress.last_progress_at,
        }
        if steps:
            body["step_columns"] = wire.STEP_COLUMNS
            body["step_rows"] = [_step_row(r) for r in steps]
        if skipped:
            body["steps_skipped"] = skipped
        if marks:
            body["marks"] = [{"step": m.step, "seqs": m.seqs} for m in marks]
        if events:
            body["events"] = [{"kind": e.kind, "at": e.at, "step": e.step, "details": e.details} for e in events]
        if fingerprints:
            names = beats.names if not full else None
            body["fingerprints"] = [
                {k: v for k, v in fp.items() if k != "names"} if names is not None and fp.get("names") is names
                else fp for fp in fingerprints]
        if full or enqueued != beats.enqueued:
            body["collectives_enqueued"] = enqueued
        if full or completed != beats.completed:
            body["collectives_completed"] = completed
        if host_memory and (full or _memory_moved(beats.host_memory, host_memory)):
            body["host_memory"] = host_memory
        if body["sent_at"] - progress.last_progress_at >= self.QUIET_BEFORE_ACTIVITY_S:
            activity = self._activity()
            if activity is not None:
                body["busy_cpu_s"], body["io_bytes"], body["wakeups"] = round(activity[0], 6), activity[1], activity[2]
        return _Beat(body, steps, marks, events, fingerprints, enqueued, completed, host_memory, full)

    # A rank this long without progress reports what its process does
    # (agent/core/activity.py): the collector tells work from a stuck rank by it.
    QUIET_BEFORE_ACTIVITY_S = 2.0

    @guarded("agent.activity", default=None)
    def _activity(self) -> Optional[tuple[float, int, int]]:
        from .core import activity

        return activity.sample()

    def _host_memory(self) -> dict[str, int]:
        from .checks.memory import host_memory, rss_bytes

        out = host_memory()
        rss = rss_bytes()
        if rss is not None:
            out["RSS"] = rss
        return out

    def send_heartbeat(self, final: bool = False, timeout: float = 2.0) -> None:
        """One beat with what the collector has not acknowledged. ``final``:
        sent even while the transport backs off, reply ignored (the rank is
        on its way out)."""
        if not self.transport.configured:
            return
        if not final and not self.transport.available():
            return
        # Bounded: a teardown's flush does not wait out a beat stuck on a slow collector.
        if not self._send_lock.acquire(timeout=timeout):
            return
        try:
            beat = self.make_heartbeat()
            try:
                # Strict JSON (a NaN loss travels as "NaN"); the slow path only then.
                body = wire.json_text(beat.body, compact=True).encode()
                reply = self.transport.post("/v1/heartbeat", body, timeout=timeout)
            except CollectorUnreachable:
                self.progress.give_back(beat.steps, beat.marks)
                with self._lock:
                    self._unsent_events[:0] = beat.events
                    self._unsent_fingerprints[:0] = beat.fingerprints
                self._beat_state().failed = True
                return
            self._beat_state().acked(beat)
        finally:
            self._send_lock.release()
        if self.transport.recovered:
            # The collector is back: bundles spooled while it was away go now.
            self.transport.recovered = False
            threading.Thread(target=self._resend_spool, name="rankwatch-spool", daemon=True).start()
        if not final:
            self._handle_reply(reply)

    def _resend_spool(self) -> None:
        if not self.run_dir:
            return
        try:
            spooled = sorted((Path(self.run_dir) / "spool").glob(f"*/rank-{self.identity.rank:05d}.tar.gz"))
            for path in spooled:
                headers = {"X-Rankwatch-Run": self.identity.run_id, "X-Rankwatch-Rank": str(self.identity.rank),
                           "X-Rankwatch-Incident": path.parent.name}
                self.transport.post("/v1/bundles", path.read_bytes(), content_type="application/gzip",
                                    headers=headers, timeout=10.0)
                path.unlink()
                log(f"spooled bundle {path.parent.name} delivered")
        except CollectorUnreachable:
            pass  # still spooled: sent on the next recovery or by the launcher at the end
        except OSError as exc:
            log(f"spooled bundles not re-sent: {type(exc).__name__}: {exc}")

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
            self.send_bundle(command.reason or "request", command.incident)
        except Exception as exc:
            log(f"bundle for {command.incident} failed: {type(exc).__name__}: {exc}")


# -- heartbeat encoding ---------------------------------------------------------------
_step_row = operator.attrgetter(*wire.STEP_COLUMNS)


def _memory_moved(old: Optional[dict[str, int]], new: dict[str, int]) -> bool:
    """Host memory worth sending: a new key, or a move of 64 MiB or 2%."""
    if not old:
        return True
    for key, value in new.items():
        before = old.get(key)
        if before is None or abs(value - before) > max(64 << 20, before // 50):
            return True
    return False


class _Beat:
    __slots__ = ("body", "steps", "marks", "events", "fingerprints", "enqueued", "completed", "host_memory",
                 "full")

    def __init__(self, body, steps, marks, events, fingerprints, enqueued, completed, host_memory, full):
        self.body, self.steps, self.marks, self.events = body, steps, marks, events
        self.fingerprints, self.enqueued, self.completed = fingerprints, enqueued, completed
        self.host_memory, self.full = host_memory, full


class _BeatState:
    """What the collector has acknowledged (the base of the next delta)."""

    def __init__(self) -> None:
        self.enqueued: Optional[dict[str, int]] = None
        self.completed: Optional[dict[str, int]] = None
        self.host_memory: Optional[dict[str, int]] = None
        self.names: Optional[list[str]] = None  # fingerprint parameter names the collector has
        self.since_full = 1 << 30  # the first beat is a full one
        self.failed = False
        self._identity: Any = None
        self._identity_dict: dict[str, Any] = {}

    def identity_dict(self, identity: wire.RankIdentity) -> dict[str, Any]:
        if identity is not self._identity:
            self._identity, self._identity_dict = identity, wire.to_dict(identity)
        return self._identity_dict

    def acked(self, beat: _Beat) -> None:
        self.enqueued, self.completed = beat.enqueued, beat.completed
        if "host_memory" in beat.body:  # the base of the next comparison is what was sent
            self.host_memory = beat.host_memory
        for fp in beat.fingerprints:
            if isinstance(fp.get("names"), list):
                self.names = fp["names"]
        self.since_full = 0 if beat.full else self.since_full + 1
        self.failed = False
