"""rankwatch adds no host read of device data to a training step.

Real training steps (DDP, gloo world of size 1, AdamW, GradScaler, the
gradient checks on every step or sampled with the probe, fingerprints,
gradient flow) run with the device logic on: the GPU-like test double makes
every CPU tensor of the job a device tensor, so the code takes the path it
takes on CUDA. A torch function mode and a dispatch mode record every read
of tensor data on the host: `aten::_local_scalar_dense` (behind `.item()`,
`float()`, `bool()`, `aten::is_nonzero`), `Tensor.tolist`, `.numpy`, `.cpu`,
`__bool__`/`__float__`/`__int__`, and blocking copies to the host
(`aten::_to_copy` to the CPU, `copy_` without non_blocking). Reads of the
adapter's own host copies, made once their event completed, are not device
reads. The same steps run without the agent first: every read seen with the
agent must be one the job makes anyway (torch's own: AdamW's step counter,
GradScaler's found-inf check), call site for call site.

The last test adds an `.item()` to the gradient hook and checks that this
test would fail.

Those modes are thread-local and, under the GPU-like double, a host-to-device
copy dispatches nothing. The tests at the end run real steps on a device
the dispatcher sees (agent/core/dispatch_double.py, issue 25): every blocking
transfer from any thread is counted with its line, and their meta-test adds
an `.item()` and a `torch.tensor(..., device=d)` to the gradient hook.
"""

from __future__ import annotations

import collections
import os
import sys

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from rankwatch import config as config_mod
from rankwatch import wire
from rankwatch.agent.core import device as device_mod
from rankwatch.agent.core import safety
from rankwatch.agent.runtime import Agent

_READ_METHODS = {"tolist", "numpy", "cpu", "item", "__bool__", "__float__", "__int__", "__index__"}
_READ_OPS = {"aten::_local_scalar_dense", "aten::is_nonzero"}
_SKIP_FILES = (os.path.abspath(__file__), "torch/overrides.py", "torch/utils/_python_dispatch.py")


def _call_site() -> tuple[str, int]:
    frame = sys._getframe(2)
    while frame is not None and any(frame.f_code.co_filename.endswith(s) or s in frame.f_code.co_filename
                                    for s in _SKIP_FILES):
        frame = frame.f_back
    if frame is None:
        return ("?", 0)
    return (frame.f_code.co_filename, frame.f_lineno)


class HostReads:
    """Both modes, entered together; `reads` counts (what, file, line)."""

    def __init__(self, double: device_mod.GpuLikeDouble | None) -> None:
        self.double = double
        self.reads: collections.Counter = collections.Counter()
        outer = self

        class Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                name = getattr(func, "__name__", "")
                if name in _READ_METHODS and args and isinstance(args[0], torch.Tensor):
                    outer._note(f"Tensor.{name}", args[0])
                return func(*args, **(kwargs or {}))

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = func._schema.name
                if name in _READ_OPS:
                    outer._note(name, args[0])
                elif name == "aten::_to_copy" and str(kwargs.get("device", "")) == "cpu" \
                        and not kwargs.get("non_blocking", False):
                    outer._note(name, args[0])
                elif name == "aten::copy_" and not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)) \
                        and args[0].device.type == "cpu" and args[1].device.type != "cpu":
                    outer._note(name, args[1])
                return func(*args, **kwargs)

        self._modes = [Functions(), Ops()]

    def _note(self, what: str, tensor: torch.Tensor) -> None:
        if self.double is not None and id(tensor) in self.double.host_buffers:
            return  # the adapter's own host copy, read after its event completed
        self.reads[(what, *_call_site())] += 1

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


STEPS = 12


def _steps(double) -> collections.Counter:
    """Real training steps; returns the host reads seen while they ran."""
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    data = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(STEPS)]
    with HostReads(double) as seen:
        for step, (x, y) in enumerate(data):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return seen.reads


