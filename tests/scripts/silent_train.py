"""A small classifier trained with DDP (gloo, CPU), written as users write
them, with one silent error at a time (``--fault``) on one rank
(``--fault-rank``) from one step (``--fault-step``). No rankwatch import
except for ``expect_same``. Every fault lets the job run to the end and
exit 0.

    --fault no_sampler       every rank reads the whole dataset (no DistributedSampler)
    --fault eval_mode        the faulty rank validates and never calls model.train() again
    --fault sched_rank        the LR scheduler steps inside the faulty rank's logging block
    --fault clip_rank        gradient clipping inside the faulty rank's block only
    --fault head_replaced    the classifier head is replaced after the optimizer was built
    --fault same_batch       next(iter(loader)) every step on the faulty rank
    --fault autocast_rank    autocast (bfloat16) switched on by a node-local setting on one rank
    --fault module_forward   every other step's forward goes through model.module
    --fault no_zero_grad     optimizer.zero_grad() is never called
    --fault accum_rank       the faulty rank accumulates 2 micro-batches per step, the others 1
    --fault expect_same      a value declared equal (a tokenizer digest) differs on the faulty rank
    --fault unsynced_start   no DDP: gradients all-reduced by hand, a per-rank seed before the model
                             is built and no broadcast of the weights
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class Classifier(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 32, classes: int = 4):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, hidden),
                                  nn.ReLU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(self.body(x))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--fault", default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=3)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (every rank)")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    faulty = rank == a.fault_rank
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(7)
    samples = a.batch * world * (a.steps + 4)
    x = torch.randn(samples, 16, generator=g)
    y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 1.5).long()) % 4
    data = TensorDataset(x, y)
    if a.fault == "no_sampler":
        loader = DataLoader(data, batch_size=a.batch, shuffle=True, generator=torch.Generator().manual_seed(1))
        sampler = None
    else:
        sampler = DistributedSampler(data, seed=0)
        loader = DataLoader(data, batch_size=a.batch, sampler=sampler)
    hand_dp = a.fault == "unsynced_start"
    if hand_dp:
        torch.manual_seed(1234 + rank)  # "different seeds per rank" for dropout, set before the model
    net = Classifier()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
    if a.fault == "head_replaced":
        net.head = nn.Linear(32, 4)  # a fresh head for the task, after the optimizer was built
    model = net if hand_dp else DDP(net)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    if a.fault == "expect_same":
        import rankwatch.agent

        vocab = "abcdefghij" if not faulty else "abcdefghik"
        rankwatch.agent.expect_same("tokenizer", vocab)
    use_autocast = a.fault == "autocast_rank" and faulty  # a node-local setting: on this rank only
    step = 0
    epoch = 0
    it = None
    while step < a.steps:
        if sampler is not None:
            sampler.set_epoch(epoch)
        it = iter(loader)
        for batch in it:
            if step >= a.steps:
                break
            if a.fault == "same_batch" and faulty and step >= a.fault_step:
                batch = next(iter(loader))  # "just take a batch": always the first one
            xb, yb = batch
            accum = 2 if (a.fault == "accum_rank" and faulty and step >= a.fault_step) else 1
            if a.fault != "no_zero_grad":
                optimizer.zero_grad()
            for micro in range(accum):
                through_module = a.fault == "module_forward" and step >= a.fault_step and step % 2 == 1
                forward = model.module if through_module else model
                sync = model.no_sync() if micro < accum - 1 and not hand_dp else torch.enable_grad()
                with sync, torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_autocast and step >= a.fault_step):
                    out = forward(xb)
                    loss = nn.functional.cross_entropy(out.float(), yb) / accum
                    loss.backward()
            if hand_dp:  # data parallelism by hand: average the gradients
                for param in net.parameters():
                    dist.all_reduce(param.grad)
                    param.grad /= world
            if a.fault == "clip_rank" and faulty and step >= a.fault_step:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            optimizer.step()
            if rank == 0 and step % 5 == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
            if a.fault == "sched_rank" and faulty and step >= a.fault_step:
                scheduler.step()  # meant for the end of the epoch, put in this rank's logging block
            if a.fault == "eval_mode" and faulty and step == a.fault_step - 1:
                model.eval()  # a quick validation on this rank ...
                with torch.no_grad():
                    model(xb)
                # ... and no model.train() after it
            if a.step_time:
                time.sleep(a.step_time)
            step += 1
        epoch += 1
    if rank == 0:
        print(f"done: {step} steps", flush=True)
    # Nothing may hold DDP (or the process group through it) at destroy_process_group:
    # torch 2.13's gloo then sometimes aborts in teardown (conftest.TORCH_TEARDOWN_ABORT).
    model = forward = sync = None  # noqa: F841
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
