"""A job with two DDP models (a GAN's generator and discriminator) prints a
fingerprint of each at the same step; their parameter names may even be the
same ("0.weight" of two Sequentials). Found by the zoo: each rank adapts its
fingerprint interval per model to its own cost, so at step 249 rank 1 had
printed only the generator, which was compared with rank 0's discriminator: a
false weight_divergence. Each model's prints are now compared with the same
model's on the other ranks."""

from __future__ import annotations

import time

from rankwatch import wire
from rankwatch.collector import analyses, codec
from rankwatch.collector.service import Collector
from rankwatch.config import Config

NAMES = ["param:0.weight", "param:0.bias"]
GEN, DISC = [4.97, 3.11], [4.51, 1.20]


def _beat(rank: int, step: int, prints: list[dict]) -> wire.Heartbeat:
    now = time.time()
    data = {"identity": {"run_id": "gan", "rank": rank, "local_rank": rank, "world_size": 2},
            "sent_at": now, "seq": step, "step": step + 1, "forwards": 2 * (step + 1), "phase": "data",
            "last_progress_at": now, "step_columns": list(wire.STEP_COLUMNS),
            "step_rows": [[step, now - 0.1, now, 2, 0.05, 0.01, 1.0, 1.0, 0, 1,
                           1 << 20, None, None, None, None, None, None]],
            "fingerprints": prints}
    return codec.decode_heartbeat(data)


def _verdicts(sampled_out: bool, diverged: bool) -> list:
    collector = Collector(config=Config())
    try:
        for step in range(12):
            for rank in (0, 1):
                prints = []
                if step % 4 == 1:
                    disc = [v * (1.5 if diverged and rank == 1 and step >= 5 else 1.0) for v in DISC]
                    prints.append({"step": step, "names": NAMES, "norms": GEN})
                    if not (sampled_out and rank == 1 and step == 5):  # rank 1's interval for it doubled
                        prints.append({"step": step, "names": NAMES, "norms": disc, "model": 1})
                collector.ingest_heartbeat(_beat(rank, step, prints))
        return analyses.run_all(collector.runs["gan"], time.time(), True)
    finally:
        collector.stop()


def test_a_rank_that_sampled_one_model_out_is_not_a_divergence():
    assert [v.kind for v in _verdicts(sampled_out=True, diverged=False)] == []


def test_a_model_that_really_diverges_is_still_named():
    found = _verdicts(sampled_out=False, diverged=True)
    assert [(v.kind, v.ranks, v.step) for v in found] == [("weight_divergence", [0, 1], 5)], found
