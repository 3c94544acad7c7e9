"""A job's relays start together; nothing they do may come in step
(issue 29, item 1): the first cadence is the collector's for the job's size,
the first report leaves at a random offset, failures back off exponentially
with jitter (a busy collector's Retry-After as a floor), and the report kept
through an outage is bounded by bytes, the newest state kept and what was
dropped counted. Unit-level (no job): about five seconds in all (one
relay's loop runs against a slow collector)."""

from __future__ import annotations

import json
import random
import threading
import time

from rankwatch import wire
from rankwatch.agent.core.transport import CollectorUnreachable, Transport
from rankwatch.node.relay import Relay, until_next_slot

COLUMNS = list(wire.STEP_COLUMNS)


def _row(step: int) -> list:
    return [step, 1000.0 + step, 1001.0 + step, 1, 0.8, 0.01, 2.0, 1.5, 0, 1, 1 << 30, None, None, None, None, None,
            None]


def _beat(rank: int, first: int, count: int, events: tuple = ()) -> bytes:
    rows = [_row(s) for s in range(first, first + count)]
    beat = {"version": 1, "identity": {"run_id": "big", "rank": rank, "local_rank": rank % 8, "world_size": 100_000},
            "sent_at": 1000.0, "seq": first,
            "step": first + count - 1, "step_columns": COLUMNS, "step_rows": rows,
            "marks": [{"step": s, "seqs": {"0": 3 * s}} for s in range(first, first + count)],
            "events": [{"kind": k, "at": 1000.0, "step": first, "details": {}} for k in events]}
    return json.dumps(beat).encode()


class _Upstream:
    """The collector as the relay sees it: away (raises), busy (503 with
    Retry-After) or answering; every body it was handed is kept."""

    def __init__(self) -> None:
        self.mode = "down"
        self.bodies: list[bytes] = []

    def __call__(self, path, body, content_type, timeout=5.0, headers=None):
        self.bodies.append(body)
        if self.mode == "down":
            raise CollectorUnreachable("connection refused")
        if self.mode == "busy":
            raise CollectorUnreachable("HTTP 503: behind", status=503, retry_after=30.0)
        return {"commands": [], "version": wire.WIRE_VERSION, "interval": 2.0}  # a collector at 8,000 ranks


def _relay(upstream, **kwargs) -> Relay:
    relay = Relay(upstream, "big", **kwargs)
    relay.server.httpd.server_close()  # never started: its endpoints are called directly
    return relay


def test_a_big_jobs_relay_starts_at_the_collectors_cadence_for_its_size():
    assert _relay(_Upstream(), world_size=100_000).interval == 10.0  # not the 1-s heartbeat cadence
    assert _relay(_Upstream(), world_size=8_000).interval == 2.0
    assert _relay(_Upstream(), world_size=100_000, hang_timeout=6.0).interval == 3.0  # half the hang timeout
    assert _relay(_Upstream(), world_size=16).interval == 1.0
    assert _relay(_Upstream()).interval == 1.0  # size unknown: the heartbeat cadence
    guessed = _relay(_Upstream(), world_size=100_000)
    guessed._take_reply({"commands": [], "version": wire.WIRE_VERSION})  # the collector asks for none
    assert guessed.interval == 1.0


def test_relays_started_together_send_their_first_reports_spread_over_the_interval():
    firsts = [_relay(_Upstream(), world_size=100_000, rng=random.Random(seed)).next_wait(first=True)
              for seed in range(40)]
    assert all(0.0 <= f < 10.0 for f in firsts)
    assert min(firsts) < 2.0 and max(firsts) > 8.0  # spread over the interval, not one instant
    assert len({round(f, 3) for f in firsts}) == len(firsts)


def test_failures_back_off_exponentially_with_jitter_and_a_success_resets():
    upstream = _Upstream()
    relay = _relay(upstream, world_size=8_000, rng=random.Random(1))  # interval 2 s
    assert relay.heartbeat(_beat(0, 100, 4))[0] == 200
    waits = []
    for _ in range(8):
        assert relay.flush() is False
        waits.append(relay.next_wait())
    for failures, wait in enumerate(waits, start=1):
        ceiling = min(12.0, 2.0 * 2 ** (failures - 1))
        assert 0.5 * ceiling <= wait <= ceiling, (failures, wait)
    assert waits[-1] >= 6.0  # capped at six cadences (12 s at this size), jittered
    # A 100,000-rank job (10-s cadence): capped at a minute.
    big = _relay(_Upstream(), world_size=100_000, rng=random.Random(4))
    big.heartbeat(_beat(0, 100, 4))
    for _ in range(8):
        assert big.flush() is False
    assert 30.0 <= big.next_wait() <= 60.0
    # Two relays failing together do not retry together.
    other = _relay(_Upstream(), world_size=8_000, rng=random.Random(2))
    other.heartbeat(_beat(0, 100, 4))
    other.flush()
    other.flush()
    other_wait = other.next_wait()
    relay_two = _relay(_Upstream(), world_size=8_000, rng=random.Random(3))
    relay_two.heartbeat(_beat(0, 100, 4))
    relay_two.flush()
    relay_two.flush()
    assert other_wait != relay_two.next_wait()
    # A busy collector's Retry-After is a floor.
    upstream.mode = "busy"
    assert relay.flush() is False
    assert relay.next_wait() >= 30.0
    # It answers again: the cadence is back, and the kept data went with the report.
    upstream.mode = "up"
    assert relay.flush() is True
    assert relay.next_wait() == 2.0
    sent = json.loads(upstream.bodies[-1])
    assert [r[0] for r in sent["heartbeats"][0]["step_rows"]] == [100, 101, 102, 103]


