"""A plain DDP job (no rankwatch import) in which one rank stalls at one step
while the others wait in ``dist.barrier()``, the way training code guards a
checkpoint write or a rank-0-only evaluation.

    --stall upload     rank R saves a checkpoint (torch.save) and uploads it
                       with an HTTP PUT to --url, a server that takes it at
                       a limited rate (it ends by itself)
    --stall evaluate   rank R evaluates for --seconds (CPU-bound tensor work
                       outside the watched model; it ends by itself)
    --stall save_hang  rank R's torch.save writes to a store that never
                       answers (a true hang inside the checkpoint phase)
    --stall busy       rank R spins in an infinite loop (a true hang that
                       keeps a CPU busy)
"""

import argparse
import gc
import http.client
import io
import time
import urllib.parse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class NeverAnswers(io.RawIOBase):
    """A file whose write blocks forever (a store that went away)."""

    def writable(self):
        return True

    def write(self, data):
        time.sleep(3600)
        return len(data)


def upload(url: str, payload: bytes) -> None:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    conn.request("PUT", parts.path or "/", body=payload)
    response = conn.getresponse()
    response.read()
    assert response.status == 200, response.status


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--stall", required=True, choices=("upload", "evaluate", "save_hang", "busy"))
    p.add_argument("--stall-rank", type=int, default=0)
    p.add_argument("--stall-step", type=int, default=6)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--url", default="")
    p.add_argument("--upload-bytes", type=int, default=0)
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for step in range(a.steps):
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step == a.stall_step:
            if rank == a.stall_rank:
                if a.stall == "upload":
                    buffer = io.BytesIO()
                    torch.save(model.state_dict(), buffer)
                    checkpoint = buffer.getvalue()
                    upload(a.url, (checkpoint * (a.upload_bytes // len(checkpoint) + 1))[:a.upload_bytes])
                elif a.stall == "evaluate":
                    until = time.time() + a.seconds
                    m = torch.randn(256, 256)
                    while time.time() < until:
                        m = torch.tanh(m @ m.T / 256)
                elif a.stall == "save_hang":
                    torch.save(model.state_dict(), NeverAnswers())
                elif a.stall == "busy":
                    n = 0
                    while True:
                        n += 1
            dist.barrier()
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    del model
    gc.collect()  # DDP is freed only by a cyclic collection
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
