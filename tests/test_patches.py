"""Every function rankwatch patches accepts every call its original accepts
(positional, keyword, mixed) with the same result, and rejects wrong calls
with the same error. Frameworks call these the ways below (Lightning and
Fabric build ``DistributedDataParallel(module=model, ...)``).

Light test: one process, a gloo world of size 1, the agent attached in
process and detached at the end (``Agent.uninstall``).
"""

from __future__ import annotations

import inspect
import io
import os
import socket
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import attached_agent
from rankwatch import config as config_mod
from rankwatch import wire
from rankwatch.agent.watch import collectives as collectives_mod
from rankwatch.agent.runtime import Agent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def agent(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a process group already exists in this test process")
    agent = attached_agent("patches", fingerprint_every=1)
    try:
        # init_process_group the way Lightning / Accelerate call it: all keywords.
        dist.init_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1, timeout=timedelta(seconds=60))
        yield agent
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        agent.uninstall()


def test_uninstall_restores_everything():
    """install() then uninstall() leaves torch as it was (runs first: before the module's agent)."""
    before = (torch.Tensor.backward, DDP.__init__, c10d.all_reduce, dist.all_reduce, torch.save,
              c10d.init_process_group, dist.init_process_group)
    config = config_mod.Config()
    identity = wire.RankIdentity(run_id="u", rank=0, local_rank=0, world_size=1, node_rank=0, host="h",
                                 pid=os.getpid(), attempt=0)
    agent = Agent(config, identity, None)
    agent.install()
    try:
        assert torch.Tensor.backward is not before[0] and dist.all_reduce is c10d.all_reduce
    finally:
        agent.uninstall()
    after = (torch.Tensor.backward, DDP.__init__, c10d.all_reduce, dist.all_reduce, torch.save,
             c10d.init_process_group, dist.init_process_group)
    assert after == before


def original(agent: Agent, owner: Any, name: str) -> Callable:
    fn = agent.patches.original(owner, name)
    if fn is None:
        from rankwatch.agent.checks import grad_checks

        fn = grad_checks._PATCHES.original(owner, name)
    assert fn is not None, f"{owner}.{name} is not patched"
    return fn


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", call()
    except Exception as exc:  # the error itself is what is compared
        return type(exc).__name__, str(exc)


def assert_same_error(patched: Callable[[], Any], unpatched: Callable[[], Any]) -> None:
    got, want = outcome(patched), outcome(unpatched)
    assert got[0] != "ok", f"expected an error, got {got}"
    assert got == want


def test_every_patch_keeps_its_signature(agent):
    from rankwatch.agent.checks import grad_checks

    patched = agent.patches.names() + grad_checks._PATCHES.names()
    names = {name for _, name in patched}
    assert {"__init__", "backward", "init_process_group", "save", "all_reduce", "broadcast"} <= names
    for owner, name in patched:
        fn = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        before = original(agent, owner, name)
        assert getattr(fn, "__rankwatch_wrapped__", False)
        assert inspect.signature(fn) == inspect.signature(before), (owner, name)
        assert fn.__name__ == before.__name__ and fn.__doc__ == before.__doc__


def test_init_process_group_wrong_call_same_error(agent):
    assert dist.get_world_size() == 1 and agent.progress.phase in ("setup", "startup")
    unpatched = original(agent, c10d, "init_process_group")
    assert_same_error(lambda: dist.init_process_group(no_such_argument=1),
                      lambda: unpatched(no_such_argument=1))
    assert_same_error(lambda: dist.init_process_group("gloo", None, timedelta(seconds=1), 1, 0, "x", "y", "z", "w",
                                                      "v", "u", "t"),
                      lambda: unpatched("gloo", None, timedelta(seconds=1), 1, 0, "x", "y", "z", "w",
                                        "v", "u", "t"))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))


@pytest.mark.parametrize("how", ["module_keyword", "positional", "mixed", "all_keywords", "subclass"])
def test_ddp_init_accepts_what_ddp_accepts(agent, how):
    model = _model()
    before = len(agent.ddp_modules)
    if how == "module_keyword":  # Lightning's DDPStrategy, Fabric
        ddp = DDP(module=model, device_ids=None, find_unused_parameters=False)
    elif how == "positional":
        ddp = DDP(model, None, None, 0)
    elif how == "mixed":
        ddp = DDP(model, broadcast_buffers=False, bucket_cap_mb=1)
    elif how == "all_keywords":
        ddp = DDP(module=model, device_ids=None, output_device=None, dim=0, broadcast_buffers=True,
                  process_group=None, bucket_cap_mb=25, find_unused_parameters=False, check_reduction=False,
                  gradient_as_bucket_view=True, static_graph=False)
    else:
        class Wrapped(DDP):  # Accelerate / Lightning subclass DDP and call super().__init__(**kwargs)
            def __init__(self, **kwargs):
                super().__init__(**kwargs)

        ddp = Wrapped(module=model)
    assert ddp.module is model
    assert agent.ddp_modules[before:] == [ddp]
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    step = agent.progress.step
    loss = ddp(torch.randn(6, 4)).pow(2).mean()
    loss.backward()
    opt.step()
    assert agent.progress.step == step + 1
    record = agent.progress.recent[-1]
    assert record.grad_norm is not None and record.grad_norm > 0  # the comm hook ran on the local buckets


