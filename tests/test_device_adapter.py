"""The device adapter and the GPU logic above it, on CPU through the test
double (`GpuLikeDouble`): events that complete later, asynchronous copies, a
current device (0) that is not the device the tensors live on, a slower
device, graph capture and an OOM raised through the allocator's observer.

One process, a gloo world of size 1, the agent attached in process. Each
test names the finding of issue 17 it covers; each failed before its fix
(the CUDA branches then ran only on a GPU, and crashed or leaked there).
"""

from __future__ import annotations

import json
import math
import os
import time
import types
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from rankwatch import config as config_mod
from rankwatch import wire
from rankwatch.agent.core import device as device_mod
from rankwatch.agent.core import safety
from rankwatch.agent.runtime import Agent

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture
def gpu():
    """The test double, as rank 0 would see GPU 1 with GPU 0 current (no set_device)."""
    double = device_mod.GpuLikeDouble(device=1, current=0)
    device_mod.install(double)
    yield double
    device_mod.install(None)


def _agent(**overrides) -> Agent:
    config = config_mod.Config(**{"fingerprint_every": 0, "grad_check_budget": 0.0, **overrides})
    identity = wire.RankIdentity(run_id="device", rank=0, local_rank=0, world_size=1, node_rank=0,
                                 host="localhost", pid=os.getpid(), attempt=0)
    agent = Agent(config, identity, None)
    agent.install()
    return agent


@pytest.fixture
def agent(world, gpu):
    safety._disabled.clear()
    agent = _agent()
    yield agent
    agent.uninstall()
    assert not safety._disabled, f"a part of the agent failed: {safety._disabled}"


def _net(width: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    # Several parameters per DDP bucket: the case that crashed the CUDA branch.
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 1))


def _train(model, opt, steps: int, nan_at: int = -1, scale: float = 1.0) -> None:
    for step in range(steps):
        opt.zero_grad()
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean() * scale
        if step == nan_at:
            loss = loss * float("nan")
        loss.backward()
        opt.step()


def _records(agent) -> dict[int, wire.StepRecord]:
    return {r.step: r for r in agent.progress.unsent}


# -- the double itself ------------------------------------------------------------------


def test_double_events_complete_only_after_later_work_and_copies_wait_for_them(gpu):
    gpu.latency_s = 3600.0  # done only by later work, never by the clock (a slow machine's pause)
    reads = device_mod.DeferredReads()
    got = []
    reads.submit([torch.tensor(2.0), torch.tensor([3.0, 4.0])], got.append)
    reads.flush()  # the step's end: its staged reads go to the host
    assert got == [] and reads.poll() == 0, "a device copy is not readable when it is queued"
    gpu.event(torch.device("cpu", 1))
    gpu.event(torch.device("cpu", 1))  # two later kernels: the copy is done by now
    assert reads.poll() == 1 and got == [[2.0, 3.0, 4.0]]


def test_deferred_reads_are_bounded_and_never_wait(gpu):
    gpu.latency_s = 3600.0  # a device that never finishes
    reads = device_mod.DeferredReads(limit=8)
    given_up = []
    started = time.perf_counter()
    for i in range(100):
        reads.submit([torch.tensor(float(i))], given_up.append)
        reads.flush()
        reads.poll()
    assert time.perf_counter() - started < 2.0
    assert len(reads.pending) <= 8 + 2  # the limit, plus what later events completed
    assert given_up and all(v is None or isinstance(v, list) for v in given_up)
    reads.give_up()
    assert not reads.pending


