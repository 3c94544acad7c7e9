"""Observability: a real Prometheus server scraping a real multi-rank run,
promtool on the alert rules, the dashboards, Grafana provisioning, the plot
and TensorBoard export."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import ROOT, free_port, run_job, wait_until, worker_env
from rankwatch.collector.metrics import METRICS

RULES = ROOT / "deploy" / "prometheus"
DASHBOARDS = ROOT / "dashboards"
needs_prometheus = pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                                      reason="Debian's prometheus package (installed by .ci/run) is missing")


@needs_prometheus
def test_prometheus_scrapes_per_rank_series_and_the_straggler_stands_out(tmp_path, train_script):
    metrics_port = free_port()
    prom_port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: rankwatch\n    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n")
    prom = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{prom_port}/api/v1"
    try:
        wait_until(lambda: _get(f"http://127.0.0.1:{prom_port}/-/ready") is not None, 30, what="prometheus")
        job = run_job(tmp_path, ["--nproc-per-node", "2", str(train_script), "--steps", "90", "--fault", "slow",
                                 "--fault-rank", "1", "--fault-step", "0", "--fault-size", "150"],
                      env={"RANKWATCH_METRICS_PORT": str(metrics_port)})
        assert job.exit_code == 0, job.output[-2000:]
        run_id = job.report["run_id"]

        def query(expr):
            data = _get(f"{api}/query?" + urllib.parse.urlencode({"query": expr}))
            return json.loads(data)["data"]["result"] if data else []

        compute = wait_until(lambda: query(f'max_over_time(rankwatch_compute_seconds{{run="{run_id}"}}[5m])'),
                             20, what="per-rank series in Prometheus")
        assert sorted(r["metric"]["rank"] for r in compute) == ["0", "1"]
        assert {r["metric"]["local_rank"] for r in compute} == {"0", "1"} and all(r["metric"]["node"] for r in compute)
        scores = {r["metric"]["rank"]: float(r["value"][1])
                  for r in query(f'max_over_time(rankwatch_straggler_score{{run="{run_id}"}}[5m])')}
        assert scores["1"] > 1.33 > scores["0"], scores
        verdicts = query(f'max_over_time(rankwatch_suspect_rank{{run="{run_id}", kind="straggler"}}[5m])')
        assert [r["metric"]["rank"] for r in verdicts] == ["1"]
        steps = query(f'max_over_time(rankwatch_step{{run="{run_id}"}}[5m])')
        assert all(float(r["value"][1]) > 10 for r in steps)
    finally:
        prom.terminate()
        prom.wait(timeout=20)


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.read()
    except OSError:
        return None


@needs_prometheus
def test_alert_rules_check_and_unit_tests():
    check = subprocess.run(["promtool", "check", "rules", str(RULES / "rankwatch-rules.yml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run(["promtool", "test", "rules", "rankwatch-rules.test.yml"], cwd=RULES,
                          capture_output=True, text=True)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    rules = (RULES / "rankwatch-rules.yml").read_text()
    for alert in ("RankwatchJobHung", "RankwatchNonFiniteGradients", "RankwatchStraggler",
                  "RankwatchMemoryGrowth", "RankwatchCollectorDown"):
        assert f"alert: {alert}" in rules


def _dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in DASHBOARDS.glob("*.json")}


def _panels(board: dict) -> list[dict]:
    out = []
    for panel in board.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def test_dashboards_are_generated_by_the_sdk_and_current():
    out = subprocess.run([sys.executable, str(DASHBOARDS / "build.py"), "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert set(_dashboards()) == {"overview.json", "ranks.json", "collector.json"}


def test_dashboards_structure_queries_and_verdict_coverage():
    known = set(METRICS)
    covered = set()
    for name, board in _dashboards().items():
        assert board["uid"].startswith("rankwatch-") and board["title"]
        variables = {v["name"] for v in board["templating"]["list"]}
        assert {"datasource", "run"} <= variables, name
        if name == "ranks.json":
            assert "rank" in variables
            assert sum(p["type"] == "heatmap" for p in _panels(board)) >= 6
        for panel in _panels(board):
            if panel.get("type") == "row":
                continue
            assert panel.get("targets"), f"{name}: panel {panel.get('title')} has no query"
            for target in panel["targets"]:
                for metric in re.findall(r"rankwatch_[a-z_]+", target["expr"]):
                    base = re.sub(r"_(bucket|sum|count)$", "", metric)
                    assert metric in known or base in known, f"{name}: {metric} is not exported"
                covered.update(re.findall(r'kind="([a-z_]+)"', target["expr"]))
            covered.update(k for k in ("hang", "collective_mismatch", "crash", "nonfinite", "grad_spike",
                                       "weight_divergence", "straggler", "oom", "memory_growth")
                           if k in (panel.get("description") or ""))
        if name != "collector.json":
            assert any(a.get("name") == "rankwatch verdicts" for a in board["annotations"]["list"])
    assert covered >= {"hang", "collective_mismatch", "crash", "nonfinite", "grad_spike", "weight_divergence",
                       "straggler", "oom", "memory_growth"}


class _FakeGrafana(BaseHTTPRequestHandler):
    """Grafana's HTTP API as far as grafana-client uses it (no Grafana server
    can run here): records every request for the test to check."""

    requests: list = []

    def log_message(self, *args):
        pass

    def _reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.requests.append(("GET", self.path, None, self.headers.get("Authorization")))
        if self.path.startswith("/api/datasources/name/"):
            self._reply(404, {"message": "Data source not found"})
        else:
            self._reply(404, {"message": "not found"})

    def do_POST(self):
        length = int(self.headers.get("Content-Length", 0))
        body = json.loads(self.rfile.read(length) or b"{}")
        self.requests.append(("POST", self.path, body, self.headers.get("Authorization")))
        self._reply(200, {"id": 1, "uid": body.get("dashboard", {}).get("uid", "x"), "status": "success"})


@pytest.fixture
def fake_grafana():
    _FakeGrafana.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeGrafana)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _FakeGrafana.requests
    server.shutdown()


def test_grafana_push_uploads_dashboards_and_datasource(fake_grafana):
    url, requests = fake_grafana
    out = subprocess.run([sys.executable, "-m", "rankwatch.cli", "grafana", "push", "--url", url, "--token", "glsa_x",
                          "--prometheus-url", "http://prometheus:9090"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    posts = [(p, b) for m, p, b, _ in requests if m == "POST"]
    boards = [b for p, b in posts if p == "/api/dashboards/db"]
    assert sorted(b["dashboard"]["uid"] for b in boards) == ["rankwatch-collector", "rankwatch-overview",
                                                             "rankwatch-ranks"]
    assert all(b["overwrite"] is True for b in boards)
    datasource = [b for p, b in posts if p == "/api/datasources"]
    assert datasource and datasource[0]["type"] == "prometheus" and datasource[0]["url"] == "http://prometheus:9090"
    assert all(auth == "Bearer glsa_x" for _, _, _, auth in requests)


def test_collector_annotates_grafana_for_each_verdict(fake_grafana, tmp_path, train_script):
    url, requests = fake_grafana
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(train_script), "--steps", "20", "--fault", "crash",
                             "--fault-rank", "1", "--fault-step", "3"],
                  env={"RANKWATCH_GRAFANA_URL": url, "RANKWATCH_GRAFANA_TOKEN": "glsa_y"})
    assert job.only("crash")["ranks"] == [1]
    annotations = wait_until(lambda: [b for m, p, b, _ in list(requests) if p == "/api/annotations"], 10,
                             what="annotation")
    assert annotations[0]["tags"] == ["rankwatch", "crash", job.report["run_id"]]
    assert "rank(s) 1" in annotations[0]["text"] and isinstance(annotations[0]["time"], int)
    assert "glsa_y" not in job.output, "the token never lands in a log"


def test_plot_and_tensorboard_of_a_straggler_run(tmp_path, train_script):
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(train_script), "--steps", "100", "--fault", "slow",
                             "--fault-rank", "1", "--fault-step", "5", "--fault-size", "60"])
    png, tb = tmp_path / "run.png", tmp_path / "tb"
    out = subprocess.run([sys.executable, "-m", "rankwatch.cli", "analyze", str(job.run_dir), "--plot", str(png),
                          "--tensorboard", str(tb)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb / "rank1"))
    acc.Reload()
    compute = acc.Scalars("rankwatch/compute_s")
    assert len(compute) >= 30 and max(e.value for e in compute) > 0.05
    verdicts = EventAccumulator(str(tb / "verdicts"))
    verdicts.Reload()
    assert any("straggler" in tag for tag in verdicts.Tags()["tensors"])