def test_ddp_init_wrong_calls_same_error(agent):
    unpatched = original(agent, DDP, "__init__")

    def build_unpatched(*args, **kwargs):
        obj = DDP.__new__(DDP)
        return unpatched(obj, *args, **kwargs)

    assert_same_error(lambda: DDP(), lambda: build_unpatched())
    model = _model()
    assert_same_error(lambda: DDP(model, module=model), lambda: build_unpatched(model, module=model))
    assert_same_error(lambda: DDP(model, no_such_option=True), lambda: build_unpatched(model, no_such_option=True))


def test_register_comm_hook_by_keyword_keeps_the_check(agent):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    seen = []

    def hook(state, bucket):
        seen.append(bucket.index())
        return allreduce_hook(state, bucket)

    ddp = DDP(_model())
    ddp.register_comm_hook(state=None, hook=hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp(torch.randn(6, 4)).sum().backward()
    opt.step()
    assert seen, "the user's hook must still run"
    assert agent.progress.recent[-1].grad_norm is not None  # and the local check too

    unpatched = original(agent, DDP, "register_comm_hook")
    other = DDP(_model())
    assert_same_error(lambda: other.register_comm_hook(None), lambda: unpatched(other, None))
    assert_same_error(lambda: other.register_comm_hook(None, hook, 3), lambda: unpatched(other, None, hook, 3))


def _graph():
    w = torch.ones(3, requires_grad=True)
    return w, (w * 2).sum()


@pytest.mark.parametrize("how", ["plain", "keywords", "positional", "unbound", "gradient"])
def test_backward_calls(agent, how):
    w, loss = _graph()
    if how == "plain":
        result = loss.backward()
    elif how == "keywords":
        result = loss.backward(gradient=None, retain_graph=True, create_graph=False, inputs=[w])
        loss.backward()  # the graph was retained
    elif how == "positional":
        result = loss.backward(None, True, False)
    elif how == "unbound":
        result = torch.Tensor.backward(loss)
    else:
        w2 = torch.ones(3, requires_grad=True)
        result = (w2 * 2).backward(torch.ones(3))
        w = w2
    assert result is None
    assert w.grad is not None and torch.all(w.grad > 0)


def test_backward_wrong_calls_same_error(agent):
    unpatched = original(agent, torch.Tensor, "backward")
    _, a = _graph()
    _, b = _graph()
    assert_same_error(lambda: a.backward(no_such=1), lambda: unpatched(b, no_such=1))
    assert_same_error(lambda: torch.Tensor.backward(), lambda: unpatched())
    _, c = _graph()
    _, d = _graph()
    assert_same_error(lambda: c.backward(None, True, False, None, "x"), lambda: unpatched(d, None, True, False, None, "x"))


def _collective_calls() -> dict[str, list[tuple[str, Callable[[Callable], Any]]]]:
    """op -> [(how, call(fn) -> comparable result)] in a world of size 1."""
    t = lambda: torch.arange(4, dtype=torch.float32)  # noqa: E731

    def in_place(fn, **kwargs):
        x = t()
        work = fn(**kwargs, tensor=x) if "tensor" not in kwargs else fn(**kwargs)
        return type(work).__name__, x.tolist()

    def all_reduce_pos(fn):
        x = t()
        return type(fn(x, dist.ReduceOp.SUM)).__name__, x.tolist()

    def all_reduce_kw(fn):
        x = t()
        return type(fn(tensor=x, op=dist.ReduceOp.MAX, group=None, async_op=False)).__name__, x.tolist()

    def all_reduce_async(fn):
        x = t()
        work = fn(x, async_op=True)
        work.wait()
        return x.tolist()

    def all_gather_kw(fn):
        out = [torch.zeros(4)]
        fn(tensor_list=out, tensor=t())
        return [o.tolist() for o in out]

    def all_gather_pos(fn):
        out = [torch.zeros(4)]
        fn(out, t())
        return [o.tolist() for o in out]

    def all_gather_into_tensor_kw(fn):
        out = torch.zeros(4)
        fn(output_tensor=out, input_tensor=t())
        return out.tolist()

    def all_gather_object_kw(fn):
        out = [None]
        fn(object_list=out, obj={"a": 1})
        return out

    def broadcast_kw(fn):
        x = t()
        fn(tensor=x, src=0)
        return x.tolist()

    def broadcast_pos(fn):
        x = t()
        fn(x, 0)
        return x.tolist()

    def broadcast_object_list_kw(fn):
        objs = [1, "two"]
        fn(object_list=objs, src=0)
        return objs

    def reduce_kw(fn):
        x = t()
        fn(tensor=x, dst=0, op=dist.ReduceOp.SUM)
        return x.tolist()

    def barrier_kw(fn):
        return type(fn(group=None, async_op=False)).__name__

    def barrier_pos(fn):
        return type(fn()).__name__

    def all_to_all_kw(fn):
        out = [torch.zeros(4)]
        fn(output_tensor_list=out, input_tensor_list=[t()])
        return [o.tolist() for o in out]

    def all_to_all_single_kw(fn):
        out = torch.zeros(4)
        fn(output=out, input=t())
        return out.tolist()

    def gather_kw(fn):
        out = [torch.zeros(4)]
        fn(tensor=t(), gather_list=out, dst=0)
        return [o.tolist() for o in out]

    def scatter_kw(fn):
        x = torch.zeros(4)
        fn(tensor=x, scatter_list=[t()], src=0)
        return x.tolist()

    def reduce_scatter_kw(fn):
        x = torch.zeros(4)
        fn(output=x, input_list=[t()])
        return x.tolist()

    def reduce_scatter_tensor_kw(fn):
        x = torch.zeros(4)
        fn(output=x, input=t())
        return x.tolist()

    def monitored_barrier_kw(fn):
        return fn(group=None, timeout=timedelta(seconds=30), wait_all_ranks=True)

    def all_gather_single_kw(fn):
        out = torch.zeros(4)
        fn(output_tensor=out, input_tensor=t())
        return out.tolist()

    def reduce_scatter_single_kw(fn):
        x = torch.zeros(4)
        fn(output=x, input=t())
        return x.tolist()

    def all_reduce_coalesced_kw(fn):
        xs = [t(), t()]
        fn(tensors=xs)
        return [x.tolist() for x in xs]

    def all_gather_coalesced_kw(fn):
        out = [[torch.zeros(4)]]
        fn(output_tensor_lists=out, input_tensor_list=[t()])
        return [o.tolist() for o in out[0]]

    def gather_object_kw(fn):
        out = [None]
        fn(obj={"b": 2}, object_gather_list=out, dst=0)
        return out

    def scatter_object_list_kw(fn):
        out = [None]
        fn(scatter_object_output_list=out, scatter_object_input_list=[{"c": 3}], src=0)
        return out

    return {
        "all_gather_single": [("keywords", all_gather_single_kw)],
        "reduce_scatter_single": [("keywords", reduce_scatter_single_kw)],
        "all_reduce_coalesced": [("keywords", all_reduce_coalesced_kw)],
        "all_gather_coalesced": [("keywords", all_gather_coalesced_kw)],
        "gather_object": [("keywords", gather_object_kw)],
        "scatter_object_list": [("keywords", scatter_object_list_kw)],
        "all_reduce": [("positional", all_reduce_pos), ("keywords", all_reduce_kw), ("async", all_reduce_async)],
        "all_gather": [("keywords", all_gather_kw), ("positional", all_gather_pos)],
        "all_gather_into_tensor": [("keywords", all_gather_into_tensor_kw)],
        "all_gather_object": [("keywords", all_gather_object_kw)],
        "broadcast": [("keywords", broadcast_kw), ("positional", broadcast_pos)],
        "broadcast_object_list": [("keywords", broadcast_object_list_kw)],
        "reduce": [("keywords", reduce_kw)],
        "barrier": [("keywords", barrier_kw), ("positional", barrier_pos)],
        "all_to_all": [("keywords", all_to_all_kw)],
        "all_to_all_single": [("keywords", all_to_all_single_kw)],
        "gather": [("keywords", gather_kw)],
        "scatter": [("keywords", scatter_kw)],
        "reduce_scatter": [("keywords", reduce_scatter_kw)],
        "reduce_scatter_tensor": [("keywords", reduce_scatter_tensor_kw)],
        "monitored_barrier": [("keywords", monitored_barrier_kw)],
    }


_CASES = [(op, how, call) for op, calls in _collective_calls().items() for how, call in calls]


def test_every_python_collective_is_covered():
    present = {name for name in collectives_mod._PY_API_COLLECTIVES if hasattr(c10d, name)}
    assert set(_collective_calls()) == present


@pytest.mark.parametrize("op,how,call", _CASES, ids=[f"{op}-{how}" for op, how, _ in _CASES])
def test_collective_same_result(agent, op, how, call):
    patched = getattr(dist, op)
    assert getattr(patched, "__rankwatch_wrapped__", False)
    unpatched = original(agent, c10d, op)
    calls_before = len(agent.collectives.calls)
    got, want = outcome(lambda: call(patched)), outcome(lambda: call(unpatched))
    assert got == want  # same value, or the same error (an op gloo lacks)
    if got[0] == "ok":
        recorded = list(agent.collectives.calls)[calls_before:]
        assert recorded and recorded[0]["op"] == op and recorded[0]["ended_ns"] > 0
        assert recorded[0]["callsite"].startswith(__file__), recorded[0]["callsite"]
        if op in ("all_reduce", "broadcast", "reduce"):
            assert recorded[0]["numel"] == 4  # the tensor is found when passed by keyword too


@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "all_gather", "barrier"])
def test_collective_wrong_calls_same_error(agent, op):
    patched, unpatched = getattr(dist, op), original(agent, c10d, op)
    calls_before = len(agent.collectives.calls)
    assert_same_error(lambda: patched(no_such_argument=1), lambda: unpatched(no_such_argument=1))
    assert_same_error(lambda: patched(*range(9)), lambda: unpatched(*range(9)))
    # A wrong call is no collective: not left "in flight" in the call log.
    assert all(c["ended_ns"] for c in list(agent.collectives.calls)[calls_before:])
    assert len(agent.collectives.calls) == calls_before


