"""What the collector knows about a run: the input of every analysis.

Built live from heartbeats, node reports and bundles, or offline from a run
dir's index and bundles. Analyses read a `RunState` and never change what it
holds about the job; they keep their own running summaries in `run.trackers`.

Every container here is bounded, whatever the run's length: a rank keeps a
window of recent step records (`step_window`, smaller for bigger jobs), its
recent collective marks, its recent events plus the first event of each kind,
and its last fingerprints. Everything that arrives is also queued on the run's
`feed`; the analyses drain that queue in step order into fixed-size running
summaries (see analyses/common.py), so a 100,000-step run costs what a
100-step run costs.
"""

from __future__ import annotations

import collections
import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from rankwatch import wire

from .evidence import RankEvidence

# Recent step records kept per rank: ~1 KiB each, so the window shrinks as the
# job grows (a fixed budget of records per run), never below MIN_STEP_WINDOW.
MAX_STEP_WINDOW = 256
MIN_STEP_WINDOW = 8
RECORDS_PER_RUN = 1_000_000
MARK_WINDOW = 32  # collective marks per rank (every 5th step: the last ~160 steps) ...
MIN_MARK_WINDOW = 4
MARKS_PER_RUN = 64_000  # ... fewer on big jobs: collective_mismatch compares every kept mark each pass
EVENT_WINDOW = 256  # recent events per rank, plus the first event of each kind
FINGERPRINT_WINDOW = 2  # a rank's latest fingerprints (the analyses keep their own summaries)
ACTIVITY_SAMPLES_KEPT = 600  # a stalled rank's activity samples (one a heartbeat: 10 minutes at 1 s)
DURATIONS_KEPT = 512  # recent step durations across ranks, for the adaptive hang timeout


