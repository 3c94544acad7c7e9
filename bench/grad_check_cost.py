"""Cost and miss rate of the local-gradient checks on a CPU (gloo).

    flock /tmp/rankwatch-heavy.lock python bench/grad_check_cost.py [--steps 300] [--trials 200]

Also (issue 17, finding 11): the host cost of each way to check local
gradients before the allreduce, against DDP's built-in C++ allreduce (no
hook), on two gloo ranks, with 1 MB buckets, per bucket:
- `python_hook`: a Python comm hook (torch's allreduce_hook) and no check;
- `comm_hook+norms`: the earlier design: the comm hook takes per-parameter
  float32 norms of the bucket (one `_foreach_norm`), then allreduce_hook;
- `accum+norms`: the shipped design on a sampled step: DDP's C++ allreduce
  kept, a post-accumulate-grad hook per parameter takes its float32 norm;
- `accum+probe`: the shipped design on a step the budget samples out (a
  gather and a count per parameter).
Measured here (2 ranks, 1 thread each, torch 2.13 CPU, `--designs-only
--steps 150 --repeats 3`), step time against the C++ allreduce:

    model                          python_hook  comm_hook+norms  accum+norms  accum+probe
    MLP, 10 params, 4 buckets         1.091         1.174           1.109        1.032
    transformer-like, 52 params,      1.107         1.127           1.049        1.061
      17 buckets

The shipped design (post-accumulate hooks, DDP's C++ allreduce kept) costs
less than the comm hook with the same norms on both, and on a CPU the norms
are a real pass over the gradients (the budget then samples them; on a GPU
they are asynchronous kernels and the host cost is the launches).

One process, a gloo world of size 1, the agent attached in process. Prints:
- per-step time of a small MLP's DDP training step with the checks off
  (DDP's built-in allreduce), with the comm hook but no check, with the
  every-step sparse probe only, and with the full check (BLAS dot) on every
  step; and the time the checker itself measured;
- the probe's miss rate on steps the cost budget samples out, for a NaN put
  into one element of one parameter's gradient, a NaN in one sample's
  backward (the loss stays finite), and a NaN in one sample's loss.
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from rankwatch import config as config_mod
from rankwatch import wire
from rankwatch.agent.runtime import Agent

BATCH, WIDTH, DEPTH = 32, 512, 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_agent(**overrides) -> Agent:
    config = config_mod.Config(fingerprint_every=0, **overrides)
    identity = wire.RankIdentity(run_id="bench", rank=0, local_rank=0, world_size=1, node_rank=0,
                                 host="localhost", pid=os.getpid(), attempt=0)
    agent = Agent(config, identity, None)
    agent.install()
    return agent


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, WIDTH), torch.nn.ReLU()]
    for _ in range(DEPTH - 1):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(WIDTH, 10))
    return torch.nn.Sequential(*layers)


class NanInBackward(torch.autograd.Function):
    """Identity forward; backward puts a NaN into one sample's gradient (one
    feature) where `site` says: a PPO-style bad sample whose loss is finite."""

    sample = -1
    site = ""

    @staticmethod
    def forward(ctx, x, site):
        ctx.site = site
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if NanInBackward.sample >= 0 and NanInBackward.site == ctx.site:
            grad = grad.clone()
            grad[NanInBackward.sample, 0] = float("nan")
        return grad, None


class _Inject(torch.nn.Module):
    def __init__(self, site: str) -> None:
        super().__init__()
        self.site = site

    def forward(self, x):
        return NanInBackward.apply(x, self.site)


def step_fn(ddp, opt, x, y, nan_loss_sample: int = -1):
    opt.zero_grad(set_to_none=False)
    per_sample = torch.nn.functional.cross_entropy(ddp(x), y, reduction="none")
    if nan_loss_sample >= 0:
        scale = torch.ones_like(per_sample)
        scale[nan_loss_sample] = float("nan")  # that sample's loss and its backward are NaN
        per_sample = per_sample * scale
    loss = per_sample.mean()
    loss.backward()
    opt.step()
    return loss


def timed_run(mode: str, steps: int) -> dict:
    overrides = {"grad_checks": mode != "off", "grad_check_budget": 0.0}
    agent = make_agent(**overrides)
    try:
        model = make_model()
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        checker = getattr(ddp, "_rankwatch_grad_checker", None)
        if checker is not None:
            checker.stride = 1 if mode == "full" else 10 ** 9
            checker.probe_elements = 0 if mode == "hook" else checker.probe_elements
        spent: list[float] = []
        if checker is not None:
            # The checker times itself; take its figure before the step end resets it.
            for name, attr in (("_adapt", "_spent"), ("_adapt_probe", "_probe_spent")):
                def capture(record, original=getattr(checker, name), attr=attr):
                    spent.append(getattr(checker, attr))
                    return original(record)

                setattr(checker, name, capture)
        x, y = torch.randn(BATCH, 64), torch.randint(0, 10, (BATCH,))
        for _ in range(20):  # warm up (DDP rebuilds its buckets after the first step)
            step_fn(ddp, opt, x, y)
        spent.clear()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step_fn(ddp, opt, x, y)
            times.append(time.perf_counter() - t0)
        return {"mode": mode, "step_ms": statistics.median(times) * 1e3,
                "check_us": statistics.median(spent) * 1e6 if spent else 0.0,
                "probe_elements": getattr(checker, "probe_elements", 0)}
    finally:
        agent.uninstall()


DESIGNS = ("cpp_default", "python_hook", "comm_hook+norms", "accum+norms", "accum+probe")


def transformer_like(blocks: int = 8, width: int = 256) -> torch.nn.Module:
    """Many parameters per bucket (weights, biases, LayerNorms), as in a transformer."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, width)]
    for _ in range(blocks):
        layers += [torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                   torch.nn.Linear(4 * width, width)]
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers)


