"""rankwatch's own failures on the node never change the job's outcome, and a
report never calls a failed job healthy:
- a full run dir (a real 2 MiB tmpfs): the job's exit status, one line saying
  where the report went instead, no traceback;
- a `--collector` that answers garbage (HTML, wrong-shaped JSON, 500s,
  silence, redirects): the report is built from what the node saw and says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import TRAIN, worker_env

pytestmark = pytest.mark.slow


# -- a full disk ------------------------------------------------------------------------------

@pytest.fixture
def full_disk(tmp_path):
    """A real 2 MiB tmpfs, filled up."""
    mount = tmp_path / "full"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        with open(mount / "filler", "wb") as out:
            try:
                while True:
                    out.write(b"\0" * 65536)
                    out.flush()
            except OSError:
                pass
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _run(tmp_path: Path, run_dir: Path, extra: list[str], env: dict | None = None, timeout: float = 240):
    cmd = [sys.executable, "-m", "rankwatch.cli", "run", "--run-dir", str(run_dir), *extra]
    return subprocess.run(cmd, cwd=tmp_path, env=worker_env(env), capture_output=True, text=True, timeout=timeout)


def _fallback_report(stderr: str, run_id_dir: Path) -> dict:
    lines = [l for l in stderr.splitlines() if "report.json could not be written" in l]
    assert len(lines) == 1, stderr[-3000:]
    assert str(run_id_dir / "report.json") in lines[0]
    written = Path(lines[0].rsplit("written to ", 1)[1].strip())
    assert written.is_file() and Path(tempfile.gettempdir()) in written.parents
    try:
        return json.loads(written.read_text())
    finally:
        written.unlink()


def test_a_full_run_dir_keeps_a_good_jobs_exit_status_and_says_where_the_report_went(tmp_path, full_disk):
    run_dir = full_disk / "run"
    done = _run(tmp_path, run_dir, ["--nproc-per-node", "2", str(TRAIN), "--steps", "12"])
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    assert "step 10 loss" in done.stdout  # the job trained all its steps
    report = _fallback_report(done.stderr, run_dir)
    assert report["status"] == "healthy" and report["world_size"] == 2
    assert not list(run_dir.glob("report.json*.tmp"))


@pytest.fixture
def standalone_collector(tmp_path):
    """A real `rankwatch collector serve` on 127.0.0.1: (url, token)."""
    import urllib.request

    from conftest import free_port, wait_until

    port = free_port()
    token = "node-side-test-token-0123456789"
    server = subprocess.Popen([sys.executable, "-m", "rankwatch.cli", "collector", "serve", "--host", "127.0.0.1",
                               "--port", str(port), "--data-dir", str(tmp_path / "collector"), "--token", token],
                              env=worker_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def healthy():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                return r.status == 200
        except OSError:
            return server.poll() is not None

    try:
        wait_until(healthy, 30, what="the collector")
        assert server.poll() is None, "the collector did not start"
        yield f"http://127.0.0.1:{port}", token
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_full_run_dir_with_a_standalone_collector_keeps_the_jobs_exit_status(tmp_path, full_disk,
                                                                                standalone_collector):
    url, token = standalone_collector
    run_dir = full_disk / "run"
    done = _run(tmp_path, run_dir, ["--collector", url, "--nproc-per-node", "2", str(TRAIN), "--steps", "12"],
                env={"RANKWATCH_TOKEN": token})
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    report = _fallback_report(done.stderr, run_dir)
    assert report["status"] == "healthy"


def test_the_launcher_prints_a_standalone_collectors_verdict_as_it_happens(tmp_path, standalone_collector):
    url, token = standalone_collector
    run_dir = tmp_path / "run"
    done = _run(tmp_path, run_dir, ["--collector", url, "--nproc-per-node", "3", str(TRAIN), "--steps", "30",
                                    "--fault", "nan", "--fault-rank", "1", "--fault-step", "6"],
                env={"RANKWATCH_TOKEN": token})
    lines = [l for l in done.stderr.splitlines() if ": nonfinite on rank 1 at step 6 (details in the report)" in l]
    assert len(lines) == 1, done.stderr[-4000:]
    summary = done.stderr.index("rankwatch: run ")
    assert done.stderr.index(lines[0]) < summary  # live, before the final summary


# -- a collector that answers garbage -----------------------------------------------------------

JUNK_MODES = ("html", "wrong_json", "error_500", "silence", "redirect", "lying_report")


class _Junk(BaseHTTPRequestHandler):
    mode = "html"

    def log_message(self, *args):
        pass

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        mode = self.server.mode
        if mode == "silence":
            self.server.stop.wait(60)  # holds the connection, never answers
            return
        if mode == "redirect":
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:9/elsewhere")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        status, body, kind = 200, b"<html><body>It works!</body></html>", "text/html"
        if mode == "wrong_json":
            body, kind = b'{"status": "ok", "verdicts": "none", "commands": 7}', "application/json"
        elif mode == "error_500":
            status, body, kind = 500, b"Internal Server Error", "text/plain"
        elif mode == "lying_report":
            # A well-formed report, of the right run, that calls every job healthy.
            run_id = self.path.split("/")[3] if self.path.startswith("/v1/runs/") else "x"
            body, kind = json.dumps({"schema": "rankwatch.report/v1", "run_id": run_id, "world_size": 2,
                                     "status": "healthy", "verdicts": []}).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = _answer


@pytest.fixture
def junk_collector():
    servers = []

    def start(mode: str) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Junk)
        server.daemon_threads = True
        server.mode, server.stop = mode, threading.Event()
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.stop.set()
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("mode", JUNK_MODES)
def test_the_launchers_view_of_an_unusable_collector_never_reports_a_failed_job_healthy(tmp_path, mode,
                                                                                        junk_collector):
    """The launcher's own end-of-run path (the real client, a real junk server)."""
    from rankwatch.node import launcher

    url = junk_collector(mode)
    remote = launcher._RemoteCollector(url, token="t")
    remote._transport.timeout = 1.0 if mode == "silence" else remote._transport.timeout
    exits = {0: (-15, 1000.5), 1: (1, 1000.0)}
    report, problem = launcher._collector_report("run-junk", remote, False, exits)
    assert report is None and problem, (report, problem)
    node = launcher.node_report("run-junk", tmp_path, exits, False, note=f"the central collector could not be used: {problem}")
    assert node.status == "faulty"
    crash = [v for v in node.verdicts if v.kind == "crash"]
    assert crash and crash[0].ranks == [1], node
    assert any("central collector" in n for n in node.notes)


def test_a_crashed_job_behind_a_garbage_collector_gets_a_crash_verdict_from_the_node(tmp_path, junk_collector):
    url = junk_collector("html")
    run_dir = tmp_path / "run"
    done = _run(tmp_path, run_dir, ["--collector", url, "--nproc-per-node", "2", str(TRAIN), "--steps", "30",
                                    "--fault", "crash", "--fault-rank", "1", "--fault-step", "3"],
                env={"RANKWATCH_TOKEN": "t"})
    assert done.returncode == 1, done.stderr[-4000:]
    assert "rankwatch/launcher.py" not in done.stderr  # the rank's own traceback only, never the launcher's
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "faulty", report
    crash = [v for v in report["verdicts"] if v["kind"] == "crash"]
    assert crash and crash[0]["ranks"] == [1], report
    assert any("could not be used" in n for n in report["notes"]), report
    assert "reporting what this node saw" in done.stderr
