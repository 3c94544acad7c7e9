"""A plain Ray Train DDP job (TorchTrainer, gloo, CPU) watched by rankwatch.

    python examples/ray_train.py --storage /tmp/ray_results --name demo
    python examples/ray_train.py --fault hang --fault-rank 1 --fault-step 5

The report is <storage>/<name>/rankwatch/report.json. The training function
knows nothing of rankwatch; faults are injected on one rank, as real bugs happen.
The part between the README markers is the code shown in README.md (the tests
run this file).
"""

import argparse
import os
import signal
import sys
import time

import torch

import ray.train.torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


def train_loop_per_worker(config):
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(rank)
    faulty = rank == config["fault_rank"]
    for step in range(config["steps"]):
        if config["fault"] == "slow" and faulty:
            time.sleep(0.2)  # a slow data pipeline or a throttled device
        x, y = torch.randn(16, 64, generator=data), torch.randn(16, 1, generator=data)
        if config["fault"] == "nan" and faulty and step == config["fault_step"]:
            x[0, 0] = float("nan")  # one bad sample on one rank
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        if config["fault"] == "hang" and faulty and step == config["fault_step"]:
            time.sleep(3600)  # stuck in compute before the backward
        if config["fault"] == "crash" and faulty and step == config["fault_step"]:
            raise RuntimeError("injected failure: bad batch")
        if config["fault"] == "sigkill" and faulty and step == config["fault_step"]:
            os.kill(os.getpid(), signal.SIGKILL)  # the kernel's OOM killer, an operator's kill -9
        if config["fault"] == "exit" and faulty and step == config["fault_step"]:
            sys.exit(0)  # this rank's data ran out: it leaves, its peers wait in the next allreduce
        loss.backward()
        opt.step()
        time.sleep(config["step_time"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--step-time", type=float, default=0.02)
    p.add_argument("--fault", default="none", choices=("none", "hang", "crash", "nan", "slow", "sigkill", "exit"))
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=5)
    p.add_argument("--storage", default="/tmp/ray_results")
    p.add_argument("--name", default="rankwatch-demo")
    p.add_argument("--no-callback", action="store_true",
                   help="leave out the line (the baseline without rankwatch, or RAY_TRAIN_CALLBACKS instead)")
    a = p.parse_args()
    config = {"steps": a.steps, "step_time": a.step_time, "fault": a.fault, "fault_rank": a.fault_rank,
              "fault_step": a.fault_step}
    name, storage = a.name, a.storage
    if a.no_callback:
        run_config = RunConfig(name=name, storage_path=storage)
    else:
        # --- README snippet begin ---
        from rankwatch.ray import RankwatchCallback

        run_config = RunConfig(name=name, storage_path=storage, callbacks=[RankwatchCallback()])
        # --- README snippet end ---
    trainer = TorchTrainer(train_loop_per_worker, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=a.workers), run_config=run_config)
    trainer.fit()


if __name__ == "__main__":
    main()
