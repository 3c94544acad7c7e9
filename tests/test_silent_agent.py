"""The agent's silent-error parts, in one process (a gloo world of size 1,
the agent attached in process): what is trained is found without DDP, the
facts are what the script did (modes with their line, clipping, autocast,
micro-batches, a user's declared value), batch fingerprints follow the data
and keep none of it, the update checks flag what they must and nothing
else, and rankwatch's hooks never travel with a copy of the model
(``copy.deepcopy`` for an EMA, ``torch.save(model)``)."""

from __future__ import annotations

import copy
import io
import os
import pickle
import socket
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from rankwatch import config as config_mod
from rankwatch import wire
from rankwatch.agent.runtime import Agent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def agent():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    agent = Agent(config_mod.Config(fingerprint_every=2),
                  wire.RankIdentity(run_id="t", rank=0, local_rank=0, world_size=1), None)
    agent.install()
    dist.init_process_group("gloo")
    yield agent
    agent.uninstall()
    dist.destroy_process_group()


def _facts(agent) -> dict[str, str]:
    out: dict[str, str] = {}
    for e in agent.events_log:
        if e.kind == "train_config":
            out.update({k: v for k, v in e.details["facts"]})
    return out


def _events(agent, kind: str) -> list:
    return [e for e in agent.events_log if e.kind == kind]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1))
        self.head = torch.nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.body(x))


def test_models_without_ddp_named_and_modes_with_their_line(agent):
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    for step in range(4):
        if step == 2:
            net.body[2].eval()  # a submodule switched off, on purpose or not
        opt.zero_grad()
        net(x).sum().backward()
        opt.step()
    models = agent.models
    assert [r.label for r in models.roots] == ["Net"] and models.roots[0].ddp is None
    assert [n for n, _ in models.named_parameters()] == ["body.0.weight", "body.0.bias", "head.weight", "head.bias"]
    facts = _facts(agent)
    assert facts["mode"] == "train; eval: body.2"
    sites = {k: v for e in _events(agent, "train_config") for k, v in e.details.get("sites", [])}
    assert sites["mode"].startswith("test_silent_agent.py:")
    assert facts["micro_batches"] == "1" and facts["replicas"] == "none" and facts["clip"] == "none"
    assert not _events(agent, "broken_update")


def test_facts_follow_the_script(agent):
    import rankwatch.agent as rw

    net = Net()
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    rw.expect_same("tokenizer", "a" * 500)
    rw.expect_same("api_token", "s3cr3t-value")
    for step in range(3):
        opt.zero_grad()
        for micro in range(2):
            with model.no_sync() if micro == 0 else torch.enable_grad():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(torch.randn(4, 8))
                out.float().sum().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=2.0)
        opt.step()
    facts = _facts(agent)
    assert facts["autocast"] == "cpu bfloat16" and facts["micro_batches"] == "2"
    assert facts["clip"] == "norm 2" and facts["replicas"].startswith("ddp:1:")
    assert facts["user.tokenizer"].startswith("sha256:")  # long: a digest
    assert facts["user.api_token"].startswith("sha256:") and "s3cr3t" not in str(agent.events_log)
    records = list(agent.progress.recent)
    assert all(r.optim_fp is not None and r.lr == pytest.approx(1e-3) for r in records)
    assert len({r.batch_fp for r in records}) == 3  # three different batches


def test_batch_fingerprints_follow_the_data_and_keep_none_of_it(agent):
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fixed = torch.randn(4, 8)
    batches = [fixed, fixed.clone(), torch.randn(4, 8), fixed]
    refs = []
    for x in batches:
        refs.append(weakref.ref(x))
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    prints = [r.batch_fp for r in agent.progress.recent]
    assert prints[0] == prints[1] == prints[3] != prints[2]
    del batches, x, fixed
    assert all(ref() is None for ref in refs), "rankwatch kept a batch alive"


def test_same_batch_from_a_new_iterator_every_step_is_reported_once(agent):
    data = torch.utils.data.TensorDataset(torch.randn(64, 8))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(7):
        (x,) = next(iter(loader))
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    (event,) = _events(agent, "batch_repeat")
    assert event.details["new_iterator_every_step"] is True and event.details["batches_per_epoch"] == 8
    # A loader of one batch, iterated epoch after epoch: the same batch is its whole dataset.
    small = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 8)), batch_size=8)
    agent.events_log.clear()
    agent.train_config  # noqa: B018 (attached)
    for epoch in range(6):
        for (x,) in small:
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    assert not _events(agent, "batch_repeat")


def test_update_checks(agent):
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net.head = torch.nn.Linear(16, 2)  # replaced after the optimizer was built
    frozen = torch.nn.Linear(8, 8)
    frozen.requires_grad_(False)
    ema = copy.deepcopy(net).requires_grad_(False)
    for step in range(4):
        opt.zero_grad()
        net(frozen(torch.randn(4, 8))).sum().backward()
        opt.step()
        with torch.no_grad():
            for e, p in zip(ema.parameters(), net.parameters()):
                e.lerp_(p, 0.5)
    (event,) = _events(agent, "broken_update")
    assert event.details["check"] == "not_in_optimizer" and event.step == 0
    assert event.details["parameters"] == ["head.bias", "head.weight"]
    assert event.details["optimizer_tensors_not_in_model"] == 2


