"""Real multi-rank jobs (gloo, CPU) whose ranks run the GPU code paths: each
script installs the device adapter's GPU-like test double before building
its model (`device.install(GpuLikeDouble(device=local_rank))`), so every
device value is read a step or more later through pinned-like copies and
events, memory counters come from the rank's own device, device time is
the double's, and an OOM goes through the allocator's observer. What a user
would notice is asserted: the report's verdicts. (Issue 17, findings 4, 7, 9;
the CUDA branches before it crashed at step 0 on a GPU.)
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import ddp_script, run_job

DATA = Path(__file__).resolve().parent / "data"

_DOUBLE = """
import os
from rankwatch.agent.core import device as rw_device
double = rw_device.GpuLikeDouble(device=int(os.environ["LOCAL_RANK"]), current=0, {options})
rw_device.install(double)
rank = dist.get_rank()
"""


def _script(tmp_path: Path, name: str, body: str, options: str = "", prelude: str = "") -> Path:
    """A DDP job on the GPU-like double. Each body builds its model from one
    seed on every rank, then seeds its batches per rank (`DATA_SEED`): the
    same batches on every rank are duplicate_data, a fault of its own."""
    import textwrap

    return ddp_script(tmp_path, name, _DOUBLE.format(options=options) + prelude + textwrap.dedent(body))


# -- finding 7: low precision -----------------------------------------------------------


def test_a_healthy_bf16_job_has_no_verdict(tmp_path):
    script = _script(tmp_path, "bf16.py", """
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                        torch.nn.GELU(), torch.nn.Linear(256, 1)).to(torch.bfloat16))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        torch.manual_seed(100 + rank)  # DATA_SEED: each rank's own batches
        for step in range(40):
            opt.zero_grad()
            x = torch.randn(32, 32, dtype=torch.bfloat16)
            loss = (model(x).float() - 1).pow(2).mean()
            loss.backward()
            opt.step()
        """)
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(script)])
    assert job.exit_code == 0, job.output[-3000:]
    assert job.report["status"] == "healthy", job.verdicts()


def test_a_healthy_fp16_job_with_loss_scaling_has_no_verdict(tmp_path):
    """fp16 gradients scaled by 2^12: every value finite, but their fp16 norm
    overflows (a false `nonfinite` before norms were taken in float32)."""
    script = _script(tmp_path, "fp16.py", """
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                                        torch.nn.Linear(512, 1)).half())
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        scale = 2.0 ** 12
        torch.manual_seed(100 + rank)  # DATA_SEED: each rank's own batches
        for step in range(30):
            opt.zero_grad()
            x = torch.randn(64, 64).half()
            loss = (model(x).float() - 3).pow(2).mean()
            (loss * scale).backward()
            for p in model.parameters():
                p.grad.div_(scale)
            opt.step()
        """)
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(script)])
    assert job.exit_code == 0, job.output[-3000:]
    assert job.report["status"] == "healthy", job.verdicts()


def test_a_gradient_only_nan_in_a_bf16_job_is_named_on_its_rank_and_step(tmp_path):
    script = _script(tmp_path, "bf16_nan.py", """
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                        torch.nn.Linear(64, 1)).to(torch.bfloat16))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        state = {"step": 0}
        def poison(grad):
            if rank == 1 and state["step"] == 6:
                return grad * float("nan")
            return grad
        model.module[2].weight.register_hook(poison)
        torch.manual_seed(100 + rank)  # DATA_SEED: each rank's own batches
        for step in range(16):
            state["step"] = step
            opt.zero_grad()
            loss = model(torch.randn(8, 16, dtype=torch.bfloat16)).float().pow(2).mean()
            loss.backward()
            opt.step()
        """)
    job = run_job(tmp_path, ["--nproc-per-node", "3", str(script)])
    nonfinite = job.only("nonfinite")
    assert (nonfinite["ranks"], nonfinite["step"]) == ([1], 6), nonfinite["summary"]
    assert nonfinite["evidence"]["parameters"] == ["2.weight"]
    assert nonfinite["evidence"]["loss_nonfinite_in_forward"] == []
    assert len(job.verdicts()) == 1, job.verdicts()


# -- finding 4: a slow GPU is a straggler, from device time -----------------------------


def test_a_slow_device_is_a_straggler_though_its_host_is_not(tmp_path):
    """Rank 1's device needs 60 ms more per step than its host took to queue
    the work (a throttled GPU). Host timing shows nothing: every rank's host
    waits equally in the next synchronisation."""
    script = _script(tmp_path, "slow_gpu.py", """
        if rank == 1:
            double.extra_s = 0.06
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        torch.manual_seed(100 + rank)  # DATA_SEED: each rank's own batches
        for step in range(120):  # a slow rank is persistent after 5 s
            opt.zero_grad()
            model(torch.randn(32, 32)).pow(2).mean().backward()
            opt.step()
        """)
    job = run_job(tmp_path, ["--nproc-per-node", "3", str(script)])
    straggler = job.only("straggler")
    assert straggler["ranks"] == [1], straggler["summary"]
    assert all(v["kind"] == "straggler" for v in job.verdicts()), job.verdicts()


def test_equal_devices_are_no_straggler(tmp_path):
    script = _script(tmp_path, "even_gpus.py", """
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        torch.manual_seed(100 + rank)  # DATA_SEED: each rank's own batches
        for step in range(60):
            opt.zero_grad()
            model(torch.randn(32, 32)).pow(2).mean().backward()
            opt.step()
        """, options="extra_s=0.02")
    job = run_job(tmp_path, ["--nproc-per-node", "3", str(script)])
    assert job.exit_code == 0 and job.report["status"] == "healthy", job.verdicts()


# -- finding 9: OOM ----------------------------------------------------------------------

_OOM_BODY = """
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
double.snapshot = __import__("json").load(open({snapshot!r}))
double.set_memory(double.device, 3 << 30, reserved=4 << 30)
batch = 4096
torch.manual_seed(100 + rank)  # DATA_SEED: each rank's own batches
for step in range(12):
    if rank == 1 and step == 4:
        {on_rank_1}
    opt.zero_grad()
    model(torch.randn(16, 16)).pow(2).mean().backward()
    opt.step()
