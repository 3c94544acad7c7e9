"""A variational autoencoder (convolutional encoder, reparameterisation,
KL + reconstruction loss with KL annealing), DDP, Adam, OneCycle schedule."""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zoocommon as zc


class VAE(nn.Module):
    def __init__(self, latent=8):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(1, 16, 4, 2, 1), nn.ReLU(), nn.Conv2d(16, 32, 4, 2, 1), nn.ReLU(),
                                 nn.Flatten(), nn.Linear(32 * 4 * 4, 2 * latent))
        self.dec = nn.Sequential(nn.Linear(latent, 32 * 4 * 4), nn.ReLU(), nn.Unflatten(1, (32, 4, 4)),
                                 nn.ConvTranspose2d(32, 16, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(16, 1, 4, 2, 1))

    def forward(self, x):
        mu, logvar = self.enc(x).chunk(2, dim=1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return self.dec(z), mu, logvar


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = VAE()
    ddp = DDP(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=a.steps)
    x_all, _ = zc.images(2048, channels=1, size=16, seed=a.seed * 10 + rank)
    x_all = torch.sigmoid(x_all)
    for step in range(a.steps):
        x = x_all[(step * 32) % 2048:(step * 32) % 2048 + 32]
        recon, mu, logvar = ddp(x)
        rec = nn.functional.binary_cross_entropy_with_logits(recon, x, reduction="sum") / len(x)
        kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / len(x)
        loss = rec + min(1.0, step / 100) * kl
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    zc.done(a.steps)


if __name__ == "__main__":
    main()