def test_a_steps_reads_go_to_the_host_as_one_copy_each_consumer_getting_its_own_values(gpu):
    """Each copy to the host of a GPU is a pinned allocation, a launch and
    an event (~0.2 ms of host time each on an H200): the reads submitted in
    a step are staged and issued at its end as one. What each read holds is
    its value when it was submitted, even if the tensor changes after."""
    gpu.latency_s = 3600.0
    copies = []
    to_host = gpu.to_host
    gpu.to_host = lambda tensor: copies.append(tensor.numel()) or to_host(tensor)
    reads = device_mod.DeferredReads()
    weight = torch.tensor([1.0, 2.0])
    got: dict[str, object] = {}
    reads.submit([weight], lambda v: got.__setitem__("weight", v))
    weight.add_(10.0)  # the optimizer's in-place update, after the read was asked for
    reads.submit([torch.tensor(3.0)], lambda v: got.__setitem__("loss", v))
    reads.submit([torch.tensor(4.0, dtype=torch.bfloat16), torch.tensor([5.0, 6.0])],
                 lambda v: got.__setitem__("norms", v))
    assert copies == [] and not reads.pending, "nothing is copied before the step ends"
    reads.flush()
    assert copies == [6], "one copy of the three reads' six values"
    gpu.event(torch.device("cpu", 1))
    gpu.event(torch.device("cpu", 1))
    assert reads.poll() == 1
    assert got == {"weight": [1.0, 2.0], "loss": [3.0], "norms": [4.0, 5.0, 6.0]}


def test_staged_reads_are_bounded_and_given_up_at_exit(gpu):
    gpu.latency_s = 3600.0
    reads = device_mod.DeferredReads()
    got = []
    for i in range(device_mod.STAGE_LIMIT + 3):  # a job whose steps never end
        reads.submit([torch.tensor(float(i))], got.append)
    assert len(reads.pending) == 1 and len(reads._staged) == 3, "a full stage goes as one copy by itself"
    reads.give_up()
    assert got == [None] * (device_mod.STAGE_LIMIT + 3) and not reads.pending and not reads._staged


def test_a_failed_copy_of_staged_reads_hands_none_to_each_and_raises(gpu):
    """A device in error (the copy raises, as CUDA does after a fault): no
    consumer is left waiting for values that will never come."""
    reads = device_mod.DeferredReads()
    got = []
    for i in range(3):
        reads.submit([torch.tensor(float(i))], got.append)

    def broken(tensor):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    gpu.to_host = broken
    with pytest.raises(RuntimeError):
        reads.flush()
    assert got == [None, None, None] and not reads._staged and not reads.pending


def test_the_cpu_adapter_reads_at_once():
    got = []
    device_mod.DeferredReads().submit([torch.tensor(1.5)], got.append)
    assert got == [[1.5]]


# -- finding 1: the gradient check on a GPU ---------------------------------------------


def test_gpu_gradient_checks_run_from_step_0_and_keep_nothing_between_steps(agent, gpu):
    """Finding 1: the CUDA branch raised on any bucket of two or more
    parameters (reshape(()) of a norm vector) and then kept appending every
    bucket's tensors forever. Now: values a step later, in the step records,
    nothing kept from one step to the next, bounded reads."""
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    checker = next(e for e in agent.extensions if type(e).__name__ == "GradChecker")
    for _ in range(30):
        _train(model, opt, 1)
        assert checker._step_values is None and checker._values == [], "device tensors kept past the step end"
    assert len(agent.progress.reads.pending) <= agent.progress.reads.limit
    records = _records(agent)
    assert len(records) >= 25, "records are held only until their values are in"
    assert all(records[s].grad_norm is not None and math.isfinite(records[s].grad_norm) for s in records)
    assert all(records[s].loss is not None for s in records)
    assert not [e for e in agent.events_log if e.kind == "step_values"], "values travel in the step rows"


def test_a_disabled_step_part_stops_the_hook_from_accumulating(agent, gpu):
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    checker = next(e for e in agent.extensions if type(e).__name__ == "GradChecker")
    _train(model, opt, 2)
    safety.disable("grad_checks.step", RuntimeError("simulated"))
    try:
        for _ in range(10):
            model(torch.randn(4, 8)).sum().backward()  # backward after backward, no step end reads them
            assert checker._step_values is None and checker._values == []
    finally:
        safety._disabled.discard("grad_checks.step")


