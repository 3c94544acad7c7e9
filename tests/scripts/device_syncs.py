"""Count the host<->device syncs rankwatch adds to real training steps on a
device the dispatcher sees (agent/core/dispatch_double.py), from every thread.

Run by tests/test_no_host_sync.py in a process of its own (registering the
backend changes torch.accelerator for the whole process). The same steps
run first without the agent, then with it; prints one JSON line: the syncs
seen with the agent, per (what, file, line), minus those the job makes
anyway, and what the agent's checks produced.

argv: grad_check_budget, then optional fault names (the meta-test's lines a
sync test must catch: "item_in_grad_hook", "tensor_on_device_in_hook").
"""

from __future__ import annotations

import collections
import json
import os
import socket
import sys

import torch
import torch.distributed as dist

from rankwatch import config as config_mod
from rankwatch import wire
from rankwatch.agent.core import device as device_mod
from rankwatch.agent.core import dispatch_double
from rankwatch.agent.core import safety
from rankwatch.agent.runtime import Agent

STEPS = 24


def _steps(device: torch.device) -> collections.Counter:
    """Real steps: AdamW, a weight decay group, inputs whose sequence length
    changes every step (dynamic padding: 20 shapes, more than any shape cache)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    lengths = [5 + (7 * step) % 20 for step in range(STEPS)]
    dispatch_double.TRANSFERS.clear()
    for step in range(STEPS):
        x = torch.randn(4, lengths[step], 8, device=device)
        y = torch.randn(4, 1, device=device)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x).mean(dim=1), y)
        loss.backward()
        opt.step()
    return dispatch_double.TRANSFERS.snapshot()


def _by_site(counts: collections.Counter) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for (what, file, line, _thread), n in counts.items():
        out[(what, file, line)] += n
    return out


def _inject(faults: list[str]) -> None:
    from rankwatch.agent.checks.grad_checks import GradChecker

    inspect = GradChecker._inspect
    if "item_in_grad_hook" in faults:
        def with_item(self, param, _inner=inspect):
            param.grad.norm().item()  # the kind of line the sync test must catch
            return _inner(self, param)
        inspect = with_item
    if "tensor_on_device_in_hook" in faults:
        def with_tensor(self, param, _inner=inspect):
            torch.tensor([0, 1], device=param.grad.device)  # finding 1's kind of line
            return _inner(self, param)
        inspect = with_tensor
    GradChecker._inspect = inspect


def main() -> None:
    budget = float(sys.argv[1])
    _inject(sys.argv[2:])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    device = dispatch_double.register()
    baseline = _by_site(_steps(device))

    double = dispatch_double.DispatchDouble()
    device_mod.install(double)
    agent = Agent(config_mod.Config(fingerprint_every=2, grad_check_budget=budget),
                  wire.RankIdentity(run_id="sync", rank=0, local_rank=0, world_size=1, node_rank=0,
                                    host="localhost", pid=os.getpid(), attempt=0), None)
    agent.install()
    try:
        seen = _steps(device)
        agent.progress.finish()
    finally:
        agent.uninstall()
        device_mod.install(None)
    threads = sorted({thread for (_w, _f, _l, thread) in seen})
    added = _by_site(seen) - baseline
    records = list(agent.progress.recent)
    print(json.dumps({
        "added": [[what, file, line, n] for (what, file, line), n in added.items()],
        "threads": threads,
        "disabled": sorted(safety._disabled),
        "records": len(records),
        "grad_checked": sum(r.grad_norm is not None or r.nonfinite_grads is not None for r in records),
        "fingerprinted": sum(1 for r in records if r.batch_fp is not None),
    }))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
