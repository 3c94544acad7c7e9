"""Fingerprints compare only what DDP keeps equal, within the cost budget.

Light test: one process, a gloo world of size 1, the agent attached in
process (the multi-rank no-false-alarm jobs are in test_agent_batchnorm.py).
"""

from __future__ import annotations


import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import attached_agent
from rankwatch.agent.checks.fingerprints import Fingerprinter
from rankwatch.agent.runtime import Agent


@pytest.fixture
def agent(world):
    agent = attached_agent("fp", fingerprint_every=2, grad_check_budget=0.0)
    yield agent
    agent.uninstall()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))


def _train(ddp, opt, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(16, 4) * 3 + 1).pow(2).mean().backward()
        opt.step()


def _fingerprinter(agent: Agent) -> Fingerprinter:
    return next(e for e in agent.extensions if isinstance(e, Fingerprinter))


def _sent(agent: Agent) -> list[dict]:
    return list(agent._unsent_fingerprints)


def test_buffers_taken_right_after_ddps_broadcast(agent):
    ddp = DDP(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    _train(ddp, opt, 2)  # step 1 ends: a fingerprint is due
    assert _sent(agent) == [], "parameters wait for the buffers of the next synchronised forward"
    bn = ddp.module[1]
    expected = float(torch.linalg.vector_norm(bn.running_mean))
    _train(ddp, opt, 1)  # its forward broadcasts buffers, then updates the running stats
    prints = _sent(agent)
    assert len(prints) == 1 and prints[0]["step"] == 1 and prints[0]["buffers"] == "after_broadcast"
    names = prints[0]["names"]
    assert names[:4] == ["param:0.weight", "param:0.bias", "param:1.weight", "param:1.bias"]
    at = names.index("buffer:1.running_mean")
    # The value before this forward's update: taken between the broadcast and the forward.
    assert prints[0]["norms"][at] == pytest.approx(expected)
    assert float(torch.linalg.vector_norm(bn.running_mean)) != pytest.approx(expected)
    assert not any(n.endswith("num_batches_tracked") for n in names)  # integer buffers: never


def test_no_buffers_without_broadcast(agent):
    ddp = DDP(_model(), broadcast_buffers=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    _train(ddp, opt, 2)
    prints = _sent(agent)
    assert len(prints) == 1 and prints[0]["step"] == 1, "sent at step end: nothing to wait for"
    assert all(n.startswith("param:") for n in prints[0]["names"])
    assert "buffers" not in prints[0]


def test_eval_forward_without_backward_completes_the_fingerprint(agent):
    ddp = DDP(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    _train(ddp, opt, 2)
    step = agent.progress.step
    ddp.eval()
    with torch.no_grad():
        ddp(torch.randn(4, 4))  # evaluation: DDP still broadcasts buffers
    assert agent.progress.step == step, "a forward without backward is no step"
    prints = _sent(agent)
    assert len(prints) == 1 and any(n.startswith("buffer:") for n in prints[0]["names"])


def test_direct_module_call_is_not_a_broadcast(agent):
    ddp = DDP(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    _train(ddp, opt, 2)
    ddp.module(torch.randn(4, 4))  # rank-0-only extra work through the inner module: no broadcast
    assert _sent(agent) == []
    agent.shutdown(0)  # at exit the parameters still go out
    prints = _sent(agent)
    assert len(prints) == 1 and all(n.startswith("param:") for n in prints[0]["names"])


def test_ignored_parameters_are_not_compared(agent):
    model = _model()
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["2.weight", "1.running_mean"])
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    _train(ddp, opt, 3)
    names = _sent(agent)[0]["names"]
    assert "param:2.weight" not in names and "buffer:1.running_mean" not in names
    assert "param:2.bias" in names and "buffer:1.running_var" in names


def test_interval_doubles_when_over_budget_and_stays_a_power_of_two(agent):
    agent.config.grad_check_budget = 1e-9  # any fingerprint is over this budget
    ddp = DDP(_model(), broadcast_buffers=False)
    fp = _fingerprinter(agent)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    _train(ddp, opt, 40)
    assert fp.multiplier > 1 and fp.multiplier & (fp.multiplier - 1) == 0
    steps = [p["step"] for p in _sent(agent)]
    assert steps and all((s + 1) % fp.every == 0 for s in steps)
    assert len(steps) < 40 // fp.every  # sampled: fewer than without a budget
