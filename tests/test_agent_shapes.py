"""The agent's step counting, loss observation and gradient checks do not
depend on the shape of the training script: several optimizers, many
parameter groups, a re-created optimizer, gradient accumulation with and
without no_sync, LR schedulers, evaluation forwards between steps, GradScaler,
torch.compile.

One process, a gloo world of size 1, the agent attached in process (the
multi-rank end-to-end runs of these shapes are in test_healthy_shapes.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import attached_agent
from rankwatch.agent.core import safety


@pytest.fixture
def agent(world):
    # Budget 0: every step fully checked, so the test sees every norm.
    agent = attached_agent("shapes", fingerprint_every=0, grad_check_budget=0.0)
    yield agent
    agent.uninstall()
    assert not safety._disabled, f"a part of the agent failed: {safety._disabled}"


def _net(width: int = 8) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))


def _batch():
    return torch.randn(8, 4), torch.randn(8, 1)


def _records(agent):
    return list(agent.progress.recent)


def test_two_optimizers_per_iteration_count_one_step(agent):
    gen, disc = DDP(_net()), DDP(_net())
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.SGD(disc.parameters(), lr=1e-2)
    for _ in range(5):
        x, y = _batch()
        opt_d.zero_grad()
        d_loss = (disc(x) - y).pow(2).mean()
        d_loss.backward()
        opt_d.step()
        opt_g.zero_grad()
        g_loss = disc(x + gen(x)).mean()
        g_loss.backward()
        opt_g.step()
    assert agent.progress.step == 5
    assert all(r.loss is not None and math.isfinite(r.loss) for r in _records(agent))


def test_critic_stepping_more_often_than_the_actor(agent):
    actor, critic = DDP(_net()), DDP(_net())
    opt_a = torch.optim.Adam(actor.parameters(), lr=1e-3)
    opt_c = torch.optim.Adam(critic.parameters(), lr=1e-3)
    for _ in range(4):
        opt_a.zero_grad()
        actor(_batch()[0]).mean().backward()
        opt_a.step()
        for _ in range(3):
            opt_c.zero_grad()
            x, y = _batch()
            (critic(x) - y).pow(2).mean().backward()
            opt_c.step()
    # Steps follow the optimizer that steps most (the critic took the lead):
    # monotonic, never stalled, one per critic update after the first iteration.
    assert agent.progress.step >= 4
    steps = [r.step for r in _records(agent)]
    assert steps == list(range(len(steps)))


def test_recreated_optimizer_keeps_counting(agent):
    model = DDP(_net())
    for phase in range(3):  # a new optimizer per phase (a restart, a fine-tuning stage)
        opt = torch.optim.SGD(model.parameters(), lr=0.01 * (phase + 1))
        for _ in range(4):
            opt.zero_grad()
            x, y = _batch()
            (model(x) - y).pow(2).mean().backward()
            opt.step()
        del opt
    assert agent.progress.step == 12


def test_recreated_optimizer_still_alive_keeps_counting(agent):
    model = DDP(_net())
    kept = []
    for phase in range(3):  # the old optimizers stay referenced (a list, a scheduler)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        kept.append(opt)
        for _ in range(4):
            opt.zero_grad()
            x, y = _batch()
            (model(x) - y).pow(2).mean().backward()
            opt.step()
    # Each new optimizer takes the lead at its second step: at most one step lost per phase.
    assert agent.progress.step >= 10
    assert agent.progress.step <= 12


def test_many_param_groups_and_a_scheduler(agent):
    model = DDP(torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(12)]))
    groups = [{"params": layer.parameters(), "lr": 0.001 * (i + 1)} for i, layer in enumerate(model.module)]
    opt = torch.optim.AdamW(groups)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=20)
    for _ in range(10):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        sched.step()
    assert agent.progress.step == 10
    assert all(r.grad_norm is not None and r.grad_norm > 0 for r in _records(agent))


@pytest.mark.parametrize("no_sync", [True, False], ids=["no_sync", "allreduce_every_micro_batch"])
def test_gradient_accumulation(agent, no_sync):
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    micro = 4
    for _ in range(5):
        opt.zero_grad()
        for i in range(micro):
            x, y = _batch()
            loss = (model(x) - y).pow(2).mean() / micro
            if no_sync and i < micro - 1:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
    records = _records(agent)
    assert agent.progress.step == 5
    assert [r.forwards for r in records] == [micro] * 5
    assert all(r.grad_norm is not None and math.isfinite(r.grad_norm) for r in records)
    assert not [e for e in agent.events_log if e.kind in ("nonfinite", "overflow_skipped")]


def test_eval_forwards_are_not_steps_and_do_not_touch_the_loss(agent):
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(6):
        opt.zero_grad()
        x, y = _batch()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            for _ in range(3):  # an evaluation loop: forwards, no backward
                (model(torch.randn(8, 4)) * 1e6).sum()
        model.train()
    records = _records(agent)
    assert agent.progress.step == 6
    assert all(r.loss is not None and r.loss < 1e3 for r in records), [r.loss for r in records]


def test_rank_local_extra_backward_is_not_the_training_loss(agent):
    model = DDP(_net())
    aux = _net()  # not DDP: e.g. a probe network trained on rank 0 only
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    aux_opt = torch.optim.SGD(aux.parameters(), lr=0.01)
    for _ in range(4):
        opt.zero_grad()
        x, y = _batch()
        (model(x) - y).pow(2).mean().backward()
        opt.step()
        aux_opt.zero_grad()
        (aux(x) * 1e6).pow(2).mean().backward()  # huge, unrelated loss
        aux_opt.step()
    records = _records(agent)
    assert agent.progress.step == 4
    assert all(r.loss is not None and r.loss < 1e3 for r in records), [r.loss for r in records]


def test_grad_scaler_loss_is_reported_unscaled(agent):
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(3):
        opt.zero_grad()
        x, y = _batch()
        loss = (model(x) - y).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    records = _records(agent)
    assert agent.progress.step == 3
    assert all(r.loss is not None and r.loss < 100 for r in records), [r.loss for r in records]


@pytest.mark.parametrize("how", ["compile_inner", "compile_ddp"])
def test_torch_compile(agent, how):
    pytest.importorskip("torch._dynamo")
    net = _net()
    if how == "compile_inner":
        model = DDP(torch.compile(net))
    else:
        model = torch.compile(DDP(net))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(4):
        opt.zero_grad()
        x, y = _batch()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
    records = _records(agent)
    assert agent.progress.step == 4
    assert agent.progress.forwards >= 4
    assert all(r.loss is not None and math.isfinite(r.loss) for r in records)
    assert any(r.grad_norm is not None for r in records)
