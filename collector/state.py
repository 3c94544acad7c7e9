"""What the collector knows about a run: the input of every analysis.

Built live from heartbeats, node reports and bundles, or offline from a run
dir's index and bundles. Analyses read a `RunState` and never mutate it.
"""

from __future__ import annotations

import collections
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from rankwatch import wire

from .evidence import RankEvidence

STEP_WINDOW = 2048


@dataclass
class RankState:
    rank: int
    local_rank: int = 0
    node_rank: int = 0
    host: str = ""
    pid: int = 0
    world_size: int = 0
    attempt: int = 0
    step: int = 0
    forwards: int = 0
    phase: str = "startup"
    phase_since: float = 0.0
    last_progress_at: float = 0.0  # agent clock
    last_heartbeat_at: float = 0.0  # collector clock
    enqueued: dict[str, int] = field(default_factory=dict)
    completed: dict[str, int] = field(default_factory=dict)
    steps: "collections.OrderedDict[int, wire.StepRecord]" = field(default_factory=collections.OrderedDict)
    marks: dict[int, dict[str, int]] = field(default_factory=dict)
    events: list[wire.Event] = field(default_factory=list)
    fingerprints: list[dict[str, Any]] = field(default_factory=list)
    host_memory: dict[str, int] = field(default_factory=dict)  # last heartbeat's
    exit_code: Optional[int] = None  # negative: signal
    exited_at: Optional[float] = None
    killed_by_rankwatch: bool = False
    evidence: dict[str, RankEvidence] = field(default_factory=dict)  # incident -> evidence

    def add_step(self, record: wire.StepRecord) -> None:
        self.steps[record.step] = record
        while len(self.steps) > STEP_WINDOW:
            self.steps.popitem(last=False)

    def exception_event(self) -> Optional[wire.Event]:
        for event in self.events:
            if event.kind == "exception":
                return event
        return None



@dataclass
class Incident:
    id: str
    kind: str  # "hang", "collective_mismatch", ...
    opened_at: float
    last_progress_at: float
    timeout: Optional[float] = None
    requested_ranks: list[int] = field(default_factory=list)
    ready: bool = False  # evidence collected (or its window closed)
    deadline: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunState:
    run_id: str
    world_size: int = 0
    started_at: float = field(default_factory=time.time)
    ranks: dict[int, RankState] = field(default_factory=dict)
    incidents: list[Incident] = field(default_factory=list)
    nodes: dict[str, wire.NodeHeartbeat] = field(default_factory=dict)
    hang_timeout: Optional[float] = None  # fixed by the user; None = adaptive
    on_hang: str = "abort"
    finished: bool = False
    interrupted: bool = False
    aborted: Optional[str] = None  # why rankwatch ended the job
    last_progress_seen_at: float = field(default_factory=time.time)  # collector clock
    orphan_evidence: list[RankEvidence] = field(default_factory=list)

    def rank(self, rank: int) -> RankState:
        state = self.ranks.get(rank)
        if state is None:
            state = self.ranks[rank] = RankState(rank=rank)
        return state

    def evidence_for(self, incident: str) -> dict[int, RankEvidence]:
        return {r: s.evidence[incident] for r, s in self.ranks.items() if incident in s.evidence}

    def all_evidence(self) -> list[RankEvidence]:
        return [ev for s in self.ranks.values() for ev in s.evidence.values()]

    def step_durations(self) -> list[float]:
        """Recent step durations across ranks (for the adaptive hang timeout)."""
        durations = []
        for state in self.ranks.values():
            for record in list(state.steps.values())[-50:]:
                durations.append(max(0.0, record.ended_at - record.started_at))
        return durations

    def adaptive_timeout(self, startup: float, floor: float, multiplier: float) -> float:
        if self.hang_timeout is not None:
            return self.hang_timeout
        if not any(s.step > 1 for s in self.ranks.values()):  # the first step is start-up too
            return startup
        durations = self.step_durations()
        if not durations:
            return startup
        typical = statistics.median(durations)
        return max(floor, multiplier * typical)
