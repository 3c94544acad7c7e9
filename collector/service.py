"""The collector: ingests heartbeats, node reports and bundles; watches for
hangs; runs the analyses; answers with commands; writes the report.

Transport-agnostic: `server.py` maps HTTP onto these methods. The same object
runs embedded in the launcher (one run) or as the standalone service (many).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from rankwatch import wire
from rankwatch.bundles import Bundle, BundleError, repack, unpack
from rankwatch.redact import redact_obj
from rankwatch import config as config_mod
from rankwatch.config import Config
from rankwatch.cadence import longest_relay_silence, node_report_interval
from rankwatch.outputs import report as report_output

from . import analyses, ingest, report as report_mod, stuck
from .analysis_budget import AnalysisBudget
from .changes import Changes
from .evidence import RankEvidence, from_bundle
from .analyses import hang
from .analyses.common import ranks_text, settle, where
from .state import Incident, RunState, percentile
from .store import Store

log = logging.getLogger("rankwatch.collector")

MAX_EVENTS = 10_000  # per rank, newest kept
ANALYSIS_INTERVAL = 1.0
RANKS_PER_ANALYSIS_SECOND = 20_000  # 100,000 ranks: analyses every 5 s (the hang watch still every tick)
RECENT_TICKS = 600  # ticks whose durations /v1/status summarises
# Seconds between two ticks past which the collector itself was not running
# (a tick of 100,000 ranks takes a few seconds; a stopped process, minutes).
PAUSED_AFTER_S = 30.0
GC_MANUAL_RANKS = 5_000  # ranks watched from which the collector runs Python's garbage collection itself
FULL_GC_INTERVAL = 300.0
THAWED_GC_INTERVAL = 3600.0
NEVER = 2**31 - 1  # a generation threshold that is never reached
FINISHED_KEPT_S = 120.0  # a finished run stays in memory this long, then is served from the index
ACTIONABLE = ("collective_mismatch", "nonfinite", "grad_spike", "weight_divergence", "straggler", "memory_growth",
              "config_divergence", "duplicate_data", "broken_update")
_SAFE_ID = wire.ID_PATTERN  # never "." or "..": ids become directory names


class RequestError(ValueError):
    """Bad input from the network; the text is safe to return to the client."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class MustWait(Exception):
    """Raised, before anything changes, by ingest called where it must not
    wait (`without_waiting`) for a message that needs the index read: a late
    message of a run that left memory. The caller takes it in where waiting
    is allowed."""


_no_waiting = threading.local()


