"""rankwatch on a real Slurm cluster (slurmctld + two slurmd nodes on this
machine, see slurm_cluster.py), through the sbatch scripts in examples/slurm/
exactly as a user submits them:

- `srun rankwatch run` (torchrun per node): two nodes and a standalone
  collector (torchrun_collector.sbatch); one node and the embedded collector
  (torchrun_embedded.sbatch);
- `srun rankwatch exec -- python` (one task per rank, no torchrun): two tasks
  and a standalone collector (exec_collector.sbatch); one task, embedded
  (exec_embedded.sbatch).

Each fault gives the verdict `rankwatch run` gives; Slurm's endings (scancel,
a time limit's --signal warning) give `termination`, never a culprit.
Each test prints its time to verdict (submit to report). Cost: ~15-40 s a job.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

import slurm_cluster
from conftest import ROOT, TRAIN, free_port, matrix

pytestmark = pytest.mark.slow
EXAMPLES = ROOT / "examples" / "slurm"
JOB_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    absent = slurm_cluster.missing()
    if absent:
        if os.environ.get("RANKWATCH_REQUIRE_SLURM"):
            pytest.fail(f"RANKWATCH_REQUIRE_SLURM is set but {', '.join(absent)} not found (apt-get install slurm-wlm munge)")
        pytest.skip(f"Slurm is not installed ({', '.join(absent)} not found: apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        if os.environ.get("RANKWATCH_REQUIRE_SLURM"):
            pytest.fail("RANKWATCH_REQUIRE_SLURM is set but the test cluster's slurmd needs root")
        pytest.skip("the test Slurm cluster's slurmd needs root")
    root = Path(tmp_path_factory.mktemp("slurm"))
    cluster = slurm_cluster.SlurmCluster(root, [free_port() for _ in range(3)])
    try:
        cluster.start()
    except Exception:
        cluster.stop()
        raise
    print(f"\n{slurm_cluster.version()} ({root})")
    yield cluster
    cluster.stop()


def job_env(extra: dict | None = None) -> dict:
    """The submitter's environment (sbatch exports it to the job): this
    interpreter's bin first, so `rankwatch` and `python` are the tested ones."""
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}", "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", "RANKWATCH_COLLECTOR_PORT": str(free_port())}
    env.update(extra or {})
    return env


def submit(cluster, tmp_path, script: str, args: list[str], options: list[str], env: dict | None = None):
    started = time.time()
    job_id = cluster.sbatch(EXAMPLES / script, args, options, tmp_path, job_env(env))
    return job_id, started


def report_of(tmp_path: Path, run_id: str, job_id: str) -> dict:
    path = tmp_path / "rankwatch-runs" / run_id / "report.json"
    out = tmp_path / f"job-{job_id}.out"
    assert path.is_file(), f"no {path}\n{out.read_text(errors='replace')[-4000:] if out.exists() else ''}"
    return json.loads(path.read_text())


def output(tmp_path: Path, job_id: str) -> str:
    out = tmp_path / f"job-{job_id}.out"
    return out.read_text(errors="replace") if out.exists() else ""


def finish(cluster, tmp_path, job_id, started, what: str) -> tuple[dict, dict]:
    fields = cluster.wait_done(job_id, JOB_TIMEOUT_S)
    report = report_of(tmp_path, f"slurm-{job_id}.0", job_id)
    print(f"\n[slurm] {what}: job {job_id} {fields.get('JobState')} ExitCode={fields.get('ExitCode')}, "
          f"report after {time.time() - started:.1f} s: {[(v['kind'], v['ranks']) for v in report['verdicts']]} "
          f"termination={report['termination'] and report['termination']['reason']}")
    return fields, report


TWO_NODES = ["--nodes=2", "--ntasks-per-node=1"]
TRAIN_ARGS = [str(TRAIN), "--steps", "30"]
# Both paths, two nodes, a standalone collector; one worker per node (PET_NPROC_PER_NODE for torchrun).
PATHS = {
    "torchrun": ("torchrun_collector.sbatch", {"PET_NPROC_PER_NODE": "1"}),
    "exec": ("exec_collector.sbatch", {}),
}
# fault -> (train.py's arguments, the verdict, the job's end in Slurm). A NaN
# does not end the job by default (on_nonfinite: dump): its exit status stays its own.
FAULTS = {
    "healthy": ([], None, "COMPLETED"),
    "crash": (["--fault", "crash", "--fault-rank", "1", "--fault-step", "5"], "crash", "FAILED"),
    "nan": (["--fault", "nan", "--fault-rank", "1", "--fault-step", "5"], "nonfinite", "COMPLETED"),
    "hang": (["--fault", "hang", "--fault-rank", "1", "--fault-step", "5"], "hang", "FAILED"),
}


