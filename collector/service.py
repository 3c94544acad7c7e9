"""The collector: ingests heartbeats, node reports and bundles; watches for
hangs; runs the analyses; answers with commands; writes the report.

Transport-agnostic: `server.py` maps HTTP onto these methods. The same object
runs embedded in the launcher (one run) or as the standalone service (many).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from rankwatch import wire
from rankwatch.bundles import Bundle, BundleError, unpack
from rankwatch import config as config_mod
from rankwatch.config import Config

from . import analyses, report as report_mod
from .evidence import RankEvidence, from_bundle
from .state import Incident, RunState
from .store import Store

log = logging.getLogger("rankwatch.collector")

MAX_EVENTS = 10_000  # per rank, newest kept
ANALYSIS_INTERVAL = 1.0
ACTIONABLE = ("collective_mismatch", "nonfinite", "grad_spike", "weight_divergence", "straggler", "memory_growth")
_SAFE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class RequestError(ValueError):
    """Bad input from the network; the text is safe to return to the client."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class _RunRuntime:
    """Live-only bookkeeping of a run (not analysis input)."""

    agent_commands: dict[int, list[wire.Command]] = field(default_factory=dict)
    node_commands: dict[str, list[wire.Command]] = field(default_factory=dict)
    first_detected: dict[tuple[str, str], str] = field(default_factory=dict)
    verdicts: list[wire.Verdict] = field(default_factory=list)
    abort_sent: bool = False
    dumped_kinds: set = field(default_factory=set)
    dirty: bool = False
    urgent: bool = False
    analysed_at: float = 0.0
    run_dir: Optional[Path] = None


