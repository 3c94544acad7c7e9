"""Structures shared between the training thread and rankwatch's own
threads: each has one owner (the thread that writes it) and the others read
a snapshot. A bundle built while steps run never fails on a structure the
training thread is changing (issue 26: "bundle for nonfinite-1 failed:
RuntimeError: deque mutated during iteration")."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist

from rankwatch import config as config_mod
from rankwatch import wire
from rankwatch.agent.runtime import Agent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bundles_built_while_steps_run(tmp_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    agent = Agent(config_mod.Config(run_dir=str(tmp_path)),
                  wire.RankIdentity(run_id="t", rank=0, local_rank=0, world_size=1), None)
    agent.install()
    dist.init_process_group("gloo")
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # thread switches as often as CPython allows: races show at once
    stop = threading.Event()
    failures: list[str] = []
    built = [0]

    def build_bundles() -> None:
        while not stop.is_set():
            try:
                agent.build_bundle("stress", f"stress-{built[0]}")
                built[0] += 1
            except Exception as exc:  # what the agent logged as "bundle ... failed"
                failures.append(f"{type(exc).__name__}: {exc}")
                return

    builder = threading.Thread(target=build_bundles, daemon=True)
    try:
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(2, 4)
        builder.start()
        deadline, hard = time.monotonic() + 4.0, time.monotonic() + 30.0  # 4 s, or until 3 bundles on a slow machine
        while not failures and built[0] < 40 and time.monotonic() < (deadline if built[0] >= 3 else hard):
            for _ in range(20):
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
                dist.all_reduce(torch.ones(1))  # a collective: the calls log grows too
    finally:
        stop.set()
        builder.join(timeout=10)
        sys.setswitchinterval(interval)
        agent.uninstall()
        dist.destroy_process_group()
    assert not failures, failures
    assert built[0] >= 3  # bundles really were built while the steps ran
