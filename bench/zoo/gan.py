"""A GAN: generator and discriminator, each with its own Adam, stepping
alternately (the discriminator on real and detached fake samples, then the
generator through the discriminator); two DDP models."""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zoocommon as zc


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    gen = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    disc = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
    g, d = DDP(gen), DDP(disc)
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    centers = torch.tensor([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.0], [0.0, -2.0]])
    for step in range(a.steps):
        real = centers[torch.randint(0, 4, (64,))] + 0.1 * torch.randn(64, 2)
        fake = g(torch.randn(64, 16))
        opt_d.zero_grad()
        loss_d = bce(d(real), torch.ones(64, 1)) + bce(d(fake.detach()), torch.zeros(64, 1))
        loss_d.backward()
        opt_d.step()
        opt_g.zero_grad()
        loss_g = bce(d(fake), torch.ones(64, 1))
        loss_g.backward()
        opt_g.step()
    zc.done(a.steps)


if __name__ == "__main__":
    main()
