"""Weight fingerprints carry an exact bit checksum per tensor next to its norm
(issue 24). Found from outside: in Lightning's transformer example one rank's
weight matrix was nudged once by 1e-3 * randn and the run ended "healthy"
120 steps later. DDP averages gradients, never weights, so the replicas
stayed apart, and a norm moves by only ~1/sqrt(n) of a zero-mean nudge of an
n-element tensor: below the norms' tolerance on a large tensor."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import ddp_script, run_job
from rankwatch import wire
from rankwatch.agent.checks.fingerprints import digest, read_digest
from rankwatch.collector import analyses, codec
from rankwatch.collector.service import Collector
from rankwatch.config import Config


def _read(tensors):
    values = torch.cat([v.reshape(-1).float() for v in digest(tensors)]).tolist()
    return read_digest(values, len(tensors))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_one_ulp_in_one_element_changes_the_checksum_not_the_norm(dtype):
    torch.manual_seed(0)
    weight = torch.randn(512, 1024).to(dtype)
    moved = weight.clone()
    moved[300, 700] = torch.nextafter(moved[300, 700].double(), torch.tensor(10.0, dtype=torch.float64)).to(dtype) \
        if dtype == torch.float64 else torch.nextafter(moved[300, 700], torch.tensor(10.0, dtype=dtype))
    assert not torch.equal(weight, moved)
    (norm_a,), (sum_a,) = _read([weight])
    (norm_b,), (sum_b,) = _read([moved])
    assert norm_a == pytest.approx(norm_b, rel=1e-5)  # what the norm alone saw: nothing
    assert sum_a != sum_b
    assert 0 <= sum_a <= 0xFFFFFFFF


def test_checksum_does_not_depend_on_reduction_order_or_layout():
    torch.manual_seed(1)
    flat = torch.randn(3_000_001)
    reversed_copy = flat.flip(0).contiguous()
    transposed = flat[:3_000_000].reshape(1000, 3000).t()  # a non-contiguous view of the same elements
    (_,), (a,) = _read([flat])
    (_,), (b,) = _read([reversed_copy])
    (_,), (c,) = _read([flat[:3_000_000].clone()])
    (_,), (d,) = _read([transposed])
    assert a == b and c == d


def test_mixed_dtypes_in_one_fingerprint():
    tensors = [torch.randn(10), torch.randn(10).half(), torch.randn(3, dtype=torch.float64), torch.randn(4).bfloat16()]
    norms, sums = _read(tensors)
    assert len(norms) == len(sums) == 4
    assert norms[2] == pytest.approx(float(tensors[2].norm()))


# -- the collector ----------------------------------------------------------------------------------

NAMES = ["param:embed.weight", "param:head.weight"]


def _beat(rank: int, step: int, prints: list[dict]) -> wire.Heartbeat:
    now = time.time()
    data = {"identity": {"run_id": "ck", "rank": rank, "local_rank": rank, "world_size": 3},
            "sent_at": now, "seq": step, "step": step + 1, "forwards": step + 1, "phase": "data",
            "last_progress_at": now, "step_columns": list(wire.STEP_COLUMNS),
            "step_rows": [[step, now - 0.1, now, 1, 0.05, 0.01, 1.0, 1.0, 0, 1,
                           1 << 20, None, None, None, None, None, None]],
            "fingerprints": prints}
    return codec.decode_heartbeat(data)


def _verdicts(sums_of) -> list:
    """3 ranks, fingerprints every 4 steps with equal norms; ``sums_of(rank,
    step)`` gives a rank's checksums (None: an agent that sends none)."""
    collector = Collector(config=Config())
    try:
        for step in range(12):
            for rank in range(3):
                prints = []
                if step % 4 == 3:
                    fp = {"step": step, "names": NAMES, "norms": [1788.2, 11.5]}
                    sums = sums_of(rank, step)
                    if sums is not None:
                        fp["sums"] = sums
                    prints.append(fp)
                collector.ingest_heartbeat(_beat(rank, step, prints))
        return analyses.run_all(collector.runs["ck"], time.time(), True)
    finally:
        collector.stop()


def test_a_difference_only_the_checksum_sees_is_named():
    found = _verdicts(lambda rank, step: [7 if rank == 1 and step >= 7 else 5, 9])
    assert [(v.kind, v.ranks, v.step) for v in found] == [("weight_divergence", [1], 7)], found
    evidence = found[0].evidence
    assert evidence["differing_tensors"] == evidence["bits_only_tensors"] == ["param:embed.weight"]
    assert "norms agree" in found[0].summary


def test_equal_checksums_and_older_agents_are_not_named():
    assert _verdicts(lambda rank, step: [5, 9]) == []
    assert _verdicts(lambda rank, step: None) == []
    # One rank's agent sends none: the norms alone decide (equal here).
    assert _verdicts(lambda rank, step: None if rank == 2 else [5 + rank, 9]) != []  # ranks 0 and 1 still differ
    assert _verdicts(lambda rank, step: None if rank == 2 else [5, 9]) == []


@pytest.mark.parametrize("sums", [[1], [1, -1], [1, 2 ** 32], [1, 1.5], "12", [1, True]],
                         ids=["short", "negative", "too-wide", "float", "string", "bool"])
def test_malformed_checksums_are_refused(sums):
    fp = {"step": 3, "names": NAMES, "norms": [1.0, 2.0], "sums": sums}
    with pytest.raises(wire.WireError):
        _beat(0, 3, [fp])
    with pytest.raises(wire.WireError):  # the same through wire's road (another key sends it there)
        _beat(0, 3, [{**fp, "model": 1}])


# -- a real job ------------------------------------------------------------------------------------

_NUDGED = """
import os
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(50_000, 64), torch.nn.Flatten(), torch.nn.Linear(64 * 4, 8))
ddp = DDP(model)
opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
rank = dist.get_rank()
torch.manual_seed(100 + rank)
for step in range(30):
    if step == 10 and rank == 1 and os.environ.get("NUDGE") == "1":
        with torch.no_grad():  # once, 1e-3 * randn on a 3.2-million-element embedding (init N(0, 1))
            model[0].weight.add_(1e-3 * torch.randn_like(model[0].weight))
    opt.zero_grad()
    out = ddp(torch.randint(0, 50_000, (16, 4)))
    torch.nn.functional.cross_entropy(out, torch.randint(0, 8, (16,))).backward()
    opt.step()
"""


@pytest.mark.parametrize("nudge", [True, False], ids=["nudged", "healthy"])
def test_a_zero_mean_nudge_of_a_large_embedding_is_named(tmp_path, nudge):
    script = ddp_script(tmp_path, "nudged.py", _NUDGED)
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(script)], timeout=240,
                  env={"NUDGE": "1" if nudge else "0", "RANKWATCH_FINGERPRINT_EVERY": "2",
                       "RANKWATCH_GRAD_CHECK_BUDGET": "1.0"})
    assert job.exit_code == 0, job.output[-3000:]
    if not nudge:
        assert job.report["verdicts"] == [], job.report["verdicts"]
        return
    divergence = job.only("weight_divergence")
    # Two ranks, no majority: both are named (either could have changed).
    assert divergence["ranks"] == [0, 1] and divergence["step"] >= 10, divergence
    assert divergence["evidence"]["bits_only_tensors"] == ["param:0.weight"], divergence["evidence"]
    assert len(job.verdicts()) == 1, job.verdicts()