def design_run(design: str, steps: int, model_fn=make_model) -> dict:
    """One design's step time (see the docstring), on this process's world."""
    shipped = design.startswith("accum")
    agent = make_agent(grad_checks=shipped, grad_check_budget=0.0)
    try:
        ddp = DDP(model_fn(), bucket_cap_mb=1)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        checker = getattr(ddp, "_rankwatch_grad_checker", None)
        if checker is not None:
            checker.stride = 1 if design == "accum+norms" else 10 ** 9
            checker.budget = 0.0
        kept: list = []
        if design in ("python_hook", "comm_hook+norms"):
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            from rankwatch.agent.checks.grad_checks import fp32_norms

            def hook(state, bucket, norms=design == "comm_hook+norms"):
                if norms:
                    kept.append(torch.stack(fp32_norms(bucket.gradients())))
                return allreduce_hook(state, bucket)

            ddp.register_comm_hook(None, hook)
        x, y = torch.randn(BATCH, 64), torch.randint(0, 10, (BATCH,))
        for _ in range(20):  # DDP rebuilds its buckets after the first step
            step_fn(ddp, opt, x, y)
            kept.clear()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step_fn(ddp, opt, x, y)
            times.append(time.perf_counter() - t0)
            kept.clear()
        buckets = len(ddp.reducer._get_zeros_like_grad_buckets())
        params = sum(1 for _ in ddp.module.parameters())
        return {"design": design, "step_ms": statistics.median(times) * 1e3, "buckets": buckets, "params": params}
    finally:
        agent.uninstall()