class _SlowUpstream:
    """A collector that answers every report after ``delay`` seconds; the
    moments the reports left are kept."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.sent_at: list[float] = []

    def __call__(self, path, body, content_type, timeout=5.0, headers=None):
        self.sent_at.append(time.monotonic())
        time.sleep(self.delay)  # the collector's answer time (not a synchronisation)
        return {"commands": [], "version": wire.WIRE_VERSION}


def test_a_relay_keeps_its_cadence_however_long_the_collector_takes_to_answer():
    """The interval counts from when a report left, not from its answer: a
    relay waiting an interval after each answer drifts by every answer's time,
    and relays that a stalled collector answered together would leave together
    from then on, a burst every cadence (seen at 100,000 ranks)."""
    upstream = _SlowUpstream(delay=0.6)
    relay = _relay(upstream, rng=random.Random(5))  # interval 1 s
    assert relay.interval == 1.0
    relay.heartbeat(_beat(0, 100, 4))
    loop = threading.Thread(target=relay._loop, daemon=True)
    loop.start()
    deadline = time.monotonic() + 20
    while len(upstream.sent_at) < 5 and time.monotonic() < deadline:
        relay.heartbeat(_beat(0, 104 + len(upstream.sent_at), 1))  # something to send every time
        time.sleep(0.05)
    relay._stop.set()
    relay._wake.set()
    loop.join(timeout=10)
    assert not loop.is_alive()
    assert len(upstream.sent_at) >= 5, upstream.sent_at
    gaps = [b - a for a, b in zip(upstream.sent_at, upstream.sent_at[1:])][:4]
    assert all(0.9 <= gap < 1.35 for gap in gaps), gaps  # an interval apart, not interval + 0.6 s
    # An answer that took an interval or more: the next slot of the phase, the missed ones skipped.
    assert until_next_slot(1.0, 0.6) == 0.4
    assert abs(until_next_slot(1.0, 1.5) - 0.5) < 1e-9 and abs(until_next_slot(10.0, 25.0) - 5.0) < 1e-9
    assert until_next_slot(2.0, 4.0) == 2.0


def test_the_report_kept_through_an_outage_is_bounded_by_bytes_newest_state_kept():
    """An 8-rank node through a long outage: every try's upload and the kept
    report stay within the bound; the newest steps and state are kept, the
    oldest records dropped and counted; an exception is never dropped."""
    bound = 64 * 1024
    upstream = _Upstream()
    relay = _relay(upstream, world_size=100_000, max_pending_bytes=bound)
    step = 0
    for attempt in range(30):
        for rank in range(8):
            status, _ = relay.heartbeat(_beat(rank, step, 16, events=("exception",) if attempt == 0 and rank == 3 else ()))
            assert status == 200
        step += 16
        assert relay.flush() is False
        kept = relay._encode(relay._node, relay._pending)
        assert len(kept) <= bound, len(kept)
    assert max(len(b) for b in upstream.bodies) <= bound
    assert relay.rows_dropped > 0
    upstream.mode = "up"
    assert relay.flush() is True
    report = wire.decode(wire.NodeReport, json.loads(upstream.bodies[-1]))
    assert len(upstream.bodies[-1]) <= bound
    beats = {hb.identity.rank: hb for hb in report.heartbeats}
    assert sorted(beats) == list(range(8))
    for hb in beats.values():
        rows = hb.step_rows
        assert hb.step == step - 1  # the newest state
        assert rows[-1][0] == step - 1 and rows[0][0] > 0  # the newest records, the oldest dropped ...
        assert hb.steps_skipped == step - len(rows)  # ... and counted
    assert [e.kind for e in beats[3].events] == ["exception"]


def test_the_agents_own_backoff_is_jittered_and_takes_retry_after(monkeypatch):
    """Agents that beat to a collector directly (the embedded one) back off
    the same way: jittered, a Retry-After as a floor."""
    import time

    transport = Transport("http://127.0.0.1:9", token=None)
    delays = []
    for _ in range(20):
        transport._failures = 0
        before = time.monotonic()
        transport._failed("down")
        delays.append(transport._next_try - before)
    assert all(0.5 <= d <= 1.05 for d in delays) and len({round(d, 4) for d in delays}) > 1
    transport._failed("busy", retry_after=20.0)
    assert transport._next_try - time.monotonic() >= 19.5


def test_the_relay_keeps_the_cadence_rules_without_loading_the_collector():
    """The relay runs beside the training on every node: its cadence and
    backoff rules come from `rankwatch.cadence`, shared with the collector,
    not from the collector's service module (numpy and the analyses)."""
    import subprocess
    import sys

    code = ("import sys; from rankwatch.node.relay import initial_interval, Relay; "
            "assert initial_interval(1.0, 100_000, 30.0) == 10.0; "
            "print(sorted(m for m in sys.modules if m.startswith('rankwatch.collector') or m == 'numpy'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