def step_window(world_size: int) -> int:
    return max(MIN_STEP_WINDOW, min(MAX_STEP_WINDOW, RECORDS_PER_RUN // max(1, world_size)))


def mark_window(world_size: int) -> int:
    return max(MIN_MARK_WINDOW, min(MARK_WINDOW, MARKS_PER_RUN // max(1, world_size)))


class Feed:
    """What arrived since the analyses last looked: per kind ("step",
    "event", "mark", "fingerprint", and "nonfinite": the step records whose
    loss or gradients are not finite, also queued as "step"), (rank, item)
    in arrival order. Appended under the ingest lock, drained by the analysis
    thread without it (deque append/popleft are atomic). A queue per kind:
    settle takes a kind's items in batches (array operations, C-speed dict
    updates), not one by one, and no pass over every record looks for the
    rare non-finite one: ingest picked it already."""

    KINDS = ("step", "event", "mark", "fingerprint", "nonfinite")

    def __init__(self) -> None:
        self._queues: dict[str, collections.deque[tuple[int, Any]]] = {k: collections.deque() for k in self.KINDS}

    def put(self, kind: str, rank: int, item: Any) -> None:
        self._queues[kind].append((rank, item))

    def drain(self) -> dict[str, list[tuple[int, Any]]]:
        """Each kind's items, the step records first: an event, mark,
        fingerprint or non-finite record is put before its rank's later
        records (a non-finite one before itself as a "step"), so every one
        older than a drained record is drained with it."""
        return {kind: _drain(queue) for kind, queue in self._queues.items()}

    def __len__(self) -> int:
        return sum(map(len, self._queues.values()))


def _drain(queue: collections.deque) -> list:
    # As many items as are in now, each taken by popleft (safe beside ingest
    # threads appending), the calls made in C: a Python loop cost ~0.3 s a
    # 100,000-rank tick on a slow machine.
    return list(itertools.starmap(queue.popleft, itertools.repeat((), len(queue))))


NOTABLE_EVENTS = ("exception", "oom", "exit")  # what crash, oom and a rank leaving the loop read


class EvidenceMap(dict):
    """incident -> a rank's evidence; notes the rank on the run's `notable` set."""

    notable: Optional[set] = None
    rank = -1

    def __setitem__(self, incident, evidence) -> None:
        super().__setitem__(incident, evidence)
        if self.notable is not None:
            self.notable.add(self.rank)


class EventLog:
    """A rank's events: the recent ones and the first of each kind (crash,
    oom and the report's notes read those, however long the run)."""

    def __init__(self) -> None:
        self._items: list[wire.Event] = []
        self.first: dict[str, wire.Event] = {}
        self.rank = -1
        self.feed: Optional[Feed] = None
        self.notable: Optional[set] = None

    def append(self, event: wire.Event) -> None:
        self.first.setdefault(event.kind, event)
        if self.notable is not None and event.kind in NOTABLE_EVENTS:
            self.notable.add(self.rank)
        self._items.append(event)
        if len(self._items) > 2 * EVENT_WINDOW:
            firsts = {id(e) for e in self.first.values()}
            cut = len(self._items) - EVENT_WINDOW
            self._items[:] = [e for i, e in enumerate(self._items) if i >= cut or id(e) in firsts]
        if self.feed is not None:
            self.feed.put("event", self.rank, event)

    def extend(self, events) -> None:
        for event in events:
            self.append(event)

    def __iter__(self) -> Iterator[wire.Event]:
        return iter(list(self._items))

    def __reversed__(self) -> Iterator[wire.Event]:
        return iter(self._items[::-1])

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index):
        return self._items[index]

    def __delitem__(self, index) -> None:  # callers trimming it themselves: it is bounded already
        del self._items[index]


class FingerprintLog:
    """A rank's latest fingerprints; every one is also fed to the analyses.
    Parameter-name lists are shared across ranks and steps (`names` table)."""

    def __init__(self) -> None:
        self._items: collections.deque[dict[str, Any]] = collections.deque(maxlen=FINGERPRINT_WINDOW)
        self.rank = -1
        self.feed: Optional[Feed] = None
        self.names: Optional[dict[tuple, list]] = None
        self._shared: Optional[list] = None  # the last shared names list this log handed out

    def append(self, fingerprint: dict[str, Any]) -> None:
        if not isinstance(fingerprint, dict):
            return
        names = fingerprint.get("names")
        if names is self._shared:
            pass  # the rank's previous names (ingest fills them in): shared already, not re-keyed per print
        elif isinstance(names, (list, tuple)) and self.names is not None:
            key = tuple(str(n) for n in names)
            shared = self.names.get(key)
            if shared is None:
                shared = self.names[key] = list(key)  # one list for every rank and step (never mutated)
            fingerprint = {**fingerprint, "names": shared}
            self._shared = shared
        self._items.append(fingerprint)
        if self.feed is not None:
            self.feed.put("fingerprint", self.rank, fingerprint)

    def extend(self, fingerprints) -> None:
        for fingerprint in fingerprints:
            self.append(fingerprint)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index):
        return list(self._items)[index]

    def __delitem__(self, index) -> None:  # callers trimming it themselves: it is bounded already
        items = list(self._items)
        del items[index]
        self._items = collections.deque(items, maxlen=FINGERPRINT_WINDOW)


class MarkLog(collections.OrderedDict):
    """step -> {pg: last enqueued seq}: the most recent marks (`mark_window`)."""

    limit = MARK_WINDOW
    feed: Optional[Feed] = None  # collective_mismatch's tracker takes the marks from it
    rank = -1

    def __setitem__(self, step, seqs) -> None:
        super().__setitem__(step, seqs)
        if self.feed is not None:
            self.feed.put("mark", self.rank, (step, seqs))
        while len(self) > self.limit:
            self.popitem(last=False)

    def setdefault(self, step, seqs=None):
        if step not in self:
            self[step] = seqs
        return self[step]


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
    last_heartbeat_at: float = 0.0  # collector clock: when its latest heartbeat arrived
    # When the rank's heartbeat thread last beat (its own sent_at, put on the
    # collector's clock), and when its node last vouched for it (the relay's
    # report or the supervisor's view listing it alive; 0: never). Through a
    # relay a live rank's beats arrive up to one relay interval late: it is
    # silent only if its node reported without a fresh beat of it.
    beat_at: float = 0.0
    vouched_at: float = 0.0
    # collector clock - agent clock: the lowest (arrival - sent) seen, network
    # delay and a relay's hold included, the collector's own queue not (taken
    # to when the request arrived, not when ingest reached it)
    clock_offset: Optional[float] = None
    sent_at: float = 0.0  # agent clock: when its latest beat was sent
    beat_every: float = 0.0  # seconds between its beats, measured (0: not yet known)
    last_seq: int = 0  # newest heartbeat taken in (older ones arrive late, out of order)
    enqueued: dict[str, int] = field(default_factory=dict)
    completed: dict[str, int] = field(default_factory=dict)
    steps: "collections.OrderedDict[int, wire.StepRecord]" = field(default_factory=collections.OrderedDict)
    marks: MarkLog = field(default_factory=MarkLog)
    events: EventLog = field(default_factory=EventLog)
    fingerprints: FingerprintLog = field(default_factory=FingerprintLog)
    host_memory: dict[str, int] = field(default_factory=dict)  # last heartbeat's
    # (collector time, CPU s, file bytes, context switches) of the rank's process while it made
    # no progress (agent/core/activity.py); None until it first stalled.
    activity: Optional[collections.deque] = None
    exit_code: Optional[int] = None  # negative: signal (a property below: setting one notes the rank)
    exited_at: Optional[float] = None
    killed_by_rankwatch: bool = False
    evidence: EvidenceMap = field(default_factory=EvidenceMap)  # incident -> evidence
    last_record: Optional[wire.StepRecord] = None  # newest step record (metrics)
    nonfinite_steps: int = 0  # steps with NaN/Inf loss or local gradients, ever
    window: int = MAX_STEP_WINDOW
    feed: Optional[Feed] = field(default=None, repr=False, compare=False)
    # The run's set of ranks with an exception, an exit, an OOM or evidence:
    # what crash, oom and hang read instead of every rank (100,000 at scale).
    notable: Optional[set] = field(default=None, repr=False, compare=False)

    def attach(self, feed: Feed, names: dict[tuple, list], world_size: int, notable: Optional[set] = None) -> None:
        self.feed = feed
        self.marks.rank, self.marks.feed = self.rank, feed
        for step, seqs in self.marks.items():  # marks from before (a reloaded rank)
            feed.put("mark", self.rank, (step, seqs))
        if notable is not None:
            self.notable = self.events.notable = notable
            if not isinstance(self.evidence, EvidenceMap):
                self.evidence = EvidenceMap(self.evidence)
            self.evidence.notable, self.evidence.rank = notable, self.rank
            if self.evidence or self.exit_code is not None or any(k in self.events.first for k in NOTABLE_EVENTS):
                notable.add(self.rank)
        self.window = step_window(world_size)
        self.events.rank = self.fingerprints.rank = self.rank
        self.events.feed = self.fingerprints.feed = feed
        self.fingerprints.names = names
        self.marks.limit = mark_window(world_size)

    def add_step(self, record: wire.StepRecord) -> None:
        if record.step in self.steps:
            self.steps[record.step] = record
            return  # a re-sent record: the analyses saw it already
        older = len(self.steps) >= self.window and record.step < next(iter(self.steps))
        if not older:  # a late record older than the window (from a bundle) only goes to the analyses
            self.steps[record.step] = record
            while len(self.steps) > self.window:
                self.steps.popitem(last=False)
        if self.last_record is None or record.step >= self.last_record.step:
            self.last_record = record
        if record.nonfinite():
            self.nonfinite_steps += 1
            if self.feed is not None:  # put first: settle drains the records, then these (Feed.drain)
                self.feed.put("nonfinite", self.rank, record)
        if self.feed is not None:
            self.feed.put("step", self.rank, record)

    def add_event(self, event: wire.Event) -> None:
        self.events.append(event)

    def add_fingerprint(self, fingerprint: dict[str, Any]) -> None:
        self.fingerprints.append(fingerprint)

    def note_activity(self, at: float, cpu_s: float, io_bytes: int, wakeups: int = 0) -> None:
        if self.activity is None:
            self.activity = collections.deque(maxlen=ACTIVITY_SAMPLES_KEPT)
        self.activity.append((at, cpu_s, io_bytes, wakeups))

    def silent_for(self, at: float) -> float:
        """How long the rank's heartbeat thread had been silent at time `at`
        (collector clock), judged from what its node last reported."""
        last = self.beat_at or self.last_heartbeat_at
        if not last:
            return 0.0
        reference = min(at, self.vouched_at) if self.vouched_at else at
        return max(0.0, reference - last)

    def exception_event(self) -> Optional[wire.Event]:
        return self.events.first.get("exception")

    def first_event(self, kind: str) -> Optional[wire.Event]:
        return self.events.first.get(kind)


def _get_exit_code(self: RankState) -> Optional[int]:
    return self._exit_code


def _set_exit_code(self: RankState, code: Optional[int]) -> None:
    self._exit_code = code
    if code is not None:
        notable = getattr(self, "notable", None)
        if notable is not None:
            notable.add(self.rank)


# After the dataclass is built (its __init__ assigns through the property).
RankState.exit_code = property(_get_exit_code, _set_exit_code)  # type: ignore[assignment]


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
    # How something outside ended the job (a scheduler, a signal): the
    # launchers say so at the end; the first one told is kept.
    termination: Optional[wire.Termination] = None
    # When any rank last made progress, on the collector's clock: the agents'
    # own progress times (corrected by each rank's clock offset), never the
    # arrival time of a late heartbeat.
    last_progress_seen_at: float = field(default_factory=time.time)
    # When that latest progress arrived, on the collector's clock: long after
    # it was made when a backlog is being delivered (after an outage).
    last_progress_arrived_at: float = field(default_factory=time.time)
    orphan_evidence: list[RankEvidence] = field(default_factory=list)
    # When the collector last turned a report away unread (it sheds load while
    # behind: admission.py), on its clock; 0: never. A rank not heard from
    # since may be the collector's doing, not the rank's (analyses/hang.py).
    reports_refused_at: float = 0.0
    # Running summaries, kept up to date as records arrive (never a rescan).
    max_step: int = 0
    ranks_reported: int = 0
    checkpointing: set = field(default_factory=set)  # ranks in the checkpoint phase
    durations: collections.deque = field(default_factory=lambda: collections.deque(maxlen=DURATIONS_KEPT))
    typical_step_s: Optional[float] = None
    step_p99_s: Optional[float] = None  # p99 of the recent step durations (the hang timeout's base)
    feed: Feed = field(default_factory=Feed, repr=False, compare=False)
    names: dict[tuple, list] = field(default_factory=dict, repr=False, compare=False)  # shared name tables
    trackers: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # analyses' summaries
    notable: set = field(default_factory=set, repr=False, compare=False)  # see RankState.notable
    # Held while the analyses' summaries are brought up to date (analyses/common.settle),
    # which runs outside the collector's ingest lock.
    analysis_lock: Any = field(default_factory=threading.RLock, repr=False, compare=False)
    # True while the live collector's analyses read their summaries under its
    # ingest lock, right after it settled them outside the lock: their own
    # settle calls then leave what arrived since for its next pass (settling
    # there sealed 100,000-rank steps with every report waiting: up to 6.6 s).
    settle_deferred: bool = field(default=False, repr=False, compare=False)

    def rank(self, rank: int) -> RankState:
        state = self.ranks.get(rank)
        if state is None:
            state = RankState(rank=rank)
            state.attach(self.feed, self.names, max(self.world_size, rank + 1), self.notable)
            self.ranks[rank] = state
        return state

    def notable_ranks(self) -> list[RankState]:
        """Ranks with an exception, an exit (code or event), an OOM or evidence, in rank order."""
        return [self.ranks[r] for r in sorted(self.notable) if r in self.ranks]

    def evidence_for(self, incident: str) -> dict[int, RankEvidence]:
        return {s.rank: s.evidence[incident] for s in self.notable_ranks() if incident in s.evidence}

    def all_evidence(self) -> list[RankEvidence]:
        return [ev for s in self.notable_ranks() for ev in list(s.evidence.values())]

    def observe_heartbeat(self, state: RankState, hb: wire.Heartbeat, now: float, progressed: bool,
                          arrived_at: Optional[float] = None) -> bool:
        """Run-level summaries the hang watch reads each tick, updated in O(1)
        per heartbeat (call before the rank's state takes the heartbeat in).
        Progress is dated by the agent, when it happened, then put on the
        collector's clock with the rank's offset: a late heartbeat carrying old
        progress no longer resets the stall clock. Returns True for a stale
        heartbeat (older than one already taken in: its sequence numbers and
        phase must not overwrite the newer ones). `arrived_at`: when the
        request carrying it arrived (default `now`), so that time spent in
        the collector's own queue does not read as transit."""
        stale = (bool(hb.seq) and hb.seq < state.last_seq and hb.identity.attempt <= state.attempt
                 and hb.identity.pid == state.pid)  # a new process counts from 1 again
        if stale:
            return True
        sent = hb.sent_at or now
        if state.sent_at and sent > state.sent_at:
            # Agent clock, so exact: per beat when both carry a count (through a
            # relay only every k-th beat arrives), else the gap itself.
            beats = hb.seq - state.last_seq if hb.seq and state.last_seq and hb.seq > state.last_seq else 1
            state.beat_every = (sent - state.sent_at) / beats
        state.sent_at = max(state.sent_at, sent)
        if hb.seq:
            state.last_seq = hb.seq
        offset = (now if arrived_at is None else min(now, arrived_at)) - sent
        if state.clock_offset is None or offset < state.clock_offset:
            state.clock_offset = offset
        state.beat_at = max(state.beat_at, min(now, sent + state.clock_offset))
        if state.last_heartbeat_at == 0.0:
            self.ranks_reported += 1
        if hb.phase == "checkpoint":
            self.checkpointing.add(state.rank)
        else:
            self.checkpointing.discard(state.rank)
        self.max_step = max(self.max_step, hb.step)
        if progressed and hb.phase == "exited":
            # The last beat of a rank that finished: the steps it made since
            # its previous beat are progress (a stall that ended just before
            # the job did), dated by the agent; the exit itself is not.
            if (hb.step > state.step or hb.forwards > state.forwards) and 0 < hb.last_progress_at <= sent:
                self._progress(min(now, hb.last_progress_at + state.clock_offset), now)
        elif progressed:
            moved = hb.step > state.step or hb.forwards > state.forwards or hb.phase != state.phase
            # Step, forward or phase: the agent's own time. A collective alone
            # (or a new rank): by the time the heartbeat was built.
            at = hb.last_progress_at if moved and 0 < hb.last_progress_at <= sent else sent
            self._progress(min(now, at + state.clock_offset), now)
        return False

    def _progress(self, at: float, now: float) -> None:
        if at > self.last_progress_seen_at:
            self.last_progress_seen_at, self.last_progress_arrived_at = at, now

    def note_duration(self, record: wire.StepRecord) -> None:
        self.durations.append(max(0.0, record.ended_at - record.started_at))

    def step_durations(self) -> list[float]:
        """Recent step durations across ranks (for the adaptive hang timeout)."""
        return list(self.durations)

    def adaptive_timeout(self, startup: float, floor: float, multiplier: float, margin: float = 2.0) -> float:
        """How long a stall lasts before it is named: the user's
        --hang-timeout, else start-up's allowance before the first steps,
        else max(floor, multiplier x p99 step time + margin): a step slower
        than three times the slowest 1 % of this run's steps is not noise."""
        if self.hang_timeout is not None:
            return self.hang_timeout
        if self.max_step <= 1 and not any(s.step > 1 for s in list(self.ranks.values())[:64]):
            return startup  # the first step is start-up too
        p99 = self.step_p99_s
        if p99 is None:
            durations = self.step_durations()
            if not durations:
                return startup
            p99 = percentile(durations, 0.99)
        return max(floor, multiplier * p99 + margin)


def percentile(values, share: float) -> float:
    """The `share` quantile of `values` (nearest rank; values not empty)."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, int(math.ceil(share * len(ordered))) - 1))
    return ordered[index]
