"""Silent errors (issue 18): jobs that run to the end, exit 0, and train
wrong. One real 3-rank DDP job (gloo, CPU) per class, each with one bug the
way users write it (tests/scripts/silent_train.py); each must give exactly
one verdict naming the culprit ranks, the cause in words, the first step
within 2 optimizer steps of the fault (8 for duplicated data), the job's
own exit status (0), and the same verdict from `rankwatch analyze`.

Heavy (real training processes): run under the shared lock, e.g.
    flock /tmp/rankwatch-heavy.lock python -m pytest -q tests/test_silent_errors.py
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import free_port, run_job
from rankwatch import wire

SCRIPT = Path(__file__).resolve().parent / "scripts" / "silent_train.py"
ALL = [0, 1, 2]


@dataclass
class Case:
    fault: str
    rank: int  # --fault-rank
    kind: str
    culprits: list[int]
    words: tuple[str, ...]  # the cause, as the summary must say it
    start: int = 3  # the step the fault begins (--fault-step, or 0 for faults present from the start)
    bound: int = 2  # verdict step at most start + bound
    evidence: dict = field(default_factory=dict)  # evidence fields that must hold exactly


CASES = [
    # Data: no DistributedSampler, every rank reads the whole (shuffled alike) dataset.
    Case("no_sampler", 1, "duplicate_data", ALL, ("identical input batches", "DistributedSampler"), start=0,
         bound=8, evidence={"across_ranks": True}),
    # Data: next(iter(loader)) every step on rank 1: the same first batch forever.
    Case("same_batch", 1, "duplicate_data", [1], ("same input batch", "next(iter(loader))"), bound=8,
         evidence={"across_ranks": False}),
    # Modes: rank 1 validated and never called model.train() again.
    Case("eval_mode", 1, "config_divergence", [1], ("Train/eval mode", "'eval'", "silent_train.py:"),
         evidence={"differing": ["mode"]}),
    # Optimizer and schedule: the scheduler steps inside rank 0's logging block.
    # Labelled exactly (issue 24 part 5): stepped at the end of step 3, the rates differ from step 4 on.
    Case("sched_rank", 0, "config_divergence", [0], ("learning rate", "scheduler"), start=4, bound=0,
         evidence={"differing": ["lr"]}),
    # Optimizer and schedule: clipping only on rank 2.
    Case("clip_rank", 2, "config_divergence", [2], ("Gradient clipping", "norm 0.1"),
         evidence={"differing": ["clip"]}),
    # Optimizer and schedule: rank 1 accumulates two micro-batches per step.
    Case("accum_rank", 1, "config_divergence", [1], ("micro-batches",), evidence={"differing": ["micro_batches"]}),
    # Precision: autocast on rank 1 only.
    Case("autocast_rank", 1, "config_divergence", [1], ("Autocast", "bfloat16"),
         evidence={"differing": ["autocast"]}),
    # Your own facts: a value declared equal differs on rank 1.
    Case("expect_same", 1, "config_divergence", [1], ("expect_same('tokenizer')",), start=0,
         evidence={"differing": ["user.tokenizer"]}),
    # Updates: the head replaced after the optimizer was built never learns.
    Case("head_replaced", 1, "broken_update", ALL, ("head.weight", "in no optimizer"), start=0),
    # Updates: optimizer.zero_grad() never called.
    Case("no_zero_grad", 1, "broken_update", ALL, ("never cleared", "zero_grad"), start=0),
    # Updates: every other forward through model.module: DDP never averages those gradients.
    Case("module_forward", 1, "weight_divergence", ALL, ("never averaged", ".module"),
         evidence={"cause": "unreduced_gradients"}),
    # Updates: hand-written data parallelism, per-rank seed, no broadcast: replicas differ from step 0.
    Case("unsynced_start", 1, "weight_divergence", ALL, ("started training with different weights",
                                                          "broadcast"), start=0,
         evidence={"cause": "unsynced_start"}),
]


def _offline_same(job) -> None:
    """`rankwatch analyze` knows the kind and gives the live run's verdicts."""
    from rankwatch.collector.offline import analyze_path

    offline = wire.to_dict(analyze_path(job.run_dir))
    live = [(v["kind"], v["ranks"], v["step"]) for v in job.verdicts()]
    assert [(v["kind"], v["ranks"], v["step"]) for v in offline["verdicts"]] == live, offline["verdicts"]