# CI runs each fault on one path and each path with two faults (about 2 min
# less); RANKWATCH_FULL_MATRIX=1 runs every fault on both paths.
@pytest.mark.parametrize("path,fault", matrix([(path, fault) for path in PATHS for fault in FAULTS],
                                              diagonal=[("exec", "healthy"), ("torchrun", "crash"), ("exec", "nan"),
                                                        ("torchrun", "hang")]))
def test_two_nodes_give_the_verdicts_of_rankwatch_run(cluster, tmp_path, path, fault):
    script, env = PATHS[path]
    args, kind, job_state = FAULTS[fault]
    job_id, started = submit(cluster, tmp_path, script, TRAIN_ARGS + args, TWO_NODES,
                             dict(env, RANKWATCH_HANG_TIMEOUT="6"))
    fields, report = finish(cluster, tmp_path, job_id, started, f"{path} {fault}")
    text = output(tmp_path, job_id)
    assert report["termination"] is None, text[-3000:]
    assert report["world_size"] == 2
    if kind is None:
        assert report["verdicts"] == [], json.dumps(report, indent=1)[:3000] + text[-3000:]
        assert fields["JobState"] == job_state, text[-3000:]
        return
    assert [(v["kind"], v["ranks"]) for v in report["verdicts"]] == [(kind, [1])], \
        json.dumps(report, indent=1)[:3000] + text[-3000:]
    assert fields["JobState"] == job_state
    # The culprit is named by the Slurm node it ran on (torchrun's c10d rendezvous picks which node gets rank 1).
    if kind in ("crash", "hang"):
        assert re.search(r"rank 1 on n[12]\b", report["verdicts"][0]["summary"]), report["verdicts"][0]["summary"]


@pytest.mark.parametrize("path", matrix(["torchrun", "exec"], diagonal=["torchrun"]))
def test_scancel_during_training_is_a_scheduler_ending_with_no_culprit(cluster, tmp_path, path):
    script, options, env = {
        "torchrun": ("torchrun_embedded.sbatch", ["--nodes=1", "--ntasks-per-node=1"], {"PET_NPROC_PER_NODE": "2"}),
        "exec": ("exec_collector.sbatch", TWO_NODES, {}),
    }[path]
    job_id, started = submit(cluster, tmp_path, script, [str(TRAIN), "--steps", "2000", "--step-time", "0.05"],
                             options, env)
    deadline = time.time() + JOB_TIMEOUT_S
    while "step 10 " not in output(tmp_path, job_id):
        assert time.time() < deadline, output(tmp_path, job_id)[-3000:]
        assert cluster.job(job_id).get("JobState") in ("PENDING", "RUNNING", "CONFIGURING"), \
            output(tmp_path, job_id)[-3000:]
        time.sleep(0.2)
    cancelled = time.time()
    cluster.scancel(job_id)
    fields, report = finish(cluster, tmp_path, job_id, cancelled, f"{path} scancel")
    assert fields["JobState"] == "CANCELLED"
    assert report["verdicts"] == [], json.dumps(report, indent=1)[:3000] + output(tmp_path, job_id)[-3000:]
    assert report["status"] == "healthy"
    ending = report["termination"]
    assert ending is not None, output(tmp_path, job_id)[-3000:]
    assert (ending["by"], ending["reason"], ending["signal"]) == ("scheduler", "cancelled", "SIGTERM"), ending
    assert ending["source"].startswith(f"SLURM_JOB_ID {job_id}")


@pytest.mark.parametrize("path", matrix(["torchrun", "exec"], diagonal=["exec"]))
def test_a_time_limit_warning_is_a_scheduler_ending_with_no_culprit(cluster, tmp_path, path):
    """--time=1 --signal=USR1@50: Slurm sends SIGUSR1 10-40 s into the job
    (its timer ticks every 30 s); train.py does not handle it, so its ranks
    end by it, as they would without rankwatch."""
    script, options, env = {
        "torchrun": ("torchrun_embedded.sbatch", ["--nodes=1", "--ntasks-per-node=1"], {"PET_NPROC_PER_NODE": "2"}),
        "exec": ("exec_embedded.sbatch", ["--nodes=1", "--ntasks=1"], {}),
    }[path]
    job_id, started = submit(cluster, tmp_path, script, [str(TRAIN), "--steps", "4000", "--step-time", "0.05"],
                             [*options, "--time=1", "--signal=USR1@50"], env)
    fields, report = finish(cluster, tmp_path, job_id, started, f"{path} time limit --signal=USR1@50")
    assert report["verdicts"] == [], json.dumps(report, indent=1)[:3000] + output(tmp_path, job_id)[-3000:]
    ending = report["termination"]
    assert ending is not None, output(tmp_path, job_id)[-3000:]
    assert (ending["by"], ending["reason"], ending["signal"]) == ("scheduler", "time_limit", "SIGUSR1"), ending
