"""A collector that is behind still answers (issue 29, item 2): reports are
admitted before their body is read; past the latency budget the rest get an
immediate 503 with Retry-After and the cadence, not a timeout each; what was
admitted is taken in once the collector catches up. Both servers, real
sockets on 127.0.0.1, a real Collector held up the way a long tick holds
it (its ingest lock). About 3 s per server."""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rankwatch.collector.admission import AdmissionConfig
from rankwatch.collector.server import SHED_BODY_GRACE_S, AsyncCollectorServer, CollectorServer
from rankwatch.collector.service import Collector
from rankwatch.config import Config

TOKEN = "t0ken"


def _report(node: int) -> bytes:
    beats = [{"version": 1, "identity": {"run_id": "busy", "rank": 8 * node + r, "local_rank": r,
                                         "world_size": 64, "host": f"n{node}"},
              "sent_at": time.time(), "seq": 1, "step": 1, "forwards": 1, "phase": "forward",
              "phase_since": time.time(), "last_progress_at": time.time()} for r in range(8)]
    return json.dumps({"version": 1, "sent_at": time.time(), "node": None, "heartbeats": beats}).encode()


def _post(port: int, body: bytes, timeout: float = 3.0) -> tuple[int, dict, dict, float]:
    started = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/node-report", body=body,
                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        response = conn.getresponse()
        payload = response.read()
        return response.status, dict(response.getheaders()), json.loads(payload or b"{}"), \
            time.monotonic() - started
    except OSError as exc:  # a timeout: what a backlog did to every sender before
        return 0, {}, {"error": repr(exc)}, time.monotonic() - started
    finally:
        conn.close()


@pytest.mark.parametrize("kind", ["aiohttp", "stdlib"])
def test_a_collector_behind_answers_at_once_with_retry_after_and_takes_in_what_it_admitted(tmp_path, kind):
    collector = Collector(Config(hang_timeout=30.0), data_dir=tmp_path)
    budget = AdmissionConfig(latency_budget_s=0.3)
    if kind == "aiohttp":
        server = AsyncCollectorServer(collector, token=TOKEN, admission=budget).start()
    else:
        server = CollectorServer(collector, token=TOKEN, admission=budget).start()
    port = int(server.url.rsplit(":", 1)[1])
    try:
        assert _post(port, _report(0))[0] == 200  # a warm collector
        with ThreadPoolExecutor(max_workers=24) as pool:
            collector._lock.acquire()  # a long tick: nothing can be taken in
            try:
                early = [pool.submit(_post, port, _report(n), 10.0) for n in range(1, 3)]  # admitted, waiting
                deadline = time.monotonic() + 10.0
                while server.admission.inflight < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert server.admission.inflight >= 2
                time.sleep(budget.latency_budget_s)  # the admitted ones are now older than the budget
                late = [pool.submit(_post, port, _report(n)) for n in range(3, 23)]
                answers = [f.result() for f in late]
            finally:
                collector._lock.release()
            admitted = [f.result() for f in early]
        for status, headers, payload, took in answers:
            assert status == 503, (status, payload)  # not a timeout
            assert took < 3.0, took  # answered, not held until a timeout (twenty clients share two cores)
            assert int(headers["Retry-After"]) >= 1 and payload["interval"] >= 1
        assert [a[0] for a in admitted] == [200, 200]  # what was admitted was taken in
        run = collector.runs["busy"]
        assert set(run.ranks) == set(range(24))
        # The hang watch is told that reports were turned away: their ranks'
        # silence since is the collector's doing (analyses/hang.py).
        assert 0 < time.time() - collector.refused_at < 30
        collector.tick(time.time())
        assert run.reports_refused_at == collector.refused_at
        assert _post(port, _report(7))[0] == 200  # caught up: admitted again
    finally:
        server.stop()
        collector.stop()