def test_torch_save_calls(agent, tmp_path):
    unpatched = original(agent, torch, "save")
    state = {"w": torch.arange(3)}
    for how in ("positional", "keywords", "path"):
        buf = io.BytesIO()
        if how == "positional":
            torch.save(state, buf, pickle_protocol=2)
        elif how == "keywords":
            torch.save(obj=state, f=buf)
        else:
            buf = tmp_path / "x.pt"
            torch.save(state, str(buf))
        if isinstance(buf, io.BytesIO):
            buf.seek(0)
        assert torch.equal(torch.load(buf)["w"], state["w"])
    assert agent.progress.phase != "checkpoint"  # restored after the write
    assert_same_error(lambda: torch.save(state), lambda: unpatched(state))
    assert_same_error(lambda: torch.save(state, "/nonexistent-dir/x.pt"), lambda: unpatched(state, "/nonexistent-dir/x.pt"))
    assert agent.progress.phase != "checkpoint"


def test_dcp_save_calls(agent, tmp_path):
    import torch.distributed.checkpoint as dcp

    unpatched = original(agent, dcp, "save")
    state = {"w": torch.arange(3.0)}
    dcp.save(state_dict=state, checkpoint_id=str(tmp_path / "kw"))
    dcp.save(state, checkpoint_id=str(tmp_path / "pos"))
    for sub in ("kw", "pos"):
        loaded = {"w": torch.zeros(3)}
        dcp.load(loaded, checkpoint_id=str(tmp_path / sub))
        assert torch.equal(loaded["w"], state["w"])
    assert_same_error(lambda: dcp.save(), lambda: unpatched())
    assert agent.progress.phase != "checkpoint"


def test_grad_scaler_scale_calls(agent):
    from torch.amp import GradScaler

    from rankwatch.agent.checks import grad_checks

    unpatched = grad_checks._PATCHES.original(GradScaler, "scale")
    if unpatched is None:
        pytest.skip("GradScaler.scale is patched only once a DDP model exists")
    scaler = GradScaler("cpu", init_scale=4.0)
    loss = torch.tensor(2.0)
    assert scaler.scale(outputs=loss).item() == unpatched(scaler, outputs=loss).item() == 8.0
    assert [t.item() for t in scaler.scale([loss, loss])] == [8.0, 8.0]
    assert_same_error(lambda: scaler.scale(), lambda: unpatched(scaler))


def test_optimizer_step_closure_result_kept(agent):
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.LBFGS([w], lr=0.1, max_iter=2)

    def closure():
        opt.zero_grad()
        loss = (w ** 2).sum()
        loss.backward()
        return loss

    result = opt.step(closure=closure)
    assert isinstance(result, torch.Tensor) and result.item() == pytest.approx(2.0)
