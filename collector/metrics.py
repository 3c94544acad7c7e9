"""Prometheus metrics, rendered at scrape time from the collector's state.

One scrape endpoint per node: the launcher's embedded collector serves
``/metrics`` for the ranks of its job (a standalone collector serves every
job it watches). Nothing is updated per heartbeat: a custom prometheus_client
collector reads the RunState when Prometheus asks.

Labels and cardinality budget (see ARCHITECTURE.md): per-rank series carry
``run``, ``node``, ``rank``, ``local_rank`` and nothing unbounded (no step, no
phase, no process group beyond the default one). 14 series per rank (12 on a
CPU-only job): 10,000 ranks are ~140,000 series, plus ~30 job-level ones.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from rankwatch import wire

from .analyses import straggler

if TYPE_CHECKING:
    from .service import Collector

# "run", not "job": Prometheus sets `job` to the scrape job itself.
RANK_LABELS = ["run", "node", "rank", "local_rank"]

# name -> (help, type); the dashboards and alert rules may use only these.
METRICS = {
    "rankwatch_step": ("Optimizer steps completed by the rank", "gauge"),
    "rankwatch_step_duration_seconds": ("Duration of the rank's last step (waiting for peers included)", "gauge"),
    "rankwatch_compute_seconds": ("The rank's own time in its last step: data, forward and backward up to the "
                                  "gradient allreduce (waiting for peers excluded)", "gauge"),
    "rankwatch_data_seconds": ("Time the rank waited for its batch in its last step", "gauge"),
    "rankwatch_grad_norm": ("Local (pre-allreduce) gradient norm of the rank's last checked step", "gauge"),
    "rankwatch_loss": ("The rank's local loss in its last step", "gauge"),
    "rankwatch_nonfinite_steps_total": ("Steps in which the rank's local loss or gradients were NaN/Inf", "counter"),
    "rankwatch_memory_rss_bytes": ("Host resident memory of the rank", "gauge"),
    "rankwatch_device_memory_allocated_bytes": ("Device memory allocated by the rank (CUDA)", "gauge"),
    "rankwatch_device_memory_reserved_bytes": ("Device memory reserved by the rank's caching allocator", "gauge"),
    "rankwatch_heartbeat_age_seconds": ("Seconds since the rank's last heartbeat", "gauge"),
    "rankwatch_collective_sequence": ("Last enqueued collective sequence number (default process group)", "gauge"),
    "rankwatch_straggler_score": ("Rank's own step time / its peers' median over the recent window", "gauge"),
    "rankwatch_rank_up": ("1 while the rank is running, 0 once it exited", "gauge"),
    "rankwatch_world_size": ("Ranks in the job", "gauge"),
    "rankwatch_seconds_since_progress": ("Seconds since any rank of the job made progress", "gauge"),
    "rankwatch_hang_timeout_seconds": ("Hang timeout in force (adaptive unless fixed)", "gauge"),
    "rankwatch_hung": ("1 when the job made no progress past its hang timeout", "gauge"),
    "rankwatch_verdicts": ("Verdicts of the job, by kind", "gauge"),
    "rankwatch_suspect_rank": ("1 for each rank named by a verdict, by kind", "gauge"),
    "rankwatch_bundles_received_total": ("Diagnostic bundles received", "counter"),
    "rankwatch_bundles_rejected_total": ("Bundles refused (malformed, oversized, unsafe)", "counter"),
    "rankwatch_ingest_latency_seconds": ("Heartbeat age when the collector received it", "histogram"),
}

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, float("inf"))


class CollectorMetrics:
    """prometheus_client custom collector over a rankwatch Collector."""

    def __init__(self, collector: "Collector") -> None:
        self.collector = collector
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._latency_counts = [0] * len(LATENCY_BUCKETS)
        self._latency_sum = 0.0
        collector.metrics = self

    # -- hooks called by the Collector -------------------------------------------
    def observe_heartbeat(self, hb: wire.Heartbeat, received_at: float) -> None:
        latency = max(0.0, received_at - hb.sent_at)
        self._latency_sum += latency
        for i, bound in enumerate(LATENCY_BUCKETS):
            if latency <= bound:
                self._latency_counts[i] += 1

    # -- exposition ------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def collect(self) -> Iterable:
        now = time.time()
        families = {}
        for name, (help_text, kind) in METRICS.items():
            if kind == "histogram":
                continue
            labels = RANK_LABELS if name.startswith(_PER_RANK) else ["run"]
            if name == "rankwatch_verdicts":
                labels = ["run", "kind"]
            elif name == "rankwatch_suspect_rank":
                labels = ["run", "kind", "rank"]
            elif name.startswith("rankwatch_bundles_"):
                labels = []
            family_cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            metric_name = name[: -len("_total")] if kind == "counter" else name
            families[name] = family_cls(metric_name, help_text, labels=labels)
        with self.collector._lock:
            for run_id, run in self.collector.runs.items():
                self._collect_run(families, run_id, run, now)
        families["rankwatch_bundles_received_total"].add_metric([], self.collector.bundles_received)
        families["rankwatch_bundles_rejected_total"].add_metric([], self.collector.bundles_rejected)
        yield from families.values()
        buckets, cumulative = [], 0
        for bound, count in zip(LATENCY_BUCKETS, self._latency_counts):
            cumulative = count  # counts are already cumulative (<= bound)
            buckets.append(("+Inf" if math.isinf(bound) else str(bound), cumulative))
        hist = HistogramMetricFamily("rankwatch_ingest_latency_seconds",
                                     METRICS["rankwatch_ingest_latency_seconds"][0],
                                     buckets=buckets, sum_value=self._latency_sum)
        yield hist

    def _collect_run(self, f, run_id: str, run, now: float) -> None:
        scores = straggler.scores(run)
        for rank, state in sorted(run.ranks.items()):
            labels = [run_id, state.host or "", str(rank), str(state.local_rank)]
            last = next(reversed(state.steps.values()), None) if state.steps else None
            f["rankwatch_step"].add_metric(labels, state.step)
            f["rankwatch_rank_up"].add_metric(labels, 0 if state.exit_code is not None else 1)
            f["rankwatch_heartbeat_age_seconds"].add_metric(labels, max(0.0, now - state.last_heartbeat_at)
                                                            if state.last_heartbeat_at else math.nan)
            if "0" in state.enqueued:
                f["rankwatch_collective_sequence"].add_metric(labels, state.enqueued["0"])
            nonfinite = sum(1 for r in state.steps.values()
                            if r.nonfinite_grads or (r.loss is not None and not math.isfinite(r.loss)))
            f["rankwatch_nonfinite_steps_total"].add_metric(labels, nonfinite)
            if rank in scores:
                f["rankwatch_straggler_score"].add_metric(labels, scores[rank]["score"])
            if last is not None:
                f["rankwatch_step_duration_seconds"].add_metric(labels, last.ended_at - last.started_at)
                for name, value in (("rankwatch_compute_seconds", last.compute_s),
                                    ("rankwatch_data_seconds", last.data_s),
                                    ("rankwatch_grad_norm", last.grad_norm),
                                    ("rankwatch_loss", last.loss),
                                    ("rankwatch_memory_rss_bytes", last.rss_bytes),
                                    ("rankwatch_device_memory_allocated_bytes", last.device_allocated_bytes),
                                    ("rankwatch_device_memory_reserved_bytes", last.device_reserved_bytes)):
                    if value is not None:
                        f[name].add_metric(labels, value)
        cfg = self.collector.config
        timeout = run.adaptive_timeout(cfg.startup_timeout, cfg.adaptive_floor, cfg.adaptive_multiplier)
        stalled = now - run.last_progress_seen_at if not run.finished else 0.0
        f["rankwatch_world_size"].add_metric([run_id], run.world_size)
        f["rankwatch_seconds_since_progress"].add_metric([run_id], stalled)
        f["rankwatch_hang_timeout_seconds"].add_metric([run_id], timeout)
        f["rankwatch_hung"].add_metric([run_id], 1 if any(i.kind == "hang" for i in run.incidents) else 0)
        verdicts = self.collector._runtime(run_id).verdicts
        for kind in wire.VERDICT_KINDS:
            f["rankwatch_verdicts"].add_metric([run_id, kind], sum(1 for v in verdicts if v.kind == kind))
        for v in verdicts:
            for rank in v.ranks:
                f["rankwatch_suspect_rank"].add_metric([run_id, v.kind, str(rank)], 1)


_PER_RANK = (
    "rankwatch_step", "rankwatch_compute", "rankwatch_data", "rankwatch_grad", "rankwatch_loss",
    "rankwatch_nonfinite", "rankwatch_memory", "rankwatch_device", "rankwatch_heartbeat",
    "rankwatch_collective", "rankwatch_straggler", "rankwatch_rank_up",
)