@contextlib.contextmanager
def without_waiting():
    """Ingest in this block raises MustWait rather than wait for the index
    (the aiohttp server's event loop: its writer holds the index for seconds
    during a big job's bulk flush). A nested block leaves the outer one's state."""
    outer = getattr(_no_waiting, "on", False)
    _no_waiting.on = True
    try:
        yield
    finally:
        _no_waiting.on = outer


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
    # Every verdict announced live, latest figures: never retracted from the report.
    announced: dict[tuple[str, str], wire.Verdict] = field(default_factory=dict)
    failed: set = field(default_factory=set)  # what already failed for this run (logged once)
    dead_announced: bool = False  # the dead-run line was said (once per run)
    named_incidents: set = field(default_factory=set)  # hang incidents whose diagnosis came in
    budget: AnalysisBudget = field(default_factory=AnalysisBudget)  # the analyses' share of a core -> step stride


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
        # Ingest notes what changed (changes.py); the store's writer takes it
        # from there. The ingest path never calls the store.
        self.changes = Changes()
        self.store = Store(index, changes=self.changes)
        self._finished_seen: dict[str, float] = {}  # run -> when it was first seen finished
        self._index_only: set[str] = set()  # runs the index holds that are not in memory
        self._evict_checked = 0.0
        self._reload()
        self.metrics = None  # set by metrics.CollectorMetrics when exported
        self._stop = threading.Event()
        self._recent_ticks: collections.deque[float] = collections.deque(maxlen=RECENT_TICKS)
        self._last_tick_at: Optional[float] = None
        self._resumed_at = float("-inf")  # the last tick after the collector had not run (PAUSED_AFTER_S)
        self._gc_manual, self._gc_full_at, self._gc_thawed_at = False, 0.0, 0.0
        self._gc_thresholds = gc.get_threshold()
        self._thread: Optional[threading.Thread] = None
        self.bundles_received = 0
        self.bundles_rejected = 0
        self.refused_at = 0.0  # when a report was last turned away unread (note_refused)
        self.on_verdict: list[Callable[[str, wire.Verdict], None]] = []
        if self.config.grafana_url:
            from rankwatch.outputs.grafana import Annotator

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
        # Shutting down (SIGTERM from Kubernetes): every run still in memory
        # leaves its report as it stands; a finished run's is already there.
        for run_id in list(self.runs):
            try:
                if not self.runs[run_id].finished:
                    self._keep_report(run_id, self.report(run_id))
            except Exception:
                log.exception("run %s: report at shutdown failed", run_id)
        if self._gc_manual:
            self._gc_manual = False
            gc.unfreeze()
            gc.set_threshold(*self._gc_thresholds)
        with self._lock:
            self.store.close()

    def _loop(self, tick: float) -> None:
        while not self._stop.wait(tick):
            started = time.perf_counter()
            try:
                self.tick(time.time())
            except Exception:
                log.exception("collector tick failed")
            self._collect_garbage(time.time())
            # How long a tick takes (bench/collector_load.py reads it from /v1/status).
            self.tick_seconds = time.perf_counter() - started
            self.tick_seconds_max = max(getattr(self, "tick_seconds_max", 0.0), self.tick_seconds)
            self._recent_ticks.append(self.tick_seconds)

    def _collect_garbage(self, now: float) -> None:
        """Python's full garbage collection scans every live object: ~2 s with
        the 3 M objects of 100,000 ranks, and left to itself it runs every few
        steps once that many records churn through the windows. Past
        GC_MANUAL_RANKS the collector takes the full collections over: the
        youngest generation stays automatic (many pauses of a millisecond, not
        one long one that every queued request feels), and every
        FULL_GC_INTERVAL the collector collects everything and freezes the
        survivors (gc.freeze), so the next full collection scans only what came
        since. Once every THAWED_GC_INTERVAL everything is thawed and collected,
        so cycles among long-lived objects (a closed connection's) are freed too.

        The middle generation is not collected automatically either (where
        Python has one: up to 3.13). A heartbeat's records live a second or
        more (until the tick settles them, the index writes them), so each
        was scanned twice, young then middle: at 100,000 ranks the middle
        collections took ~13 % of a core and freed ~70 objects in 40 s
        (bench/collector_load.py; gc.callbacks' counts), against 9-11 % for the
        young ones. What they would free waits for the full collection."""
        if self._stop.is_set():  # stopping: stop() has handed the thresholds back (a late tick must not undo it)
            return
        big = sum(len(run.ranks) for run in list(self.runs.values())) >= GC_MANUAL_RANKS
        if big and not self._gc_manual:
            self._gc_manual, self._gc_full_at, self._gc_thawed_at = True, now, now
            self._gc_thresholds = gc.get_threshold()
            young, middle = self._gc_thresholds[:2]
            if sys.version_info < (3, 14):
                # From 3.14 the second threshold may be the incremental collector's pace, not a generation's: left as is.
                middle = NEVER
            gc.set_threshold(young, middle, NEVER)  # no automatic full collection
        elif not big and self._gc_manual:
            self._gc_manual = False
            gc.unfreeze()
            gc.set_threshold(*self._gc_thresholds)
        if self._gc_manual and now - self._gc_full_at >= FULL_GC_INTERVAL:
            self._gc_full_at = now
            if now - self._gc_thawed_at >= THAWED_GC_INTERVAL:
                self._gc_thawed_at = now
                gc.unfreeze()
            gc.collect()
            gc.freeze()

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

    def _stride_scale(self, run_id: str) -> int:
        rt = self._rt.get(run_id)
        return rt.budget.scale if rt is not None else 1

    def _runtime(self, run_id: str) -> _RunRuntime:
        rt = self._rt.get(run_id)
        if rt is None:
            rt = self._rt[run_id] = _RunRuntime()
        return rt

    def _run(self, run_id: str, world_size: int = 0) -> RunState:
        if not _SAFE_ID.match(run_id):
            raise RequestError(f"invalid run id {run_id!r}")
        run = self.runs.get(run_id)
        if run is None and self._needs_index(run_id):
            # The one read of the index on ingest, off the steady path: a run
            # that left memory (finished minutes ago) gets a late message.
            run = self._restore(run_id)
        if run is None:
            run = self.runs[run_id] = RunState(run_id=run_id, world_size=world_size,
                                               hang_timeout=self.config.hang_timeout, on_hang=self.config.on_hang)
            self.changes.run(run)
        if world_size and world_size > run.world_size:
            run.world_size = world_size
        return run

    def _needs_index(self, run_id: str) -> bool:
        """Whether taking in a message of ``run_id`` reads the index (a run
        that left memory). Inside without_waiting() it raises MustWait
        instead: that read waits for the index writer's lock."""
        if run_id in self.runs or run_id not in self._index_only:
            return False
        if getattr(_no_waiting, "on", False):
            raise MustWait(run_id)
        return True

    # -- restart and retention ----------------------------------------------------------
    def _reload(self) -> None:
        """Restart without loss: the runs the index knows as unfinished come
        back (ranks, recent steps, incidents, verdicts already issued)."""
        self._index_only = set(self.store.run_ids())
        for run_id in self.store.unfinished_run_ids():
            try:
                self._restore(run_id)
            except Exception:
                log.exception("run %s could not be reloaded from the index", run_id)
        if self.runs:
            log.info("reloaded %d unfinished run(s) from the index: %s", len(self.runs), ", ".join(self.runs))

    def _restore(self, run_id: str) -> Optional[RunState]:
        run = self.store.load_run(run_id)
        if run is None:
            return None
        self.runs[run_id] = run
        self._index_only.discard(run_id)
        rt = self._runtime(run_id)
        rt.verdicts = self.store.verdicts(run_id)
        for v in rt.verdicts:
            rt.first_detected.setdefault((v.kind, ",".join(map(str, v.ranks))), v.detected_at)
            rt.dumped_kinds.add(v.kind)  # acted on before the restart
        return run

    def _evict_finished(self, now: float) -> None:
        """Finished runs leave memory (kept in the index, served from it)."""
        if now - self._evict_checked < 10.0 or self.store.path is None or self.store.degraded:
            return
        self._evict_checked = now
        for run_id, run in list(self.runs.items()):
            if not run.finished:
                continue
            seen = self._finished_seen.setdefault(run_id, now)
            if now - seen >= FINISHED_KEPT_S:
                del self.runs[run_id]
                self._index_only.add(run_id)
                self._rt.pop(run_id, None)
                self._finished_seen.pop(run_id, None)

    # -- ingest ------------------------------------------------------------------------
    def ingest_heartbeat(self, hb: wire.Heartbeat, now: Optional[float] = None,
                         arrived_at: Optional[float] = None) -> wire.Reply:
        """One rank's heartbeat (`arrived_at`: when its request arrived, for
        the rank's clock offset: a wait in the collector's queue is not
        transit)."""
        now = now or time.time()
        ident = hb.identity
        _expand_step_rows(hb)  # validated before any state changes
        _redact_events(hb)  # defence in depth: the agent redacted them already
        with self._lock:
            run = self._run(ident.run_id, ident.world_size)
            if not 0 <= ident.rank < max(run.world_size, ident.rank + 1):
                raise RequestError(f"rank {ident.rank} outside world size {run.world_size}")
            effect = ingest.heartbeat(run, hb, now, self.changes, arrived_at)
            commands = self._runtime(run.run_id).agent_commands.pop(ident.rank, [])
            if effect.touched:
                self._touch(run.run_id, urgent=effect.urgent)
        if self.metrics:
            self.metrics.observe_heartbeat(hb, now)
        return wire.Reply(commands=commands)

    def ingest_node(self, node: wire.NodeHeartbeat, now: Optional[float] = None,
                    arrived_at: Optional[float] = None) -> wire.Reply:
        now = now or time.time()
        with self._lock:
            self._evict_finished(now)  # in memory only: the index already has them
            known = self.runs.get(node.run_id)
            world = max(node.world_size, known.world_size if known is not None else 0)
            if world and any(w.rank >= world for w in node.workers):  # checked before anything changes
                raise RequestError(f"node report names a rank outside the world size {world}")
            run = self._run(node.run_id, node.world_size)
            key = f"{node.host}#{node.launcher_pid or node.node_rank}"
            rt = self._runtime(run.run_id)
            effect = ingest.node(run, node, key, now, rt.abort_sent, self.changes, arrived_at)
            commands = rt.node_commands.pop(key, [])
            if effect.touched:
                self._touch(run.run_id)
            if rt.abort_sent and run.aborted:
                commands.append(wire.Command(kind="abort", reason=run.aborted))
            verdicts = [announcement(run.run_id, v) for v in rt.verdicts[-MAX_ANNOUNCED:]]
        return wire.Reply(commands=commands, verdicts=verdicts)

    def ingest_node_report(self, report: wire.NodeReport, now: Optional[float] = None,
                           arrived_at: Optional[float] = None) -> wire.NodeReply:
        """One node's batch (from its relay): the supervisor's view and its
        ranks' heartbeats. A bad heartbeat is dropped alone (the others and
        the node's view still count)."""
        now = now or time.time()
        good = []
        for hb in report.heartbeats:
            try:
                _expand_step_rows(hb)
                good.append(hb)
            except wire.WireError as exc:
                self.heartbeats_rejected = getattr(self, "heartbeats_rejected", 0) + 1
                log.debug("node report: heartbeat dropped: %s", exc)
        ranks: dict[str, list[wire.Command]] = {}
        with self._lock:
            if getattr(_no_waiting, "on", False):  # checked before any of the report is taken in
                for run_id in {hb.identity.run_id for hb in good} | ({report.node.run_id} if report.node else set()):
                    self._needs_index(run_id)
            node_reply = self.ingest_node(report.node, now, arrived_at) if report.node is not None else wire.Reply()
            commands = node_reply.commands
            for hb in good:
                try:
                    reply = self.ingest_heartbeat(hb, now, arrived_at)
                except RequestError as exc:
                    self.heartbeats_rejected = getattr(self, "heartbeats_rejected", 0) + 1
                    log.debug("node report: heartbeat of rank %s dropped: %s", hb.identity.rank, exc)
                    continue
                if reply.commands:
                    ranks[str(hb.identity.rank)] = reply.commands
            world = max([report.node.world_size if report.node else 0] + [hb.identity.world_size for hb in good])
            run_id = report.node.run_id if report.node else (good[0].identity.run_id if good else "")
            run = self.runs.get(run_id)
            timeout = (run.hang_timeout if run is not None and run.hang_timeout else None) or self.config.hang_timeout
        return wire.NodeReply(commands=commands, ranks=ranks, verdicts=node_reply.verdicts,
                              interval=node_report_interval(world, timeout or self.config.adaptive_floor),
                              step_stride=record_stride(world, run.typical_step_s if run is not None else None,
                                                        self._stride_scale(run_id)))

    def ingest_bundle(self, data: bytes, run_hint: str = "", now: Optional[float] = None,
                      rank_hint: str = "") -> dict[str, Any]:
        try:
            return self._ingest_bundle(data, run_hint, now or time.time(), rank_hint)
        except RequestError:
            self.bundles_rejected += 1
            raise

    def _ingest_bundle(self, data: bytes, run_hint: str, now: float, rank_hint: str = "") -> dict[str, Any]:
        # Validated whole before anything changes or is written: the archive
        # (bounded read, typed members), its evidence, its place in the run;
        # what is stored is the validated, redacted re-pack, not the bytes sent.
        try:
            bundle = unpack(data)
            from_bundle(bundle)
            data = repack(bundle, data)
        except (BundleError, wire.WireError) as exc:
            raise RequestError(f"bundle rejected: {exc}") from None
        except Exception as exc:
            log.warning("bundle rejected: evidence unreadable: %s: %s", type(exc).__name__, exc)
            raise RequestError(f"bundle rejected: evidence unreadable ({type(exc).__name__})") from None
        if run_hint and bundle.manifest.run_id != run_hint:
            raise RequestError("bundle's run id does not match the request's")
        if rank_hint and rank_hint != str(bundle.manifest.rank):
            raise RequestError("bundle's rank does not match the sender's (X-Rankwatch-Rank)")
        if not _SAFE_ID.match(bundle.manifest.incident or "x"):
            raise RequestError(f"invalid incident id {bundle.manifest.incident!r}")
        with self._lock:
            known = self.runs.get(bundle.manifest.run_id)
            if known is not None and known.world_size and bundle.manifest.rank >= known.world_size:
                raise RequestError(f"bundle of rank {bundle.manifest.rank} outside the run's world size "
                                   f"{known.world_size}")
            run = self._run(bundle.manifest.run_id, 0 if known is not None else bundle.manifest.world_size)
            path = self._save_bundle_file(run.run_id, bundle, data)
            bundle.source_path = str(path)
            merge_bundle(run, bundle)
            self._touch(run.run_id, urgent=True)
            self.changes.bundle(run.run_id, bundle.manifest, str(path), len(data), now)
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
        if path.exists():
            # Never overwrite: the first bundle of a rank and incident stays
            # (a re-sent spool finds it there and is done).
            return path
        tmp = path.with_name(path.name + ".part")
        try:
            tmp.write_bytes(data)
            tmp.replace(path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise RequestError(f"bundle not stored: {exc.strerror or exc}", 507) from None
        return path

    def note_refused(self) -> None:
        """A report was turned away unread (the server's admission control
        sheds load while the collector is behind). O(1): called per report."""
        self.refused_at = time.time()

    # -- live monitoring -----------------------------------------------------------------
    def tick(self, now: float) -> None:
        """Hang watch and analyses of every run, each isolated from the others:
        one run's failure is logged once and never stops another's watch."""
        if self._last_tick_at is not None and now - self._last_tick_at > PAUSED_AFTER_S:
            # The collector itself did not run (stopped, its VM frozen, its
            # host swapping): what the relays held is about to arrive.
            self._resumed_at = now
            log.warning("the collector did not run for %.0f s: stalls are judged once the relays' backlog is in",
                        now - self._last_tick_at)
        self._last_tick_at = now
        with self._lock:
            runs = [(run, self._runtime(run.run_id)) for run in self.runs.values()]
        for run, rt in runs:
            try:
                self._tick_run(run, rt, now)
            except Exception:
                self._failed_once(run, rt, "tick")

    def _tick_run(self, run: RunState, rt: _RunRuntime, now: float) -> None:
        began = time.thread_time()
        try:
            self._watch_and_analyse(run, rt, now)
        finally:
            rt.budget.spent(time.thread_time() - began)
            rt.budget.review(now)

    def _watch_and_analyse(self, run: RunState, rt: _RunRuntime, now: float) -> None:
        run.reports_refused_at = self.refused_at  # any run's ranks may have been among those turned away
        with self._lock:
            if not run.finished:
                self._watch_for_hang(run, now)
                self._close_incidents(run, now)
            # Analyses when something new arrived, at most once a second, less often on big
            # jobs (a pass reads every rank once: ~0.6 s at 100,000), incidents at once.
            interval = max(ANALYSIS_INTERVAL, len(run.ranks) / RANKS_PER_ANALYSIS_SECOND)
            due = rt.dirty and (now - rt.analysed_at >= interval or rt.urgent)
            if due:
                rt.dirty = rt.urgent = False
                rt.analysed_at = now
        if not due:
            if interval > ANALYSIS_INTERVAL and len(run.feed):
                # Big jobs: what arrived is taken in every tick, in small pieces,
                # though the analyses' next pass is seconds away.
                try:
                    settle(run)
                except Exception:
                    self._failed_once(run, rt, "analysis")
            return
        # The running summaries take in what arrived, outside the ingest lock
        # (the heavy part: O(records) + O(ranks) per sealed step)...
        try:
            settle(run)
        except Exception:
            self._failed_once(run, rt, "analysis")
        # ... then each analysis reads its summary: cheap, under the lock (what
        # arrived meanwhile waits for the next pass, not the reports behind it).
        with self._lock:
            run.settle_deferred = True
            try:
                self._analyse(run, now, final=False)
            finally:
                run.settle_deferred = False

    def _failed_once(self, run: RunState, rt: _RunRuntime, what: str) -> None:
        if what not in rt.failed:
            rt.failed.add(what)
            log.exception("run %s: %s failed (logged once; the other runs are not affected)", run.run_id, what)

    def _touch(self, run_id: str, urgent: bool = False) -> None:
        rt = self._runtime(run_id)
        rt.dirty = True
        rt.urgent = rt.urgent or urgent

    def _live_ranks(self, run: RunState) -> list[int]:
        return sorted(r for r, s in run.ranks.items() if s.exit_code is None)

    def _watch_for_hang(self, run: RunState, now: float) -> None:
        """O(1) per tick until a stall: every figure here is a running summary
        kept on ingest. The stall clock is the latest progress the agents
        report (their own times, on the collector's clock), so heartbeats
        queued behind a slow collector do not push the incident back."""
        if not run.ranks or run.aborted:
            return
        # Named fast in every phase (a checkpoint write included); ending the
        # job is a separate, stricter judgement (collector/stuck.py).
        timeout = stuck.naming_timeout(run, self.config)
        stalled = now - run.last_progress_seen_at
        if stalled < timeout:
            return
        # What arrives in a backlog (the collector was paused, or the relays
        # could not reach it) is the job's past: a stall is judged once it is
        # in, not on the numbers of before it nor on each piece of it. A
        # backlog shows as a stall that ended on progress made before its
        # incident opened; until one interval passes with no more such
        # progress, the next stall waits (one incident, not one per piece).
        cadence = node_report_interval(run.world_size, timeout) or self.config.heartbeat_interval
        since = self._backlog_since(run, now, cadence)
        if since is not None:
            if now < run.last_progress_arrived_at + cadence:
                return
            if any(s.last_heartbeat_at < since for s in run.ranks.values() if s.exit_code is None):
                return  # a rank's held beats are not in yet (O(ranks), only while a backlog comes)
        # An incident of this stall: its last progress is the latest seen. Not
        # "opened after the latest progress": progress delivered late (a
        # collector outage, a relay's backlog) ends an incident opened on stale
        # numbers though it is dated before it opened, and the stall that
        # follows is another one, to be named in turn.
        if any(i.kind == "hang" and i.last_progress_at >= run.last_progress_seen_at for i in run.incidents):
            return  # already diagnosing this stall
        live = self._live_ranks(run)
        if not live:
            return
        stale_after = hang.STALE_HEARTBEATS * self.config.heartbeat_interval
        incident = Incident(id=f"hang-{len(run.incidents) + 1}", kind="hang", opened_at=now,
                            last_progress_at=run.last_progress_seen_at, timeout=timeout,
                            requested_ranks=hang.evidence_ranks(run, live, now, stale_after),
                            deadline=now + self._evidence_window(run), details={"stale_after_s": stale_after})
        self._open_incident(run, incident, "hang")

    def _backlog_since(self, run: RunState, now: float, cadence: float) -> Optional[float]:
        """When the delivery of a backlog began, while one may still be
        coming: the collector's resumption after it did not run, or the
        opening of a hang incident whose stall ended on progress made before
        it opened (the relays could not reach the collector). Bounded by the
        relays' longest pause between tries and one cadence more
        (`cadence.longest_relay_silence`): a rank not heard from by then is
        judged on what is known."""
        bound = longest_relay_silence(cadence)
        if now < self._resumed_at + bound:
            return self._resumed_at
        last = next((i for i in reversed(run.incidents) if i.kind == "hang"), None)
        if (last is not None and last.details.get("ended_at", float("inf")) < last.opened_at
                and now < last.details.get("ended_seen_at", float("-inf")) + bound):
            return last.opened_at
        return None

    def _evidence_window(self, run: RunState) -> float:
        """How long an incident waits for its bundles: through relays at scale
        the commands leave with the nodes' next reports, one interval later."""
        relayed = node_report_interval(run.world_size, run.hang_timeout or self.config.hang_timeout
                                       or self.config.adaptive_floor)
        return self.config.evidence_window + (relayed or 0.0)

    def _open_incident(self, run: RunState, incident: Incident, reason: str) -> None:
        """Ask the chosen ranks for a bundle and their nodes' supervisors for
        outside stacks. O(ranks + nodes): at 100,000 ranks only the suspects
        and a few references are asked (`hang.evidence_ranks`)."""
        run.incidents.append(incident)
        rt = self._runtime(run.run_id)
        wanted = set(incident.requested_ranks)
        for rank in incident.requested_ranks:
            rt.agent_commands.setdefault(rank, []).append(
                wire.Command(kind="dump", incident=incident.id, reason=reason))
        # Ranks whose heartbeat thread stopped (GIL held, stuck in C code) cannot
        # answer: the supervisor takes their native and faulthandler stacks.
        stale_after = hang.STALE_HEARTBEATS * self.config.heartbeat_interval
        stale = {r for r in wanted if r in run.ranks and run.ranks[r].silent_for(incident.opened_at) > stale_after}
        outside = []
        for key, node in run.nodes.items():
            ranks = [w.rank for w in node.workers if w.rank in wanted]
            if ranks:
                rt.node_commands.setdefault(key, []).append(
                    wire.Command(kind="capture", incident=incident.id, reason=reason, ranks=ranks,
                                 details={"stale": [r for r in ranks if r in stale]}))
                outside += [r for r in ranks if r in stale]
        if outside:
            # Their outside view, taken while they were silent, is what shows a
            # freeze; the stack signal may end it, and the agent's own bundle,
            # sent after, shows where the rank went next. Waited for (within
            # the window), whichever arrives first.
            incident.details["outside_for"] = sorted(outside)
        self.store.save_incident(run.run_id, incident)
        log.info("run %s: %s incident %s opened; evidence requested from %s",
                 run.run_id, reason, incident.id, ranks_text(incident.requested_ranks))

    def _act_on(self, run: RunState, v: wire.Verdict, now: float) -> None:
        """The configured action for a new verdict: report, dump or abort."""
        # hang has its own incident (on_hang); crash and oom end the job by themselves.
        action = getattr(self.config, f"on_{v.kind}", "report") if v.kind in ACTIONABLE else "report"
        rt = self._runtime(run.run_id)
        if action in ("dump", "abort") and v.kind not in rt.dumped_kinds:
            rt.dumped_kinds.add(v.kind)
            live = self._live_ranks(run)
            alive = set(live)
            incident = Incident(id=f"{v.kind}-{len(run.incidents) + 1}", kind=v.kind, opened_at=now,
                                last_progress_at=run.last_progress_seen_at,
                                requested_ranks=hang.with_references(live, [r for r in v.ranks if r in alive]),
                                deadline=now + self._evidence_window(run), details={"abort": action == "abort"})
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

    def _dead_run(self, run: RunState, v: wire.Verdict, now: float) -> None:
        """A dead run (analyses/nonfinite.py): one loud line as it happens,
        and with ``on_dead_run: abort`` the job ends (bundles first)."""
        action = self.config.on_dead_run
        if action == "ignore":
            return
        dead = v.evidence["dead_run"]
        ending = action == "abort" and not run.finished
        log.warning("%s", (f"run {run.run_id}: TRAINING IS DEAD: the loss has been non-finite on every rank since step "
                           f"{dead['since_step']}; the weights are non-finite and every further step is wasted. "
                           + ("Ending the job (on_dead_run: abort)." if ending else
                              "The job goes on (on_dead_run: abort would end it)."))[:400])
        if not ending:
            return
        live = self._live_ranks(run)
        incident = Incident(id=f"dead_run-{len(run.incidents) + 1}", kind="nonfinite", opened_at=now,
                            last_progress_at=run.last_progress_seen_at, requested_ranks=live,
                            deadline=now + self._evidence_window(run), details={"abort": True, "dead_run": True})
        self._open_incident(run, incident, "dead_run")

    def _close_incidents(self, run: RunState, now: float) -> None:
        """An incident is diagnosed once its evidence is in or its window
        closed; a big job's hang as soon as the heartbeats' numbers name the
        culprit (`hang.conclusive`: its ranks' bundles come at the relays'
        cadence and add their stacks later). The job is aborted only once the
        evidence is in or the window closed: the bundles are what is read
        afterwards."""
        stale_after = hang.STALE_HEARTBEATS * self.config.heartbeat_interval
        for incident in run.incidents:
            if incident.kind == "hang" and incident.ready and incident.details.get("open"):
                self._follow_stall(run, incident, now, stale_after)
                continue
            if incident.ready and not incident.details.get("abort_pending"):
                continue
            have = run.evidence_for(incident.id)
            outside = set(incident.details.get("outside_for") or ())
            complete = all(r in have and (r not in outside or have[r].outside_seen)
                           and (have[r].source == "agent" or run.ranks[r].silent_for(incident.opened_at) > stale_after)
                           for r in incident.requested_ranks)
            window_over = complete or now >= incident.deadline
            if not incident.ready:
                early = (not window_over and incident.kind == "hang"
                         and len(incident.requested_ranks) < len(run.ranks)
                         and hang.conclusive(run, incident, stale_after))
                if not (window_over or early):
                    continue
                incident.ready = True
                self._touch(run.run_id, urgent=True)
                incident.details["diagnosed_at"] = now
                incident.details["evidence_from"] = sorted(have)
                if incident.kind == "hang":
                    incident.details["open"] = True  # followed until it ends or is shown stuck
                elif incident.details.get("abort"):
                    incident.details["abort_pending"] = True
                self.store.save_incident(run.run_id, incident)
                if incident.kind == "hang":
                    self._follow_stall(run, incident, now, stale_after)
                    continue
            if incident.details.get("abort_pending") and window_over:
                del incident.details["abort_pending"]
                incident.details["evidence_from"] = sorted(have)
                self.store.save_incident(run.run_id, incident)
                run.aborted = (f"rankwatch ended the dead run (incident {incident.id}: the loss non-finite on every "
                               f"rank, on_dead_run: abort)" if incident.details.get("dead_run") else
                               f"rankwatch aborted the job after diagnosing incident {incident.id}")
                self._runtime(run.run_id).abort_sent = True

    def _stall_ended(self, run: RunState, incident: Incident, now: float) -> bool:
        """Progress again after a named stall: it ended by itself."""
        if run.last_progress_seen_at <= incident.last_progress_at:
            return False
        incident.details.pop("open", None)
        incident.details["ended_at"] = run.last_progress_seen_at
        incident.details["ended_seen_at"] = now  # when the progress that ended it arrived
        incident.details["stalled_s"] = round(run.last_progress_seen_at - incident.last_progress_at, 3)
        self.store.save_incident(run.run_id, incident)
        self._touch(run.run_id, urgent=True)
        log.warning("run %s: the stall of incident %s ended by itself after %.1f s "
                    "(a note in the report, not a verdict)", run.run_id, incident.id, incident.details["stalled_s"])
        return True

    def _follow_stall(self, run: RunState, incident: Incident, now: float, stale_after: float) -> None:
        """A named stall, each tick: ended by itself (progress again: a note,
        not a verdict), or, with on_hang abort, shown stuck (the job is
        ended). Anything in between waits."""
        found = hang.diagnose(run, incident, now, final=False)
        rt = self._runtime(run.run_id)
        if found is not None and incident.id not in rt.named_incidents:
            # Named now, maybe by time alone (a big job's numbers judged once
            # STALE_WAIT_S passed with no new data): the analyses' pass must
            # run to announce it, though nothing new arrived.
            rt.named_incidents.add(incident.id)
            self._touch(run.run_id, urgent=True)
        # A rank frozen holding the GIL (its heartbeat thread stopped too) is
        # stuck as named: the supervisor's stack signal may break its wait,
        # and a stall rankwatch ended is not one that ended by itself.
        frozen = found is not None and str(found.evidence.get("reason", "")).startswith("is frozen")
        if frozen:
            incident.details["frozen"] = True
        elif self._stall_ended(run, incident, now):
            return
        if run.on_hang != "abort" or run.aborted or found is None:
            return
        if frozen:
            reason = {"rule": "its interpreter frozen holding the GIL (heartbeat thread stopped) when named",
                      "ranks": {str(r): {"rule": "frozen"} for r in found.ranks},
                      "stalled_for_s": round(now - incident.last_progress_at, 1)}
        else:
            reason = stuck.stuck(run, incident, list(found.ranks), now, self.config, stale_after)
        if reason is None:
            return
        incident.details.pop("open", None)
        incident.details["stuck"] = reason
        incident.details["stuck_at"] = now
        self.store.save_incident(run.run_id, incident)
        self._touch(run.run_id, urgent=True)
        log.warning("run %s: %s stuck (%s): ending the job", run.run_id, ranks_text(list(found.ranks)),
                    reason["rule"])
        run.aborted = f"rankwatch aborted the job: incident {incident.id}, {ranks_text(list(found.ranks))} stuck"
        self._runtime(run.run_id).abort_sent = True

    def _analyse(self, run: RunState, now: float, final: bool) -> list[wire.Verdict]:
        rt = self._runtime(run.run_id)
        if not rt.announced and rt.verdicts:  # restored from the index
            rt.announced = {_key(v): v for v in rt.verdicts}
        ignored = config_mod.ignored_kinds(self.config)
        try:
            found = [v for v in analyses.run_all(run, now, final) if v.kind not in ignored]
        except Exception:
            self._failed_once(run, rt, "analysis")
            found = []
        for v in found:
            key = _key(v)
            if key not in rt.first_detected:
                rt.first_detected[key] = v.detected_at
                # One line as it happens; the full summary is printed once, in the final report.
                log.warning("%s", announcement(run.run_id, v))
                for callback in self.on_verdict:
                    try:
                        callback(run.run_id, v)
                    except Exception:
                        log.exception("verdict callback failed")
                if not run.finished:
                    self._act_on(run, v, now)
            v.detected_at = rt.first_detected[key]
            rt.announced[key] = v
            if v.kind == "nonfinite" and "dead_run" in v.evidence and not rt.dead_announced:
                rt.dead_announced = True
                self._dead_run(run, v, now)
            self.store.save_verdict(run.run_id, v)
        ended = {i.id for i in run.incidents if i.kind == "hang" and "ended_at" in i.details}
        if ended:  # a stall that ended by itself is a note, not a verdict (announced or not)
            for key, v in list(rt.announced.items()):
                if v.kind == "hang" and v.evidence.get("incident") in ended:
                    del rt.announced[key]
        kept = _still_announced(rt.announced, found)
        # An announced verdict that a later, truer root explains (rank 0's NaN at
        # step 7 announced before rank 1's step-6 record arrived) becomes that
        # root's consequence: one fault, one verdict.
        rt.verdicts = analyses.explain_away(found + kept) if kept else found
        return rt.verdicts

    # -- end of a run ------------------------------------------------------------------------
    def finish(self, run_id: str, interrupted: bool = False,
               exits: Optional[dict[int, tuple[int, float]]] = None,
               termination: Optional[wire.Termination] = None) -> wire.Report:
        """The launcher is done: record what it knows, analyse a last time.
        A launcher that says something outside ended the job (``termination``)
        makes its ranks' signal deaths consequences of that, never a crash."""
        with self._lock:
            run = self._run(run_id)
            run.interrupted = run.interrupted or interrupted or termination is not None
            if run.termination is None or (termination is not None and termination.by == "scheduler"
                                           and run.termination.by != "scheduler"):
                run.termination = termination or run.termination
            rt = self._runtime(run_id)
            for rank, (code, at) in (exits or {}).items():
                state = run.rank(rank)
                if state.exit_code is None:
                    state.exit_code, state.exited_at = code, at
                    state.killed_by_rankwatch = rt.abort_sent
            for incident in run.incidents:
                incident.details.pop("abort_pending", None)  # the job is over
                if incident.kind == "hang" and incident.details.get("open") and not incident.details.get("frozen"):
                    self._stall_ended(run, incident, time.time())  # progress in the ranks' last beats
                if not incident.ready:
                    incident.ready = True
                    incident.details.setdefault("diagnosed_at", time.time())
            run.finished = True
            self.store.save_run(run, finished_at=time.time())
            for state in run.ranks.values():
                self.store.save_rank(run_id, state)
            verdicts = self._analyse(run, time.time(), final=True)
            report = report_mod.build(run, verdicts)
            self._keep_report(run_id, report)
            return report

    def _keep_report(self, run_id: str, report: wire.Report) -> None:
        """The standalone collector keeps each run's report.json next to its
        bundles (``<data-dir>/runs/<id>/``), so `kubectl cp` + `rankwatch
        analyze` or a plain file read finds it. The embedded collector's
        launcher writes its own into the run dir."""
        if self._run_dir_for is not None or self.data_dir is None:
            return
        try:
            report_output.write(report, self.run_dir(run_id) / "report.json")
        except (OSError, RequestError) as exc:
            log.warning("run %s: report.json not written (%s); it is served from the index", run_id, exc)

    def report(self, run_id: str) -> wire.Report:
        with self._lock:
            run = self.runs.get(run_id)
            if run is None and _SAFE_ID.match(run_id) and self.store.has_run(run_id):
                run = self._restore(run_id)  # finished and out of memory: from the index
            if run is None:
                raise RequestError(f"unknown run {run_id!r}", 404)
            return report_mod.build(run, self._runtime(run_id).verdicts)

    def status(self) -> dict[str, Any]:
        with self._lock:  # references under the lock; the verdicts (immutable once made) converted outside it
            runs = {rid: (run, list(self._runtime(rid).verdicts)) for rid, run in self.runs.items()}
        ticks = list(self._recent_ticks)
        return {
            "runs": {
                rid: {
                    "world_size": run.world_size,
                    "ranks_seen": len(run.ranks),
                    "finished": run.finished,
                    "aborted": run.aborted,
                    "incidents": [i.id for i in list(run.incidents)],
                    "verdicts": [wire.to_dict(v) for v in verdicts],
                }
                for rid, (run, verdicts) in runs.items()
            },
            "bundles_received": self.bundles_received,
            "bundles_rejected": self.bundles_rejected,
            "heartbeats_rejected": getattr(self, "heartbeats_rejected", 0),
            "tick_seconds": getattr(self, "tick_seconds", None),
            "tick_seconds_max": getattr(self, "tick_seconds_max", None),
            # The last RECENT_TICKS ticks (most are cheap: the analyses' pass is
            # every N/20,000 s on big jobs): how long the ones that work take.
            "tick_seconds_p50": percentile(ticks, 0.5) if ticks else None,
            "tick_seconds_p99": percentile(ticks, 0.99) if ticks else None,
            "index_degraded": self.store.degraded,
            # heartbeats whose records the index missed (a writer held up past the journal's bound)
            "index_beats_dropped": self.changes.beats_dropped,
        }


_redacted: dict[int, tuple[Any, Any]] = {}  # id(details) -> (details, its redacted copy)


def _redact_events(hb: wire.Heartbeat) -> None:
    """Each event's details redacted. The decoder hands every rank's identical
    start-up facts over as one shared object: redacted once (memo held by
    identity, the object kept alive with it so its id is never reused)."""
    for event in hb.events:
        details = event.details
        if event.kind != "step_values" and details:
            memo = _redacted.get(id(details))
            if memo is None or memo[0] is not details:
                if len(_redacted) >= 10_000:
                    _redacted.clear()
                memo = _redacted[id(details)] = (details, redact_obj(details))
            event.details = memo[1]


def _key(v: wire.Verdict) -> tuple[str, str]:
    return (v.kind, ",".join(map(str, v.ranks)))


def _still_announced(announced: dict[tuple[str, str], wire.Verdict], found: list[wire.Verdict]) -> list[wire.Verdict]:
    """Verdicts announced earlier that the latest pass no longer reports (a leak
    that plateaued, evidence that aged out of a window): kept, with their last
    figures, unless a reported verdict now lists them as its consequence."""
    covered = {_key(v) for v in found}
    for v in found:
        for c in v.evidence.get("consequences") or []:
            if isinstance(c, dict):
                covered.add((str(c.get("kind")), ",".join(map(str, c.get("ranks") or []))))
    kept = [v for key, v in announced.items() if key not in covered]
    return sorted(kept, key=lambda v: v.first_seen_at)


MAX_ANNOUNCED = 8  # verdict lines a node's reply carries (the newest)


def announcement(run_id: str, v: wire.Verdict) -> str:
    """The one line that says a verdict as it happens (the full summary is
    printed once, in the final report)."""
    if v.kind == "hang" and v.evidence.get("incident"):
        # A named stall: said at once, live; the job is ended only if it is shown stuck.
        stack = v.evidence.get("culprit_stack") or []
        at = f" at {where(stack)}" if stack else ""
        return (f"run {run_id}: hang on {ranks_text(v.ranks)} at step {v.step}{at}, no progress for "
                f"{v.evidence.get('hang_timeout_s') or 0:.0f} s (details in the report)")[:256]
    return f"run {run_id}: {v.kind} on {ranks_text(v.ranks)} at step {v.step} (details in the report)"[:256]


STEP_RECORDS_PER_SECOND = 20_000  # what one collector takes in comfortably, with everything else
MAX_STRIDE = 64


def record_stride(world_size: int, typical_step_s: Optional[float], scale: int = 1) -> Optional[int]:
    """Every how many steps the relays forward each rank's step record (see
    `NodeReply.step_stride`): a power of two keeping the job's records near
    STEP_RECORDS_PER_SECOND (100,000 ranks at a step a second: every 8th step),
    times `scale`, the run's `AnalysisBudget` (collector/analysis_budget.py:
    coarser while the analyses use more than their share of a core).
    The cross-rank analyses read the same sampled steps on every rank; the
    relays still forward every unusual record, thin each rank's collective
    marks and fingerprints by the same stride (rankwatch/node/relay.py
    `StepSampler`), and the hang watch reads the heartbeats, not the records."""
    stride = 1
    if typical_step_s and world_size > STEP_RECORDS_PER_SECOND * 0.05:
        rate = world_size / max(typical_step_s, 0.01)
        while rate / stride > STEP_RECORDS_PER_SECOND and stride < MAX_STRIDE:
            stride *= 2
    stride = min(MAX_STRIDE, stride * max(1, scale))
    return stride if stride > 1 else None


def _expand_step_rows(hb: wire.Heartbeat) -> None:
    """Compact step rows become StepRecords (validated field by field)."""
    if hb.step_rows:
        hb.steps = wire.step_records(hb)
        hb.step_rows = []


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
    phase = ev.progress.get("phase")
    phase = phase if isinstance(phase, str) and wire.valid_token(phase) else None
    if m.step is not None and m.step > state.step:
        state.step = m.step
        if phase and ev.source == "supervisor":
            state.phase = phase
    if phase and state.phase == "startup":
        # No heartbeat said where the rank was (an offline analysis of bundles
        # alone): the bundle's own progress does, as the live report had it.
        state.phase = phase
    # Now in the rank's state: the evidence keeps no second copy (memory at scale).
    ev.steps, ev.marks, ev.events = [], [], []


def merge_evidence(a: RankEvidence, b: RankEvidence) -> RankEvidence:
    """The agent's bundle (inside view) and the supervisor's (outside view) of
    the same rank and incident: keep both halves."""
    inside, outside = (a, b) if a.source == "agent" else (b, a)
    merged = inside
    if outside is not inside:
        merged.native_stacks = merged.native_stacks or outside.native_stacks
        merged.worker_stacks = merged.worker_stacks or outside.worker_stacks
        merged.faulthandler = merged.faulthandler or outside.faulthandler
        if not merged.stacks:
            merged.stacks = outside.stacks
        merged.notes = merged.notes + outside.notes
        merged.outside_seen = merged.outside_seen or outside.outside_seen
        if inside.source != "agent":
            merged.source = outside.source
    return merged
