"""Issue 25's findings that one process shows: the agent attached in this
test process (a gloo world of size 1, DDP), the GPU-like double installed so
the device path runs (events, deferred copies; ``latency_s=0``: every read
is in at the step's end). Each test asserts what the job's records and
events show a user. Cheap: about a second each.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from rankwatch import config as config_mod
from rankwatch import wire
from rankwatch.agent.core import device as device_mod
from rankwatch.agent.core import safety
from rankwatch.agent.runtime import Agent


@pytest.fixture
def agent_on_double(world):
    made = []

    def make(double_options=None, **config):
        safety._disabled.clear()
        double = device_mod.GpuLikeDouble(device=1, current=0, latency_s=0.0, **(double_options or {}))
        device_mod.install(double)
        agent = Agent(config_mod.Config(**config),
                      wire.RankIdentity(run_id="findings", rank=0, local_rank=0, world_size=1, node_rank=0,
                                        host="localhost", pid=os.getpid(), attempt=0), None)
        agent.install()
        made.append(agent)
        return agent, double

    yield make
    for agent in made:
        agent.uninstall()
    device_mod.install(None)
    safety._disabled.clear()


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                   torch.nn.Linear(32, 1)).to(dtype))


def _nonfinite(agent):
    return [e for e in agent.events_log if e.kind == "nonfinite"]


# -- finding 7 -----------------------------------------------------------------------------


def test_a_backward_that_raises_does_not_stop_the_gradient_checks(agent_on_double):
    """A batch-size finder: at step 3 the first backward raises half-way
    (an OOM, caught), and the step is retried. Autograd never runs the end
    callback of a backward that raised; the checks must go on: a NaN in
    rank 0's gradient of `4.weight` at step 8 is named at step 8."""
    agent, _ = agent_on_double()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    state = {"raise": False, "poison": False}

    def maybe_raise(grad):
        if state["raise"]:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return grad

    def maybe_poison(grad):
        return grad * float("nan") if state["poison"] else grad

    model.module[4].weight.register_hook(maybe_poison)
    for step in range(12):
        opt.zero_grad()
        if step == 3:
            state["raise"] = True
            try:
                hidden = model.module[0](torch.randn(64, 8))
                hidden.register_hook(maybe_raise)  # reached after the later layers' gradients
                model.module[4](model.module[3](model.module[2](model.module[1](hidden)))).pow(2).mean().backward()
            except torch.cuda.OutOfMemoryError:
                opt.zero_grad()
            state["raise"] = False
        state["poison"] = step == 8
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
    agent.progress.finish()
    records = {r.step: r for r in agent.progress.recent}
    checked = [s for s, r in records.items() if r.nonfinite_grads is not None]  # a full check or the probe
    assert checked == list(range(12)), [(s, r.grad_norm, r.nonfinite_grads) for s, r in records.items()]
    found = _nonfinite(agent)
    assert found and (found[0].step, found[0].details["parameters"]) == (8, ["4.weight"]), found


def test_float64_gradients_are_checked_and_timed(agent_on_double):
    """float64 gradients made `vector_norm(dtype=float32)` raise: the guard
    turned the whole gradient hook off (norms and, with it, step timing)."""
    agent, _ = agent_on_double()
    model = _model(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(6):
        opt.zero_grad()
        model(torch.randn(16, 8, dtype=torch.float64)).pow(2).mean().backward()
        opt.step()
    agent.progress.finish()
    assert not safety._disabled, safety._disabled
    records = list(agent.progress.recent)
    assert len(records) == 6
    assert all(r.nonfinite_grads == 0 for r in records), [r.nonfinite_grads for r in records]
    assert any(r.grad_norm is not None and r.grad_norm > 0 for r in records), [r.grad_norm for r in records]
    assert all(r.compute_s is not None for r in records[1:]), [r.compute_s for r in records]


# -- finding 6 -----------------------------------------------------------------------------


@pytest.mark.parametrize("config", [{"grad_checks": False}, {"silent_checks": False, "grad_checks": False}],
                         ids=["grad_checks_off", "all_checks_off"])
def test_step_timing_stands_without_the_gradient_checker(agent_on_double, config):
    """`compute_s` (the straggler check's input) was only set by the
    gradient checker's end-of-backward: without it, no straggler check."""
    agent, _ = agent_on_double(**config)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(6):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
    agent.progress.finish()
    records = list(agent.progress.recent)
    assert len(records) == 6
    assert all(r.compute_s is not None for r in records[1:]), [r.compute_s for r in records]


# -- finding 5 -----------------------------------------------------------------------------


def _sharded_like_fsdp2(double, width=192):
    """A model whose every layer waits, as FSDP2's do, on a collective queued
    on a side stream, in the forward (the unshard's all-gather) and in the
    backward (the unshard again): ``current_stream().wait_event(event)``
    through the stream API the double serves. The double's peer is slower
    (``peer_slowdown``), so the compute stream stalls at every wait."""
    streams = types.SimpleNamespace()
    double.serve_streams(streams)
    side = streams.Stream()

    def all_gather(*_):
        with streams.stream(side):
            event = side.record_event()
        streams.current_stream().wait_event(event)

    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(4)]
    for layer in layers:
        layer.register_forward_pre_hook(all_gather)
        layer.register_full_backward_pre_hook(all_gather)
    return DDP(torch.nn.Sequential(*layers)), streams, side