def _with_agent(**config) -> tuple[collections.Counter, Agent]:
    double = device_mod.GpuLikeDouble(device=1, current=0)
    device_mod.install(double)
    agent = Agent(config_mod.Config(**{"fingerprint_every": 2, **config}),
                  wire.RankIdentity(run_id="sync", rank=0, local_rank=0, world_size=1, node_rank=0,
                                    host="localhost", pid=os.getpid(), attempt=0), None)
    agent.install()
    try:
        reads = _steps(double)
        agent.progress.finish()
    finally:
        agent.uninstall()
        device_mod.install(None)
    return reads, agent


@pytest.fixture(scope="module")
def baseline(world):
    return _steps(None)


@pytest.mark.parametrize("budget", [0.0, 1e-9], ids=["full_check_every_step", "probe_on_sampled_out_steps"])
def test_the_agent_adds_no_host_read_of_device_data(world, baseline, budget):
    safety._disabled.clear()
    reads, agent = _with_agent(grad_check_budget=budget)
    assert not safety._disabled, safety._disabled
    added = reads - baseline
    assert not added, "host reads of device data the agent added:\n" + "\n".join(
        f"  {what} at {file}:{line} x{n}" for (what, file, line), n in added.items())
    # and the checks really ran, on the device path
    records = list(agent.progress.recent)
    assert len(records) == STEPS
    assert sum(r.grad_norm is not None or r.nonfinite_grads is not None for r in records) >= STEPS - 2
    assert any(e.kind == "overflow_skipped" for e in agent.events_log) or all(
        r.loss is not None for r in records)


def test_the_detector_catches_an_item_on_the_hot_path(world, baseline, monkeypatch):
    """What this test is for: a `.item()` added to the gradient hook is seen."""
    from rankwatch.agent.checks.grad_checks import GradChecker

    original = GradChecker._inspect

    def with_a_sync(self, param):
        param.grad.norm().item()  # the kind of line this test must catch
        return original(self, param)

    monkeypatch.setattr(GradChecker, "_inspect", with_a_sync)
    reads, _ = _with_agent(grad_check_budget=0.0)
    added = reads - baseline
    assert any(what in ("aten::_local_scalar_dense", "Tensor.item") for (what, _file, _line) in added), added


# -- on a device the dispatcher sees (agent/core/dispatch_double.py), every thread ---------------------

def _device_syncs(budget: float, *faults: str) -> dict:
    """tests/scripts/device_syncs.py in a process of its own (~8 s)."""
    import json
    import subprocess

    from conftest import SCRIPTS, worker_env

    done = subprocess.run([sys.executable, str(SCRIPTS / "device_syncs.py"), str(budget), *faults],
                          capture_output=True, text=True, timeout=240, env=worker_env())
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("budget", [0.0, 1e-9], ids=["full_check_every_step", "probe_on_sampled_out_steps"])
def test_the_agent_adds_no_host_device_transfer_on_a_dispatcher_visible_device(budget):
    """Issue 25, findings 1-3: `torch.tensor(..., device=d)` for the stale
    watch's sample index (every step), for the batch fingerprint's positions
    (every new input shape: 20 here, more than the cache held), and the
    probe layout's `.to(device)` copies (every parameter, whenever the
    probe's size changes) were each a blocking host-to-device copy on CUDA.
    The steps' inputs change shape every step; the gradient hooks run on
    the autograd engine's device thread, which a thread-local mode cannot see."""
    result = _device_syncs(budget)
    assert not result["disabled"], result["disabled"]
    assert not result["added"], "host<->device syncs the agent added:\n" + "\n".join(
        f"  {what} at {file}:{line} x{n}" for what, file, line, n in result["added"])
    # the checks ran, on the device path, on every step they watch
    assert result["records"] == 24
    assert result["grad_checked"] >= 22 and result["fingerprinted"] >= 22, result


def test_the_device_sync_test_can_fail():
    """What the test above is for: an `.item()` and a `torch.tensor(...,
    device=d)` added to the gradient hook are each seen, with their line."""
    result = _device_syncs(0.0, "item_in_grad_hook", "tensor_on_device_in_hook")
    seen = {(what, os.path.basename(file)) for what, file, _line, _n in result["added"]}
    assert ("aten::_local_scalar_dense", "device_syncs.py") in seen, result["added"]
    assert ("host to device copy", "device_syncs.py") in seen, result["added"]
