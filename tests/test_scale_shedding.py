"""A collector that is behind still answers (issue 29, item 2): reports are
admitted before their body is read; past the latency budget the rest get an
immediate 503 with Retry-After and the cadence, not a timeout each; what was
admitted is taken in once the collector catches up. Both servers, real
sockets on 127.0.0.1, a real Collector held up the way a long tick holds
it (its ingest lock). About 3 s per server."""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rankwatch import wire
from rankwatch.collector.admission import AdmissionConfig
from rankwatch.collector.server import AsyncCollectorServer, CollectorServer
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
                early = [pool.submit(_post, port, _report(n)) for n in range(1, 3)]  # admitted, waiting
                deadline = time.monotonic() + 2.0
                while server.admission.inflight < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(budget.latency_budget_s)  # the admitted ones are now older than the budget
                late = [pool.submit(_post, port, _report(n)) for n in range(3, 23)]
                answers = [f.result() for f in late]
            finally:
                collector._lock.release()
            admitted = [f.result() for f in early]
        for status, headers, payload, took in answers:
            assert status == 503, (status, payload)  # not a timeout
            assert took < 1.5, took
            assert int(headers["Retry-After"]) >= 1 and payload["interval"] >= 1
        assert [a[0] for a in admitted] == [200, 200]  # what was admitted was taken in
        run = collector.runs["busy"]
        assert set(run.ranks) == set(range(24))
        assert _post(port, _report(7))[0] == 200  # caught up: admitted again
    finally:
        server.stop()
        collector.stop()
