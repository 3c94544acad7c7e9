"""`crash`: a rank exited abnormally. The culprit is the first failure that was
not caused by a peer's failure.

When one rank dies, its peers fail too ("Connection closed by peer", timeouts,
NCCL aborts) and torchrun then terminates the rest with SIGTERM; torchrun's
"Root Cause" is simply the earliest timestamp, which is often such a victim.
Here every failure is classified by its cause before ordering them.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import Optional

from rankwatch import wire

from ..state import RankState, RunState
from .common import iso, located, ranks_text, verdict, where

# Failures that are the consequence of a peer's failure (or of a collective
# mismatch, which collective_mismatch explains).
PEER_FAILURE = re.compile(
    r"connection closed by peer|connection reset by peer|broken pipe|ECONNRESET|EPIPE|"
    r"socket timeout|connection refused|read error|"
    r"communicator was aborted|remote process exited|network error|"
    r"NCCL.*(abort|remote)|ProcessGroupNCCL.*watchdog|peer .* (closed|died|exited)|"
    r"Unexpected end of stream|unbound buffer|Application timeout caused pair closure|"
    r"TCPStore|recvValue|recvBytes|sendBytes",
    re.IGNORECASE,
)
# A timeout is a peer's fault only inside the distributed runtime: a DataLoader
# or a user's own timeout is the rank's own failure.
TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
DISTRIBUTED = re.compile(r"gloo|nccl|c10d|ProcessGroup|torch/distributed|torch\.distributed|TCPStore|collective",
                         re.IGNORECASE)
COLLECTIVE_ERROR = re.compile(
    r"size doesn't match|size does not match|preamble|expected size|mismatch",
    re.IGNORECASE,
)
OUT_OF_MEMORY = re.compile(
    r"out of memory|can't allocate memory|cannot allocate memory|std::bad_alloc|OutOfMemoryError|MemoryError",
    re.IGNORECASE,
)
# Signals torchrun (or the user stopping the job) sends to tear workers down.
TEARDOWN_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}
SETTLE_SECONDS = 3.0  # peers' failures arrive within this window after the cause
SAME_CAUSE_WINDOW = 2.0  # independent failures this close together are all culprits
# A rank's exit time (its agent's or the supervisor's clock) and its peers'
# failure times are compared with this slack.
LEFT_SLACK_S = 2.0


@dataclass
class Failure:
    rank: int
    at: float
    cause: str  # exception type + message, or the signal
    kind: str  # "exception", "signal", "exit"
    peer_caused: bool
    collective_error: bool
    exit_code: Optional[int]
    step: Optional[int]
    traceback: str = ""
    phase: str = ""
    oom: bool = False
    unused_parameters: tuple = ()  # reported as `oom`, not `crash`


def failure_of(state: RankState) -> Optional[Failure]:
    exc = state.exception_event()
    if exc is not None:
        message = str(exc.details.get("message", ""))
        etype = str(exc.details.get("type", "Exception"))
        text = f"{etype}: {message}"
        at = exc.at
        if state.exited_at is not None:
            at = min(at, state.exited_at)
        return Failure(
            rank=state.rank, at=at, kind="exception",
            cause=one_line(text) if "Original Traceback" in text else text[:500],
            peer_caused=_peer_caused(text, str(exc.details.get("traceback", ""))),
            collective_error=_is_mismatch(text), exit_code=state.exit_code if state.exit_code is not None else 1,
            step=exc.step, traceback=str(exc.details.get("traceback", ""))[-3000:],
            phase=str(exc.details.get("phase", "")), oom=bool(OUT_OF_MEMORY.search(text)),
            unused_parameters=tuple(exc.details.get("unused_parameters") or ()),
        )
    code = state.exit_code
    if code is None or code == 0 or state.killed_by_rankwatch:
        return None
    at = state.exited_at or state.last_heartbeat_at
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return Failure(rank=state.rank, at=at, cause=f"killed by {name} (exit code {code})", kind="signal",
                       peer_caused=False, collective_error=False, exit_code=code, step=state.step,
                       phase=state.phase, oom=code == -signal.SIGKILL and host_memory_exhausted(state))
    return Failure(rank=state.rank, at=at, cause=f"exited with status {code} without a Python exception",
                   kind="exit", peer_caused=False, collective_error=False, exit_code=code, step=state.step,
                   phase=state.phase)


def host_memory_exhausted(state: RankState, margin: float = 0.05) -> bool:
    """A SIGKILL with the host (or the container) out of memory at the last
    report: the kernel's OOM killer, which leaves no other trace in the job."""
    mem = state.host_memory
    total, available = mem.get("MemTotal"), mem.get("MemAvailable")
    if total and available is not None and available < margin * total:
        return True
    limit, rss = mem.get("CgroupLimit"), mem.get("RSS")
    return bool(limit and rss and rss > (1 - margin) * limit)


def one_line(cause: str) -> str:
    """A cause fit for a one-line summary. An exception re-raised from a
    DataLoader worker (or any "Original Traceback") ends with the original
    error: that is the one to show."""
    lines = [line.strip() for line in cause.splitlines() if line.strip()]
    if not lines:
        return cause
    if len(lines) > 1 and any("Original Traceback" in line for line in lines):
        return f"{lines[-1][:300]} ({lines[0].split(':', 1)[-1].strip()[:120]})"
    return lines[0][:300]


