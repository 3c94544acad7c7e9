"""torch.compile never breaks the job because of rankwatch (issue 17,
finding 6), on CPU where torch allows it:

- compiled autograd with DDP's Python reducer (`optimize_ddp="python_reducer"`):
  DDP calls comm hooks once per parameter with a `(grad, param)` tuple; the
  agent's default hook raised `AttributeError: 'tuple' object has no
  attribute 'buffer'` inside backward;
- `torch.compile(optimizer.step, fullgraph=True)`: the global optimizer hooks
  are traced; the agent's (`time.time()`, locks) made Dynamo raise
  `Unsupported`. Steps are still counted (see progress.CompiledSteps).
  Torch's own optimizers graph-break on purpose in `_use_grad` (torch 2.13),
  so the fullgraph case uses an optimizer without it, as a user's own would;
- collectives inside a `fullgraph=True` region.

One process, a gloo world of size 1, the agent attached in process.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import attached_agent
from rankwatch.agent.core import safety

pytest.importorskip("torch._dynamo")


@pytest.fixture
def agent(world):
    safety._disabled.clear()
    torch._dynamo.reset()
    agent = attached_agent("compile", fingerprint_every=0, grad_check_budget=0.0)
    yield agent
    agent.uninstall()
    torch._dynamo.reset()
    assert not safety._disabled, f"a part of the agent failed: {safety._disabled}"


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


class PlainSGD(torch.optim.Optimizer):
    """An optimizer of the user's own, without torch's `_use_grad` graph breaks."""

    def __init__(self, params, lr: float = 0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def test_compiled_autograd_with_the_python_reducer(agent, monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "optimize_ddp", "python_reducer")
    model = torch.compile(DDP(_net()), backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
    assert agent.progress.step == 3
    assert any(e.kind == "grad_checks_off" and e.details.get("reason") == "python_reducer"
               for e in agent.events_log)


def test_a_users_hook_still_gets_the_python_reducers_tuples(agent, monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "optimize_ddp", "python_reducer")
    seen = []

    def hook(state, bucket):  # a hook written for the python reducer: (grad, param)
        seen.append(type(bucket).__name__)
        grad, param = bucket
        param.grad.copy_(grad)

    ddp = DDP(_net())
    ddp.register_comm_hook(None, hook)
    model = torch.compile(ddp, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
    assert agent.progress.step == 2


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_optimizer_step_with_fullgraph(agent, backend):
    model = DDP(_net())
    opt = PlainSGD(model.parameters())
    step = torch.compile(opt.step, fullgraph=True, backend=backend)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        step()
    agent.progress.finish()
    assert agent.progress.step == 5
    records = list(agent.progress.recent)
    assert len(records) == 5 and all(r.loss is not None and r.grad_norm is not None for r in records)


def test_compiled_builtin_optimizer_step(agent):
    model = DDP(_net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = torch.compile(opt.step, backend="eager")
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        step()
    agent.progress.finish()
    assert agent.progress.step == 4


def test_collectives_in_a_fullgraph_region(agent):
    def reduce_and_scale(t):
        dist.all_reduce(t)
        return t * 2

    out = torch.compile(reduce_and_scale, fullgraph=True, backend="eager")(torch.ones(3))
    assert out.tolist() == [2.0, 2.0, 2.0]


def _compiled_ddp_graph_breaks() -> tuple[dict[str, int], list[str], int]:
    """Graph breaks (by reason) and Dynamo's warnings while a compiled DDP
    model trains 3 steps; and the forwards it made."""
    import warnings

    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = torch.compile(DDP(_net()), backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
    reasons = {key.split("\n")[0] + " | " + key.split("Explanation:")[-1].split(".")[0].strip(): count
               for key, count in counters["graph_break"].items()}
    return reasons, [str(w.message) for w in caught if "Dynamo" in str(w.message)], 3


def test_no_graph_break_of_rankwatchs_own_in_a_compiled_model(world):
    """Issue 26: with rankwatch, a compiled DDP model had graph breaks plain
    torch does not have: `time.time` (progress.py) and `time.perf_counter`
    (device.py) traced from the forward pre-hook, and Dynamo warned about
    tracing them. The same model, trained with and without the agent, has
    the same graph breaks (by reason), and the agent still counts its
    forwards and steps."""
    plain, plain_warnings, _ = _compiled_ddp_graph_breaks()
    safety._disabled.clear()
    agent = attached_agent("compile")
    try:
        watched, watched_warnings, steps = _compiled_ddp_graph_breaks()
        agent.progress.finish()
        assert set(watched) == set(plain), (watched, plain)
        assert watched_warnings == plain_warnings
        # Any forward hook on the DDP module (a no-op one too) makes Module._call_impl take
        # its hook path: Dynamo then meets DDP's own break once more. Nothing beyond that.
        assert sum(watched.values()) <= sum(plain.values()) + 1, (watched, plain)
        assert agent.progress.step == steps and agent.progress.forwards == steps
        assert all(r.loss is not None for r in agent.progress.recent)
    finally:
        agent.uninstall()
        torch._dynamo.reset()
    assert not safety._disabled, f"a part of the agent failed: {safety._disabled}"


def test_a_compiled_model_traces_while_another_thread_imports(world):
    """A compiled DDP job crashed under rankwatch (CI, the `compiled` healthy
    shape): Dynamo traced the agent's forward pre-hook, whose "is torch
    compiling" test read `sys.modules`, and Dynamo iterated that dict while
    another thread (a DataLoader, a logger) imported a module: "dictionary
    changed size during iteration". Nothing the agent's traced hooks touch
    may be shared state another thread changes. Here a thread adds and drops
    modules without pause while the model is traced again and again."""
    import sys
    import threading
    import types

    safety._disabled.clear()
    agent = attached_agent("compile")
    stop = threading.Event()

    def churn():
        names = [f"_rankwatch_churn_{i}" for i in range(64)]
        while not stop.is_set():
            for name in names:
                sys.modules[name] = types.ModuleType(name)
            for name in names:
                sys.modules.pop(name, None)

    thread = threading.Thread(target=churn, daemon=True)
    thread.start()
    try:
        model = DDP(_net())
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(6):
            torch._dynamo.reset()  # trace again: each trace is a chance for the race
            compiled = torch.compile(model, backend="eager")
            opt.zero_grad()
            compiled(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
        agent.progress.finish()
        assert agent.progress.step == 6
    finally:
        stop.set()
        thread.join(timeout=10)
        agent.uninstall()
        torch._dynamo.reset()
    assert not safety._disabled, f"a part of the agent failed: {safety._disabled}"
