"""A Lightning `Trainer` job (DDP strategy on CPU/gloo): validation every 50
steps, `ModelCheckpoint` on the validation loss, a LightningModule with
AdamW and a OneCycle schedule stepped per optimizer step."""

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import zoocommon as zc


class Classifier(L.LightningModule):
    def __init__(self, steps):
        super().__init__()
        self.steps = steps
        self.net = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 5))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 5, generator=torch.Generator().manual_seed(7))
    return TensorDataset(x, (x @ w).argmax(-1))


def main():
    a = zc.args()
    zc.seed_all(a.seed)
    L.seed_everything(a.seed, workers=True)
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=int(__import__("os").environ["LOCAL_WORLD_SIZE"]),
                        max_steps=a.steps, val_check_interval=50, check_val_every_n_epoch=None,
                        callbacks=[ModelCheckpoint(dirpath=f"zoo-ckpt-{a.seed}", monitor="val_loss", save_top_k=1)],
                        logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Classifier(a.steps), DataLoader(data(4096, a.seed), batch_size=32, shuffle=True),
                DataLoader(data(256, 99), batch_size=64))
    zc.done(trainer.global_step)


if __name__ == "__main__":
    main()
