"""Ray Train `TorchTrainer` (gloo, CPU, 2 workers): `prepare_model` (DDP)
and `prepare_data_loader` (a DistributedSampler, set_epoch each epoch), an
MLP with dropout, SGD with momentum, `ray.train.report` of the loss every 50
steps. Launched by Ray, not torchrun: rankwatch joins through Ray's own
RAY_TRAIN_CALLBACKS=rankwatch.ray.RankwatchCallback (zoo.py sets it), and
writes report.json under the run's storage.

    python ray_train.py --steps 300 --seed 0 --storage DIR
"""

import argparse
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

import ray
import ray.train
import ray.train.torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

WORKERS = 2


def train_loop_per_worker(config):
    torch.set_num_threads(1)
    torch.manual_seed(config["seed"])
    g = torch.Generator().manual_seed(config["seed"] + 1)
    x = torch.randn(4096, 32, generator=g)
    y = torch.tanh(x[:, :8].sum(dim=1, keepdim=True))
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, drop_last=True))
    model = ray.train.torch.prepare_model(torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(128, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    step, epoch = 0, 0
    while step < config["steps"]:
        if ray.train.get_context().get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            optimizer.step()
            step += 1
            if step % 50 == 0:
                ray.train.report({"loss": float(loss), "step": step})
            if step == config["steps"]:
                break
        epoch += 1


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--storage", default=os.path.abspath("ray_results"))
    a = parser.parse_args()
    ray.init(num_cpus=WORKERS + 1, include_dashboard=False, log_to_driver=True)
    trainer = TorchTrainer(train_loop_per_worker, train_loop_config={"steps": a.steps, "seed": a.seed},
                           scaling_config=ScalingConfig(num_workers=WORKERS),
                           run_config=RunConfig(name="zoo", storage_path=a.storage))
    trainer.fit()
    print(f"zoo: steps={a.steps}", flush=True)


if __name__ == "__main__":
    main()
