"""The per-node relay: one batched report per node per interval.

Runs in the launcher (`rankwatch run --collector URL`). The node's agents
beat to it on loopback (kept-alive connections, the same `/v1/heartbeat`
they would send the collector); the supervisor hands it the node's view in
process. Every interval it sends the collector one `NodeReport` (the node
view and every rank's heartbeats since the last report, merged per rank) and
hands the `NodeReply`'s commands back: the node's to the supervisor, each
rank's in that rank's next heartbeat reply.

At 12,500 nodes this makes 8x fewer requests and connections at the
collector, and a node keeps its ranks' recent data while the collector is
slow or away (bounded per rank; re-sent merged when it is back). The
collector may ask for a slower cadence at scale (`NodeReply.interval`);
progress is dated by the agents, so the hang deadline does not move with it.

Urgent news (an exception, an exit, a non-finite value, a dead worker) is sent
at once, not at the next interval.

A job's relays all start at the same moment, so nothing they do may come in
step (issue 29): the first cadence is the collector's rule for the job's
world size (the launcher knows it), not 1 s; the first report leaves at a
random offset within that interval, and each next one in the relay's
phase, an interval after the last one left (`until_next_slot`: not after
its answer, or relays that a stalled collector answered together would
leave together from then on); a failure, a timeout or a busy answer
(429/503, whose `Retry-After` is a floor) backs off exponentially with
jitter up to a few cadences (`rankwatch.cadence.backoff_cap`: 6 cadences, at most
MAX_BACKOFF_S), reset by a success; and the report kept for the
collector is bounded by bytes (MAX_PENDING_BYTES): past it the oldest
records, marks, events and fingerprints of every rank are dropped, the
newest state is kept, and what was dropped is counted (`rows_dropped`, and
each rank's `steps_skipped`). So a relay's memory and upload stay bounded
through any outage.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import random
import threading
import time
from typing import Any, Callable, Optional

from rankwatch import wire
from rankwatch.cadence import backoff_cap, node_report_interval

log = logging.getLogger("rankwatch.node.relay")

MAX_ROWS_PER_RANK = 512  # step rows held per rank between reports (the newest kept)
MAX_ITEMS_PER_RANK = 256  # marks, events held per rank
MAX_FINGERPRINTS_PER_RANK = 4
URGENT_EVENTS = ("exception", "exit", "nonfinite", "oom")
NORM_HISTORY = 16  # a rank's recent gradient norms, to tell an unusual one at a sampled cadence
NORM_JUMP = 3.0  # a norm this many times the rank's recent median is forwarded whatever its step
MAX_PENDING_BYTES = 2 * 1024 * 1024  # a node's kept report: 1/8 of the collector's node-report limit
MAX_PERIODIC_KEYS = 4096  # (kind, rank, model)s whose previous mark or fingerprint step a relay keeps
_TRIMMED_LISTS = ("step_rows", "steps", "marks", "events", "fingerprints")


class StepSampler:
    """At scale the collector asks for every `stride`-th step record
    (`NodeReply.step_stride`). The relay forwards those (the same steps on
    every rank, so the cross-rank analyses compare like with like) and every
    record that is unusual on its own rank: a non-finite loss or gradient, or
    a gradient norm NORM_JUMP times its recent median. A few comparisons per
    record; the node's other records stay out of the collector.

    A rank's collective marks and weight fingerprints come every few steps
    (the agent's `collective_mark_every`, `fingerprint_every`): the relay
    forwards every `stride`-th of each, the same ones on every rank whatever
    that period (`_periodic`), and every fingerprint with a non-finite norm.
    What they show lasts: a mark counts the collectives since the start, so
    an extra or missing one shows at every later mark, and replicas' weights
    that drifted apart stay apart; a coarser stride names them later, not
    less. Parameter names, sent only when they change, ride on the rank's next
    forwarded fingerprint when theirs is left out."""

    def __init__(self) -> None:
        self.stride = 1
        self._norms: dict[int, collections.deque] = {}
        self._last_step: dict[tuple, int] = {}  # (kind, rank, model) -> the step of its previous mark or print
        # (rank, model) -> names of a fingerprint left out, for that model's next forwarded one
        self._names: dict[tuple[int, int], Any] = {}

    def sample(self, rank: int, beat: dict[str, Any]) -> dict[str, Any]:
        beat = self._sample_rows(rank, beat)
        for key in ("marks", "fingerprints"):
            items = beat.get(key)
            if items and isinstance(items, list):
                kept, changed = self._periodic(key, rank, items)
                if changed:
                    beat = {**beat, key: kept}
        return beat

    def _periodic(self, kind: str, rank: int, items: list) -> tuple[list, bool]:
        """(the items kept, whether any was left out or changed) Every
        `stride`-th: the item of step S is kept when (S // gap) %
        stride == 0, gap being the steps since the rank's previous one (each
        model's own, for fingerprints). Every rank has them at the same
        steps, so every relay keeps the same ones. A rank's first, one out of
        order, a malformed one (the collector judges it) and a fingerprint
        of a moment of its own (``"at": "start"``, which tells replicas) are
        kept. The previous steps are counted at every stride (1 included), so
        a new stride applies alike on every relay."""
        kept = []
        changed = False
        prints = kind == "fingerprints"
        for item in items:
            step = item.get("step") if isinstance(item, dict) else None
            if type(step) is not int or (prints and item.get("at") is not None):
                kept.append(item)
                continue
            model = wire.fingerprint_model(item) if prints else 0
            key = (kind, rank, model)
            previous = self._last_step.get(key)
            if previous is None and len(self._last_step) >= MAX_PERIODIC_KEYS:
                self._last_step.clear()  # a sender inventing models: forget, never grow
            self._last_step[key] = step
            gap = step - previous if previous is not None else 0
            wanted = self.stride <= 1 or gap <= 0 or (step // gap) % self.stride == 0
            if not prints:
                if wanted:
                    kept.append(item)
                else:
                    changed = True
                continue
            if not wanted and _finite_norms(item):
                changed = True
                if isinstance(item.get("names"), list):
                    if len(self._names) >= MAX_PERIODIC_KEYS and (rank, model) not in self._names:
                        self._names.clear()  # as _last_step: bounded whatever a sender invents
                    self._names[(rank, model)] = item["names"]
                continue
            names = self._names.pop((rank, model), None)
            if names is not None and "names" not in item:
                item = {**item, "names": names}
                changed = True
            kept.append(item)
        return kept, changed

    def _sample_rows(self, rank: int, beat: dict[str, Any]) -> dict[str, Any]:
        rows, columns = beat.get("step_rows"), beat.get("step_columns")
        if not rows or not isinstance(columns, list):
            return beat
        try:
            at = {name: columns.index(name) for name in ("step", "loss", "grad_norm", "nonfinite_grads")
                  if name in columns}
        except ValueError:
            return beat
        if "step" not in at:
            return beat
        norms = self._norms.get(rank)
        if norms is None:
            norms = self._norms[rank] = collections.deque(maxlen=NORM_HISTORY)
        kept = []
        for row in rows:
            if self.stride <= 1 or self._wanted(row, at, norms):
                kept.append(row)
            norm = row[at["grad_norm"]] if "grad_norm" in at else None
            if isinstance(norm, (int, float)) and math.isfinite(norm):
                norms.append(float(norm))
        if len(kept) == len(rows):
            return beat
        return {**beat, "step_rows": kept}

    def _wanted(self, row: list, at: dict[str, int], norms: collections.deque) -> bool:
        step = row[at["step"]]
        if not isinstance(step, int) or step % self.stride == 0:
            return True
        if "nonfinite_grads" in at and row[at["nonfinite_grads"]]:
            return True
        for name in ("loss", "grad_norm"):
            value = row[at[name]] if name in at else None
            if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value)):
                return True  # "NaN", "Infinity" travel as strings
        norm = row[at["grad_norm"]] if "grad_norm" in at else None
        if isinstance(norm, (int, float)) and len(norms) >= NORM_HISTORY // 2:
            ordered = sorted(norms)
            if norm > NORM_JUMP * ordered[len(ordered) // 2]:
                return True
        return False


def _finite_norms(fingerprint: dict[str, Any]) -> bool:
    """Every norm a finite number ("NaN", "Infinity" travel as strings)."""
    norms = fingerprint.get("norms")
    return not isinstance(norms, list) or wire.all_finite(norms)


def merge_beats(old: Optional[dict[str, Any]], new: dict[str, Any]) -> dict[str, Any]:
    """Two heartbeats of one rank as one: the newer one's state, both ones'
    records (bounded). Counters a delta beat left out keep the older value."""
    if old is None:
        return new
    merged = dict(new)
    for key in ("collectives_enqueued", "collectives_completed", "host_memory"):
        if key not in new and key in old:
            merged[key] = old[key]
    old_rows, new_rows = old.get("step_rows") or [], new.get("step_rows") or []
    if old_rows:
        if not new_rows:
            merged["step_columns"], merged["step_rows"] = old.get("step_columns"), old_rows
        elif old.get("step_columns") == new.get("step_columns"):
            rows = old_rows + new_rows
            merged["step_rows"] = rows[-MAX_ROWS_PER_RANK:]
            merged["steps_skipped"] = int(merged.get("steps_skipped") or 0) + max(0, len(rows) - MAX_ROWS_PER_RANK)
    if old.get("steps_skipped"):
        merged["steps_skipped"] = int(merged.get("steps_skipped") or 0) + int(old["steps_skipped"])
    for key, bound in (("steps", MAX_ROWS_PER_RANK), ("marks", MAX_ITEMS_PER_RANK), ("events", MAX_ITEMS_PER_RANK),
                       ("fingerprints", MAX_FINGERPRINTS_PER_RANK)):
        if old.get(key):
            items = list(old[key]) + list(new.get(key) or [])
            merged[key] = items[-bound:]
    return merged


def until_next_slot(interval: float, since_sent: float) -> float:
    """Seconds from now to a relay's next report while the collector answers:
    an interval after the last one left (``since_sent`` seconds ago), or,
    when its answer took an interval or more, the next such slot (those
    missed are skipped). Counted from the answer instead, relays that a
    stalled collector answered together would leave together from then on,
    every cadence; this way each keeps the phase it started with."""
    return interval - since_sent % interval


def initial_interval(base: float, world_size: int, hang_timeout: Optional[float]) -> float:
    """The cadence before the collector's first answer: the collector's own
    rule for this world size (`node_report_interval`), so a cold start of a
    big job is not a burst at the 1-s heartbeat cadence."""
    wanted = node_report_interval(world_size, hang_timeout or 20.0) if world_size > 0 else None
    return max(base, wanted or 0.0)


def trim_pending(pending: dict[int, dict[str, Any]], size: Callable[[], int], limit: int) -> int:
    """Drop the oldest half of every rank's lists until ``size()`` fits in
    ``limit`` (or nothing is left to drop); the beats' state fields stay.
    Returns the number of items dropped; each rank's dropped step records
    are added to its `steps_skipped`, which the collector counts."""
    dropped = 0
    while size() > limit:
        dropped_now = 0
        for beat in pending.values():
            for key in _TRIMMED_LISTS:
                items = beat.get(key)
                if not items:
                    continue
                if key == "events":  # an exception, an exit, a non-finite value: never dropped
                    urgent = [isinstance(e, dict) and e.get("kind") in URGENT_EVENTS for e in items]
                    cut = (urgent.count(False) + 1) // 2
                    seen, kept = 0, []
                    for event, keep in zip(items, urgent):
                        if not keep:
                            seen += 1
                            if seen <= cut:
                                continue
                        kept.append(event)
                    beat[key] = kept
                else:
                    cut = (len(items) + 1) // 2
                    beat[key] = items[cut:]
                dropped_now += cut
                if key in ("step_rows", "steps"):
                    beat["steps_skipped"] = int(beat.get("steps_skipped") or 0) + cut
        if not dropped_now:
            break
        dropped += dropped_now
    return dropped


class Relay:
    def __init__(self, upstream_post: Callable[..., Any], run_id: str, token: Optional[str] = None,
                 interval: float = 1.0, host: str = "127.0.0.1", port: int = 0, world_size: int = 0,
                 hang_timeout: Optional[float] = None, max_pending_bytes: int = MAX_PENDING_BYTES,
                 rng: Optional[random.Random] = None):
        from rankwatch.collector.server import CollectorServer

        self.upstream_post = upstream_post  # (path, body, content type, timeout=) -> decoded JSON; raises on failure
        self.run_id = run_id
        self.interval = initial_interval(interval, world_size, hang_timeout)
        self._base_interval = interval
        self.max_pending_bytes = max_pending_bytes
        self._rng = rng or random.Random()
        self._retry_after: Optional[float] = None  # what a busy collector last asked for
        self.rows_dropped = 0  # records, marks, events, fingerprints dropped to the byte bound
        self.largest_upload = 0  # bytes of the largest report sent or tried
        self._lock = threading.Lock()
        self._pending: dict[int, dict[str, Any]] = {}  # rank -> merged heartbeat (raw JSON)
        self._node: Optional[dict[str, Any]] = None
        self._node_sent_dead: set[int] = set()
        self._rank_commands: dict[int, list[dict[str, Any]]] = {}
        self._node_commands: list[dict[str, Any]] = []
        self._verdicts: list[str] = []  # the collector's verdict lines, for the launcher to print
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._send_lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._failures = 0
        self._warned = False
        self.reports_sent = 0
        self.sampler = StepSampler()
        self.server = CollectorServer(None, host=host, port=port, token=token,  # type: ignore[arg-type]
                                      routes=_RelayRoutes(self, token), max_connections=1024)

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> "Relay":
        self.server.start()
        self._thread = threading.Thread(target=self._loop, name="rankwatch-relay", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Last report (the supervisor's final view included), then close."""
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=10)
        self.flush(timeout=10.0)
        self.server.stop()

    # -- from the agents (HTTP threads) ----------------------------------------------
    def heartbeat(self, body: bytes) -> tuple[int, dict[str, Any]]:
        data = wire.parse_json(body, "Heartbeat") if hasattr(wire, "parse_json") else json.loads(body)
        identity = data.get("identity") if isinstance(data, dict) else None
        rank = identity.get("rank") if isinstance(identity, dict) else None
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < wire.MAX_LIST_ITEMS * 100:
            return 400, {"error": "Heartbeat.identity.rank: expected a rank"}
        if identity.get("run_id") != self.run_id:
            return 400, {"error": f"Heartbeat.identity.run_id: this relay serves run {self.run_id!r}"}
        try:  # only valid beats are batched: one bad rank must never block its whole node's report
            wire.step_records(wire.decode(wire.Heartbeat, data))
        except wire.WireError as exc:
            return 400, {"error": str(exc)}
        urgent = any(isinstance(e, dict) and e.get("kind") in URGENT_EVENTS for e in data.get("events") or [])
        with self._lock:
            data = self.sampler.sample(rank, data)
            self._pending[rank] = merge_beats(self._pending.get(rank), data)
            commands = self._rank_commands.pop(rank, [])
        if urgent:
            self._wake.set()
        return 200, {"commands": commands, "version": wire.WIRE_VERSION}

    # -- from the supervisor (in process) -------------------------------------------------
    def supervisor_post(self, path: str, body: bytes, content_type: str = "application/json",
                        timeout: float = 5.0) -> Any:
        if path != "/v1/nodes":
            return self.upstream_post(path, body, content_type, timeout=timeout)
        node = json.loads(body)
        dead = {w.get("rank") for w in node.get("workers") or [] if not w.get("alive", True)}
        with self._lock:
            self._node = node
            commands, self._node_commands = self._node_commands, []
            verdicts = list(self._verdicts)
            news = bool(dead - self._node_sent_dead) or node.get("finished")
        if news:
            self._wake.set()
        return {"commands": commands, "version": wire.WIRE_VERSION, "verdicts": verdicts}

    # -- to the collector ---------------------------------------------------------------------
    def next_wait(self, first: bool = False, since_sent: Optional[float] = None) -> float:
        """Seconds until the next report: a random offset within the interval
        for the first (relays that start together spread over it), while the
        collector answers the next slot of the relay's phase (an interval
        after the last report left, ``since_sent`` seconds ago:
        `until_next_slot`), and after failures an exponential backoff with
        jitter (a busy collector's Retry-After, or at least the interval, as
        its floor) from now."""
        if first:
            return self.interval * self._rng.random()
        if not self._failures:
            return self.interval if since_sent is None else until_next_slot(self.interval, since_sent)
        from rankwatch.agent.core.transport import backoff_delay

        delay = backoff_delay(self._failures, self.interval, backoff_cap(self.interval), self._rng)
        if self._retry_after is not None:
            delay = max(delay, self._retry_after * (1.0 + 0.5 * self._rng.random()))
        return delay

    def _loop(self) -> None:
        first = True
        sent_at: Optional[float] = None
        while not self._stop.is_set():
            wait = self.next_wait(first, None if sent_at is None else time.monotonic() - sent_at)
            if self._failures:
                # Backing off: urgent news waits too (the collector is away or
                # busy); it is in the kept report and leaves with the next try.
                self._stop.wait(wait)
            else:
                self._wake.wait(wait)
            self._wake.clear()
            first = False
            if self._stop.is_set():
                return
            sent_at = time.monotonic()
            try:
                self.flush()
            except Exception as exc:  # the relay must survive anything
                log.warning("relay error: %s: %s", type(exc).__name__, exc)

    def flush(self, timeout: float = 5.0) -> bool:
        with self._send_lock:
            with self._lock:
                pending, self._pending = self._pending, {}
                node = self._node
                dead = {w.get("rank") for w in (node or {}).get("workers") or [] if not w.get("alive", True)}
            if not pending and node is None:
                return True
            body = self._encode(node, pending)
            self.largest_upload = max(self.largest_upload, len(body))
            try:
                raw = self.upstream_post("/v1/node-report", body, "application/json", timeout=timeout)
            except Exception as exc:
                with self._lock:  # keep it for the next report, merged under what came since
                    for rank, beat in pending.items():
                        self._pending[rank] = merge_beats(beat, self._pending[rank]) if rank in self._pending \
                            else beat
                    # The kept report stays within the byte bound however long the outage.
                    self._encode(node, self._pending)
                retry_after = getattr(exc, "retry_after", None)
                self._retry_after = retry_after if isinstance(retry_after, (int, float)) else None
                self._failures += 1
                if not self._warned:
                    self._warned = True
                    log.warning("collector unreachable from the node relay (%s); keeping the node's data", exc)
                return False
            self._failures = 0
            self._retry_after = None
            self.reports_sent += 1
            with self._lock:
                self._node_sent_dead |= dead
            self._take_reply(raw)
            return True

    def _encode(self, node: Optional[dict[str, Any]], pending: dict[int, dict[str, Any]]) -> bytes:
        """The node report, within the byte bound (the oldest rows dropped, counted)."""
        def body() -> bytes:
            report = {"version": wire.WIRE_VERSION, "sent_at": time.time(), "node": node,
                      "heartbeats": list(pending.values())}
            return wire.json_text(report, compact=True).encode()  # strict JSON

        data = body()
        if len(data) > self.max_pending_bytes:
            self.rows_dropped += trim_pending(pending, lambda: len(body()), self.max_pending_bytes)
            data = body()
        return data

    def _take_reply(self, raw: Any) -> None:
        if not isinstance(raw, dict):
            return
        try:
            reply = wire.decode(wire.NodeReply, raw)
        except wire.WireError as exc:
            log.warning("ignoring a malformed reply from the collector: %s", exc)
            return
        with self._lock:
            self._node_commands.extend(wire.to_dict(c) for c in reply.commands)
            self._verdicts = list(reply.verdicts)
            for rank, commands in reply.ranks.items():
                try:
                    key = int(rank)
                except ValueError:
                    continue
                self._rank_commands.setdefault(key, []).extend(wire.to_dict(c) for c in commands)
        interval = getattr(reply, "interval", None)
        if isinstance(interval, (int, float)) and 0.2 <= interval <= 60:
            self.interval = max(self._base_interval, float(interval))
        else:  # the collector's word wins over the start-up guess: no cadence asked, the base one
            self.interval = self._base_interval
        stride = getattr(reply, "step_stride", None)
        self.sampler.stride = stride if isinstance(stride, int) and stride >= 1 else 1


class _RelayRoutes:
    """The relay's endpoints for the node's agents (token checked)."""

    def __init__(self, relay: Relay, token: Optional[str]):
        from rankwatch.collector.server import Routes

        self.relay = relay
        self._auth = Routes(None, token)  # type: ignore[arg-type]

    def precheck(self, method: str, path: str, authorization: Optional[str], length: Optional[str],
                 cookie: Optional[str] = None):
        return self._auth.precheck(method, path, authorization, length)  # no pages here: a cookie opens nothing

    def handle(self, method: str, path: str, body: bytes, header: Callable[[str], Optional[str]],
               arrived_at: Optional[float] = None):
        # `arrived_at` is the collector's business (its clock offsets): the
        # relay forwards each beat as its agent sent it.
        from rankwatch.collector.server import _json

        try:
            if method == "GET" and path == "/healthz":
                return _json(200, {"ok": True})
            if method == "POST" and path == "/v1/heartbeat":
                status, payload = self.relay.heartbeat(body)
                return _json(status, payload)
            if method == "POST" and path == "/v1/bundles":
                headers = {k: v for k in ("X-Rankwatch-Run", "X-Rankwatch-Rank", "X-Rankwatch-Incident")
                           if (v := header(k))}
                try:
                    raw = self.relay.upstream_post(path, body, "application/gzip", timeout=30.0, headers=headers)
                except Exception as exc:
                    return _json(502, {"error": f"collector unreachable: {exc}"})
                return _json(200, raw)
            return _json(404, {"error": f"no route {path}"})
        except wire.WireError as exc:
            return _json(400, {"error": str(exc)})
        except ValueError as exc:
            return _json(400, {"error": f"not valid JSON ({exc})"})