@pytest.mark.parametrize("case", CASES, ids=[c.fault for c in CASES])
def test_silent_error_is_named(tmp_path, case):
    job = run_job(tmp_path, ["--nproc-per-node", "3", "--master-port", str(free_port()), str(SCRIPT),
                             "--fault", case.fault, "--fault-rank", str(case.rank), "--fault-step", "3"],
                  timeout=180)
    assert job.exit_code == 0, job.output[-3000:]  # reported, not aborted: the job's own status
    verdicts = job.verdicts()
    assert len(verdicts) == 1, json.dumps(verdicts, indent=1)[:4000]
    v = verdicts[0]
    assert v["kind"] == case.kind, json.dumps(v, indent=1)[:3000]
    assert v["ranks"] == case.culprits, v
    assert case.start <= v["step"] <= case.start + case.bound, (v["step"], v["summary"])
    for words in case.words:
        assert words in v["summary"], (words, v["summary"])
    for name, value in case.evidence.items():
        assert v["evidence"].get(name) == value, (name, v["evidence"])
    _offline_same(job)
    print(f"\n[{case.fault}] {v['kind']} on {v['ranks']} at step {v['step']} (fault from step {case.start}):"
          f"\n  {v['summary']}")


def test_learning_rate_divergence_explains_the_replicas_drifting_apart(tmp_path):
    """The scheduler on rank 0 makes rank 0's weights drift: weight_divergence
    follows, as the config_divergence's consequence with its cause named."""
    job = run_job(tmp_path, ["--nproc-per-node", "3", "--master-port", str(free_port()), str(SCRIPT),
                             "--fault", "sched_rank", "--fault-rank", "0", "--steps", "24"],
                  env={"RANKWATCH_FINGERPRINT_EVERY": "4"}, timeout=180)
    assert job.exit_code == 0, job.output[-3000:]
    (v,) = job.verdicts()
    assert v["kind"] == "config_divergence" and v["ranks"] == [0]
    drift = [c for c in v["evidence"]["consequences"] if c["kind"] == "weight_divergence"]
    assert drift and drift[0]["ranks"] == [0] and drift[0]["cause"] == v["id"], (v["id"], v["evidence"])
    assert v["id"].startswith("config_divergence@")


def test_silent_error_actions_ignore_and_abort(tmp_path):
    """on_<kind>: ignore silences the kind; on_<kind>: abort ends the job
    (the only way a silent error changes the exit status)."""
    ignored = run_job(tmp_path, ["--nproc-per-node", "3", "--master-port", str(free_port()), str(SCRIPT),
                                 "--fault", "no_sampler"], env={"RANKWATCH_ON_DUPLICATE_DATA": "ignore"},
                      run_dir=tmp_path / "ignored")
    assert ignored.exit_code == 0 and ignored.report["status"] == "healthy", ignored.report
    aborted = run_job(tmp_path, ["--nproc-per-node", "3", "--master-port", str(free_port()), str(SCRIPT),
                                 "--fault", "clip_rank", "--fault-rank", "2", "--steps", "400", "--step-time", "0.05"],
                      env={"RANKWATCH_ON_CONFIG_DIVERGENCE": "abort"}, run_dir=tmp_path / "aborted", timeout=180)
    assert aborted.exit_code != 0, aborted.output[-2000:]
    assert "done: 400 steps" not in aborted.output
    v = aborted.only("config_divergence")
    assert v["ranks"] == [2]
