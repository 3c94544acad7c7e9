"""Record the node reports a real job's relay sends, for the load bench to replay.

    flock /tmp/rankwatch-heavy.lock python bench/record_node_reports.py    # ~1.5 min on 2 cores

Runs a real `rankwatch run --collector URL --nproc-per-node 8` job (DDP on
gloo, every check on, the GPU code paths through agent/core/device.py's
`GpuLikeDouble`, one optimizer step a second) against a real collector
(stdlib server, in this process), and saves every `POST /v1/node-report`
body the node's relay sent, as it sent them, to
bench/data/node_reports.json.gz. `bench/collector_load.py --messages
recorded` replays them with rank and step rewritten; nothing is hand-built.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "data" / "node_reports.json.gz"

JOB = """
import os, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from rankwatch.agent.core import device as rw_device

dist.init_process_group("gloo")
rank = dist.get_rank()
# GPU-flavour step values: device reads a step late through the double's events.
rw_device.install(rw_device.GpuLikeDouble(device=int(os.environ["LOCAL_RANK"]), current=0))
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 1)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
torch.manual_seed(100 + rank)
began = time.time()
for step in range({steps}):
    opt.zero_grad()
    x = torch.randn(32, 64)
    loss = (model(x) - 1).pow(2).mean()
    loss.backward()
    opt.step()
    time.sleep(max(0.0, began + (step + 1) * {step_time} - time.time()))  # one step per step_time
dist.destroy_process_group()
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--step-time", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)

    from rankwatch.collector import Collector, CollectorServer
    from rankwatch.config import Config

    folder = Path(tempfile.mkdtemp(prefix="rankwatch-record-"))
    collector = Collector(Config(), data_dir=folder / "collector")
    server = CollectorServer(collector, token="record-token")
    recorded: list[str] = []
    handle = server.routes.handle

    def recording(method, path, body, header):
        if method == "POST" and path == "/v1/node-report":
            recorded.append(body.decode())
        return handle(method, path, body, header)

    server.routes.handle = recording
    server.start()
    collector.start()
    script = folder / "job.py"
    script.write_text(textwrap.dedent(JOB.format(steps=args.steps, step_time=args.step_time)))
    env = dict(os.environ, RANKWATCH_TOKEN="record-token", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "rankwatch.cli", "run", "--collector", server.url, "--run-dir", str(folder / "run"),
           "--nproc-per-node", "8", str(script)]
    started = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    finally:
        collector.stop()
        server.stop()
    if proc.returncode != 0:
        print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"recorded_at": time.time(), "job_seconds": time.time() - started, "steps": args.steps,
            "step_time": args.step_time, "ranks": 8, "command": "python bench/record_node_reports.py"}
    with gzip.open(args.out, "wt") as f:
        json.dump({"meta": meta, "reports": recorded}, f)
    sizes = sorted(len(r) for r in recorded)
    print(f"recorded {len(recorded)} node reports ({sizes[0]}-{sizes[-1]} bytes, median {sizes[len(sizes) // 2]}) "
          f"to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