class Collector:
    def __init__(self, config: Optional[Config] = None, data_dir: Optional[Path] = None,
                 run_dir_for: Optional[Callable[[str], Path]] = None):
        self.config = config or Config()
        self.data_dir = Path(data_dir) if data_dir else None
        self._run_dir_for = run_dir_for
        self.runs: dict[str, RunState] = {}
        self._rt: dict[str, _RunRuntime] = {}
        self._lock = threading.RLock()
        index = (self.data_dir / "collector.sqlite") if self.data_dir else None
        self.store = Store(index)
        self.metrics = None  # set by metrics.CollectorMetrics when exported
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.bundles_received = 0
        self.bundles_rejected = 0
        self.on_verdict: list[Callable[[str, wire.Verdict], None]] = []
        if self.config.grafana_url:
            from rankwatch.grafana import Annotator

            self.on_verdict.append(Annotator(self.config.grafana_url, self.config.grafana_token))

    # -- lifecycle ---------------------------------------------------------------
    def start(self, tick: float = 0.5) -> None:
        self._thread = threading.Thread(target=self._loop, args=(tick,), name="rankwatch-collector", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        for callback in self.on_verdict:
            flush = getattr(callback, "flush", None)
            if flush:
                flush()
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        with self._lock:
            self.store.close()

    def _loop(self, tick: float) -> None:
        while not self._stop.wait(tick):
            try:
                self.tick(time.time())
            except Exception:
                log.exception("collector tick failed")

    def run_dir(self, run_id: str) -> Path:
        rt = self._runtime(run_id)
        if rt.run_dir is None:
            if self._run_dir_for is not None:
                rt.run_dir = Path(self._run_dir_for(run_id))
            elif self.data_dir is not None:
                rt.run_dir = self.data_dir / "runs" / run_id
            else:
                raise RequestError("collector has no storage configured", 500)
        return rt.run_dir

    def _runtime(self, run_id: str) -> _RunRuntime:
        rt = self._rt.get(run_id)
        if rt is None:
            rt = self._rt[run_id] = _RunRuntime()
        return rt

    def _run(self, run_id: str, world_size: int = 0) -> RunState:
        if not _SAFE_ID.match(run_id):
            raise RequestError(f"invalid run id {run_id!r}")
        run = self.runs.get(run_id)
        if run is None:
            run = self.runs[run_id] = RunState(run_id=run_id, world_size=world_size,
                                               hang_timeout=self.config.hang_timeout, on_hang=self.config.on_hang)
            self.store.save_run(run)
        if world_size and world_size > run.world_size:
            run.world_size = world_size
        return run

    # -- ingest ------------------------------------------------------------------------
    def ingest_heartbeat(self, hb: wire.Heartbeat, now: Optional[float] = None) -> wire.Reply:
        now = now or time.time()
        ident = hb.identity
        with self._lock:
            run = self._run(ident.run_id, ident.world_size)
            if not 0 <= ident.rank < max(run.world_size, ident.rank + 1):
                raise RequestError(f"rank {ident.rank} outside world size {run.world_size}")
            state = run.rank(ident.rank)
            new_rank = state.last_heartbeat_at == 0.0
            progressed = (
                new_rank
                or hb.step > state.step
                or hb.forwards > state.forwards
                or hb.phase != state.phase
                or any(v > state.enqueued.get(pg, -1) for pg, v in hb.collectives_enqueued.items())
            )
            if ident.attempt > state.attempt:  # torchrun restarted the workers: a fresh rank
                state.exit_code, state.exited_at, state.killed_by_rankwatch = None, None, False
            state.local_rank, state.node_rank, state.host = ident.local_rank, ident.node_rank, ident.host
            state.pid, state.world_size, state.attempt = ident.pid, ident.world_size, ident.attempt
            state.step, state.forwards = max(state.step, hb.step), max(state.forwards, hb.forwards)
            state.phase, state.phase_since = hb.phase, hb.phase_since
            state.last_progress_at = max(state.last_progress_at, hb.last_progress_at)
            state.last_heartbeat_at = now
            state.enqueued.update(hb.collectives_enqueued)
            state.completed.update(hb.collectives_completed)
            for record in hb.steps:
                state.add_step(record)
            for mark in hb.marks:
                state.marks[mark.step] = mark.seqs
            for event in hb.events:
                if event.kind == "step_values":
                    # Read a step late on a GPU (no sync): fill the step's record.
                    record = state.steps.get(event.step)
                    for name in ("grad_norm", "loss"):
                        value = event.details.get(name)
                        if record is not None and isinstance(value, (int, float)) and getattr(record, name) is None:
                            setattr(record, name, float(value))
                    continue
                state.events.append(event)
                if event.kind == "exit" and state.exit_code is None:
                    code = event.details.get("exit_code")
                    if isinstance(code, int):
                        state.exit_code, state.exited_at = code, event.at
            del state.events[:-MAX_EVENTS]
            if hb.host_memory:
                state.host_memory = dict(hb.host_memory)
            state.fingerprints.extend(hb.fingerprints)
            del state.fingerprints[:-256]
            if progressed and hb.phase != "exited":
                run.last_progress_seen_at = now
            self.store.save_heartbeat_data(run.run_id, ident.rank, hb)
            self.store.save_rank(run.run_id, state)
            commands = self._runtime(run.run_id).agent_commands.pop(ident.rank, [])
            if hb.steps or hb.events or hb.marks or hb.fingerprints:
                self._touch(run.run_id, urgent=any(e.kind in ("exception", "nonfinite") for e in hb.events))
        if self.metrics:
            self.metrics.observe_heartbeat(hb, now)
        return wire.Reply(commands=commands)

    def ingest_node(self, node: wire.NodeHeartbeat, now: Optional[float] = None) -> wire.Reply:
        now = now or time.time()
        with self._lock:
            run = self._run(node.run_id, node.world_size)
            key = f"{node.host}#{node.launcher_pid or node.node_rank}"
            run.nodes[key] = node
            if node.hang_timeout is not None:
                run.hang_timeout = node.hang_timeout
            run.on_hang = node.on_hang
            rt = self._runtime(run.run_id)
            for worker in node.workers:
                state = run.rank(worker.rank)
                state.local_rank, state.node_rank = worker.local_rank, node.node_rank
                if not state.host:
                    state.host = node.host
                if state.pid == 0:
                    state.pid = worker.pid
                if not worker.alive and worker.exit_code is not None and state.exit_code is None:
                    state.exit_code = worker.exit_code
                    state.exited_at = worker.exited_at or now
                    state.killed_by_rankwatch = rt.abort_sent
                    self.store.save_rank(run.run_id, state)
            commands = rt.node_commands.pop(key, [])
            if any(not w.alive for w in node.workers):
                self._touch(run.run_id)
            if rt.abort_sent and run.aborted:
                commands.append(wire.Command(kind="abort", reason=run.aborted))
            self.store.save_run(run)
        return wire.Reply(commands=commands)

    def ingest_bundle(self, data: bytes, run_hint: str = "", now: Optional[float] = None) -> dict[str, Any]:
        try:
            return self._ingest_bundle(data, run_hint, now or time.time())
        except RequestError:
            self.bundles_rejected += 1
            raise

    def _ingest_bundle(self, data: bytes, run_hint: str, now: float) -> dict[str, Any]:
        try:
            bundle = unpack(data)
        except BundleError as exc:
            raise RequestError(f"bundle rejected: {exc}") from None
        if run_hint and bundle.manifest.run_id != run_hint:
            raise RequestError("bundle's run id does not match the request's")
        if not _SAFE_ID.match(bundle.manifest.incident or "x"):
            raise RequestError(f"invalid incident id {bundle.manifest.incident!r}")
        with self._lock:
            run = self._run(bundle.manifest.run_id, bundle.manifest.world_size)
            path = self._save_bundle_file(run.run_id, bundle, data)
            bundle.source_path = str(path)
            merge_bundle(run, bundle)
            self._touch(run.run_id, urgent=True)
            self.store.save_bundle(run.run_id, bundle.manifest, str(path), len(data), now)
            self.bundles_received += 1
        return {"stored": str(path)}

    def _save_bundle_file(self, run_id: str, bundle: Bundle, data: bytes) -> Path:
        m = bundle.manifest
        incident = m.incident or "unsolicited"
        name = f"rank-{m.rank:05d}" + ("" if m.source == "agent" else f".{m.source}") + ".tar.gz"
        folder = self.run_dir(run_id) / "bundles" / incident
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / name
        if path.resolve().parent != folder.resolve():
            raise RequestError("bundle path escapes the run dir")
        path.write_bytes(data)
        return path

    # -- live monitoring -----------------------------------------------------------------
    def tick(self, now: float) -> None:
        with self._lock:
            for run in list(self.runs.values()):
                rt = self._runtime(run.run_id)
                if not run.finished:
                    self._watch_for_hang(run, now)
                    self._close_incidents(run, now)
                # The analyses read everything: run them when something new
                # arrived, at most once a second (incidents always).
                if rt.dirty and (now - rt.analysed_at >= ANALYSIS_INTERVAL or rt.urgent):
                    rt.dirty = rt.urgent = False
                    rt.analysed_at = now
                    self._analyse(run, now, final=False)
            self.store.commit()

    def _touch(self, run_id: str, urgent: bool = False) -> None:
        rt = self._runtime(run_id)
        rt.dirty = True
        rt.urgent = rt.urgent or urgent

    def _live_ranks(self, run: RunState) -> list[int]:
        return sorted(r for r, s in run.ranks.items() if s.exit_code is None)

    def _watch_for_hang(self, run: RunState, now: float) -> None:
        if not run.ranks or run.aborted:
            return
        live = self._live_ranks(run)
        if not live:
            return
        cfg = self.config
        timeout = run.adaptive_timeout(cfg.startup_timeout, cfg.adaptive_floor, cfg.adaptive_multiplier)
        if run.hang_timeout is None and any(s.phase == "checkpoint" for s in run.ranks.values()):
            timeout = max(timeout, cfg.checkpoint_timeout)  # phase-aware: a checkpoint write takes long
        reported = sum(1 for s in run.ranks.values() if s.last_heartbeat_at)
        if reported == 0 or reported < run.world_size:
            # Start-up: workers still import torch and join the rendezvous (slow
            # on a loaded node). Even a fixed --hang-timeout waits this long for
            # every rank's first word; a rank that never reports is still caught.
            timeout = max(timeout, cfg.startup_timeout)
        stalled = now - run.last_progress_seen_at
        if stalled < timeout:
            return
        if any(i.kind == "hang" and i.opened_at >= run.last_progress_seen_at for i in run.incidents):
            return  # already diagnosing this stall
        last_progress = max((s.last_progress_at for s in run.ranks.values() if s.last_progress_at),
                            default=run.last_progress_seen_at)
        incident = Incident(id=f"hang-{len(run.incidents) + 1}", kind="hang", opened_at=now,
                            last_progress_at=min(last_progress, run.last_progress_seen_at) if last_progress else
                            run.last_progress_seen_at, timeout=timeout, requested_ranks=live,
                            deadline=now + cfg.evidence_window)
        self._open_incident(run, incident, "hang")

    def _open_incident(self, run: RunState, incident: Incident, reason: str) -> None:
        run.incidents.append(incident)
        rt = self._runtime(run.run_id)
        for rank in incident.requested_ranks:
            rt.agent_commands.setdefault(rank, []).append(
                wire.Command(kind="dump", incident=incident.id, reason=reason))
        # Ranks whose heartbeat thread stopped (GIL held, stuck in C code) cannot
        # answer: the supervisor takes their native and faulthandler stacks.
        stale_after = 3 * self.config.heartbeat_interval
        stale = [r for r in incident.requested_ranks
                 if incident.opened_at - run.ranks[r].last_heartbeat_at > stale_after]
        for key, node in run.nodes.items():
            ranks = [w.rank for w in node.workers if w.rank in incident.requested_ranks]
            if ranks:
                rt.node_commands.setdefault(key, []).append(
                    wire.Command(kind="capture", incident=incident.id, reason=reason, ranks=ranks,
                                 details={"stale": [r for r in stale if r in ranks]}))
        self.store.save_incident(run.run_id, incident)
        log.info("run %s: %s incident %s opened; evidence requested from ranks %s",
                 run.run_id, reason, incident.id, incident.requested_ranks)

    def _act_on(self, run: RunState, v: wire.Verdict, now: float) -> None:
        """The configured action for a new verdict: report, dump or abort."""
        # hang has its own incident (on_hang); crash and oom end the job by themselves.
        action = getattr(self.config, f"on_{v.kind}", "report") if v.kind in ACTIONABLE else "report"
        rt = self._runtime(run.run_id)
        if action in ("dump", "abort") and v.kind not in rt.dumped_kinds:
            rt.dumped_kinds.add(v.kind)
            incident = Incident(id=f"{v.kind}-{len(run.incidents) + 1}", kind=v.kind, opened_at=now,
                                last_progress_at=run.last_progress_seen_at, requested_ranks=self._live_ranks(run),
                                deadline=now + self.config.evidence_window, details={"abort": action == "abort"})
            self._open_incident(run, incident, v.kind)
        if v.kind == "straggler":
            # A short profiler trace on the slow rank and on one healthy rank, to compare.
            healthy = [r for r in sorted(run.ranks) if r not in v.ranks][:1]
            incident = f"profile-{len(run.incidents) + 1}"
            for rank in v.ranks[:1] + healthy:
                rt.agent_commands.setdefault(rank, []).append(wire.Command(
                    kind="action", incident=incident, reason="straggler", details={"action": "profile", "steps": 3}))
        if v.kind == "nonfinite" and self.config.anomaly_mode_on_nonfinite:
            for rank in v.ranks:
                rt.agent_commands.setdefault(rank, []).append(wire.Command(
                    kind="action", reason="nonfinite", details={"action": "detect_anomaly"}))

    def _close_incidents(self, run: RunState, now: float) -> None:
        for incident in run.incidents:
            if incident.ready:
                continue
            have = run.evidence_for(incident.id)
            complete = all(r in have and have[r].source == "agent" or
                           (r in have and run.ranks[r].last_heartbeat_at < incident.opened_at - 3 * self.config.heartbeat_interval)
                           for r in incident.requested_ranks)
            if complete or now >= incident.deadline:
                incident.ready = True
                self._touch(run.run_id, urgent=True)
                incident.details["diagnosed_at"] = now
                incident.details["evidence_from"] = sorted(have)
                self.store.save_incident(run.run_id, incident)
                if (incident.kind == "hang" and run.on_hang == "abort") or incident.details.get("abort"):
                    run.aborted = f"rankwatch aborted the job after diagnosing incident {incident.id}"
                    self._runtime(run.run_id).abort_sent = True

    def _analyse(self, run: RunState, now: float, final: bool) -> list[wire.Verdict]:
        rt = self._runtime(run.run_id)
        ignored = config_mod.ignored_kinds(self.config)
        found = [v for v in analyses.run_all(run, now, final) if v.kind not in ignored]
        for v in found:
            key = (v.kind, ",".join(map(str, v.ranks)))
            if key not in rt.first_detected:
                rt.first_detected[key] = v.detected_at
                # One line as it happens; the full summary is printed once, in the final report.
                log.warning("run %s: %s on rank(s) %s at step %s (details in the report)",
                            run.run_id, v.kind, ",".join(map(str, v.ranks)), v.step)
                for callback in self.on_verdict:
                    try:
                        callback(run.run_id, v)
                    except Exception:
                        log.exception("verdict callback failed")
                if not run.finished:
                    self._act_on(run, v, now)
            v.detected_at = rt.first_detected[key]
            self.store.save_verdict(run.run_id, v)
        rt.verdicts = found
        return found

    # -- end of a run ------------------------------------------------------------------------
    def finish(self, run_id: str, interrupted: bool = False,
               exits: Optional[dict[int, tuple[int, float]]] = None) -> wire.Report:
        """The launcher is done: record what it knows, analyse a last time."""
        with self._lock:
            run = self._run(run_id)
            run.interrupted = run.interrupted or interrupted
            rt = self._runtime(run_id)
            for rank, (code, at) in (exits or {}).items():
                state = run.rank(rank)
                if state.exit_code is None:
                    state.exit_code, state.exited_at = code, at
                    state.killed_by_rankwatch = rt.abort_sent
            for incident in run.incidents:
                if not incident.ready:
                    incident.ready = True
                    incident.details.setdefault("diagnosed_at", time.time())
            run.finished = True
            self.store.save_run(run, finished_at=time.time())
            for state in run.ranks.values():
                self.store.save_rank(run_id, state)
            verdicts = self._analyse(run, time.time(), final=True)
            self.store.commit()
            return report_mod.build(run, verdicts)

    def report(self, run_id: str) -> wire.Report:
        with self._lock:
            run = self.runs.get(run_id)
            if run is None:
                raise RequestError(f"unknown run {run_id!r}", 404)
            return report_mod.build(run, self._runtime(run_id).verdicts)

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {
                "runs": {
                    rid: {
                        "world_size": run.world_size,
                        "ranks_seen": len(run.ranks),
                        "finished": run.finished,
                        "aborted": run.aborted,
                        "incidents": [i.id for i in run.incidents],
                        "verdicts": [wire.to_dict(v) for v in self._runtime(rid).verdicts],
                    }
                    for rid, run in self.runs.items()
                },
                "bundles_received": self.bundles_received,
                "bundles_rejected": self.bundles_rejected,
            }


def merge_bundle(run: RunState, bundle: Bundle) -> None:
    """Merge a bundle's evidence into the run (also used offline)."""
    m = bundle.manifest
    ev = from_bundle(bundle)
    state = run.rank(m.rank)
    if not state.host:
        state.host = m.host
    incident = m.incident or f"{m.reason}-{m.rank}"
    current = state.evidence.get(incident)
    state.evidence[incident] = merge_evidence(current, ev) if current else ev
    # A crash bundle carries the exception and the step records: an
    # offline run dir without an index still has what crash needs.
    known = {(e.kind, round(e.at, 3)) for e in state.events}
    for raw in ev.events:  # events the heartbeats could not deliver (collector down, rank died)
        try:
            event = wire.decode(wire.Event, raw)
        except wire.WireError:
            continue
        if (event.kind, round(event.at, 3)) not in known and event.kind != "step_values":
            state.events.append(event)
    if ev.exception and state.exception_event() is None:
        state.events.append(wire.Event(kind="exception", at=m.created_at, step=m.step,
                                       details={k: ev.exception.get(k) for k in ("type", "message", "traceback")}))
    for record in ev.steps:
        try:
            step_record = wire.decode(wire.StepRecord, record)
        except wire.WireError:
            continue
        if step_record.step not in state.steps:
            state.add_step(step_record)
    for mark in ev.marks:
        if isinstance(mark.get("step"), int) and isinstance(mark.get("seqs"), dict):
            state.marks.setdefault(mark["step"], mark["seqs"])
    if m.step is not None and m.step > state.step:
        state.step = m.step
        phase = ev.progress.get("phase") if ev.source == "supervisor" else None
        if isinstance(phase, str) and phase:
            state.phase = phase


def merge_evidence(a: RankEvidence, b: RankEvidence) -> RankEvidence:
    """The agent's bundle (inside view) and the supervisor's (outside view) of
    the same rank and incident: keep both halves."""
    inside, outside = (a, b) if a.source == "agent" else (b, a)
    merged = inside
    if outside is not inside:
        merged.native_stacks = merged.native_stacks or outside.native_stacks
        merged.faulthandler = merged.faulthandler or outside.faulthandler
        if not merged.stacks:
            merged.stacks = outside.stacks
        merged.notes = merged.notes + outside.notes
        if inside.source != "agent":
            merged.source = outside.source
    return merged
