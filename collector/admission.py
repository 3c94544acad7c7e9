"""Admission control for the collector's ingest: shed load before it costs.

A collector that is behind can only tell its senders to slow down by
answering them, so it must still answer when behind (issue 29). Each
heartbeat, node report or node view is admitted before its body is read or
decoded, or answered at once with 503, `Retry-After` and the cadence:

- *behind*: the oldest report admitted and not done has waited longer than
  the latency budget (what a report may take, queueing included) since its
  body was in (a slow upload is its sender's wait, not a backlog),
- *late*: the server reached this request only past the budget (its loop
  was busy), or
- *full*: as many reports are in as the budget holds at the measured cost of
  one (an exponential average), between MIN_SLOTS and MAX_SLOTS.

So a backlog costs its senders one cheap answer each, not a timeout each;
what is admitted is taken in within about the budget, and the hang watch
keeps working from it. Senders back off (the relays exponentially with
jitter, with Retry-After as a floor) and keep their data for the next try.
Both servers (`server.py`) share this object's rule.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from rankwatch.cadence import node_report_interval

INGEST_PATHS = ("/v1/heartbeat", "/v1/node-report", "/v1/nodes")


@dataclass
class AdmissionConfig:
    latency_budget_s: float = 0.5  # a report's time from arrival to answer (the p99 the collector aims for)
    min_slots: int = 4
    max_slots: int = 4096
    first_cost_s: float = 0.002  # the cost assumed for a report before one was measured


class Admission:
    def __init__(self, config: Optional[AdmissionConfig] = None, cadence: Callable[[], Optional[float]] = lambda: None,
                 on_shed: Callable[[], None] = lambda: None):
        self.config = config or AdmissionConfig()
        self._cadence = cadence
        self._on_shed = on_shed  # told of each report turned away (the hang watch must know: analyses/hang.py)
        self._lock = threading.Lock()
        # ticket -> when its body was in, oldest first; tickets whose body is
        # still arriving wait apart: a slow upload is its sender's wait, not
        # the collector's backlog (one slow relay would make every report shed).
        self._inflight: "collections.OrderedDict[int, float]" = collections.OrderedDict()
        self._reading: set[int] = set()
        self._next_ticket = 0
        self.cost_s = self.config.first_cost_s  # exponential average of one report's time in the collector
        self.admitted = 0
        self.shed = 0

    @property
    def slots(self) -> int:
        c = self.config
        return max(c.min_slots, min(c.max_slots, int(c.latency_budget_s / max(self.cost_s, 1e-6))))

    def enter(self, arrived: Optional[float] = None) -> Optional[int]:
        """A ticket for a report to take in, or None: answer `shed_response()`.
        ``arrived``: when the server first read the request's bytes
        (time.monotonic()), if it knows: a request it reached only past the
        budget (its loop was busy) is answered at once. Call `ready` once
        the body is in."""
        now = time.monotonic()
        with self._lock:
            oldest = next(iter(self._inflight.values()), None)
            behind = oldest is not None and now - oldest > self.config.latency_budget_s
            late = arrived is not None and now - arrived > self.config.latency_budget_s
            if behind or late or len(self._inflight) + len(self._reading) >= self.slots:
                self.shed += 1
                self._on_shed()
                return None
            ticket = self._next_ticket
            self._next_ticket += 1
            self._reading.add(ticket)
            self.admitted += 1
            return ticket

    def ready(self, ticket: int) -> None:
        """The ticket's body is in: from now on its wait is the collector's."""
        with self._lock:
            if ticket in self._reading:
                self._reading.discard(ticket)
                self._inflight[ticket] = time.monotonic()

    def leave(self, ticket: int, cost_s: Optional[float]) -> None:
        """The report is done; ``cost_s`` is its time in the collector (not its
        wait), None when it never got there. A ticket already left is ignored."""
        with self._lock:
            self._reading.discard(ticket)
            if self._inflight.pop(ticket, None) is not None and cost_s is not None:
                self.cost_s += 0.05 * (cost_s - self.cost_s)

    @property
    def inflight(self) -> int:
        return len(self._inflight) + len(self._reading)

    def retry_after(self) -> int:
        """Whole seconds (HTTP's delta-seconds): the cadence the collector
        asks of its relays, at least a second."""
        cadence = self._cadence() or 1.0
        return max(1, math.ceil(cadence))

    def shed_response(self) -> tuple[int, bytes, str, dict[str, str]]:
        seconds = self.retry_after()
        body = (b'{"error":"collector behind: report not taken, keep it and retry","retry_after":%d,"interval":%d}'
                % (seconds, seconds))
        return 503, body, "application/json", {"Retry-After": str(seconds)}


def collector_cadence(collector: Any) -> Callable[[], Optional[float]]:
    """The relays' cadence for everything the collector watches (its rule for
    the ranks of all its runs), recomputed at most once a second."""
    cached = {"at": -1.0, "value": None}

    def cadence() -> Optional[float]:
        now = time.monotonic()
        if now - cached["at"] >= 1.0:
            runs = list(getattr(collector, "runs", {}).values())
            ranks = sum(len(run.ranks) for run in runs)
            timeouts = [run.hang_timeout for run in runs if getattr(run, "hang_timeout", None)]
            cached["value"] = node_report_interval(ranks, min(timeouts) if timeouts else 20.0)
            cached["at"] = now
        return cached["value"]

    return cadence
