"""A mixture-of-experts layer with top-1 routing: some experts get no tokens
on some steps (no gradient there), so DDP runs with
`find_unused_parameters=True`; a load-balancing loss; AdamW."""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zoocommon as zc

EXPERTS = 8


class MoE(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.router = nn.Linear(dim, EXPERTS)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 64), nn.GELU(), nn.Linear(64, dim))
                                     for _ in range(EXPERTS))

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        choice = probs.argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = choice == e
            if sel.any():  # an expert without tokens is not run: no gradient this step
                out[sel] = expert(x[sel]) * probs[sel, e:e + 1]
        balance = EXPERTS * (probs.mean(0) * nn.functional.one_hot(choice, EXPERTS).float().mean(0)).sum()
        return out, balance


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.moe = MoE()
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h, balance = self.moe(torch.relu(self.inp(x)))
        return self.head(h), balance


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = Net()
    ddp = DDP(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(a.seed))
    for step in range(a.steps):
        x = torch.randn(6, 16)  # a few tokens: some experts get none
        logits, balance = ddp(x)
        loss = nn.functional.cross_entropy(logits, (x @ w).argmax(-1)) + 0.01 * balance
        opt.zero_grad()
        loss.backward()
        opt.step()
    zc.done(a.steps)


if __name__ == "__main__":
    main()
