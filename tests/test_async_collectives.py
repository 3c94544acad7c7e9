"""NCCL-like asynchrony on gloo: collectives issued with ``async_op=True``
and waited later, in another function, so a waiting rank sits in
``work.wait()`` or on a future, never inside a torch.distributed Python frame
(on NCCL it would sit in ``loss.item()``). The hang is named from progress:
per process group, how far each rank got in enqueuing collectives (issue 17,
finding 2).

Variant `no_flight_recorder` removes the Flight Recorder's JSON dump from
torch in the script (as on torch < 2.8 with gloo, < 2.5 with NCCL): the
numbers then come from rankwatch's own count of Python-API collectives and
their futures' completion. Before that count existed, every rank was "not
in a collective" and no rank stood out.
"""

from __future__ import annotations

import pytest

from conftest import ddp_script, matrix, run_job

_BODY = """
import os, time
if os.environ.get("NO_FLIGHT_RECORDER"):
    # torch without the JSON dumps (< 2.8 for gloo): nothing of Flight Recorder to read
    for name in ("_dump_fr_trace_json", "_dump_nccl_trace_json"):
        if hasattr(torch._C._distributed_c10d, name):
            delattr(torch._C._distributed_c10d, name)
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
for p in model.parameters():
    dist.broadcast(p.data, 0)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)


def reduce_gradients(model):
    return [dist.all_reduce(p.grad, async_op=True) for p in model.parameters()]


def finish(works, how):
    if how == "future":
        torch.futures.wait_all([w.get_future() for w in works])
    else:
        for w in works:
            w.wait()


torch.manual_seed(100 + rank)  # each rank's own batches (the same on every rank is duplicate_data)
for step in range(60):
    opt.zero_grad()
    loss = model(torch.randn(8, 16)).pow(2).mean()
    loss.backward()
    if rank == 1 and step == 8:
        time.sleep(3600)  # stuck in its own code before issuing this step's allreduces
    works = reduce_gradients(model)
    finish(works, os.environ["WAIT_HOW"])
    for p in model.parameters():
        p.grad.div_(dist.get_world_size())
    opt.step()
    time.sleep(0.02)
"""


@pytest.mark.parametrize("how,flight_recorder", matrix(
    [(how, fr) for how in ("work_wait", "future") for fr in (True, False)],
    diagonal=[("work_wait", True), ("future", False)]))
def test_a_hang_behind_async_collectives_is_named_from_progress(tmp_path, flight_recorder, how):
    script = ddp_script(tmp_path, "async_hang.py", _BODY)
    env = {"WAIT_HOW": how, **({} if flight_recorder else {"NO_FLIGHT_RECORDER": "1"})}
    job = run_job(tmp_path, ["--nproc-per-node", "3", "--hang-timeout", "8", str(script)], env=env)
    hang = job.only("hang")
    assert hang["ranks"] == [1], hang["summary"]
    assert hang["step"] == 8, hang["summary"]
    assert "never reached collective #" in hang["summary"], hang["summary"]
    assert "async_hang.py" in hang["summary"]
    waiting = hang["evidence"]["ranks"]
    assert not waiting["0"]["waiting_in_collective"], "rank 0 waits in work.wait()/a future, outside torch.distributed"
    assert len(job.verdicts()) == 1, job.verdicts()