def _train(agent, model, steps, width=192, micro_batches=1):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(micro_batches):
            model(torch.randn(256, width)).pow(2).mean().backward()
        opt.step()
    agent.progress.finish()
    return list(agent.progress.recent)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("micro_batches", [1, 3], ids=["one_backward", "gradient_accumulation"])
def test_compute_time_leaves_out_the_stalls_behind_a_slower_peer(agent_on_double, micro_batches):
    """On a GPU, FSDP2's collectives return at once and the compute stream
    waits on them: a fast rank's device span from its first forward to its
    backward's end holds its stalls behind the slow rank, and compute_s came
    out the slow rank's on every rank. The peer here is 8x slower: the
    step's time is mostly stalls, and compute_s must be the rank's own work
    (with gradient accumulation the span runs to the last micro-batch's
    backward, and every micro-batch's stalls are in it)."""
    agent, double = agent_on_double(double_options={"peer_slowdown": 8.0}, grad_check_budget=1.0)
    model, _, _ = _sharded_like_fsdp2(double)
    records = _train(agent, model, 30 // micro_batches + 10, micro_batches=micro_batches)[10:]
    timed = [r for r in records if r.compute_s is not None]
    assert len(timed) >= len(records) - 2, [r.compute_s for r in records]  # every step timed (but the last)
    own = sorted(r.compute_s for r in timed)[len(timed) // 2]
    step = sorted(r.ended_at - r.started_at for r in records)[len(records) // 2]
    assert 0 < own < 0.4 * step, (own, step)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_a_step_whose_stalls_were_not_timed_has_no_compute_time_rather_than_a_wrong_one(agent_on_double):
    """Waits are timed on sampled steps (the budget's stride): the others
    carry no compute_s, never their span with the stalls in it."""
    agent, double = agent_on_double(double_options={"peer_slowdown": 8.0}, grad_check_budget=1e-7)
    model, _, _ = _sharded_like_fsdp2(double)
    records = _train(agent, model, 30)[10:]
    assert agent.progress.waits.stride > 1
    assert any(r.compute_s is None for r in records), [r.compute_s for r in records]
    step = sorted(r.ended_at - r.started_at for r in records)[len(records) // 2]
    assert all(r.compute_s < 0.4 * step for r in records if r.compute_s is not None), \
        ([r.compute_s for r in records], step)


def test_waits_of_other_streams_are_no_stalls_and_a_failed_timing_still_waits(agent_on_double, monkeypatch):
    """FSDP's all-gather stream waiting on its copy-in stalls no compute; and
    when rankwatch cannot record its events the wait itself still happens,
    once, and the step goes without compute_s."""
    agent, double = agent_on_double(double_options={"peer_slowdown": 8.0})
    _, streams, side = _sharded_like_fsdp2(double)
    waits = agent.progress.waits
    device = torch.device("cpu", double.device)
    waits.open(double, device, step=0)
    other = streams.Stream()
    other.wait_event(side.record_event())
    waits.close()
    assert waits.take(1.0, 0) == ([], 0)

    waits.open(double, device, step=0)
    compute = streams.current_stream()

    def broken(stream):
        raise RuntimeError("no event")

    monkeypatch.setattr(double, "stream_event", broken)
    event = side.record_event()
    compute.wait_event(event)
    assert compute.clock >= event.at  # the original wait ran
    waits.close()
    spans, untimed = waits.take(1.0, 0)
    assert (spans, untimed) == ([], 1)
