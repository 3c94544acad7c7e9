"""Prometheus metrics, rendered at scrape time from the collector's state.

One scrape endpoint per node: the launcher's embedded collector serves
``/metrics`` for the ranks of its job (a standalone collector serves every
job it watches). Nothing is updated per heartbeat: the exposition is written
from the RunStates when Prometheus asks.

At scale: the rendering never takes the collector's ingest lock (it reads
each rank's latest values, which ingest replaces whole, and the analyses'
running summaries), renders each run on its own (a run whose state cannot
be rendered is left out and logged once; the other runs are not affected),
and writes the text exposition format directly (prometheus_client's object
path costs ~10x more per sample at 100,000 ranks).

Labels and cardinality budget (see ARCHITECTURE.md): per-rank series carry
``run``, ``node``, ``rank``, ``local_rank`` and nothing unbounded (no step, no
phase, no process group beyond the default one). 14 series per rank (12 on a
CPU-only job): 10,000 ranks are ~140,000 series, plus ~30 job-level ones.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Optional

from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString

from rankwatch import wire

from . import stuck
from .analyses import straggler

if TYPE_CHECKING:
    from .service import Collector

log = logging.getLogger("rankwatch.collector.metrics")

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


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _value(value) -> str:
    return floatToGoString(value)


_LAST_RECORD_FIELDS = (("rankwatch_compute_seconds", "compute_s"), ("rankwatch_data_seconds", "data_s"),
                       ("rankwatch_grad_norm", "grad_norm"), ("rankwatch_loss", "loss"),
                       ("rankwatch_memory_rss_bytes", "rss_bytes"),
                       ("rankwatch_device_memory_allocated_bytes", "device_allocated_bytes"),
                       ("rankwatch_device_memory_reserved_bytes", "device_reserved_bytes"))


class CollectorMetrics:
    """The /metrics exposition of a rankwatch Collector."""

    def __init__(self, collector: "Collector") -> None:
        self.collector = collector
        self._latency_counts = [0] * len(LATENCY_BUCKETS)
        self._latency_sum = 0.0
        self._latency_lock = threading.Lock()
        self._failed: set[str] = set()  # runs whose rendering failed (logged once)
        collector.metrics = self

    # -- hooks called by the Collector -------------------------------------------
    def observe_heartbeat(self, hb: wire.Heartbeat, received_at: float) -> None:
        latency = max(0.0, received_at - hb.sent_at)
        with self._latency_lock:
            self._latency_sum += latency
            for i, bound in enumerate(LATENCY_BUCKETS):
                if latency <= bound:
                    self._latency_counts[i] += 1

    # -- exposition ------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        return self.text(time.time()).encode(), CONTENT_TYPE_LATEST

    def text(self, now: float) -> str:
        families: dict[str, list[str]] = {name: [] for name in METRICS}
        runs = list(self.collector.runs.items())  # a copy: never under the ingest lock
        for run_id, run in runs:
            lines: dict[str, list[str]] = {name: [] for name in METRICS}
            try:
                self._run(lines, run_id, run, now)
            except Exception:
                if run_id not in self._failed:
                    self._failed.add(run_id)
                    log.exception("/metrics: run %s could not be rendered; left out (the other runs are not)", run_id)
                continue
            for name, out in lines.items():
                if out:
                    families[name].extend(out)
        families["rankwatch_bundles_received_total"].append(
            f"rankwatch_bundles_received_total {_value(self.collector.bundles_received)}")
        families["rankwatch_bundles_rejected_total"].append(
            f"rankwatch_bundles_rejected_total {_value(self.collector.bundles_rejected)}")
        with self._latency_lock:
            counts, total = list(self._latency_counts), self._latency_sum
        name = "rankwatch_ingest_latency_seconds"
        for bound, count in zip(LATENCY_BUCKETS, counts):  # counts are already cumulative (<= bound)
            le = "+Inf" if math.isinf(bound) else str(bound)
            families[name].append(f'{name}_bucket{{le="{le}"}} {_value(count)}')
        families[name].append(f"{name}_count {_value(counts[-1])}")
        families[name].append(f"{name}_sum {_value(total)}")
        out: list[str] = []
        for name, (help_text, kind) in METRICS.items():
            out.append(f"# HELP {name} {_help(help_text)}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(families[name])
        return "\n".join(out) + "\n"

    def _run(self, f: dict[str, list[str]], run_id: str, run, now: float) -> None:
        scores = straggler.scores(run)  # the analysis' running summary: no rescan
        rid = _escape(run_id)
        step_l, up_l, age_l = f["rankwatch_step"], f["rankwatch_rank_up"], f["rankwatch_heartbeat_age_seconds"]
        seq_l, nonfinite_l = f["rankwatch_collective_sequence"], f["rankwatch_nonfinite_steps_total"]
        score_l, duration_l = f["rankwatch_straggler_score"], f["rankwatch_step_duration_seconds"]
        record_lines = [(f[name], name, attr) for name, attr in _LAST_RECORD_FIELDS]
        for rank, state in sorted(list(run.ranks.items())):
            labels = f'{{run="{rid}",node="{_escape(state.host or "")}",rank="{rank}",local_rank="{state.local_rank}"}}'
            step_l.append(f"rankwatch_step{labels} {_value(state.step)}")
            up_l.append(f"rankwatch_rank_up{labels} {_value(0 if state.exit_code is not None else 1)}")
            heard = state.last_heartbeat_at
            age_l.append(f"rankwatch_heartbeat_age_seconds{labels} "
                         f"{_value(max(0.0, now - heard) if heard else math.nan)}")
            seq = state.enqueued.get("0")
            if seq is not None:
                seq_l.append(f"rankwatch_collective_sequence{labels} {_value(seq)}")
            nonfinite_l.append(f"rankwatch_nonfinite_steps_total{labels} {_value(state.nonfinite_steps)}")
            score = scores.get(rank)
            if score is not None:
                score_l.append(f"rankwatch_straggler_score{labels} {_value(score['score'])}")
            last: Optional[wire.StepRecord] = state.last_record
            if last is not None:
                duration_l.append(f"rankwatch_step_duration_seconds{labels} {_value(last.ended_at - last.started_at)}")
                for lines, name, attr in record_lines:
                    value = getattr(last, attr)
                    if value is not None:
                        lines.append(f"{name}{labels} {_value(value)}")
        cfg = self.collector.config
        timeout = stuck.naming_timeout(run, cfg)
        stalled = now - run.last_progress_seen_at if not run.finished else 0.0
        job = f'{{run="{rid}"}}'
        f["rankwatch_world_size"].append(f"rankwatch_world_size{job} {_value(run.world_size)}")
        f["rankwatch_seconds_since_progress"].append(f"rankwatch_seconds_since_progress{job} {_value(stalled)}")
        f["rankwatch_hang_timeout_seconds"].append(f"rankwatch_hang_timeout_seconds{job} {_value(timeout)}")
        # A named stall still going (one that ended by itself is a note).
        hung = 1 if any(i.kind == "hang" and "ended_at" not in i.details for i in list(run.incidents)) else 0
        f["rankwatch_hung"].append(f"rankwatch_hung{job} {_value(hung)}")
        rt = self.collector._rt.get(run_id)
        verdicts = list(rt.verdicts) if rt is not None else []
        for kind in wire.VERDICT_KINDS:
            count = sum(1 for v in verdicts if v.kind == kind)
            f["rankwatch_verdicts"].append(f'rankwatch_verdicts{{run="{rid}",kind="{kind}"}} {_value(count)}')
        for v in verdicts:
            for rank in v.ranks:
                f["rankwatch_suspect_rank"].append(
                    f'rankwatch_suspect_rank{{run="{rid}",kind="{v.kind}",rank="{rank}"}} {_value(1)}')


_PER_RANK = (
    "rankwatch_step", "rankwatch_compute", "rankwatch_data", "rankwatch_grad", "rankwatch_loss",
    "rankwatch_nonfinite", "rankwatch_memory", "rankwatch_device", "rankwatch_heartbeat",
    "rankwatch_collective", "rankwatch_straggler", "rankwatch_rank_up",
)