def test_gpu_nan_in_gradients_is_named_a_step_later(agent, gpu):
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    _train(model, opt, 4)

    def poison(grad):
        return grad * float("nan")

    handle = model.module[2].weight.register_hook(poison)
    _train(model, opt, 1)
    handle.remove()
    _train(model, opt, 4)
    bad = [e for e in agent.events_log if e.kind == "nonfinite"]
    assert bad and bad[0].step == 4, bad
    assert bad[0].details["parameters"] == ["2.weight"]
    assert bad[0].details["source"] == "local_gradients"
    assert _records(agent)[4].nonfinite_grads == 1


def test_gpu_probe_names_the_poisoned_parameter_on_a_sampled_out_step(agent, gpu):
    """On steps the full check is sampled out, each parameter's probe values
    are gathered in its hook and judged together at the backward's end (one
    indexed count for all parameters): the count must land on the parameter
    it came from, whichever one it is."""
    class Still(torch.optim.SGD):  # steps (the hooks run) but leaves the weights alone: no NaN carried over
        def step(self, closure=None):
            return None

    model = DDP(_net())
    opt = Still(model.parameters(), lr=0.0)
    checker = next(e for e in agent.extensions if type(e).__name__ == "GradChecker")
    _train(model, opt, 4)
    checker.stride = 4  # steps 5, 6 and 7 are probe steps
    _train(model, opt, 1)  # step 4: a full check
    for name in ("2.weight", "4.bias", "0.weight"):
        module, kind = name.split(".")
        handle = getattr(model.module[int(module)], kind).register_hook(lambda grad: grad * float("nan"))
        _train(model, opt, 1)
        handle.remove()
    _train(model, opt, 2)
    records = _records(agent)
    assert records[4].grad_norm is not None and records[8].grad_norm is not None, "full checks on steps 4 and 8"
    assert [records[s].nonfinite_grads for s in (4, 5, 6, 7, 8)] == [0, 1, 1, 1, 0]
    bad = {e.step: e.details["parameters"] for e in agent.events_log if e.kind == "nonfinite"}
    assert (bad.get(5), bad.get(6), bad.get(7)) == (["2.weight"], ["4.bias"], ["0.weight"]), bad


# -- finding 4: device time ------------------------------------------------------------


def test_compute_time_is_device_time(agent, gpu):
    """Finding 4: compute_s was the host time at which the last bucket was
    queued. A slower device now shows in compute_s."""
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gpu.extra_s = 0.5  # the device needs 0.5 s more than the host took to queue the work
    _train(model, opt, 6)
    agent.progress.finish()
    records = _records(agent)
    assert records and all(r.compute_s is not None and r.compute_s >= 0.5 for r in records.values()), \
        [r.compute_s for r in records.values()]
    host = [r.ended_at - r.started_at for r in records.values()]
    assert max(host) < 0.5, "the host itself was fast: only the device time says slow"


# -- finding 5: the device of the tensors, not GPU 0 -----------------------------------


def test_everything_happens_on_the_tensors_device_not_the_current_one(agent, gpu):
    """Finding 5: without torch.cuda.set_device the current device is 0 while
    the tensors live on device k; events went to device 0's stream (racing
    the copy), every rank made a context on GPU 0, and memory stats read GPU 0."""
    gpu.set_memory(0, 0)
    gpu.set_memory(1, 123 << 20, reserved=200 << 20)
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    reads_before = gpu.stats_reads
    _train(model, opt, 5)
    agent.progress.finish()
    records = _records(agent)
    assert all(r.device_allocated_bytes == 123 << 20 and r.device_reserved_bytes == 200 << 20
               for r in records.values())
    assert gpu.stats_reads - reads_before == 5, "one read of the allocator's counters per step"
    assert gpu.touched == {1}, f"device 0 was used: {gpu.touched}"


# -- finding 6: graph capture ----------------------------------------------------------


def test_nothing_runs_during_a_graph_capture(agent, gpu):
    """Finding 6: a whole-step CUDA graph capture was invalidated by the
    step-end code (event queries, pinned allocations)."""
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _train(model, opt, 3)
    with gpu.capture():
        _train(model, opt, 1)  # forward, backward (comm hook), optimizer step: all under capture
    _train(model, opt, 3)
    assert gpu.violations == []
    assert agent.progress.step == 7


