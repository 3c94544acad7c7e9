"""An LSTM language model with truncated backpropagation through time (the
hidden state carried across chunks, detached), gradient clipping, SGD and
ReduceLROnPlateau on the training loss averaged over the ranks; DDP.

The scheduler must see the same loss on every rank: stepped on each rank's
own loss, the ranks cut the learning rate at different steps and the
replicas drift apart (the zoo's first version did exactly that, and
rankwatch named it: config_divergence on the learning rate at step 222,
then weight_divergence)."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zoocommon as zc

VOCAB, BPTT, BATCH = 64, 20, 16


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.lstm = nn.LSTM(64, 128, num_layers=2, batch_first=True, dropout=0.1)
        self.out = nn.Linear(128, VOCAB)

    def forward(self, x, state):
        h, state = self.lstm(self.embed(x), state)
        return self.out(h), state


def main():
    a = zc.args()
    rank, world = zc.init(a.seed)
    model = LM()
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=20)
    stream = zc.tokens(BATCH, BPTT * a.steps + 1, VOCAB, seed=a.seed * 10 + rank)
    state = None
    for step in range(a.steps):
        x = stream[:, step * BPTT:(step + 1) * BPTT]
        y = stream[:, step * BPTT + 1:(step + 1) * BPTT + 1]
        if state is not None:
            state = tuple(s.detach() for s in state)  # truncated BPTT
        logits, state = ddp(x, state)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        sched.step(mean_loss.item() / world)
    zc.done(a.steps)


if __name__ == "__main__":
    main()
