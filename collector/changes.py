"""What ingest changed that the index must keep, recorded in memory.

The ingest path (`ingest.py`, called by `service.Collector`) only updates run
state and notes here what changed: a run's row, a rank's latest state, a
heartbeat's records/marks/fingerprints/events, a stored bundle. It never
touches SQLite. The store's writer thread takes everything noted so far at
each of its flushes (`Store.flush` included) and writes it, so a request never
waits on the index and the state logic can be tested without a database.

A rank's state and a run's row are noted by reference and written as they
are when the writer takes them (one row however many beats came between);
heartbeat data is noted per beat, in arrival order.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

from rankwatch import wire

from .state import RankState, RunState

log = logging.getLogger("rankwatch.collector")

MAX_BEATS = 262_144  # heartbeats noted and not yet taken (a writer stuck on a slow disk): the oldest half goes


class BeatData(NamedTuple):
    """What the index keeps of one heartbeat. Not the beat itself: a beat
    waits here up to a flush, long enough for Python's garbage collector to
    scan it twice, and its other parts (its object, dicts, empty lists) would
    only add to that: at 100,000 ranks ~10,000 beats a second."""

    run_id: str
    rank: int
    world_size: int
    steps: Sequence[wire.StepRecord]
    marks: Sequence[wire.CollectiveMark]
    events: Sequence[wire.Event]
    fingerprints: Sequence[dict[str, Any]]  # names filled in (ingest.with_names)


@dataclass
class Noted:
    """One batch of changes, as the writer takes it."""

    runs: dict[str, RunState] = field(default_factory=dict)
    ranks: dict[tuple[str, int], RankState] = field(default_factory=dict)
    beats: list[BeatData] = field(default_factory=list)
    # (run id, manifest, stored path, size, received at)
    bundles: list[tuple[str, wire.BundleManifest, str, int, float]] = field(default_factory=list)
    # (run id, rank, events) of beats dropped past MAX_BEATS: their events are kept
    events: list[tuple[str, int, list[wire.Event]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.runs or self.ranks or self.beats or self.bundles or self.events)


class Changes:
    """The journal between ingest and the store: noted under a small lock of
    its own (ingest holds the collector's; the writer never takes that one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._noted = Noted()
        self.beats_dropped = 0

    def run(self, run: RunState) -> None:
        with self._lock:
            self._noted.runs[run.run_id] = run

    def rank(self, run_id: str, state: RankState) -> None:
        with self._lock:
            self._noted.ranks[(run_id, state.rank)] = state

    def heartbeat(self, run_id: str, rank: int, hb: wire.Heartbeat, fingerprints: list[dict[str, Any]]) -> None:
        if not (hb.steps or hb.marks or fingerprints or hb.events):
            return  # nothing of a bare beat goes to the index but the rank's row
        with self._lock:
            beats = self._noted.beats
            # An empty list is left with its beat: () is shared and untracked.
            beats.append(BeatData(run_id, rank, hb.identity.world_size, hb.steps or (), hb.marks or (),
                                  hb.events or (), fingerprints or ()))
            if len(beats) > MAX_BEATS:
                # Memory over completeness: the live state has every record;
                # the index (a restart's, an offline analysis') misses the
                # oldest half's step records, marks and fingerprints. Their
                # events (an exception, an exit) are kept, as they always were.
                dropped = beats[: MAX_BEATS // 2]
                del beats[: MAX_BEATS // 2]
                self._noted.events += [(b.run_id, b.rank, b.events) for b in dropped if b.events]
                if not self.beats_dropped:
                    log.warning("the index writer is behind: the oldest %d heartbeats' records are not indexed "
                                "(live state has them; /v1/status index_beats_dropped counts them)", len(dropped))
                self.beats_dropped += len(dropped)

    def bundle(self, run_id: str, manifest: wire.BundleManifest, path: str, size: int, received_at: float) -> None:
        with self._lock:
            self._noted.bundles.append((run_id, manifest, path, size, received_at))

    def take(self) -> Noted:
        """Everything noted so far; the journal starts empty again."""
        with self._lock:
            noted, self._noted = self._noted, Noted()
        return noted
