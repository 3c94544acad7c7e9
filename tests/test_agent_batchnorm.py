"""No false alarm on legitimate replica differences: BatchNorm running
statistics differ between DDP replicas at step end (each rank normalises its
own batch); DDP makes them equal only by its broadcast at the start of a
forward, and never with broadcast_buffers=False. Parameters stay checked.

Heavy: real 3-rank gloo DDP jobs under `rankwatch run`.
"""

from __future__ import annotations

import pytest

from conftest import ddp_script, run_job

_CNN = """
import os
from torch.utils.data import DataLoader, TensorDataset, DistributedSampler
BROADCAST = os.environ.get("BN_BROADCAST", "1") == "1"
SYNC = os.environ.get("BN_SYNC", "0") == "1"
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
    torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
if SYNC:
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
ddp = DDP(model, broadcast_buffers=BROADCAST)
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(192, 3, 8, 8, generator=g), torch.randint(0, 4, (192,), generator=g))
sampler = DistributedSampler(data, shuffle=True, seed=0)
loader = DataLoader(data, batch_size=8, sampler=sampler)
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
for epoch in range(3):
    sampler.set_epoch(epoch)
    ddp.train()
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    ddp.eval()
    with torch.no_grad():  # an evaluation pass between epochs: forwards without backward
        ddp(torch.randn(8, 3, 8, 8))
PERTURB
"""


def _run(tmp_path, broadcast: bool, sync: bool, perturb: str = "", budget: str = ""):
    script = ddp_script(tmp_path, "bn.py", _CNN.replace("PERTURB", perturb))
    env = {"BN_BROADCAST": "1" if broadcast else "0", "BN_SYNC": "1" if sync else "0",
           "RANKWATCH_FINGERPRINT_EVERY": "2"}
    if budget:  # tiny steps: without a generous budget fingerprints are sampled out
        env["RANKWATCH_GRAD_CHECK_BUDGET"] = budget
    return run_job(tmp_path, ["--nproc-per-node", "3", str(script)], env=env, timeout=240)


def _fingerprints(job):
    from rankwatch.collector.offline import load

    run, _ = load(job.run_dir)
    return {rank: state.fingerprints for rank, state in run.ranks.items()}


# SyncBatchNorm: DDP accepts it only on GPU modules ("SyncBatchNorm layers only
# work with GPU modules"), so it cannot run in this CPU suite.
@pytest.mark.parametrize("broadcast,sync", [(True, False), (False, False)],
                         ids=["batchnorm", "batchnorm-no-broadcast"])
def test_healthy_batchnorm_cnn_has_no_verdict(tmp_path, broadcast, sync):
    job = _run(tmp_path, broadcast, sync)
    assert job.exit_code == 0, job.output[-3000:]
    assert job.report["status"] == "healthy", job.report
    assert job.report["verdicts"] == []
    prints = _fingerprints(job)
    assert all(prints.get(r) for r in range(3)), "every rank sent fingerprints"
    names = prints[0][-1]["names"]
    assert any(n.startswith("param:") for n in names)
    has_buffers = any(n.startswith("buffer:") for fp in prints[0] for n in fp["names"])
    # Buffers are compared only where DDP broadcast them.
    assert has_buffers == broadcast, names


def test_perturbed_parameter_still_named_with_batchnorm(tmp_path):
    # After training, rank 1 changes one weight and takes six more steps.
    perturb = """
if dist.get_rank() == 1:
    with torch.no_grad():
        model[0].weight[0, 0, 0, 0] += 1.0
ddp.train()
for _ in range(6):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(ddp(torch.randn(8, 3, 8, 8)), torch.zeros(8, dtype=torch.long)).backward()
    opt.step()
"""
    job = _run(tmp_path, broadcast=True, sync=False, perturb=perturb, budget="1.0")
    verdicts = job.verdicts("weight_divergence")
    assert verdicts, job.report
    assert verdicts[0]["ranks"] == [1]
    assert any("param:0.weight" in t for t in verdicts[0]["evidence"]["differing_tensors"])
    assert not any(t.startswith("buffer:") for t in verdicts[0]["evidence"]["differing_tensors"])
