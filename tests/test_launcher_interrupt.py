"""Ctrl-C on a hung job watched with `--on-hang wait`: the waiting ranks are
stuck in a collective (a C call) and ignore SIGINT; torchrun alone would
wait 30 s in silence before SIGKILL. rankwatch says what happens and ends
them within seconds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import TRAIN, wait_until, worker_env

pytestmark = pytest.mark.slow


def _lines(path):
    return path.read_text(errors="replace") if path.exists() else ""


def test_ctrl_c_on_a_hung_job_says_what_happens_and_ends_it_quickly(tmp_path):
    err = tmp_path / "stderr.txt"
    cmd = [sys.executable, "-m", "rankwatch.cli", "run", "--on-hang", "wait", "--hang-timeout", "4",
           "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "3", str(TRAIN), "--steps", "40",
           "--fault", "hang", "--fault-rank", "1", "--fault-step", "5"]
    with open(err, "w") as stderr:
        # A terminal's Ctrl-C goes to the whole foreground process group: its own session here.
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=worker_env(), stdout=subprocess.DEVNULL, stderr=stderr,
                                start_new_session=True)
        try:
            wait_until(lambda: ": hang on rank 1 at step" in _lines(err) or proc.poll() is not None, 120,
                       what="the hang verdict")
            assert proc.poll() is None, _lines(err)[-3000:]
            pressed = time.monotonic()
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=60)
            took = time.monotonic() - pressed
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    text = _lines(err)
    said = [line for line in text.splitlines() if line.startswith("[rankwatch] Ctrl-C:")]
    assert len(said) == 1 and "job is hung" in said[0] and "SIGKILL" in said[0], text[-3000:]
    assert took < 25, f"{took:.1f} s from Ctrl-C to exit (torchrun alone: 30 s+)\n{text[-3000:]}"
    assert proc.returncode != 0
    assert (tmp_path / "run" / "report.json").is_file()