@pytest.mark.parametrize("kind", ["aiohttp", "stdlib"])
def test_a_reports_wait_for_ingest_is_not_taken_for_transit(tmp_path, kind):
    """A rank's clock offset is the lowest (arrival - sent) of its reports.
    Taken when ingest reached the report, a node whose reports all waited
    behind a long tick got an offset that much too big, and the hang watch
    read its beats as later than they were (a beat from before the stall as
    one from during it)."""
    collector = Collector(Config(hang_timeout=30.0), data_dir=tmp_path)
    if kind == "aiohttp":
        server = AsyncCollectorServer(collector, token=TOKEN, admission=AdmissionConfig(latency_budget_s=5.0)).start()
    else:
        server = CollectorServer(collector, token=TOKEN, admission=AdmissionConfig(latency_budget_s=5.0)).start()
    port = int(server.url.rsplit(":", 1)[1])
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            collector._lock.acquire()  # a long tick
            try:
                first = pool.submit(_post, port, _report(0), 10.0)  # in ingest, waiting for the lock
                deadline = time.monotonic() + 5.0
                while server.admission.inflight < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                sent = time.time()
                queued = pool.submit(_post, port, _report(1), 10.0)  # behind it, in the ingest queue
                while server.admission.inflight < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                held_until = time.time() + 1.0
                while time.time() < held_until:  # both wait a second more
                    time.sleep(0.05)
            finally:
                collector._lock.release()
            answers = [first.result(), queued.result()]
        assert [a[0] for a in answers] == [200, 200], answers
        ranks = collector.runs["busy"].ranks
        waited = held_until - sent
        offsets = [ranks[r].clock_offset for r in range(8, 16)]
        assert all(o is not None and o < waited - 0.5 for o in offsets), (offsets, waited)
    finally:
        server.stop()
        collector.stop()


def test_a_connection_kept_after_a_shed_report_is_not_cut_off_while_idle(tmp_path):
    """A shed report whose body was in, or came just after its headers, keeps
    its connection; the request's deadline ends with it, so the sweeper does not cut the idle
    connection off a request timeout later (the relay's next report on it
    would fail as a broken connection)."""
    collector = Collector(Config(hang_timeout=30.0), data_dir=tmp_path)
    server = AsyncCollectorServer(collector, token=TOKEN, request_timeout=1.0,
                                  admission=AdmissionConfig(latency_budget_s=0.2)).start()
    port = int(server.url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10.0)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            collector._lock.acquire()  # behind: the first report is admitted and waits, the next is shed
            try:
                admitted = pool.submit(_post, port, _report(1), 10.0)
                deadline = time.monotonic() + 5.0
                while server.admission.inflight < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.3)  # older than the latency budget
                body = _report(2)
                conn.putrequest("POST", "/v1/node-report")
                for name, value in {**headers, "Content-Length": str(len(body))}.items():
                    conn.putheader(name, value)
                conn.endheaders()  # the headers alone: the server sheds before the body comes
                time.sleep(SHED_BODY_GRACE_S / 5)  # a body that comes a little later (http.client writes it apart anyway)
                conn.send(body)
                shed = conn.getresponse()
                shed.read()
                assert shed.status == 503
                assert shed.getheader("Connection", "").lower() != "close"
            finally:
                collector._lock.release()
            assert admitted.result()[0] == 200
        cut_before = server.cut_off
        deadline = time.monotonic() + 2.5  # idle past the request timeout and a sweep or two
        while time.monotonic() < deadline:
            time.sleep(0.1)
        conn.request("POST", "/v1/node-report", body=_report(3), headers=headers)
        again = conn.getresponse()
        again.read()
        assert again.status == 200 and server.cut_off == cut_before
    finally:
        conn.close()
        server.stop()
        collector.stop()


