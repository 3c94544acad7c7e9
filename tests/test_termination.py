"""report.json's `termination` (contract additions 2026-11-25) for plain
`rankwatch run`, no scheduler: a job ended by a signal from outside says so
and names no culprit; a job that ends by itself has `termination: null`; the
offline `rankwatch analyze` of the run dir says the same. Cost: ~25 s (two
small 2-rank gloo jobs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from conftest import TRAIN, run_job, wait_until, worker_env


def _analyze(run_dir):
    done = subprocess.run([sys.executable, "-m", "rankwatch.cli", "analyze", str(run_dir), "--json"],
                          capture_output=True, text=True, timeout=60, env=worker_env())
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_a_job_that_ends_by_itself_has_no_termination(tmp_path):
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(TRAIN), "--steps", "6"])
    assert job.exit_code == 0, job.output[-3000:]
    assert "termination" in job.report and job.report["termination"] is None
    assert _analyze(job.run_dir)["termination"] is None


def test_sigterm_from_outside_is_a_signal_ending_not_a_crash(tmp_path):
    """As `kill -TERM` of the whole job (every process, as a scheduler or a
    container runtime does): exit 143, no verdict, termination by signal."""
    err = tmp_path / "stderr.txt"
    out = tmp_path / "stdout.txt"
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rankwatch.cli", "run", "--run-dir", str(run_dir), "--nproc-per-node", "2",
           str(TRAIN), "--steps", "400", "--step-time", "0.05"]
    with open(err, "w") as stderr, open(out, "w") as stdout:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=worker_env(), stdout=stdout, stderr=stderr,
                                start_new_session=True)
        try:
            # Training is under way once rank 0 printed step 10.
            wait_until(lambda: proc.poll() is not None or "step 10 " in out.read_text(), 120, interval=0.2,
                       what="training to start")
            assert proc.poll() is None, err.read_text()[-3000:]
            sent = time.time()
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=90)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = err.read_text(errors="replace")
    report = json.loads((run_dir / "report.json").read_text())
    assert proc.returncode == 128 + signal.SIGTERM, text[-3000:]
    assert report["verdicts"] == [], json.dumps(report, indent=1)[:3000]
    assert report["status"] == "healthy"
    ending = report["termination"]
    assert ending["by"] == "signal" and ending["signal"] == "SIGTERM" and ending["reason"] == "unknown", ending
    assert str(proc.pid) in ending["source"]
    at = time.mktime(time.strptime(ending["at"][:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
    assert sent - 2 <= at <= sent + 5
    assert "ended by a signal from outside" in text
    assert _analyze(run_dir)["termination"] == ending

