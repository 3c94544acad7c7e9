"""Each part of the agent is built with exactly what it uses (issue 28, part
1): an event sink, the progress tracker, the patch registry, the config...
never the `Agent`, and no part imports agent/runtime.py. So a check can be
built and tested with fakes of those few things: no Agent, no process
group, nothing of torch patched."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import torch

import rankwatch.agent
from rankwatch import config as config_mod
from rankwatch.agent.checks import gradient_flow, update_checks
from rankwatch.agent.watch import loaders
from rankwatch.agent.core import safety
from rankwatch.agent.core.device import DeferredReads
from rankwatch.agent.watch.models import Forward, Root

AGENT = Path(rankwatch.agent.__file__).parent
# The rooms, bottom to top: a module imports its own room or a room below, never above.
ROOMS = ("core", "watch", "checks", "evidence")


class FakeEmit:
    def __init__(self) -> None:
        self.events: list[tuple[str, Optional[int], dict[str, Any]]] = []

    def __call__(self, kind: str, step: Optional[int] = None, **details: Any) -> None:
        self.events.append((kind, step, details))


class FakePatches:
    """Records what a part would patch; patches nothing."""

    def __init__(self) -> None:
        self.applied: list[tuple[Any, str]] = []

    def apply(self, owner: Any, name: str, make: Any) -> None:
        self.applied.append((owner, name))
        return None


class FakeProgress:
    def __init__(self, step: int = 0) -> None:
        self.step = step
        self.typical_loss = None
        self.optimizer_steps = 0
        self.reads = DeferredReads()
        self.step_extras: list = []
        self.backward_extras: list = []
        self.record_complete: list = []

    def defer(self, tensors, consume) -> None:
        consume([float(t) for t in tensors])

    def end_step(self, record) -> None:
        """As Progress does: earlier reads that are in reach their consumers, then the extras run."""
        self.reads.poll()
        for extra in self.step_extras:
            extra(record)

    def lead_optimizer(self) -> Any:
        return None


def _fake_models() -> SimpleNamespace:
    return SimpleNamespace(on_training_forward=[], on_training_backward=[], on_optimizer_pre=[],
                           on_optimizer_post=[], name_of=lambda p: None, named_parameters=lambda: [])


def test_update_checks_built_from_fakes_report_an_unreduced_backward():
    emit, progress, patches, models = FakeEmit(), FakeProgress(step=3), FakePatches(), _fake_models()
    checks = update_checks.attach(models, emit=emit, progress=progress, patches=patches)
    assert checks is not None
    assert (torch.optim.Optimizer, "zero_grad") in patches.applied and (torch.nn.Module, "zero_grad") in patches.applied
    assert progress.step_extras and models.on_training_backward and models.on_optimizer_pre
    # A backward after a forward straight through `ddp.module` (DDP never sees it), then the optimizer steps.
    forward = Forward(root=Root(module=None, label="Net"), args=(), kwargs={}, via="module", site="train.py:12")
    models.on_training_backward[0]([forward])
    models.on_optimizer_pre[0](SimpleNamespace(param_groups=[]))
    assert emit.events == [("unreduced_backward", 3, {"via": "module", "module": "Net", "site": "train.py:12"})]
    assert not any(name.startswith("update_checks") for name in safety._disabled)


def test_gradient_flow_built_from_fakes_names_parameters_without_a_gradient():
    emit, progress = FakeEmit(), FakeProgress()
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    flow = gradient_flow.attach(SimpleNamespace(module=model), config=config_mod.Config(), emit=emit,
                                progress=progress)
    model[1](torch.randn(2, 3)).sum().backward()  # the first layer never gets a gradient
    for step in range(gradient_flow.WATCH_STEPS):
        progress.end_step(SimpleNamespace(step=step))
    assert [(kind, details["parameters"]) for kind, _, details in emit.events] == [
        ("unused_parameters", ["0.weight", "0.bias"])]
    assert flow.handles == []  # the per-parameter hooks are gone after the first steps


def test_a_loader_tracker_patches_through_the_registry_it_is_given():
    patches = FakePatches()
    assert loaders.attach(config=config_mod.Config(silent_checks=False), patches=patches) is None
    tracker = loaders.attach(config=config_mod.Config(), patches=patches)
    assert tracker is not None
    assert [name for _, name in patches.applied] == ["__next__", "__enter__"]


def test_the_progress_tracker_has_all_the_parts_use_of_it():
    from rankwatch.agent.core import ports
    from rankwatch.agent.watch.progress import Progress

    members = [n for n in vars(ports.StepProgress) if not n.startswith("_")] + list(ports.StepProgress.__annotations__)
    progress = Progress()
    assert len(members) > 10 and [n for n in members if not hasattr(progress, n)] == []


def _annotation_names(node: Optional[ast.expr]) -> set[str]:
    if node is None:
        return set()
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
    names |= {n.value.strip() for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return names


def test_no_part_imports_the_runtime_or_receives_the_agent():
    # The parts live in the rooms; runtime.py, bootstrap.py and __init__.py on top
    # compose them and may know the Agent.
    parts = sorted(p for room in ROOMS for p in (AGENT / room).glob("*.py"))
    assert len(parts) > 20
    offences = []
    for path in parts:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                names = {a.name for a in node.names}
                if (module.endswith("runtime") or ("runtime" in names and (not module or module.endswith("agent")))):
                    offences.append(f"{path.name}:{node.lineno} imports the runtime")
            elif isinstance(node, ast.Import):
                if any(a.name.endswith("agent.runtime") for a in node.names):
                    offences.append(f"{path.name}:{node.lineno} imports the runtime")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                for arg in args.posonlyargs + args.args + args.kwonlyargs:
                    if "Agent" in _annotation_names(arg.annotation) or arg.arg == "agent":
                        offences.append(f"{path.name}:{node.lineno} {node.name}() takes the Agent ({arg.arg})")
    assert not offences, "\n".join(offences)


def _imports(package_dir: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (anywhere in the
    file: a function-level import is an arrow too)."""
    modules = {}
    for path in package_dir.rglob("*.py"):
        rel = path.relative_to(package_dir).with_suffix("")
        parts = [] if rel.parts == ("__init__",) else list(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        modules[".".join([package, *parts])] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                for alias in node.names:
                    target = f"{module}.{alias.name}"
                    deps.add(target if target in modules else module)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _level(module: str) -> int:
    """A module's floor: its room's place in ROOMS; the top (runtime,
    bootstrap, the package itself) above them all."""
    parts = module.split(".")
    if len(parts) > 2 and parts[2] in ROOMS:
        return ROOMS.index(parts[2])
    return len(ROOMS)


def test_agent_import_graph_has_no_circle_and_only_downward_arrows():
    graph = _imports(AGENT, "rankwatch.agent")
    assert {m.split(".")[2] for m in graph if m.count(".") >= 3} == set(ROOMS)
    assert not _cycles(graph), _cycles(graph)
    upward = [f"{a} -> {b}" for a, deps in graph.items() for b in deps if _level(b) > _level(a)]
    assert not upward, "\n".join(upward)


def test_collector_import_graph_has_no_circle():
    import rankwatch.collector

    graph = _imports(Path(rankwatch.collector.__file__).parent, "rankwatch.collector")
    assert len(graph) > 20
    assert not _cycles(graph), _cycles(graph)


def test_the_graph_reader_sees_a_circle():
    """The two tests above can fail: a planted circle is found."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_checks_read_the_device_through_the_ranks_one_poller():
    """Issue 28, part 3: the update, training-config and fingerprint checks
    submit their device reads to the progress tracker's poller (no poller of
    their own), so the step end polls them and a rank's exit drains them with
    the step's own. A read still pending there reaches its check when
    Progress polls."""
    from rankwatch.agent.checks import fingerprints, train_config
    from rankwatch.agent.core.imports import ImportWatch

    emit, progress, patches = FakeEmit(), FakeProgress(step=3), FakePatches()
    config = config_mod.Config()
    parts = [
        update_checks.attach(_fake_models(), emit=emit, progress=progress, patches=patches),
        train_config.attach(_fake_models(), None, emit=emit, progress=progress, patches=patches,
                            imports=ImportWatch()),
        fingerprints.attach_optimizers(_fake_models(), config=config, progress=progress,
                                       add_fingerprint=lambda *a, **k: None, ddp_modules=[]),
    ]
    assert all(part is not None and part.reader is progress.reads for part in parts)

    class Late:  # a device whose copies are not in yet
        ready_now = False

        def capturing(self, device=None):
            return False

        def ready(self, handle):
            return self.ready_now

    late, got = Late(), []
    progress.reads._add(late, None, lambda: [1.0], lambda v: None)  # the step's own read, first in line
    parts[0].reader.submit([torch.tensor(2.0)], got.append)
    assert got == [] and len(progress.reads.pending) == 2, "waits behind the step's own read"
    late.ready_now = True
    progress.reads.poll()
    assert got == [[2.0]]
