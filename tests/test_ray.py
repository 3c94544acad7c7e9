"""rankwatch on Ray Train: real local Ray cluster, TorchTrainer, 2 CPU workers, gloo.

Every case runs examples/ray_train.py (the README's code) as its own driver
process against one Ray cluster started for this module, so a crash cannot
take pytest down. The training function is plain DDP through
``ray.train.torch.prepare_model``; faults are injected on one rank.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train.torch")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "ray_train.py"
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


@dataclass
class RayJob:
    exit_code: int
    report: dict
    output: str
    elapsed: float
    report_at: float  # when report.json appeared (time.time())
    started_at: float

    def verdicts(self, kind: str | None = None) -> list[dict]:
        return [v for v in self.report.get("verdicts", []) if kind is None or v["kind"] == kind]

    def only(self, kind: str) -> dict:
        found = self.verdicts(kind)
        assert found, f"no {kind} verdict; report:\n{json.dumps(self.report, indent=1)[:3000]}\n{self.output[-4000:]}"
        assert len(self.verdicts()) == 1, f"one fault, one verdict: {[v['kind'] for v in self.verdicts()]}"
        return found[0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One local Ray cluster (4 CPUs) for the module; every driver joins it."""
    os.environ.update(RAY_ENV)
    temp = tmp_path_factory.mktemp("ray")
    ray.init(num_cpus=4, _temp_dir=str(temp), include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def run_driver(cluster: str, tmp_path: Path, name: str, args: list[str], timeout: float = 150,
               extra_env: dict | None = None) -> RayJob:
    storage = tmp_path / "ray_results"
    env = dict(os.environ, **RAY_ENV, RAY_ADDRESS=cluster, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANKWATCH_RUN_ID", None)
    env.update(extra_env or {})
    cmd = [sys.executable, str(EXAMPLE), "--storage", str(storage), "--name", name, *args]
    started = time.time()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    elapsed = time.time() - started
    output = proc.stdout + proc.stderr
    report_file = storage / name / "rankwatch" / "report.json"
    assert report_file.is_file(), f"no report.json (exit {proc.returncode}):\n{output[-5000:]}"
    assert (report_file.parent / "report.html").is_file(), f"no report.html:\n{output[-5000:]}"
    job = RayJob(proc.returncode, json.loads(report_file.read_text()), output, elapsed,
                 report_file.stat().st_mtime, started)
    for v in job.verdicts():  # the figures the closing note quotes (pytest -s)
        print(f"\n{name}: {v['kind']} ranks={v['ranks']} step={v['step']} first_seen={v['first_seen_at']} "
              f"detected={v['detected_at']}: {v['summary']}")
    print(f"\n{name}: exit {job.exit_code}, driver {elapsed:.1f} s")
    return job


def test_healthy_run_has_no_verdict(cluster, tmp_path):
    # Bound to every interface (what a multi-node cluster needs): the workers get the node's address.
    job = run_driver(cluster, tmp_path, "healthy", ["--steps", "25"], extra_env={"RANKWATCH_BIND": "0.0.0.0"})
    assert job.exit_code == 0, job.output[-4000:]
    assert job.report["status"] == "healthy" and job.report["verdicts"] == [], json.dumps(job.report, indent=1)
    assert job.report["world_size"] == 2
    advertised = re.search(r"collector (http://\S+)", job.output)
    assert advertised and not advertised.group(1).startswith("http://0.0.0.0"), job.output[-3000:]


def test_crash_names_the_rank_that_raised_with_a_standalone_collector(cluster, tmp_path):
    # The collector as a service (token required) instead of embedded in Ray's controller.
    port = _free_port()
    token = "ray-test-" + os.urandom(8).hex()
    data = tmp_path / "collector-data"
    service = subprocess.Popen([sys.executable, "-m", "rankwatch.cli", "collector", "serve", "--host", "127.0.0.1",
                                "--port", str(port), "--data-dir", str(data), "--token", token],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(port, service)
        job = run_driver(cluster, tmp_path, "crash", ["--fault", "crash", "--fault-rank", "1", "--fault-step", "4"],
                         extra_env={"RANKWATCH_COLLECTOR": f"http://127.0.0.1:{port}", "RANKWATCH_TOKEN": token})
    finally:
        service.terminate()
        service.communicate(timeout=20)
    assert job.exit_code != 0, "Ray raises the worker's error from fit()"
    crash = job.only("crash")
    assert crash["ranks"] == [1] and crash["step"] == 4
    assert "injected failure: bad batch" in crash["summary"]
    assert list(data.glob("runs/crash-*/bundles/*/rank-00001*.tar.gz")), "the crash bundle went to the service"


def test_killed_worker_is_a_crash_by_sigkill(cluster, tmp_path):
    # Ray tells its controller only "the actor died"; the signal is rankwatch's inference (no fatal
    # record from faulthandler), the step comes from the rank's black box and its peer.
    job = run_driver(cluster, tmp_path, "sigkill", ["--fault", "sigkill", "--fault-rank", "1", "--fault-step", "4"])
    assert job.exit_code != 0
    crash = job.only("crash")
    assert crash["ranks"] == [1] and crash["step"] == 4
    assert "SIGKILL" in crash["summary"]


def test_a_rank_that_exits_early_is_the_hang_not_a_crash(cluster, tmp_path):
    """sys.exit(0) in one rank's training function (its data ran out): Ray
    reports it as the function's error ("SystemExit: 0"), but the rank left
    cleanly and its peer waits for it in the next allreduce. Named as a
    process's clean exit is: a hang on the rank that left, not a crash."""
    job = run_driver(cluster, tmp_path, "exit", ["--fault", "exit", "--fault-rank", "1", "--fault-step", "4"])
    hang = job.only("hang")
    assert hang["ranks"] == [1] and hang["step"] == 4, hang
    assert "SystemExit" not in hang["summary"]


def test_nan_names_the_origin_rank_and_step_with_no_code_change(cluster, tmp_path):
    # No line in the driver at all: Ray's own RAY_TRAIN_CALLBACKS adds the callback.
    job = run_driver(cluster, tmp_path, "nan", ["--no-callback", "--fault", "nan", "--fault-rank", "1",
                                                "--fault-step", "6", "--steps", "15"],
                     extra_env={"RAY_TRAIN_CALLBACKS": "rankwatch.ray.RankwatchCallback"})
    nonfinite = job.only("nonfinite")
    assert nonfinite["ranks"] == [1] and nonfinite["step"] == 6


def test_slow_rank_is_a_straggler(cluster, tmp_path):
    job = run_driver(cluster, tmp_path, "slow", ["--fault", "slow", "--fault-rank", "0", "--steps", "40"])
    assert job.exit_code == 0, "a straggler is reported, not killed"
    straggler = job.only("straggler")
    assert straggler["ranks"] == [0]
    assert straggler["step"] is not None and straggler["step"] <= 25, "found while the job runs"


def test_hang_is_named_and_the_run_ends_with_rankwatch_abort(cluster, tmp_path):
    # A Ray worker is never judged idle (collector/stuck.py): Ray's own native
    # threads (gRPC pollers, its io and timer threads) use ~0.27 % of a core in
    # a worker whose training thread sleeps, over the 0.1 % idle bound. So the
    # run ends by the busy bound, max(300 s, 10 x the hang timeout) by default,
    # set shorter here to keep the test short.
    job = run_driver(cluster, tmp_path, "hang", ["--fault", "hang", "--fault-rank", "1", "--fault-step", "5",
                                                 "--steps", "60"], extra_env={"RANKWATCH_HANG_ABORT_TIMEOUT": "40"},
                     timeout=240)  # Ray's start-up and teardown around the fixed 40 s: ~150 s on a slow machine
    assert job.exit_code != 0
    hang = job.only("hang")
    assert hang["ranks"] == [1] and hang["step"] == 5
    # fit() raises Ray's ControllerError whose controller_failure is our RankwatchAbort.
    assert re.search(r"ControllerError: Training failed due to controller error:\s*"
                     r"rankwatch ended the run: hang on rank 1 at step 5: .*Report: \S+report\.json",
                     job.output), job.output[-4000:]
    stalled = hang["evidence"]["stalled_for_s"]
    detected = _seconds(hang["detected_at"]) - _seconds(hang["first_seen_at"])
    # CONTRACT: within hang-timeout + 5 s of the last progress (adaptive: 20 s floor here).
    assert detected <= hang["evidence"]["hang_timeout_s"] + 5, (detected, stalled)
    print(f"\nhang: verdict {detected:.1f} s after the last progress (timeout {hang['evidence']['hang_timeout_s']} s);"
          f" driver ran {job.elapsed:.1f} s")


def test_without_rankwatch_ray_reports_nothing_on_the_same_hang(cluster, tmp_path):
    """The baseline: the same hang job, no rankwatch, bounded wait."""
    storage = tmp_path / "ray_results"
    env = dict(os.environ, **RAY_ENV, RAY_ADDRESS=cluster, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(EXAMPLE), "--storage", str(storage), "--name", "baseline", "--no-callback",
           "--fault", "hang", "--fault-rank", "1", "--fault-step", "5", "--steps", "60"]
    wait = float(os.environ.get("RANKWATCH_RAY_BASELINE_WAIT", "40"))
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=wait)
        finished = True
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        finished = False
    assert not finished, f"Ray ended the hung job by itself within {wait} s:\n{out[-3000:]}"
    print(f"\nbaseline: after {wait:.0f} s of the same hang Ray had printed no error and no timeout "
          f"({len(out.splitlines())} lines of output, none naming a culprit)")
    assert "Error" not in out and "Timed out" not in out and "timeout" not in out.lower(), out[-3000:]


def test_readme_shows_the_tested_snippet():
    text = EXAMPLE.read_text()
    snippet = text.split("# --- README snippet begin ---\n", 1)[1].split("        # --- README snippet end ---", 1)[0]
    lines = [line.strip() for line in snippet.splitlines() if line.strip()]
    readme = (ROOT / "README.md").read_text()
    if "rankwatch.ray" not in readme:
        pytest.skip("README has no Ray Train section yet")
    for line in lines:
        assert line in readme, f"README's Ray section lacks the tested line {line!r}"


# -- no cluster needed ---------------------------------------------------------------------------

def test_the_token_never_travels_in_the_pickled_callback(monkeypatch):
    """Ray pickles the callback to the controller and to every worker: after
    the controller started, the per-run token must not be in it (the workers
    get it from their runtime env)."""
    import pickle

    from rankwatch.ray import RankwatchCallback

    monkeypatch.delenv("RANKWATCH_TOKEN", raising=False)
    callback = RankwatchCallback(on_hang="wait")
    callback._url, callback._token = "http://127.0.0.1:1", "s3cr3t-token-value"
    callback.config = callback.config.__class__(**{**callback.config.__dict__, "token": callback._token})
    blob = pickle.dumps(callback)
    assert b"s3cr3t-token-value" not in blob
    copy = pickle.loads(blob)
    assert copy.config.on_hang == "wait" and copy.config.token is None and copy._collector is None
    with pytest.raises(TypeError):
        RankwatchCallback(no_such_setting=1)


def test_sys_exit_in_the_training_function_is_read_as_the_process_exit_it_would_be():
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback

    from rankwatch.ray import _exit_of

    class Status:
        running = False

        def __init__(self, error):
            self.error = error

    assert _exit_of(Status(UserExceptionWithTraceback(SystemExit(0), "SystemExit: 0"))) == (0, "finished")
    assert _exit_of(Status(UserExceptionWithTraceback(SystemExit(None), "SystemExit"))) == (0, "finished")
    assert _exit_of(Status(UserExceptionWithTraceback(SystemExit(3), "SystemExit: 3"))) == (3, "exit")
    assert _exit_of(Status(UserExceptionWithTraceback(SystemExit("bad config"), "SystemExit: bad config"))) == (1, "exit")
    assert _exit_of(Status(UserExceptionWithTraceback(ValueError("x"), "ValueError: x"))) == (1, "exception")
    assert _exit_of(Status(None)) == (0, "finished")


def test_training_thread_is_read_as_the_main_thread():
    from rankwatch.ray import mark_training_thread

    threads = [
        {"name": "MainThread", "main": True, "frames": [{"file": "ray/_private/worker.py", "name": "main_loop"}]},
        {"name": "", "main": False, "frames": [
            {"file": "/x/ray/train/v2/_internal/execution/worker_group/thread_runner.py", "name": "_run_target"},
            {"file": "/job/train.py", "name": "train_loop_per_worker"}]},
    ]
    mark_training_thread(threads)
    assert [t["main"] for t in threads] == [False, True]
    named = [{"name": "MainThread", "main": True, "frames": []},
             {"name": "TrainingThread(train_fn)", "main": False, "frames": []}]
    mark_training_thread(named)
    assert [t["main"] for t in named] == [False, True]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_healthy(port: int, service: subprocess.Popen, timeout: float = 30.0) -> None:
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        assert service.poll() is None, service.communicate()[0][-2000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError("the standalone collector did not come up")


def _seconds(iso: str) -> float:
    import datetime as dt

    return dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
