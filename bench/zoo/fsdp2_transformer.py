"""FSDP2 (`fully_shard` per block and on the root) of a small transformer
encoder built from torch's own `nn.TransformerEncoderLayer`, AdamW, cosine
schedule, gradient clipping through the sharded parameters."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import zoocommon as zc

VOCAB = 64


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
                                    for _ in range(2))
        self.head = nn.Linear(64, VOCAB)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    torch.manual_seed(a.seed)  # the same initial weights on every rank before sharding
    mesh = init_device_mesh("cpu", (world,))
    model = Encoder()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, a.steps)
    data = zc.tokens(4096, 16, VOCAB, seed=a.seed * 10 + rank)
    for step in range(a.steps):
        x = data[(step * 8) % 4096:(step * 8) % 4096 + 8]
        logits = model(x[:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    zc.done(a.steps)


if __name__ == "__main__":
    main()
