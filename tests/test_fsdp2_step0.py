"""Issue 25 item 9: an FSDP2 model is watched from step 0. `fully_shard`
is wrapped when the job imports it (rankwatch never imports
torch.distributed.fsdp itself: over a second), so the first forward is timed
and the model is a root before the first optimizer step. Each case runs in
a fresh interpreter: whether torch.distributed.fsdp is imported yet is the
point."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import free_port

SCRIPT = """
import json, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}", RANK="0", WORLD_SIZE="1")
import torch
import torch.distributed as dist
from rankwatch import config, wire
from rankwatch.agent.runtime import Agent
{early_import}
agent = Agent(config.Config(), wire.RankIdentity(run_id="f", rank=0, local_rank=0, world_size=1), None)
agent.install()
imported_by_install = "torch.distributed.fsdp" in sys.modules and not {imported_before}
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo")
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
roots_before_forward = [type(r.module).__name__ for r in agent.models.roots]
opt = torch.optim.SGD(model.parameters(), lr=0.1)
first_forward_timed = None
for step in range(3):
    model(torch.randn(4, 8)).sum().backward()
    if step == 0:
        first_forward_timed = agent.progress._first_forward_at is not None
    opt.step()
    opt.zero_grad()
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import FullyShardedDataParallel
later = dict(dcp_save=getattr(dcp.save, "__rankwatch_wrapped__", False),
             fsdp1_clip=getattr(FullyShardedDataParallel.clip_grad_norm_, "__rankwatch_wrapped__", False))
out = dict(imported_by_install=imported_by_install, roots=roots_before_forward, later=later,
           first_forward_timed=first_forward_timed, state=hasattr(fully_shard, "state"),
           sharded=type(model).__name__)
agent.uninstall()
from torch.distributed import fsdp
out["restored"] = not getattr(fsdp.fully_shard, "__rankwatch_wrapped__", False)
dist.destroy_process_group()
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.parametrize("imported_before", [False, True], ids=["job_imports_fsdp_after_install",
                                                                "fsdp_imported_before_install"])
def test_an_fsdp2_model_is_a_root_before_its_first_step(tmp_path, imported_before):
    script = tmp_path / "fsdp2_step0.py"
    script.write_text(SCRIPT.format(port=free_port(), imported_before=imported_before,
                                    early_import="import torch.distributed.fsdp" if imported_before else ""))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["imported_by_install"] is False, "rankwatch imported torch.distributed.fsdp itself"
    assert out["roots"] == ["FSDPSequential"], out  # the model itself (fully_shard swaps its class)
    assert out["first_forward_timed"] is True, out
    assert out["state"] is True, "the wrapper hides fully_shard.state"
    assert out["sharded"].startswith("FSDP"), out
    assert out["restored"] is True, out
    # The other patches that wait for the job's import (agent/core/imports.py): the
    # checkpoint phase of torch.distributed.checkpoint's saves, FSDP1's clipping.
    assert out["later"] == {"dcp_save": True, "fsdp1_clip": True}, out
