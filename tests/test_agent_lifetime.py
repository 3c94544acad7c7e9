"""The agent never keeps the job's models alive longer than the script does.

A DDP model holds its process group; a script that drops it before
``destroy_process_group`` must see it freed then, as under plain torch
(agent/core/weakrefs.py: torch 2.13's gloo may abort a process whose DDP
outlives the process group). Freed by reference counting, at the ``del``:
no cyclic garbage collection runs between the ``del`` and the check, as none
runs between a script's ``del model`` and its ``destroy_process_group``.

One process, a gloo world of size 1, the agent attached in process with
every check on (fingerprints every step, gradient checks unbudgeted).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import attached_agent
from rankwatch.agent.core import safety
from rankwatch.agent.runtime import Agent


def _agent() -> Agent:
    safety._disabled.clear()
    agent = attached_agent("lifetime", fingerprint_every=1, grad_check_budget=1.0)
    return agent


@pytest.fixture
def agent(world):
    agent = _agent()
    yield agent
    agent.uninstall()
    assert not safety._disabled, f"a part of the agent failed: {safety._disabled}"


def _train(model, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()


MODELS = {
    "linear": lambda: torch.nn.Linear(4, 1),
    "batchnorm": lambda: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1)),
}


def _dropped_ddp(build) -> tuple[bool, bool]:
    """Train a DDP model, drop it: (freed at the ``del`` by reference counting
    alone, freed by a cyclic collection)."""
    gc.collect()
    gc.disable()
    try:
        model = DDP(build())
        _train(model, 6)
        dropped = weakref.ref(model)
        del model
        at_once = dropped() is None
    finally:
        gc.enable()
    gc.collect()
    return at_once, dropped() is None


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_dropped_ddp_model_is_freed_when_plain_torch_frees_it(world, name):
    """Plain torch frees some DDP models at the ``del`` and some (DDP's own
    closures make a cycle: BatchNorm's buffer broadcast, torch 2.13) at the
    next cyclic collection. Under the agent, each is freed no later."""
    plain = _dropped_ddp(MODELS[name])
    agent = _agent()
    try:
        watched = _dropped_ddp(MODELS[name])
        assert agent.progress.step == 6 and agent.models is not None
    finally:
        agent.uninstall()
    assert not safety._disabled, f"a part of the agent failed: {safety._disabled}"
    assert plain[1], "plain torch kept the DDP model"
    assert watched[1] and (watched[0] or not plain[0]), {"plain (at once, after gc)": plain, "watched": watched}


def test_a_second_ddp_model_is_watched_after_the_first_is_dropped(agent):
    """A job that trains one model, drops it and builds another (a sweep, a
    fine-tune after pre-training) keeps its watching: the new model's
    forwards are counted and its fingerprints carry their own model index."""
    first = DDP(MODELS["batchnorm"]())
    _train(first, 3)
    del first
    second = DDP(MODELS["batchnorm"]())
    _train(second, 3)
    assert agent.progress.step == 6
    assert agent.ddp_modules.added == 2 and list(agent.ddp_modules) == [second]
    roots = [root for root in agent.models.roots if root.ddp is not None]
    assert [root.ddp for root in roots] == [second]


def test_a_dropped_models_parameters_are_freed(agent):
    """A script that trains one model and drops it (with its optimizer) gets
    its memory back as under plain torch: nothing of the agent's (roots,
    gradient checks, fingerprints, gradient-flow hooks) keeps its
    parameters; and the parts built for it leave the agent's lists."""
    model = DDP(MODELS["batchnorm"]())
    _train(model, 4)
    params = [weakref.ref(p) for p in model.parameters()]
    parts_before = len(agent.extensions)
    del model
    gc.collect()
    alive = [ref() for ref in params if ref() is not None]
    assert not alive, [type(r).__name__ for r in gc.get_referrers(alive[0])]
    assert len(agent.extensions) < parts_before
    assert all(root.module is not None for root in agent.models.roots)
    assert agent.models.named_parameters() == []


def test_a_dropped_model_without_ddp_is_freed(agent):
    """The same for a model trained without DDP (its gradient checks come
    from the first optimizer step's discovery)."""
    model = MODELS["batchnorm"]()
    _train(model, 4)
    assert agent.models.roots and agent.models.roots[0].module is model
    params = [weakref.ref(p) for p in model.parameters()]
    del model
    gc.collect()
    alive = [ref() for ref in params if ref() is not None]
    assert not alive, [type(r).__name__ for r in gc.get_referrers(alive[0])]
    assert agent.models.roots == []


def test_a_model_freed_on_another_thread_is_retired_by_the_training_thread(agent):
    """A cyclic collection may run on any thread (the heartbeat's): the parts
    of a model it frees are retired by the training thread at its next step
    end, never unhooked from another thread in the middle of a backward."""
    import threading

    gc.collect()
    gc.disable()  # the collection below, on another thread, is the one that frees it
    try:
        model = DDP(MODELS["batchnorm"]())
        _train(model, 3)
        parts = len(agent.extensions)
        model.__dict__["_cycle"] = [model]  # freed only by a cyclic collection
        dropped = weakref.ref(model)
        del model
        assert dropped() is not None
        collector = threading.Thread(target=gc.collect)
        collector.start()
        collector.join()
        assert dropped() is None
        assert len(agent.extensions) == parts, "retired on the heartbeat's thread"
        _train(torch.nn.Linear(4, 1), 1)  # the training thread's next step end
        assert len(agent.extensions) < parts
    finally:
        gc.enable()