"""


def test_a_batch_size_finder_that_catches_oom_is_healthy(tmp_path):
    finder = """while True:  # a batch-size finder: halve until it fits
            try:
                if batch > 256:
                    double.raise_oom(batch * (1 << 20))
                break
            except torch.cuda.OutOfMemoryError:
                batch //= 2"""
    script = _script(tmp_path, "finder.py", _OOM_BODY.format(snapshot=str(DATA / "cuda_snapshot.json"),
                                                             on_rank_1=finder))
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(script)])
    assert job.exit_code == 0, job.output[-3000:]
    assert job.report["status"] == "healthy", job.verdicts()


def test_an_oom_that_ends_the_rank_is_oom_with_its_snapshot(tmp_path):
    script = _script(tmp_path, "oom.py", _OOM_BODY.format(snapshot=str(DATA / "cuda_snapshot.json"),
                                                          on_rank_1="double.raise_oom(8 << 30)"))
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(script)])
    assert job.exit_code != 0
    oom = job.only("oom")
    assert oom["ranks"] == [1] and oom["step"] == 4, oom["summary"]
    assert "out of device memory" in oom["summary"] and "8.0 GiB" in oom["summary"], oom["summary"]
    assert oom["evidence"]["snapshot_summary"], "the snapshot taken when the rank ended is in the evidence"
    assert len(job.verdicts()) == 1, [(v["kind"], v["ranks"]) for v in job.verdicts()]
    json.dumps(job.report)


# -- finding 3: without DDP (a hand-written data-parallel loop; FSDP2 and others alike) --------

_BY_HAND = """
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
def average_gradients():
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
"""


def test_without_ddp_a_gradient_only_nan_is_named_on_its_rank_from_local_gradients(tmp_path):
    """No DDP: the gradients are averaged by the script's own all_reduce, so
    a NaN from rank 1's batch reaches every rank's weights. The local
    gradient checks (attached once the optimizer step shows what is trained)
    name rank 1 at the step it happened."""
    script = _script(tmp_path, "by_hand_nan.py", prelude=_BY_HAND, body="""
        state = {"step": 0}
        def poison(grad):
            if rank == 1 and state["step"] == 6:
                return grad * float("nan")
            return grad
        model[2].weight.register_hook(poison)
        torch.manual_seed(100 + rank)  # DATA_SEED: each rank's own batches
        for step in range(14):
            state["step"] = step
            opt.zero_grad()
            model(torch.randn(8, 32)).pow(2).mean().backward()
            average_gradients()
            opt.step()
        """)
    job = run_job(tmp_path, ["--nproc-per-node", "3", str(script)])
    nonfinite = job.only("nonfinite")
    assert (nonfinite["ranks"], nonfinite["step"]) == ([1], 6), nonfinite["summary"]
    assert nonfinite["evidence"]["parameters"] == ["2.weight"], nonfinite["evidence"]
    assert len(job.verdicts()) == 1, job.verdicts()


def test_without_ddp_a_slow_device_is_a_straggler_from_device_time(tmp_path):
    script = _script(tmp_path, "by_hand_slow.py", prelude=_BY_HAND, body="""
        if rank == 1:
            double.extra_s = 0.06
        double.set_memory(double.device, (1 + rank) << 30, reserved=8 << 30)
        torch.manual_seed(100 + rank)  # DATA_SEED: each rank's own batches
        for step in range(120):  # a slow rank is persistent after 5 s
            opt.zero_grad()
            model(torch.randn(32, 32)).pow(2).mean().backward()
            average_gradients()
            opt.step()
        """)
    job = run_job(tmp_path, ["--nproc-per-node", "3", str(script)])
    assert job.exit_code == 0, job.output[-3000:]
    straggler = job.only("straggler")
    assert straggler["ranks"] == [1], straggler["summary"]
    assert all(v["kind"] == "straggler" for v in job.verdicts()), job.verdicts()