def _designs_worker(rank: int, world: int, port: int, steps: int, repeats: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for model_name, model_fn in (("MLP", make_model), ("transformer-like", transformer_like)):
            rows: dict[str, list[dict]] = {}
            for _ in range(repeats):  # interleaved: drift on a shared machine hits every design alike
                for design in DESIGNS:
                    rows.setdefault(design, []).append(design_run(design, steps, model_fn))
            results[model_name] = rows
        if rank == 0:
            out.put(results)
    finally:
        dist.destroy_process_group()


def design_costs(steps: int, repeats: int, world: int = 2) -> dict:
    """Every design on `world` gloo ranks (the division by the world size is
    then done by DDP's C++ path and the Python hook alike)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_designs_worker, args=(r, world, port, steps, repeats, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = out.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    return results


def print_design_costs(results: dict) -> None:
    for model_name, rows in results.items():
        cpp = statistics.median(r["step_ms"] for r in rows["cpp_default"])
        first = rows["cpp_default"][0]
        print(f"{model_name}: {first['params']} parameters in {first['buckets']} buckets of 1 MB, 2 gloo ranks; "
              f"host cost against DDP's C++ allreduce:")
        print(f"  {'design':<14}{'step ms':>10}{'vs C++':>9}{'us/bucket':>11}")
        for design in DESIGNS:
            step_ms = statistics.median(r["step_ms"] for r in rows[design])
            print(f"  {design:<14}{step_ms:>10.3f}{step_ms / cpp:>9.3f}{(step_ms - cpp) * 1e3 / first['buckets']:>11.1f}")


def budgeted_run(steps: int) -> dict:
    """The checker as shipped: default budget, stride and probe size adapted."""
    agent = make_agent()
    try:
        ddp = DDP(make_model())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        checker = ddp._rankwatch_grad_checker
        spent: list[float] = []
        for name, attr in (("_adapt", "_spent"), ("_adapt_probe", "_probe_spent")):
            def capture(record, original=getattr(checker, name), attr=attr):
                spent.append(getattr(checker, attr))
                return original(record)

            setattr(checker, name, capture)
        x, y = torch.randn(BATCH, 64), torch.randint(0, 10, (BATCH,))
        for _ in range(steps):  # long enough for the stride and the probe to settle
            step_fn(ddp, opt, x, y)
        spent.clear()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step_fn(ddp, opt, x, y)
            times.append(time.perf_counter() - t0)
        return {"budget": agent.config.grad_check_budget, "stride": checker.stride,
                "probe_lines": checker.probe_elements, "step_ms": statistics.median(times) * 1e3,
                "check_us": statistics.mean(spent) * 1e6 if spent else 0.0}
    finally:
        agent.uninstall()


def fingerprint_cost(steps: int) -> dict:
    """What one fingerprint costs (the norms of every parameter and buffer),
    and the interval the budget settles on for this model."""
    agent = make_agent()
    agent.config.fingerprint_every = 1
    try:
        from rankwatch.agent.checks.fingerprints import Fingerprinter

        model = make_model()
        model.insert(1, torch.nn.BatchNorm1d(WIDTH))
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        fp = next(e for e in agent.extensions if isinstance(e, Fingerprinter))
        spent: list[float] = []
        original = fp._adapt

        def capture(record, cost):
            spent.append(cost)
            return original(record, cost)

        fp._adapt = capture
        x, y = torch.randn(BATCH, 64), torch.randint(0, 10, (BATCH,))
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step_fn(ddp, opt, x, y)
            times.append(time.perf_counter() - t0)
        return {"tensors": len(fp.names), "cost_us": statistics.median(spent) * 1e6 if spent else 0.0,
                "multiplier": fp.multiplier, "every": fp.every, "step_ms": statistics.median(times) * 1e3,
                "budget": fp.budget}
    finally:
        agent.uninstall()


def miss_rates(trials: int, probe_lines: int) -> dict:
    agent = make_agent(grad_check_budget=0.0)
    try:
        model = make_model()
        # Where a sample's backward can turn NaN: its logits' gradient, or the
        # input of a middle Linear (one sample, one feature).
        layers = list(model)
        layers.insert(4, _Inject("middle"))
        layers.append(_Inject("logits"))
        model = torch.nn.Sequential(*layers)
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        checker = ddp._rankwatch_grad_checker
        checker.stride = 10 ** 9  # every step sampled out: only the probe looks
        x, y = torch.randn(BATCH, 64), torch.randint(0, 10, (BATCH,))
        for _ in range(5):
            step_fn(ddp, opt, x, y)
        checker.stride = 10 ** 9
        checker.probe_elements = probe_lines
        clean = {k: v.clone() for k, v in model.state_dict().items()}
        params = [p for p in model.parameters()]
        sizes = [p.numel() for p in params]
        rng = random.Random(0)
        results = {}
        kinds = ("one_gradient_element", "one_sample_backward_logits", "one_sample_backward_middle",
                 "one_sample_loss")
        for kind in kinds:
            caught = present = 0
            for _ in range(trials):
                handle = None
                nan_loss = -1
                if kind == "one_gradient_element":
                    # a parameter picked in proportion to its size, then one element
                    index = rng.choices(range(len(params)), weights=sizes)[0]
                    flat = rng.randrange(sizes[index])

                    def poison(grad, flat=flat):
                        grad = grad.clone()
                        grad.view(-1)[flat] = float("nan")
                        return grad

                    handle = params[index].register_hook(poison)
                elif kind.startswith("one_sample_backward"):
                    NanInBackward.sample = rng.randrange(BATCH)
                    NanInBackward.site = kind.rsplit("_", 1)[1]
                else:
                    nan_loss = rng.randrange(BATCH)
                step = agent.progress.step
                before = list(agent.events_log)
                step_fn(ddp, opt, x, y, nan_loss_sample=nan_loss)
                if handle is not None:
                    handle.remove()
                NanInBackward.sample = -1
                # Ground truth: is any local gradient element not finite? (A NaN
                # that a ReLU's mask removed is no NaN to find.)
                if not all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None):
                    present += 1
                    agent.progress.finish(grace_s=0.0)  # this step's record and its events out now
                    seen = {id(e) for e in before}
                    found = [e for e in agent.events_log if id(e) not in seen and e.kind == "nonfinite"
                             and e.step == step]
                    if found and found[0].details.get("source") == "local_gradients":
                        caught += 1
                with torch.no_grad():
                    model.load_state_dict(clean)
            results[kind] = {"trials": present, "caught": caught,
                             "miss_rate": (1 - caught / present) if present else float("nan")}
        results["bucket_elements"] = sum(sizes)
        results["probe_elements_per_bucket"] = checker.probe_elements
        return results
    finally:
        agent.uninstall()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--designs-only", action="store_true", help="only the per-bucket cost of each design")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print_design_costs(design_costs(args.steps, args.repeats))
    if args.designs_only:
        return 0
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        params = sum(p.numel() for p in make_model().parameters())
        print(f"model: MLP {DEPTH + 1} Linear layers, {params:,} parameters, batch {BATCH}, 1 thread, gloo world 1")
        rows: dict[str, list[dict]] = {}
        for _ in range(args.repeats):  # interleaved: drift on a shared machine hits every mode alike
            for mode in ("off", "hook", "probe", "full"):
                rows.setdefault(mode, []).append(timed_run(mode, args.steps))
        base = statistics.median(r["step_ms"] for r in rows["off"])
        hook = statistics.median(r["step_ms"] for r in rows["hook"])
        # "hook" vs "off" in a world of one: DDP's built-in reduction skips the
        # division by the world size there, the Python allreduce_hook does not
        # (with two or more ranks both divide).
        print(f"{'mode':<8}{'step ms':>10}{'vs off':>10}{'vs hook':>10}{'check us/step':>15}")
        for mode, runs in rows.items():
            step_ms = statistics.median(r["step_ms"] for r in runs)
            check_us = statistics.median(r["check_us"] for r in runs)
            print(f"{mode:<8}{step_ms:>10.3f}{step_ms / base:>10.3f}{step_ms / hook:>10.3f}{check_us:>15.1f}")
        adaptive = budgeted_run(args.steps)
        print(f"with the default budget ({adaptive['budget']:.3%} of step time): full check every "
              f"{adaptive['stride']} steps, probe of {adaptive['probe_lines']} elements per bucket (at least one per parameter), "
              f"step {adaptive['step_ms']:.3f} ms ({adaptive['step_ms'] / base:.3f} x off), "
              f"checker {adaptive['check_us']:.1f} us/step on average")
        fp = fingerprint_cost(args.steps)
        print(f"fingerprint: {fp['tensors']} tensors, {fp['cost_us']:.1f} us each; with fingerprint_every=1 and "
              f"its share of the budget ({fp['budget']:.3%} of step time) the interval settles at "
              f"{fp['every'] * fp['multiplier']} steps (step {fp['step_ms']:.3f} ms)")
        for lines in (512, 16):
            rates = miss_rates(args.trials, lines)
            print(f"probe of {lines} elements per bucket, at least one per parameter "
                  f"({rates['bucket_elements']:,} gradient elements), "
                  f"steps the budget samples out:")
            for kind in ("one_gradient_element", "one_sample_backward_logits", "one_sample_backward_middle",
                         "one_sample_loss"):
                r = rates[kind]
                print(f"  NaN in {kind:<28} caught {r['caught']:>4}/{r['trials']:<4} (steps with a NaN in the "
                      f"local gradients)  miss rate {r['miss_rate']:.3f}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
