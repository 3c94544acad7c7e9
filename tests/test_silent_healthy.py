"""Healthy jobs in the shapes the issue 18 lists as looking like silent
errors must stay healthy (tests/scripts/silent_healthy.py; several shapes
per job). A healthy report proves something only if the checks ran: every
rank must have sent its training facts and per-step digests, and every
optimizer step must have reached the collector.

The other healthy shapes of the issue run in existing tests with these
checks on: a model that converges to near-zero loss with occasional hard
examples (tests/scripts/converging_classifier.py, test_healthy_shapes.py),
a BatchNorm CNN with no_sync, several optimizers and torch.compile
(tests/frameworks/shapes.py).

Heavy: run under the shared lock, e.g.
    flock /tmp/rankwatch-heavy.lock python -m pytest -q tests/test_silent_healthy.py
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import free_port, run_job

SCRIPT = Path(__file__).resolve().parent / "scripts" / "silent_healthy.py"
DONE = re.compile(r"^done: (\d+) steps", re.MULTILINE)
SHAPES = ["mixed", "amp_accum", "compiled", "hand_dp"]


@pytest.mark.parametrize("shape", SHAPES)
def test_healthy_shape_stays_healthy(tmp_path, shape):
    job = run_job(tmp_path, ["--nproc-per-node", "3", "--master-port", str(free_port()), str(SCRIPT),
                             "--shape", shape], timeout=240)
    assert job.exit_code == 0, job.output[-4000:]
    assert job.report["verdicts"] == [], job.report
    steps = int(DONE.search(job.output).group(1))
    from rankwatch.collector.offline import load

    run, _ = load(job.run_dir)
    for rank, state in run.ranks.items():
        assert state.step == steps, (rank, state.step, steps)
        facts = [e for e in state.events if e.kind == "train_config"]
        assert facts, f"rank {rank} sent no training facts"
        records = [r for r in state.steps.values()]
        assert all(r.optim_fp is not None for r in records), f"rank {rank}: optimizer digests missing"
        with_batch = [r for r in records if r.batch_fp is not None]
        assert len(with_batch) >= len(records) // 2, f"rank {rank}: batch fingerprints missing"