def test_without_ddp_an_oom_that_ends_the_rank_is_oom_with_its_snapshot(tmp_path):
    body = _OOM_BODY.replace("model = DDP(torch.nn.Sequential(", "model = (torch.nn.Sequential(").replace(
        "    opt.step()\n", "    average_gradients()\n    opt.step()\n").replace(
        "opt = torch.optim.SGD(model.parameters(), lr=1e-3)\n",
        "opt = torch.optim.SGD(model.parameters(), lr=1e-3)\n" + _BY_HAND.split("opt = torch.optim.SGD(model.parameters(), lr=1e-3)\n")[1])
    assert "DDP(" not in body and "average_gradients()\n    opt.step()" in body
    script = _script(tmp_path, "by_hand_oom.py", body.format(snapshot=str(DATA / "cuda_snapshot.json"),
                                                             on_rank_1="double.raise_oom(8 << 30)"))
    job = run_job(tmp_path, ["--nproc-per-node", "2", str(script)])
    assert job.exit_code != 0
    oom = job.only("oom")
    assert oom["ranks"] == [1] and oom["step"] == 4, oom["summary"]
    assert "out of device memory" in oom["summary"], oom["summary"]
    assert oom["evidence"]["snapshot_summary"], "the snapshot taken when the rank ended is in the evidence"
    assert len(job.verdicts()) == 1, [(v["kind"], v["ranks"]) for v in job.verdicts()]


_FSDP2 = """
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                            torch.nn.Linear(64, 1))
for layer in model:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
"""


def test_fsdp2_a_gradient_only_nan_is_named_on_its_rank_before_the_reduce_scatter(tmp_path):
    """fully_shard on CPU: the NaN enters rank 1's backward at step 5 (a hook
    on an activation: the loss stays finite everywhere) and FSDP's
    reduce-scatter spreads it to every rank's shard. The local gradients,
    seen on FSDP's unsharded parameters before the reduce-scatter, name rank 1."""
    script = _script(tmp_path, "fsdp2_nan.py", prelude=_FSDP2, body="""
        def poison(grad):
            return grad * float("nan") if rank == 1 and step == 5 else grad
        def watch(module, args, out):
            out.register_hook(poison)  # returns None: the output is unchanged
        model[1].register_forward_hook(watch)
        torch.manual_seed(100 + rank)  # DATA_SEED: each rank's own batches
        for step in range(12):
            loss = model(torch.randn(8, 16)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        """)
    job = run_job(tmp_path, ["--nproc-per-node", "3", str(script)])
    nonfinite = job.only("nonfinite")
    assert (nonfinite["ranks"], nonfinite["step"]) == ([1], 5), nonfinite["summary"]
    assert nonfinite["evidence"]["source"] == "local_gradients", nonfinite["evidence"]
    assert nonfinite["evidence"]["parameters"] == ["0.weight"] or "0.weight" in nonfinite["evidence"]["parameters"]
    assert len(job.verdicts()) == 1, job.verdicts()


def test_fsdp2_a_slow_device_is_a_straggler(tmp_path):
    script = _script(tmp_path, "fsdp2_slow.py", prelude=_FSDP2, body="""
        if rank == 1:
            double.extra_s = 0.06
        torch.manual_seed(100 + rank)  # DATA_SEED: each rank's own batches
        for step in range(100):  # a slow rank is persistent after 5 s
            model(torch.randn(32, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        """)
    job = run_job(tmp_path, ["--nproc-per-node", "3", str(script)])
    assert job.exit_code == 0, job.output[-3000:]
    straggler = job.only("straggler")
    assert straggler["ranks"] == [1], straggler["summary"]
    assert all(v["kind"] == "straggler" for v in job.verdicts()), job.verdicts()


def test_fsdp2_waiting_on_its_own_collectives_through_device_streams_is_no_straggler(tmp_path):
    """FSDP2's own code, given the double's streams and events
    (`GpuLikeDouble.serve_streams`: on a plain CPU its events are None and
    it never waits), makes the compute stream wait on each all-gather and
    reduce-scatter through the stream class rankwatch patches, and every
    rank stalls behind a slower peer (issue 25, finding 5). The stalls are
    timed and taken out alike on every rank: no verdict."""
    script = _script(tmp_path, "fsdp2_streams.py", prelude="double.peer_slowdown = 2.0\ndouble.serve_streams(torch.cpu)\n"
                     + _FSDP2, body="""
        torch.manual_seed(100 + rank)  # DATA_SEED: each rank's own batches
        for step in range(120):
            model(torch.randn(32, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert getattr(type(torch.cpu.Event()).wait, "__rankwatch_wrapped__", False)
        """)
    job = run_job(tmp_path, ["--nproc-per-node", "3", str(script)])
    assert job.exit_code == 0, job.output[-3000:]
    assert job.report["status"] == "healthy", job.verdicts()