def test_the_budget_counts_the_servers_wait_but_not_a_slow_upload():
    """A report the server reached only past the budget (its loop was busy)
    is answered at once; a report whose body is in ages against the budget;
    a report whose body is still arriving (one slow relay, or a hostile
    connection) does not make every other report shed."""
    from rankwatch.collector.admission import Admission

    refused = []
    admission = Admission(AdmissionConfig(latency_budget_s=0.3), on_shed=lambda: refused.append(1))
    assert admission.enter(arrived=time.monotonic() - 1.0) is None  # reached past the budget
    slow = admission.enter(arrived=time.monotonic())
    assert slow is not None  # its body trickles in
    began = time.monotonic()
    deadline = began + 5.0
    while time.monotonic() - began < 0.5 and time.monotonic() < deadline:
        time.sleep(0.01)
    quick = admission.enter()
    assert quick is not None  # the slow upload is its sender's wait
    admission.ready(quick)
    began = time.monotonic()
    while time.monotonic() - began < 0.5 and time.monotonic() < deadline + 1.0:
        time.sleep(0.01)
    assert admission.enter() is None  # `quick` waits past the budget: behind
    assert len(refused) == 2
    admission.leave(quick, 0.001)
    assert admission.enter() is not None  # caught up
    admission.leave(slow, None)
    assert admission.inflight == 1


def test_a_free_collector_takes_reports_in_on_the_loop_and_a_held_one_off_it(tmp_path):
    """The aiohttp server takes a report in on its event loop while the
    collector is free (no hand-over to the ingest thread and back), and on
    the ingest thread while a tick holds the collector, so the loop keeps
    answering."""
    collector = Collector(Config(hang_timeout=30.0), data_dir=tmp_path)
    server = AsyncCollectorServer(collector, token=TOKEN, admission=AdmissionConfig(latency_budget_s=5.0)).start()
    port = int(server.url.rsplit(":", 1)[1])
    try:
        assert _post(port, _report(0))[0] == 200
        assert _post(port, _report(1))[0] == 200
        assert not server._ingest._threads  # never needed
        with ThreadPoolExecutor(max_workers=1) as pool:
            collector._lock.acquire()  # a long tick
            try:
                waiting = pool.submit(_post, port, _report(2), 10.0)
                deadline = time.monotonic() + 5.0
                while server.admission.inflight < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert server.admission.inflight == 1 and not waiting.done()
                assert _get_health(port) == 200  # the loop still answers
            finally:
                collector._lock.release()
            assert waiting.result()[0] == 200
        assert server._ingest._threads  # the held report waited there
        assert set(collector.runs["busy"].ranks) == set(range(24))
    finally:
        server.stop()
        collector.stop()


def _get_health(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3.0)
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().status
    finally:
        conn.close()


def test_a_late_report_of_a_run_that_left_memory_never_holds_the_loop(tmp_path):
    """A run that left memory is read back from the index when a late
    report of it comes; while the index writer holds the index (seconds
    during a big job's flush), that report waits on the ingest thread, not
    on the event loop, which keeps answering."""
    collector = Collector(Config(hang_timeout=30.0), data_dir=tmp_path)
    server = AsyncCollectorServer(collector, token=TOKEN, admission=AdmissionConfig(latency_budget_s=5.0)).start()
    port = int(server.url.rsplit(":", 1)[1])
    try:
        assert _post(port, _report(0))[0] == 200
        collector.store.flush()
        with collector._lock:  # the run leaves memory, as a finished one does (service._evict_finished)
            del collector.runs["busy"]
            collector._index_only.add("busy")
        with ThreadPoolExecutor(max_workers=1) as pool:
            collector.store._lock.acquire()  # the writer's flush
            try:
                late = pool.submit(_post, port, _report(1), 10.0)
                deadline = time.monotonic() + 5.0
                while not server._ingest._threads and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert server._ingest._threads and not late.done()  # waiting off the loop
                assert _get_health(port) == 200
            finally:
                collector.store._lock.release()
            assert late.result()[0] == 200
        run = collector.runs["busy"]
        assert set(range(16)) <= set(run.ranks)  # read back, then the late report taken in
    finally:
        server.stop()
        collector.stop()


def test_a_nested_no_waiting_block_leaves_the_outer_ones_rule():
    """Ingest in a `without_waiting` block raises MustWait rather than wait
    for the index; a block nested in one (a helper that uses it too) must
    not lift the outer block's rule when it ends."""
    from rankwatch.collector.service import _no_waiting, without_waiting

    with without_waiting():
        with without_waiting():
            assert _no_waiting.on
        assert _no_waiting.on  # still the outer block's rule
    assert not _no_waiting.on