# -- finding 8: bounded, and accumulation is not overflow ------------------------------


def test_accumulation_without_no_sync_is_not_an_overflow(agent, gpu):
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        for _ in range(4):  # 4 micro-batches, each backward allreduces (no no_sync)
            model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    agent.progress.finish()
    assert not [e for e in agent.events_log if e.kind in ("overflow_skipped", "nonfinite")]
    assert agent.progress.step == 5


def test_a_step_gradscaler_skips_is_counted_once_with_its_parameters(agent, gpu):
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    for step in range(6):
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        if step == 2:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    for _ in range(3):
        _train(model, opt, 1)
    skipped = [e for e in agent.events_log if e.kind == "overflow_skipped"]
    assert len(skipped) == 1, skipped
    assert skipped[0].details["parameters"], "the non-finite parameters are named when their values come"
    assert not [e for e in agent.events_log if e.kind == "nonfinite"], "a skipped overflow is not a NaN"


def test_the_event_log_is_a_window(world):
    agent = _agent()
    try:
        for i in range(5000):
            agent.record_event("noise", step=i)
        agent.record_event("exception", message="x")
        for i in range(3000):
            agent.record_event("noise2", step=i)
        assert len(agent.events_log) <= 1024
        kinds = [e.kind for e in agent.recent_events()]
        assert "exception" in kinds and kinds.count("noise") == 1  # the first of each kind stays
    finally:
        agent.uninstall()


# -- finding 9: OOM ---------------------------------------------------------------------


def test_a_caught_oom_gives_no_oom_and_costs_nothing_on_the_allocating_thread(agent, gpu, monkeypatch):
    from rankwatch.agent.evidence import bundle as bundle_mod

    built = []
    monkeypatch.setattr(bundle_mod, "build", lambda *a, **k: built.append(a) or b"")
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _train(model, opt, 2)
    for batch in (1 << 30, 1 << 28, 1 << 26):  # a batch-size finder
        started = time.thread_time()  # this thread's own work: a scheduler's pause on a busy machine is not it
        with pytest.raises(torch.cuda.OutOfMemoryError):
            gpu.raise_oom(batch * 4)
        assert time.thread_time() - started < 0.1
    assert built == [], "no bundle on the allocating thread"
    _train(model, opt, 2)
    kinds = [e.kind for e in agent.events_log]
    assert "oom" not in kinds and "oom_caught" in kinds


def test_an_oom_that_ends_the_rank_is_oom_with_the_snapshot(agent, gpu, monkeypatch, tmp_path):
    from rankwatch.agent.evidence import bundle as bundle_mod

    gpu.snapshot = json.loads((DATA / "cuda_snapshot.json").read_text())
    delivered = []
    monkeypatch.setattr(bundle_mod, "deliver", lambda archive, incident, timeout=5.0, **parts: delivered.append(
        (incident, archive)))
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _train(model, opt, 2)
    try:
        gpu.raise_oom(1 << 33)
    except torch.cuda.OutOfMemoryError as exc:
        agent.on_exception(exc)
    oom = [e for e in agent.events_log if e.kind == "oom"]
    assert oom and oom[0].details["requested_bytes"] == 1 << 33
    assert delivered and delivered[0][0].startswith("oom-")
    from rankwatch.bundles import unpack

    bundle = unpack(delivered[0][1])
    assert bundle.manifest.reason == "oom"
    assert bundle.get("memory_snapshot.json")["summary"]["allocated_bytes"] > 0