def test_gradients_never_cleared_and_a_backward_ddp_never_saw(agent):
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(4):
        forward = model.module if step == 2 else model
        forward(torch.randn(4, 8)).sum().backward()  # no zero_grad at all
        opt.step()
    checks = {e.details["check"]: e.step for e in _events(agent, "broken_update")}
    assert checks == {"grads_not_cleared": 1}
    (unreduced,) = _events(agent, "unreduced_backward")
    assert unreduced.step == 2 and unreduced.details["via"] == "module"
    assert unreduced.details["site"].startswith("test_silent_agent.py:")


@pytest.mark.parametrize("cleared", [False, True])
def test_gradients_never_cleared_under_fsdp2(agent, cleared):
    """FSDP2 reduce-scatters each gradient into its sharded parameter's .grad
    (adding to it when it is there): no tensor hook on a sharded parameter
    ever fires, so the gradient is read at the next backward's call
    (faultbench fsdp2-broken_update-s0 was missed). Cleared every step: nothing."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    net = Net()
    for layer in (net.body[0], net.head):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for step in range(4):
        if cleared:
            opt.zero_grad()
        net(torch.randn(4, 8)).sum().backward()
        opt.step()
    checks = {e.details["check"]: e.step for e in _events(agent, "broken_update")}
    assert checks == ({} if cleared else {"grads_not_cleared": 1})


@pytest.mark.parametrize("cleared", [False, True])
def test_gradients_never_cleared_with_a_closure_step(agent, cleared):
    """``optimizer.step(closure)`` (Lightning's automatic optimization, LBFGS):
    forward, zero_grad and backward run inside the step, after its pre-hooks.
    The check judged at the pre-hook, before any backward had reached the
    watched gradients, and never saw them (faultbench
    lightning-broken_update-s1 was missed). Cleared inside the closure: nothing."""
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def closure():
        loss = model(torch.randn(4, 8)).sum()
        if cleared:
            opt.zero_grad()
        loss.backward()
        return loss

    for _ in range(4):
        opt.step(closure)
    checks = {e.details["check"]: e.step for e in _events(agent, "broken_update")}
    assert checks == ({} if cleared else {"grads_not_cleared": 1})


def test_hooks_never_travel_with_a_copy_of_the_model(agent):
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    assert net._forward_pre_hooks  # rankwatch's are on the model ...
    ema = copy.deepcopy(net)  # ... not on its copy, and the agent was not copied along
    assert not ema._forward_pre_hooks and not ema._forward_pre_hooks_with_kwargs
    buffer = io.BytesIO()
    torch.save(net, buffer)
    assert b"rankwatch" not in buffer.getvalue()
    assert b"rankwatch" not in pickle.dumps(net)
    assert net._forward_pre_hooks  # the original keeps them
    ema(torch.randn(8, 4))


def test_parameters_their_optimizer_never_changes(agent):
    """An optimizer that steps but leaves one group untouched (a custom
    step that forgets a group); a group with lr 0 and a frozen layer are
    left alone by design and not flagged."""

    class ForgetsLastGroup(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups[:-1]:
                for p in group["params"]:
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-group["lr"])

    net = Net()
    opt = ForgetsLastGroup([{"params": net.body.parameters(), "lr": 0.1},
                            {"params": net.head.parameters(), "lr": 0.1}])
    still = torch.nn.Linear(2, 2)
    zero_lr = torch.optim.SGD(still.parameters(), lr=0.0)
    for step in range(3):
        opt.zero_grad()
        zero_lr.zero_grad()
        (net(torch.randn(4, 8)).sum() + still(torch.randn(3, 2)).sum()).backward()
        opt.step()
        zero_lr.step()
    (event,) = _events(agent, "broken_update")
    assert event.details["check"] == "not_updated" and event.step == 0
    assert event.details["parameters"] == ["Net.head.bias", "Net.head.weight"]


@pytest.fixture
def device_agent(monkeypatch):
    """The agent as on a GPU (the device adapter's GPU-like test double):
    nothing is read on the host, every value comes back a few events late."""
    from rankwatch.agent.core import device

    device.install(device.GpuLikeDouble(lag=2, latency_s=60.0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    agent = Agent(config_mod.Config(), wire.RankIdentity(run_id="t", rank=0, local_rank=0, world_size=1), None)
    agent.install()
    dist.init_process_group("gloo")
    try:
        yield agent
    finally:
        agent.uninstall()
        device.install(None)
        dist.destroy_process_group()


def test_device_path_reports_late_with_the_right_steps(device_agent):
    agent = device_agent
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    fixed = torch.randn(4, 8)
    for step in range(6):
        x = fixed if step in (1, 2) else torch.randn(4, 8)
        scaler.scale(model(x).sum()).backward()  # no zero_grad: gradients never cleared
        scaler.step(opt)
        scaler.update()
    records = {r.step: r for r in agent.progress.recent}
    assert records[5].batch_fp is None  # the last step's values are not back: nothing was read at once
    late = {step: r.batch_fp for step, r in records.items() if r.batch_fp is not None}
    assert set(late) >= {0, 1, 2, 3} and late[1] == late[2] != late[3]  # filled into the held step rows
    assert not _events(agent, "step_values")  # never an event per step
    checks = {e.details["check"]: e.step for e in _events(agent, "broken_update")}
    assert checks == {"grads_not_cleared": 1}
    scale = [(e.step, dict(e.details["facts"]).get("loss_scale")) for e in _events(agent, "train_config")
             if "loss_scale" in dict(e.details["facts"])]
    assert scale and scale[0] == (1, "256"), scale  # the scale of update() after step 0 trains step 1, as on a CPU


class ConvBeforeBatchNorm(torch.nn.Module):
    """Conv2d with bias=True followed by BatchNorm2d, as many tutorials write it:
    in train mode the BatchNorm removes the batch mean, so the bias's gradient
    is mathematically zero and numerically ~1e-8."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1, bias=True)
        self.bn = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


@pytest.mark.parametrize("make_optimizer", [
    lambda p: torch.optim.SGD(p, lr=0.1),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.0),
    lambda p: torch.optim.Adam(p, lr=1e-3),
], ids=["sgd", "sgd_momentum", "adam"])
def test_an_update_below_the_parameters_resolution_is_no_broken_update(agent, make_optimizer):
    """issue 23: a healthy CNN got `not_updated` on its conv bias at step 0 on
    every rank. lr·grad (~1e-9) is below the bias's float32 resolution, so the
    step leaves it exactly unchanged: that is expected, not a broken optimizer.
    The check says in the notes that it could not judge it."""
    torch.manual_seed(0)
    net = ConvBeforeBatchNorm()
    with torch.no_grad():
        net.conv.bias.uniform_(0.25, 1.0)  # a trained bias's size: resolution 3e-8 to 1.2e-7
    opt = make_optimizer(net.parameters())
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,))
    for step in range(6):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    assert not _events(agent, "broken_update"), [e.details for e in _events(agent, "broken_update")]


