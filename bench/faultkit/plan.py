"""What the benchmark runs: fault kinds, the verdict each should get, job
shapes, and one planned run per (shape, kind, seed) with its culprit rank and
fault step drawn from the seed. Pure: no processes here."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Optional

WORLD_SIZE = 3  # a majority exists for every cross-rank rule; 3 ranks fit 2 cores
WORLD_SIZES = (2, 3, 4)  # drawn per run when no world size is given (4 ranks is what 2 cores carry)
STEPS = 50  # per job: >= 30 steps after the latest fault step (a leak or a slow rank needs ~15-25)
FIRST_FAULT_STEP, LAST_FAULT_STEP = 0, 14  # from the first step (start-up) on


@dataclass(frozen=True)
class FaultKind:
    name: str
    expected: str  # the verdict kind a tool should give (rankwatch's vocabulary, docs/contract.md)
    how: str  # how the injector makes it, for the docs
    # steps per job, where the fault needs more than STEPS to be named: a slow
    # rank is persistent once it has lasted 5 s (collector/analyses/straggler.py),
    # ~150 of the quick shapes' 35 ms steps
    steps: Optional[int] = None


FAULTS: dict[str, FaultKind] = {k.name: k for k in (
    FaultKind("hang", "hang", "a forward pre-hook sleeps forever at the step's first forward"),
    FaultKind("dataloader_hang", "hang", "the DataLoader's `__next__` sleeps forever"),
    FaultKind("early_exit", "hang", "a forward pre-hook calls `sys.exit(0)`: the rank leaves, its peers wait"),
    FaultKind("crash", "crash", "a forward pre-hook raises `RuntimeError`"),
    FaultKind("sigkill", "crash", "a forward pre-hook sends the rank SIGKILL"),
    FaultKind("oom", "oom", "a forward pre-hook asks the CPU allocator for 4x the host's RAM; torch raises "
              "its own allocation error"),
    FaultKind("collective_mismatch", "collective_mismatch", "after the optimizer step, one extra `all_reduce` "
              "of 8 or 1,000,000 elements (seeded) on that rank only"),
    FaultKind("nan_loss", "nonfinite", "a forward hook turns the first leaf module's output into NaN"),
    FaultKind("nan_grad", "nonfinite", "`Tensor.register_hook` on the first leaf's output makes its gradient "
              "NaN; the loss stays finite"),
    FaultKind("grad_spike", "grad_spike", "`Tensor.register_hook` multiplies the first leaf's output gradient "
              "by 1e4, once"),
    FaultKind("weight_divergence", "weight_divergence", "after the optimizer step, N(0, 1e-3) noise is added "
              "to that replica's parameters, once"),
    FaultKind("straggler", "straggler", "every step's first forward sleeps as long as the rank's median step "
              "(about 2x slower)", steps=200),
    FaultKind("leak", "memory_growth", "16 MiB kept alive after every optimizer step"),
    FaultKind("config_divergence", "config_divergence", "the rank's model is switched to eval mode "
              "(dropout off) at each step's first forward"),
    FaultKind("duplicate_data", "duplicate_data", "the DataLoader hands that rank the same batch step "
              "after step"),
    FaultKind("broken_update", "broken_update", "`Optimizer.zero_grad` and `Module.zero_grad` become no-ops: "
              "gradients are never cleared"),
)}

HEALTHY = "healthy"
KIND_ORDER = [HEALTHY, *FAULTS]


@dataclass(frozen=True)
class Shape:
    name: str
    title: str
    launcher: str  # "torchrun" or "ray"
    not_applicable: tuple[str, ...] = ()
    why_not: str = ""
    world_sizes: tuple[int, ...] = WORLD_SIZES  # drawn from per run


# The plain DDP job (a small MLP) also runs on 8 ranks: what 2 cores carry for it.
DDP_WORLD_SIZES = (*WORLD_SIZES, 8)


SHAPES: dict[str, Shape] = {s.name: s for s in (
    Shape("ddp", "plain DDP", "torchrun", world_sizes=DDP_WORLD_SIZES),
    Shape("fsdp2", "FSDP2", "torchrun", ("weight_divergence",),
          "FSDP2 keeps one copy of each shard: there is no replica to diverge from"),
    Shape("lightning", "Lightning Trainer", "torchrun"),
    Shape("hf", "Hugging Face Trainer", "torchrun"),
    Shape("ray", "Ray Train", "ray"),
)}


@dataclass(frozen=True)
class RunPlan:
    shape: str
    kind: str  # a FAULTS key or HEALTHY
    seed: int
    rank: Optional[int]  # the culprit; None when healthy
    step: Optional[int]
    variant: str = ""
    world_size: int = WORLD_SIZE
    steps: int = STEPS
    magnitude: str = ""  # the fault's size (FAULTBENCH_MAGNITUDE); empty: the injector's default

    @property
    def run_id(self) -> str:
        return f"{self.shape}-{self.kind}-s{self.seed}"

    @property
    def expected(self) -> Optional[str]:
        return FAULTS[self.kind].expected if self.kind in FAULTS else None

    def to_json(self) -> dict:
        return {**asdict(self), "run_id": self.run_id, "expected": self.expected}


def plan_run(shape: str, kind: str, seed: int, world_size: Optional[int] = WORLD_SIZE,
             steps: int = STEPS) -> RunPlan:
    """``world_size`` None: drawn from the shape's world sizes with the run's seed."""
    rng = random.Random(f"{shape}/{kind}/{seed}")
    if world_size is None:
        world_size = rng.choice(SHAPES[shape].world_sizes)
    if kind == HEALTHY:
        return RunPlan(shape, kind, seed, None, None, "", world_size, steps)
    steps = max(steps, FAULTS[kind].steps or 0) if kind in FAULTS else steps
    rank = rng.randrange(world_size)
    step = rng.randint(FIRST_FAULT_STEP, LAST_FAULT_STEP)
    # Both sizes of the extra collective, alternating over shapes and seeds (a draw left one out).
    variant = ("small", "large")[(seed + list(SHAPES).index(shape)) % 2] if kind == "collective_mismatch" else ""
    return RunPlan(shape, kind, seed, rank, step, variant, world_size, steps)


def plan_all(shapes: list[str], kinds: list[str], seeds: list[int], world_size: Optional[int] = WORLD_SIZE,
             steps: int = STEPS, healthy_seeds: Optional[list[int]] = None) -> list[RunPlan]:
    """Every applicable (shape, kind, seed), seed-major so that a partial run
    already covers every cell once. Healthy runs may have seeds of their own
    (more of them: every verdict on one counts against precision)."""
    plans = []
    healthy_seeds = seeds if healthy_seeds is None else healthy_seeds
    for seed in sorted(set(seeds) | set(healthy_seeds)):
        for kind in kinds:
            if seed not in (healthy_seeds if kind == HEALTHY else seeds):
                continue
            for shape in shapes:
                if kind in SHAPES[shape].not_applicable:
                    continue
                plans.append(plan_run(shape, kind, seed, world_size, steps))
    return plans