def collective_timeout(failure: Failure) -> bool:
    """The failure is the collective timeout: the rank waited for peers
    (gloo's "Timed out waiting ... ms", NCCL's watchdog) until torch gave up."""
    return (failure.kind == "exception" and not failure.collective_error and bool(TIMEOUT.search(failure.cause))
            and bool(DISTRIBUTED.search(failure.cause + "\n" + failure.traceback[-2000:]))
            and not PEER_FAILURE.search(failure.cause))


def _peer_caused(text: str, traceback: str) -> bool:
    if _is_mismatch(text):
        return False
    if PEER_FAILURE.search(text):
        return True
    return bool(TIMEOUT.search(text)) and bool(DISTRIBUTED.search(text + "\n" + traceback[-2000:]))


def _is_mismatch(text: str) -> bool:
    return bool(COLLECTIVE_ERROR.search(text))


def failures(run: RunState) -> list[Failure]:
    out = [f for f in (failure_of(s) for s in run.notable_ranks()) if f is not None]
    out.sort(key=lambda f: f.at)
    if not out:
        return out
    # Teardown signals are torchrun (or the user) stopping the job: never the
    # cause while any other failure exists. torchrun's own failure times are
    # whole seconds, so "after" cannot be trusted to order them.
    def is_teardown(f: Failure) -> bool:
        return f.kind == "signal" and f.exit_code is not None and -f.exit_code in TEARDOWN_SIGNALS

    others = [f for f in out if not is_teardown(f)]
    # A rank that left cleanly before the teardown made the launcher stop the
    # rest (Ray Train ends the worker group when one worker's function
    # returns): the teardown follows from it (hang's left_the_loop names it).
    left = any(left_cleanly_before(run, [f]) for f in out if is_teardown(f))
    for failure in out:
        if is_teardown(failure) and (others or run.interrupted or run.aborted or failure is not out[0] or left):
            failure.peer_caused = True
    if run.interrupted:
        for failure in out:
            if failure.kind == "signal":
                failure.peer_caused = True
    return out


def detect(run: RunState, now: float, final: bool) -> list[wire.Verdict]:
    found = failures(run)
    if not found:
        return []
    first_at = found[0].at
    if not final and now - first_at < SETTLE_SECONDS:
        return []  # let the peers' failures arrive before naming a cause
    causes = [f for f in found if not f.peer_caused and not f.collective_error]
    if any(f.oom for f in causes):
        return []  # oom names the culprit
    if not causes:
        if any(f.collective_error or f.oom for f in found):
            return []  # collective_mismatch / oom name the culprit
        if run.aborted or run.interrupted:
            return []
        if left_cleanly_before(run, found):
            return []  # hang's left_the_loop names the rank that exited early
        causes = found[:1]  # every failure looks like a consequence: name the first
    first = causes[0]
    culprit_state = run.ranks[first.rank]
    seen_dead = any(ev.source == "supervisor" and ev.reason == "crash" for ev in culprit_state.evidence.values())
    if first.kind != "exception" and not seen_dead:
        # A killed rank could not report its last steps; its peers, in lockstep
        # with it, say which step the job was in when it died.
        peer_steps = [f.step for f in found if f is not first and f.kind == "exception" and f.step is not None]
        if peer_steps and (first.step is None or min(peer_steps) > first.step):
            first.step = min(peer_steps)
            first.phase = "unknown"
    culprits = [f for f in causes if f.at - first.at <= SAME_CAUSE_WINDOW]
    victims = [f for f in found if f not in culprits]
    summary = f"{ranks_text(f.rank for f in culprits).capitalize()} ({located(run, [first.rank])}) crashed first: {one_line(first.cause)}"
    if first.step is not None:
        summary += f" (step {first.step}" + (f", phase {first.phase})" if first.phase not in ("", "unknown") else ")")
    if first.unused_parameters:
        summary += (f"; parameters that never received a gradient: {', '.join(first.unused_parameters[:6])} "
                    f"(unused in forward: pass find_unused_parameters=True to DDP, or use them)")
    last_stack = next((ev.main_stack for ev in culprit_state.evidence.values() if ev.main_stack), [])
    if first.kind != "exception" and last_stack:
        summary += f"; its last Python stack: {where(last_stack)}"
    summary += "."
    if victims:
        summary += f" {len(victims)} other rank(s) failed as a consequence."
    evidence = {
        "failures": [
            {"rank": f.rank, "at": f.at, "cause": f.cause, "kind": f.kind, "exit_code": f.exit_code,
             "consequence": f.peer_caused, "step": f.step}
            for f in found
        ],
        "traceback": first.traceback,
        "hosts": {str(f.rank): run.ranks[f.rank].host for f in culprits[:64]},
        "unused_parameters": list(first.unused_parameters),
        # CONTRACT: what followed from the cause (the peers' failures).
        "consequences": [{"kind": "crash", "ranks": [f.rank], "step": f.step, "first_seen_at": iso(f.at),
                          "summary": f.cause[:500], "exit_code": f.exit_code} for f in victims],
    }
    return [verdict("crash", [f.rank for f in culprits], first.step, first.at, max(now, first.at), summary, evidence)]


def left_cleanly_before(run: RunState, found: list[Failure]) -> bool:
    """A rank exited 0 before these (all peer-caused) failures: its peers were
    still in a collective with it."""
    first = min(f.at for f in found)
    return any(s.exit_code == 0 and s.exited_at is not None and not s.killed_by_rankwatch
               and s.exited_at <= first + LEFT_SLACK_S for s in run.notable_ranks())
