"""PyTorch Lightning: `Trainer(accelerator="cpu", strategy="ddp")` on an MLP
with dropout, launched by torchrun (Lightning reads RANK / WORLD_SIZE from it).

    torchrun --nproc-per-node 3 lightning_job.py [STEPS]
"""

import gc
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 50
SEED = int(os.environ.get("FAULTBENCH_SEED") or 0)  # the run's seed: its data, init and sampling


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)


def main():
    pl.seed_everything(SEED, verbose=False)
    g = torch.Generator().manual_seed(SEED + 1)
    x = torch.randn(4096, 64, generator=g)
    y = torch.tanh(x[:, :8].sum(dim=1, keepdim=True))
    data = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, drop_last=True)
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy="ddp",
                         max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Regressor(), data)
    if trainer.global_rank == 0:
        print(f"final loss: {trainer.callback_metrics['train_loss'].item():.6f}", flush=True)
    # Without it gloo's threads may abort the interpreter's exit (SIGABRT), with or without rankwatch;
    # the model let go first (tests/conftest.py).
    del trainer
    gc.collect()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
