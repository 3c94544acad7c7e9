"""Ingest as state: what one heartbeat or one node's view does to a run.

Pure functions of the run's state and the message: they update `RunState` /
`RankState` in memory and note in `Changes` what the index must keep. No
SQLite, no file, no lock (the caller, `service.Collector`, holds its own), so
they are tested with a bare `RunState` and a `Changes`.

The message was validated (and redacted) before it gets here; a check that
can refuse it (a rank outside the world) is the caller's, before any change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from rankwatch import wire

from .changes import Changes
from .state import RankState, RunState

URGENT_EVENTS = ("exception", "nonfinite")  # the analyses look at once, not at their next pass


@dataclass(frozen=True)
class Effect:
    """What the caller does next: whether the analyses have something new to
    read (``touched``), and whether it cannot wait for their next pass."""

    touched: bool = False
    urgent: bool = False


def heartbeat(run: RunState, hb: wire.Heartbeat, now: float, changes: Changes,
              arrived_at: Optional[float] = None) -> Effect:
    """One rank's heartbeat into its run (`arrived_at`: when its request
    arrived, for the rank's clock offset; default `now`)."""
    ident = hb.identity
    state = run.rank(ident.rank)
    new_rank = state.last_heartbeat_at == 0.0
    progressed = (
        new_rank
        or hb.step > state.step
        or hb.forwards > state.forwards
        or hb.phase != state.phase
        or any(v > state.enqueued.get(pg, -1) for pg, v in hb.collectives_enqueued.items())
    )
    stale = run.observe_heartbeat(state, hb, now, progressed, arrived_at)  # stall clock: the agents' progress times
    if ident.attempt > state.attempt:  # torchrun restarted the workers: a fresh rank
        state.exit_code, state.exited_at, state.killed_by_rankwatch = None, None, False
    state.local_rank, state.node_rank, state.host = ident.local_rank, ident.node_rank, ident.host
    state.pid, state.world_size, state.attempt = ident.pid, ident.world_size, ident.attempt
    state.step, state.forwards = max(state.step, hb.step), max(state.forwards, hb.forwards)
    if not stale:  # a late, older heartbeat does not take the newer phase and sequence numbers back
        state.phase, state.phase_since = hb.phase, hb.phase_since
    state.last_progress_at = max(state.last_progress_at, hb.last_progress_at)
    state.last_heartbeat_at = now
    if not stale:
        state.enqueued.update(hb.collectives_enqueued)
        state.completed.update(hb.collectives_completed)
    for record in hb.steps:
        state.add_step(record)
    for mark in hb.marks:
        state.marks[mark.step] = mark.seqs
    for event in hb.events:
        if event.kind == "step_values":
            _fill_step_values(state, event)
            continue
        state.events.append(event)
        if event.kind == "exit" and state.exit_code is None:
            code = event.details.get("exit_code")
            if isinstance(code, int):
                state.exit_code, state.exited_at = code, event.at
    if hb.host_memory:
        state.host_memory = dict(hb.host_memory)
    if hb.busy_cpu_s is not None and hb.io_bytes is not None:
        state.note_activity(now, hb.busy_cpu_s, hb.io_bytes, hb.wakeups or 0)
    fingerprints = with_names(hb.fingerprints, state.fingerprints) if hb.fingerprints else []
    state.fingerprints.extend(fingerprints)
    changes.heartbeat(run.run_id, ident.rank, hb, fingerprints)
    changes.rank(run.run_id, state)
    if hb.steps or hb.events or hb.marks or hb.fingerprints:
        return Effect(touched=True, urgent=any(e.kind in URGENT_EVENTS for e in hb.events))
    return Effect()


def node(run: RunState, view: wire.NodeHeartbeat, key: str, now: float, killed_by_rankwatch: bool,
         changes: Changes, arrived_at: Optional[float] = None) -> Effect:
    """A node's supervisor view (its launcher's settings, its workers alive or
    exited) into the run. ``killed_by_rankwatch``: an exit seen now follows an
    abort the collector sent. ``arrived_at``: when its request arrived; the
    node vouches for its live ranks as of then, the time their beats in the
    same report are measured against (a wait in the collector's queue is
    neither the ranks' silence nor transit)."""
    vouched = now if arrived_at is None else min(now, arrived_at)
    run.nodes[key] = view
    if view.hang_timeout is not None:
        run.hang_timeout = view.hang_timeout
    run.on_hang = view.on_hang
    for worker in view.workers:
        state = run.rank(worker.rank)
        state.local_rank, state.node_rank = worker.local_rank, view.node_rank
        if worker.alive:
            state.vouched_at = max(state.vouched_at, vouched)
        if not state.host:
            state.host = view.host
        if state.pid == 0:
            state.pid = worker.pid
        if not worker.alive and worker.exit_code is not None and state.exit_code is None:
            state.exit_code = worker.exit_code
            state.exited_at = worker.exited_at or now
            state.killed_by_rankwatch = killed_by_rankwatch
            changes.rank(run.run_id, state)
    changes.run(run)
    return Effect(touched=any(not w.alive for w in view.workers))


def _fill_step_values(state: RankState, event: wire.Event) -> None:
    """A step read late on a GPU (no sync): its values fill the step's record."""
    record = state.steps.get(event.step)
    for name in ("grad_norm", "loss"):
        value = wire.number(event.details.get(name))  # non-finite values travel as strings
        if record is not None and value is not None and getattr(record, name) is None:
            setattr(record, name, value)
    fp = event.details.get("batch_fp")  # the input batch's fingerprint, read as late
    if record is not None and record.batch_fp is None and type(fp) is int and 0 <= fp <= wire.MAX_COUNT:
        record.batch_fp = fp


def with_names(fingerprints: list[dict[str, Any]], known) -> list[dict[str, Any]]:
    """Agents send a fingerprint's parameter names only when they change: the
    others take the last names of their model on this rank (a job may
    fingerprint two models, a GAN's generator and discriminator; none known
    yet: the print is dropped)."""
    last: dict[int, Any] = {}
    for fp in known:
        if "names" in fp:
            last[wire.fingerprint_model(fp)] = fp["names"]
    out = []
    for fp in fingerprints:
        names, model = fp.get("names"), wire.fingerprint_model(fp)
        if isinstance(names, (list, tuple)):
            last[model] = names
        elif last.get(model) is not None:
            fp = {**fp, "names": last[model]}
        else:
            continue
        out.append(fp)
    return out