def test_an_unjudged_update_is_said_in_the_notes(agent):
    torch.manual_seed(0)
    net = ConvBeforeBatchNorm()
    with torch.no_grad():
        net.conv.bias.fill_(0.5)  # resolution ~6e-8: the ~1e-9 update of plain SGD rounds away
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,))
    for step in range(4):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    assert not _events(agent, "broken_update")
    (note,) = _events(agent, "update_unjudged")
    assert note.details["parameters"] == ["conv.bias"]
    assert note.details["largest_update_ulps"] < 4


def test_ddp_built_again_around_the_same_module_is_still_ddp(agent):
    """issue 23 (the zoo's freeze_unfreeze job): fine-tuning scripts unfreeze
    a backbone and build DDP again around the same module (DDP registers its
    hooks for the parameters that need gradients when it is built). The new
    wrapper's forwards are DDP forwards: no `unreduced_backward`."""
    backbone, head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)
    net = torch.nn.Sequential(backbone, torch.nn.ReLU(), head)
    for p in backbone.parameters():
        p.requires_grad_(False)
    model = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(6):
        if step == 3:
            for p in backbone.parameters():
                p.requires_grad_(True)
            del model
            model = DDP(net)
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    assert not _events(agent, "unreduced_backward"), [e.details for e in _events(agent, "unreduced_backward")]


def _shadowed(agent, peers_sync: bool) -> None:
    """Three steps, then one iteration this rank only shadows (DDP's join
    hook, as Join runs it once its inputs ran out) while its peers take a
    step (``peers_sync``) or a no_sync micro-batch. A world of one has no
    peers, so their answer to the join hook's sync question is given."""
    ddp = DDP(Net())
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(4, 8)).sum().backward()
        opt.step()
    ddp._check_global_requires_backward_grad_sync = lambda is_joined_rank: peers_sync
    ddp.join_hook().main_hook()


def test_an_iteration_shadowed_in_a_join_is_a_step_of_this_rank(agent):
    """issue 23 (the zoo's join_uneven): counted by optimizer steps alone, a
    rank that ran out of inputs in Join fell a step behind its peers for
    every iteration it shadowed: `collective_mismatch` at the next marked
    step, weights compared across different steps."""
    _shadowed(agent, peers_sync=True)
    assert agent.progress.step == 4
    shadow = agent.progress.recent[-1]
    assert (shadow.step, shadow.forwards, shadow.compute_s, shadow.grad_norm) == (3, 0, None, None)
    assert [e.step for e in _events(agent, "join_shadowed")] == [3]


def test_a_no_sync_iteration_shadowed_in_a_join_is_a_micro_batch_not_a_step(agent):
    _shadowed(agent, peers_sync=False)
    assert agent.progress.step == 3 and not _events(agent, "join_shadowed")
