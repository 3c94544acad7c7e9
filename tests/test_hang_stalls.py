"""Naming a stall and ending the job are separate (issue 24 part 4, CONTRACT
additions 2026-11-25): a stall is named within the hang timeout, live; the job
is ended only once the stalled rank is shown stuck (collector/stuck.py); a
stall that ends by itself is a note in the report, not a verdict.

Real 2-rank gloo jobs (tests/scripts/stalls.py): rank 0 stalls at step 6
while rank 1 waits in dist.barrier(). Cost: about 40-60 s each (the stalls
are 30 s, as long as a real upload, past the old 20 s timeout)."""

from __future__ import annotations

import datetime as dt
import re
import subprocess
import sys

import pytest

from conftest import SCRIPTS, run_job

STALL_S = 30.0


def _t(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@pytest.fixture
def slow_store():
    """A real HTTP object store on 127.0.0.1 taking uploads at 2 MB/s."""
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "slow_store.py"), "--rate", "2000000"],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}/checkpoints/step-6.pt"
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _stall_job(tmp_path, stall: str, *extra: str, env: dict | None = None, timeout: float = 240):
    return run_job(tmp_path, ["--nproc-per-node", "2", str(SCRIPTS / "stalls.py"), "--stall", stall,
                              "--stall-rank", "0", "--stall-step", "6", *extra], timeout=timeout, env=env)


def _ended_stall(job) -> str:
    assert job.exit_code == 0, f"a stall that ends by itself never ends the job:\n{job.output[-3000:]}"
    assert job.report["status"] == "healthy", job.report
    notes = [n for n in job.report.get("notes", []) if n.startswith("stall (not a hang")]
    assert len(notes) == 1, job.report.get("notes")
    assert re.search(r"hang on rank 0 at step 7 at \S*stalls\.py", job.output), "named live, with rank and line"
    assert "ending the job" not in job.output
    return notes[0]


def test_checkpoint_upload_on_rank_0_is_named_then_noted_and_the_job_finishes(tmp_path, slow_store):
    job = _stall_job(tmp_path, "upload", "--url", slow_store, "--upload-bytes", str(int(2_000_000 * STALL_S)))
    note = _ended_stall(job)
    assert "rank(s) 0 made no progress for" in note and "stalls.py" in note and "(step 7)" in note, note
    lasted = float(re.search(r"no progress for ([\d.]+) s", note).group(1))
    assert lasted >= STALL_S * 0.8, note
    named = float(re.search(r"named ([\d.]+) s after the last progress", note).group(1))
    print(f"\nupload stall: lasted {lasted:.1f} s, named {named:.1f} s after the last progress; job exit 0")


def test_long_rank_0_evaluation_is_never_killed(tmp_path):
    job = _stall_job(tmp_path, "evaluate", "--seconds", str(STALL_S))
    note = _ended_stall(job)
    lasted = float(re.search(r"no progress for ([\d.]+) s", note).group(1))
    assert lasted >= STALL_S * 0.8, note


def test_a_true_hang_inside_a_checkpoint_write_is_named_and_ended(tmp_path):
    job = _stall_job(tmp_path, "save_hang")
    assert job.exit_code != 0
    hang = job.only("hang")
    assert hang["ranks"] == [0] and hang["step"] == 7, hang["summary"]
    assert hang["evidence"]["ranks"]["0"]["phase"] == "checkpoint"
    assert hang["evidence"]["ended_because"]["ranks"]["0"]["rule"] == "idle", hang["evidence"]["ended_because"]
    named = _t(hang["detected_at"]) - _t(hang["first_seen_at"])
    ended = hang["evidence"]["ended_after_s"]
    assert named <= hang["evidence"]["hang_timeout_s"] + 5
    assert ended <= 15 + hang["evidence"]["hang_timeout_s"] + 5, ended
    print(f"\nhang in torch.save: named {named:.1f} s, ended {ended:.1f} s after the last progress")


def test_an_infinite_busy_loop_is_ended_at_the_abort_bound(tmp_path):
    job = _stall_job(tmp_path, "busy", env={"RANKWATCH_HANG_ABORT_TIMEOUT": "25"})
    assert job.exit_code != 0
    hang = job.only("hang")
    assert hang["ranks"] == [0] and hang["step"] == 7
    because = hang["evidence"]["ended_because"]
    assert "abort bound" in because["rule"], because
    ended = hang["evidence"]["ended_after_s"]
    assert 25 <= ended <= 35, ended
    named = _t(hang["detected_at"]) - _t(hang["first_seen_at"])
    print(f"\nbusy loop: named {named:.1f} s, ended {ended:.1f} s after the last progress")
