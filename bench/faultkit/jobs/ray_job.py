"""Ray Train (`TorchTrainer`, gloo, CPU): plain DDP through
`ray.train.torch.prepare_model` and `prepare_data_loader`, an MLP with dropout.

    python ray_job.py STORAGE NAME [STEPS] [WORKERS]

Starts its own local Ray cluster. Nothing here knows of rankwatch: the
benchmark adds it with Ray's own RAY_TRAIN_CALLBACKS variable.
"""

import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import ray
import ray.train.torch
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

STORAGE, NAME = sys.argv[1], sys.argv[2]
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 50
WORKERS = int(sys.argv[4]) if len(sys.argv) > 4 else 3


def train_loop_per_worker(config):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 64, generator=g)
    y = torch.tanh(x[:, :8].sum(dim=1, keepdim=True))
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, drop_last=True))
    model = ray.train.torch.prepare_model(torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)))
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
            if step == config["steps"]:
                break
        epoch += 1


def main():
    ray.init(num_cpus=WORKERS + 1, include_dashboard=False, log_to_driver=True)
    trainer = TorchTrainer(train_loop_per_worker, train_loop_config={"steps": STEPS},
                           scaling_config=ScalingConfig(num_workers=WORKERS),
                           run_config=RunConfig(name=NAME, storage_path=STORAGE))
    trainer.fit()
    print("training finished", flush=True)


if __name__ == "__main__":
    main()
