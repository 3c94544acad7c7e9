"""The collector's HTTP front faces the network: bad requests get a clear
4xx, nothing is lost, and the service keeps serving."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from rankwatch import wire
from rankwatch.bundles import pack
from rankwatch.collector import Collector, CollectorServer
from rankwatch.config import Config


@pytest.fixture
def server(tmp_path):
    collector = Collector(config=Config(), data_dir=tmp_path)
    srv = CollectorServer(collector, host="127.0.0.1", port=0, token="t0ken").start()
    yield srv
    srv.stop()
    collector.stop()


def _post(url, path, body: bytes, token="t0ken", content_type="application/json", headers=None):
    req = urllib.request.Request(url + path, data=body, method="POST")
    req.add_header("Content-Type", content_type)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _hb(rank=0, step=1):
    return wire.Heartbeat(identity=wire.RankIdentity(run_id="job", rank=rank, local_rank=rank, world_size=2),
                          sent_at=time.time(), step=step)


def test_valid_heartbeat_is_accepted(server):
    status, body = _post(server.url, "/v1/heartbeat", wire.dumps(_hb()))
    assert status == 200 and body["commands"] == []
    assert server.collector.runs["job"].ranks[0].step == 1


def test_bad_requests_get_clear_errors_and_the_service_survives(server):
    assert _post(server.url, "/v1/heartbeat", wire.dumps(_hb()), token=None)[0] == 401
    assert _post(server.url, "/v1/heartbeat", wire.dumps(_hb()), token="wrong")[0] == 401
    status, body = _post(server.url, "/v1/heartbeat", b'{"identity": 5}')
    assert status == 400 and "identity" in body["error"]
    status, body = _post(server.url, "/v1/bundles", b"garbage", content_type="application/gzip")
    assert status == 400 and "bundle rejected" in body["error"]
    bad_run = wire.BundleManifest(run_id="../../etc", rank=0, local_rank=0, world_size=1, host="h", pid=1,
                                  step=0, created_at=time.time(), reason="hang", incident="i1")
    status, body = _post(server.url, "/v1/bundles", pack(bad_run, {}), content_type="application/gzip")
    assert status == 400 and "run_id" in body["error"] and "../../etc" in body["error"]
    bad_incident = wire.BundleManifest(run_id="job", rank=0, local_rank=0, world_size=1, host="h", pid=1,
                                       step=0, created_at=time.time(), reason="hang", incident="../x")
    status, body = _post(server.url, "/v1/bundles", pack(bad_incident, {}), content_type="application/gzip")
    assert status == 400 and "incident" in body["error"] and "../x" in body["error"]
    # An oversized body is refused from its Content-Length, before it is read.
    req = urllib.request.Request(server.url + "/v1/heartbeat", data=b"x", method="POST")
    req.add_header("Authorization", "Bearer t0ken")
    req.add_header("Content-Length", str(wire.MAX_MESSAGE_BYTES + 1))
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=5)
    assert err.value.code == 413
    # Still serving, and nothing earlier was lost.
    assert _post(server.url, "/v1/heartbeat", wire.dumps(_hb(rank=1, step=2)))[0] == 200
    with urllib.request.urlopen(server.url + "/healthz", timeout=5) as r:
        assert json.loads(r.read()) == {"ok": True}
    assert server.collector.bundles_rejected == 3


def test_bundle_is_stored_inside_the_run_dir(server, tmp_path):
    manifest = wire.BundleManifest(run_id="job", rank=1, local_rank=1, world_size=2, host="h", pid=1, step=0,
                                   created_at=time.time(), reason="request", incident="req-1")
    status, body = _post(server.url, "/v1/bundles", pack(manifest, {"stacks.json": []}),
                         content_type="application/gzip")
    assert status == 200
    stored = body["stored"]
    assert stored.startswith(str(tmp_path)) and stored.endswith("rank-00001.tar.gz")
