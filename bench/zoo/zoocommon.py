"""What every zoo job shares: its arguments (--steps, --seed), the process
group (gloo, CPU, started by `rankwatch run` / torchrun), made-up data (no
downloads) and the closing line zoo.py reads ("zoo: steps=N").

Only plumbing lives here: each job builds its library's own model and runs
its library's own trainer or a plain loop, as users write them.
"""

from __future__ import annotations

import argparse
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.distributed as dist


def args(default_steps: int = 300) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=default_steps, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def init(seed: int, backend: str = "gloo") -> tuple[int, int]:
    """The process group and every random generator, seeded per rank (data
    differ across ranks, the model's initial weights do not: DDP broadcasts
    them)."""
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    seed_all(seed * 1000 + rank)
    return rank, world


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % (2**32))
    except ImportError:
        pass


def done(steps: int) -> None:
    """The closing line zoo.py checks (rank 0), then the group is taken down."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"zoo: steps={steps}", flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def images(n: int, channels: int = 3, size: int = 32, classes: int = 10, seed: int = 0):
    """A learnable image task: each class is a fixed random pattern plus noise."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(classes, channels, size, size, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    x = patterns[y] + 0.5 * torch.randn(n, channels, size, size, generator=g)
    return x, y


def tokens(n: int, length: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Token sequences with structure (a noisy counting pattern), so a language model learns."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + step * torch.arange(length)) % vocab
    noise = torch.rand(n, length, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, vocab, (n, length), generator=g), seq)


class Repeat:
    """Cycle a DataLoader for as many batches as asked (epochs, set_epoch)."""

    def __init__(self, loader, sampler=None):
        self.loader, self.sampler = loader, sampler

    def __iter__(self):
        epoch = 0
        while True:
            if self.sampler is not None:
                self.sampler.set_epoch(epoch)
            yield from self.loader
            epoch += 1
