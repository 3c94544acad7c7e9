"""A small PyTorch Lightning job: Trainer(strategy="ddp", accelerator="cpu",
devices=2), launched by torchrun (Lightning reads RANK/WORLD_SIZE from it).

A fault is a Callback, as a user's own callback bug would be: it hangs, raises
or feeds a NaN batch on one rank at one step (see faults.py).
"""

import math
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl

import faults

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 12


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class BuggyCallback(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        kind = faults.due(trainer.global_step)
        if kind == "nan":
            batch[0].fill_(math.nan)
        faults.hang_or_crash(kind)


def main():
    pl.seed_everything(0, verbose=False)
    x = torch.randn(512, 16)
    y = x.sum(dim=1, keepdim=True)
    data = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=STEPS,
                         callbacks=[BuggyCallback()], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regressor(), data)
    if trainer.global_rank == 0:
        print(f"final loss: {trainer.callback_metrics['train_loss'].item():.9g}", flush=True)
    # Without it, gloo's threads may abort the interpreter's exit ("terminate
    # called without an active exception", SIGABRT) under plain torchrun too.
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