def test_an_oom_names_the_device_total_as_such_and_summarises_the_ranks_own_device(agent, gpu, monkeypatch):
    """Issue 25, finding 8: the allocator calls its OOM observer with
    (device, requested, device total, device free); the total was stored as
    `device_allocated_bytes`. And the memory summary was taken without a
    device: on a rank that never called set_device, GPU 0's."""
    from rankwatch.agent.evidence import bundle as bundle_mod

    gpu.snapshot = json.loads((DATA / "cuda_snapshot.json").read_text())
    gpu.total[1] = 80 << 30
    gpu.set_memory(1, 3 << 30, reserved=4 << 30)
    delivered = []
    monkeypatch.setattr(bundle_mod, "deliver", lambda archive, incident, timeout=5.0, **parts: delivered.append(
        (incident, archive)))
    model = DDP(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    _train(model, opt, 2)
    gpu.touched.clear()
    try:
        gpu.raise_oom(1 << 33)
    except torch.cuda.OutOfMemoryError as exc:
        agent.on_exception(exc)
    oom = [e for e in agent.events_log if e.kind == "oom"]
    assert oom, [e.kind for e in agent.events_log]
    details = oom[0].details
    assert details["device_total_bytes"] == 80 << 30, details
    assert details.get("device_allocated_bytes") != 80 << 30, details
    from rankwatch.bundles import unpack

    bundle = unpack(delivered[0][1])
    assert "device 1" in bundle.text_members.get("memory_summary.txt", ""), sorted(bundle.text_members)
    assert 0 not in gpu.touched, "GPU 0 (the current device) was asked about: a context there on CUDA"


class _ModelledCuda:
    """What CUDA does with the current device during event work (read in
    torch 2.13's sources, REFERENCE.md "CUDA semantics"): a rank that never
    called set_device has device 0 current while its tensors live on
    device k. `torch.Event` goes through InlineEvent -> CUDAGuardImpl, whose
    record / elapsed_time / destroy end with setDevice(orig): device 0 is
    made current, and on CUDA 12 that creates a primary context there.
    `torch.cuda.Event` switches with a RAII guard (MaybeSetDevice) that
    creates none. `contexts` holds the devices a context was created on."""

    def __init__(self, current: int, tensors_on: int) -> None:
        self.current = current
        self.contexts = {tensors_on}
        outer = self

        class Stream:
            def __init__(self, index):
                self.device = torch.device("cuda", index)

        class ModuleEvent:  # torch.cuda.Event
            def __init__(self, enable_timing=False):
                self.at, self.timing, self.stream = None, enable_timing, None

            def record(self, stream=None):
                self.at = time.perf_counter()  # MaybeSetDevice(stream's device): no new context
                self.stream = stream

            def wait(self, stream=None):  # Python in torch.cuda.Event: what Stream.wait_event calls
                pass

            def query(self):
                return True

            def elapsed_time(self, end):
                return (end.at - self.at) * 1000.0

        class GenericEvent:  # torch.Event
            def __init__(self, device=None, enable_timing=False):
                self.at = None

            def record(self, stream=None):
                self.at = time.perf_counter()
                outer.contexts.add(outer.current)  # CUDAGuardImpl: setDevice(orig_device)

            def query(self):
                outer.contexts.add(outer.current)
                return True

            def elapsed_time(self, end):
                outer.contexts.add(outer.current)
                return (end.at - self.at) * 1000.0

        self.Stream, self.Event, self.GenericEvent = Stream, ModuleEvent, GenericEvent

    def current_stream(self, device=None):
        return self.Stream(self.current if device is None or device.index is None else device.index)


def test_event_work_creates_no_context_on_the_current_device(monkeypatch):
    """Issue 25, finding 4: the accelerator adapter's events on GPU 1, with
    GPU 0 current (no set_device), must create no context on GPU 0."""
    cuda = _ModelledCuda(current=0, tensors_on=1)
    adapter = device_mod.AcceleratorDevice("cpu")  # any device type: its module is the model above
    adapter.module = cuda
    monkeypatch.setattr(torch, "Event", cuda.GenericEvent)
    monkeypatch.setattr(torch.accelerator, "current_stream", cuda.current_stream, raising=False)
    on = torch.device("cuda", 1)
    start = adapter.event(on, timing=True)
    end = adapter.event(on, timing=True)
    assert adapter.ready(end)
    assert adapter.elapsed_s(start, end) is not None
    assert cuda.contexts == {1}, f"contexts on devices {sorted(cuda.contexts)}: GPU 0 got one"


def test_stream_waits_calls_name_the_module_event_and_the_stream_they_are_given(monkeypatch):
    """The three calls agent/watch/stream_waits.py makes of the accelerator
    adapter (issue 25, finding 5): the event class whose Python ``wait``
    every stream wait goes through, a device's current stream, and a timing
    event recorded on the stream given (autograd's device thread may have
    another current stream), with no context on the current GPU 0."""
    cuda = _ModelledCuda(current=0, tensors_on=1)
    adapter = device_mod.AcceleratorDevice("cpu")
    adapter.module = cuda
    monkeypatch.setattr(torch, "Event", cuda.GenericEvent)
    assert adapter.event_type() is cuda.Event
    on = torch.device("cuda", 1)
    assert adapter.current_stream(on).device == on
    assert adapter.current_stream(None).device == torch.device("cuda", 0)  # the current device's
    stream = adapter.current_stream(on)
    event = adapter.stream_event(stream)
    assert isinstance(event, cuda.Event) and event.timing and event.stream is stream
    assert cuda.contexts == {1}, f"contexts on devices {sorted(cuda.contexts)}: GPU 0 got one"
    # A device module whose event has no Python wait (a C++ type) or no event: nothing to patch.
    cuda.Event = type("CppEvent", (), {})
    assert adapter.event_type() is None
    del cuda.Event
    assert adapter.event_type() is None


def test_deferred_values_flatten_in_a_few_launches_to_the_same_floats():
    """DeferredReads.submit's flattening: the same float32 vector as a
    detach/reshape/float per value (mixed dtypes and shapes, a value that
    requires grad), always a new tensor (the host adapter reads it later as
    it is), in a number of launches that does not grow with the scalars."""
    from torch.utils._python_dispatch import TorchDispatchMode

    values = [torch.tensor(1.5), torch.tensor(2.0, dtype=torch.float64), torch.ones(3, dtype=torch.bfloat16),
              torch.tensor(7), torch.arange(4.0).reshape(2, 2), torch.tensor(3.0, requires_grad=True) * 2,
              torch.tensor(True)]
    expected = torch.cat([v.detach().reshape(-1).float() for v in values])
    got = device_mod._flat_float32(values)
    assert got.dtype == torch.float32 and not got.requires_grad and torch.equal(got, expected)
    one = torch.arange(3.0)
    assert device_mod._flat_float32([one]).data_ptr() != one.data_ptr()

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    scalars = [torch.tensor(float(i)) for i in range(200)]
    with Count():
        device_mod._flat_float32(scalars)
    assert Count.calls <= 4, Count.calls  # was 3 a value


def test_memory_stats_read_the_allocators_nested_dict_without_flattening_it():
    """The accelerator adapter reads torch.cuda's nested statistics (the
    shape torch/csrc/cuda/Module.cpp builds: stat -> pool -> kind) as the
    flat ``memory_stats`` would name them, and never calls the flat one
    (its Python walk was 0.45 ms a step on an H100)."""
    def pools(current, peak):
        kinds = {"current": current, "peak": peak, "allocated": peak, "freed": peak - current}
        return {"all": dict(kinds), "large_pool": dict(kinds), "small_pool": {k: 0 for k in kinds}}

    nested = {"allocated_bytes": pools(3 << 20, 7 << 20), "reserved_bytes": pools(8 << 20, 8 << 20),
              "active": pools(4, 9), "num_ooms": 0}
    module = types.SimpleNamespace(asked=[])

    def as_nested(device):
        module.asked.append(device)
        return nested

    def flat(device):
        raise AssertionError("the flat statistics were built")

    module.memory_stats_as_nested_dict, module.memory_stats = as_nested, flat
    adapter = device_mod.AcceleratorDevice("cpu")
    adapter.module = module
    on = torch.device("cuda", 1)
    assert adapter.memory_stats(on) == (3 << 20, 8 << 20, 7 << 20)
    assert module.asked == [on]
    nested.clear()  # the allocator has not started: torch gives {}
    assert adapter.memory_stats(on) == (0, 0, 0)
