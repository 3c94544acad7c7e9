"""rankwatch never hurts the job it watches, and always leaves a report:
a collector that is down for the whole run, an interrupted launcher,
unreadable bundles, offline analysis."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import free_port, run_job, wait_until, worker_env


def test_collector_down_for_the_whole_run_does_not_hurt_training(tmp_path, train_script):
    dead = f"http://127.0.0.1:{free_port()}"
    job = run_job(tmp_path, ["--collector", dead, "--nproc-per-node", "2", str(train_script), "--steps", "30"])
    assert job.exit_code == 0, job.output[-3000:]
    assert "step 20" in job.output, "training ran to the end"
    assert "unreachable" in job.output
    assert job.report["status"] == "healthy"


def test_collector_down_and_a_crash_is_still_diagnosed_from_the_run_dir(tmp_path, train_script):
    dead = f"http://127.0.0.1:{free_port()}"
    job = run_job(tmp_path, ["--collector", dead, "--nproc-per-node", "2", str(train_script), "--steps", "30",
                             "--fault", "crash", "--fault-rank", "1", "--fault-step", "4"])
    assert job.exit_code != 0
    crash = job.only("crash")
    assert crash["ranks"] == [1] and "bad batch" in crash["summary"]
    assert list((job.run_dir / "spool").rglob("rank-00001.tar.gz")), "the crash bundle waited in the spool"


def test_interrupted_launcher_still_writes_the_report(tmp_path, train_script):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rankwatch.cli", "run", "--run-dir", str(run_dir), "--nproc-per-node", "2",
           str(train_script), "--steps", "100000", "--step-time", "0.01"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        wait_until(lambda: list((run_dir / "stacks").glob("*.blackbox")) and _stepped(run_dir), 60,
                   what="training to start")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    report = json.loads((run_dir / "report.json").read_text())
    assert report["status"] == "healthy", "a user stopping the job is not a fault of the job"
    assert report["world_size"] == 2


def _stepped(run_dir: Path) -> bool:
    from rankwatch.node import blackbox

    box = blackbox.read(blackbox.path_for(run_dir, 0))
    return bool(box and box["step"] >= 3)


def test_analyze_rebuilds_the_report_offline(tmp_path, train_script):
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(train_script), "--steps", "30",
                             "--fault", "crash", "--fault-rank", "0", "--fault-step", "3"])
    live = [(v["kind"], v["ranks"], v["step"]) for v in job.report["verdicts"]]
    out = subprocess.run([sys.executable, "-m", "rankwatch.cli", "analyze", str(job.run_dir), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    offline = json.loads(out.stdout)
    assert [(v["kind"], v["ranks"], v["step"]) for v in offline["verdicts"]] == live
    # One bundle archive alone is enough for a crash.
    bundle = next(job.run_dir.glob("bundles/crash-r0-*/rank-00000.tar.gz"))
    text = subprocess.run([sys.executable, "-m", "rankwatch.cli", "analyze", str(bundle)],
                          capture_output=True, text=True, timeout=60)
    assert text.returncode == 0 and "[crash]" in text.stdout and "bad batch" in text.stdout


def test_analyze_reports_unreadable_bundles_clearly(tmp_path):
    folder = tmp_path / "bundles"
    folder.mkdir()
    (folder / "rank-00000.tar.gz").write_bytes(b"\x1f\x8b\x08 truncated")
    out = subprocess.run([sys.executable, "-m", "rankwatch.cli", "analyze", str(folder)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "rank-00000.tar.gz" in out.stderr and "unreadable or truncated" in out.stderr
    missing = subprocess.run([sys.executable, "-m", "rankwatch.cli", "analyze", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_analyze_keeps_good_bundles_next_to_a_bad_one(tmp_path, train_script):
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(train_script), "--steps", "30",
                             "--fault", "crash", "--fault-rank", "1", "--fault-step", "3"])
    folder = tmp_path / "copy"
    folder.mkdir()
    for path in job.run_dir.glob("bundles/*/*.tar.gz"):
        (folder / f"{path.parent.name}-{path.name}").write_bytes(path.read_bytes())
    (folder / "broken.tar.gz").write_bytes(next(folder.iterdir()).read_bytes()[:100])
    out = subprocess.run([sys.executable, "-m", "rankwatch.cli", "analyze", str(folder), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "broken.tar.gz" in out.stderr
    verdicts = json.loads(out.stdout)["verdicts"]
    assert verdicts and verdicts[0]["kind"] == "crash" and verdicts[0]["ranks"] == [1]
