"""What a benchmark run publishes: the machine it ran on, the Markdown tables
(docs/benchmark.md), the README's headline block, and the plot of time to
verdict per fault kind and tool."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Optional

from faultkit import scoring
from faultkit.plan import FAULTS, HEALTHY, KIND_ORDER, SHAPES

TOOLS = {
    "rankwatch": "rankwatch",
    "torchrun": "torchrun alone",
    "ray": "Ray Train alone",
    "fr_trace": "Flight Recorder + fr_trace",
    "torchrun+fr_trace": "torchrun + Flight Recorder + fr_trace",
}

# The verdict kinds each tool can say at all: its recall ceiling is the share of
# fault runs whose expected verdict is among them.
VOCABULARY = {
    "torchrun": {"crash"},
    "ray": {"crash"},
    "fr_trace": {"hang", "collective_mismatch"},
    "torchrun+fr_trace": {"crash", "oom", "hang", "collective_mismatch"},
}


def ceiling(runs: list[dict], tool: str) -> scoring.Proportion:
    """The recall a tool could reach at best: scored fault runs whose expected
    verdict its vocabulary holds (rankwatch: every kind)."""
    scored = [r for r in runs if r["kind"] != HEALTHY and scoring.status(r, tool) == "scored"]
    vocabulary = VOCABULARY.get(tool)
    hits = sum(1 for r in scored if vocabulary is None or r.get("expected") in vocabulary)
    return scoring.wilson(hits, len(scored))


def paired_table(runs: list[dict]) -> list[str]:
    """Time to verdict on the same runs: those rankwatch and the other tool
    both got right, median of each."""
    lines = ["| against | runs both got right | rankwatch median s [95 % CI] | the other's median s [95 % CI] | "
             "rankwatch faster on |", "|---|---|---|---|---|"]
    for tool in tools_present(runs):
        if tool == "rankwatch":
            continue
        ours, theirs, faster = [], [], 0
        for run in runs:
            a, b = scoring.scored(run, "rankwatch"), scoring.scored(run, tool)
            if a is None or b is None or run["kind"] == HEALTHY:
                continue
            x, y = scoring.time_to_verdict(run, a), scoring.time_to_verdict(run, b)
            if x is None or y is None:
                continue
            ours.append(x)
            theirs.append(y)
            faster += x < y
        if not ours:
            lines.append(f"| {TOOLS[tool]} | 0 | – | – | – |")
            continue
        lines.append(f"| {TOOLS[tool]} | {len(ours)} | {seconds(scoring.quantile(ours, 0.5))} | "
                     f"{seconds(scoring.quantile(theirs, 0.5))} | {faster}/{len(ours)} |")
    return lines


def machine() -> dict:
    info = {"cpu": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0)),
            "os": f"{platform.system()} {platform.release()}", "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["ram_gib"] = round(int(f.readline().split()[1]) / 2 ** 20, 1)
    except OSError:
        pass
    for name, module in (("torch", "torch"), ("lightning", "lightning"), ("transformers", "transformers"),
                         ("accelerate", "accelerate"), ("ray", "ray")):
        try:
            from importlib.metadata import version

            info[name] = version(module)
        except Exception:
            info[name] = "not installed"
    info["rankwatch_commit"] = checkout_commit()
    return info


ROOT = Path(__file__).resolve().parents[2]


def checkout_commit(root: Path = ROOT) -> str:
    """The commit this checkout is at, "+changes" when tracked code differs
    from it (the outputs a run writes, docs/ and README.md, do not count)."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        changed = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--",
                                  ".", ":!docs", ":!README.md"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+changes" if changed else "")


def commits(runs: list[dict]) -> list[str]:
    """The commits the runs were made at (one, for a table that may be published)."""
    return sorted({str(r.get("commit") or "unrecorded") for r in runs})


# ------------------------------------------------------------ formatting --

def _num(x: Optional[float], digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def proportion(p: scoring.Proportion) -> str:
    if p.n == 0:
        return "–"
    return f"{p.hits}/{p.n} = {p.value:.2f} [{p.low:.2f}, {p.high:.2f}]"


def seconds(q: scoring.Quantile) -> str:
    if q.n == 0:
        return "–"
    low = "…" if q.low is None else f"{q.low:.1f}"
    high = "…" if q.high is None else f"{q.high:.1f}"
    return f"{q.value:.1f} [{low}, {high}]"


def tools_present(runs: list[dict]) -> list[str]:
    present = {t for r in runs for t, a in (r.get("tools") or {}).items() if a.get("applies", True)}
    return [t for t in TOOLS if t in present]


def kinds_present(runs: list[dict]) -> list[str]:
    present = {r["kind"] for r in runs}
    return [k for k in KIND_ORDER if k in present]


# ---------------------------------------------------------------- tables --

def kind_table(runs: list[dict]) -> list[str]:
    lines = ["| fault | expected verdict | tool | runs | recall [95 % CI] | culprit accuracy | "
             "precision of that verdict kind | median s [95 % CI] | p95 s [95 % CI] | verdict step - fault step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    tools = tools_present(runs)
    precision = {t: scoring.score_precision(runs, t) for t in tools}
    per_tool = {t: scoring.score_kinds(runs, t) for t in tools}
    for kind in kinds_present(runs):
        if kind == HEALTHY:
            continue
        expected = FAULTS[kind].expected
        for tool in tools:
            s = per_tool[tool].get(kind)
            if s is None or s.runs == 0:
                continue
            p = precision[tool].get(expected)
            lines.append(f"| {kind} | `{expected}` | {TOOLS[tool]} | {s.runs}"
                         f"{f' (+{s.not_injected} not injected)' if s.not_injected else ''} | "
                         f"{proportion(s.recall)} | {proportion(s.culprit_accuracy)} | "
                         f"{proportion(p.precision) if p else '– (no verdict of this kind)'} | "
                         f"{seconds(s.median)} | {seconds(s.p95)} | {lags(s.step_lags)} |")
    for tool in tools:
        s = scoring.score_overall(runs, tool)
        p = precision[tool]["all"]
        lines.append(f"| **all faults** | | **{TOOLS[tool]}** | {s.runs} | {proportion(s.recall)} | "
                     f"{proportion(s.culprit_accuracy)} | {proportion(p.precision)} (every verdict) | "
                     f"{seconds(s.median)} | {seconds(s.p95)} | {lags(s.step_lags)} |")
    return lines


def _ranks(settings: dict, runs: list[dict]) -> str:
    if settings.get("world_size"):
        return str(settings["world_size"])
    sizes = sorted({r.get("world_size") for r in runs if r.get("world_size")})
    return f"{'–'.join(str(x) for x in (sizes[0], sizes[-1]))} (drawn per run)" if sizes else "?"


def lags(values: list) -> str:
    """Step lags as "exact in k/n; range a..b" ("–": the tool names no step)."""
    if not values:
        return "–"
    exact = sum(1 for x in values if x == 0)
    return f"exact {exact}/{len(values)}; {min(values)}..{max(values)}"


def headline_table(runs: list[dict]) -> list[str]:
    """Per fault kind, each tool's recall as hits/runs; then the totals."""
    tools = tools_present(runs)
    per_tool = {t: scoring.score_kinds(runs, t) for t in tools}
    lines = ["| fault (verdict expected) | " + " | ".join(TOOLS[t] for t in tools) + " |",
             "|---|" + "---|" * len(tools)]
    for kind in kinds_present(runs):
        cells = []
        for tool in tools:
            s = per_tool[tool].get(kind)
            if s is None or s.runs == 0:
                cells.append("–")
            elif kind == HEALTHY:
                cells.append(f"{s.verdicts} false alarm{'s' if s.verdicts != 1 else ''} in {s.runs} runs")
            else:
                cells.append(f"{s.hits}/{s.runs}")
        label = "healthy runs" if kind == HEALTHY else f"{kind} (`{FAULTS[kind].expected}`)"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    cells = []
    for tool in tools:
        s = scoring.score_overall(runs, tool)
        p = scoring.score_precision(runs, tool)["all"]
        cells.append(f"recall {_num(s.recall.value)} (ceiling {_num(ceiling(runs, tool).value)}), "
                     f"precision {_num(p.precision.value)}, median {_num(s.median.value, 1)} s")
    lines.append("| **all** | " + " | ".join(cells) + " |")
    return lines


def precision_table(runs: list[dict]) -> list[str]:
    lines = ["| tool | verdict kind | verdicts | correct | on healthy runs | precision [95 % CI] |",
             "|---|---|---|---|---|---|"]
    for tool in tools_present(runs):
        scores = scoring.score_precision(runs, tool)
        for key in sorted(k for k in scores if k != "all") + ["all"]:
            p = scores[key]
            if p.verdicts == 0 and key != "all":
                continue
            lines.append(f"| {TOOLS[tool]} | {'**every verdict**' if key == 'all' else f'`{key}`'} | {p.verdicts} | "
                         f"{p.correct} | {p.on_healthy} | {proportion(p.precision)} |")
    return lines


def shape_table(runs: list[dict]) -> list[str]:
    tools = tools_present(runs)
    lines = ["| shape | " + " | ".join(f"{TOOLS[t]}: recall" for t in tools) + " | "
             + " | ".join(f"{TOOLS[t]}: false alarms" for t in tools) + " |",
             "|---|" + "---|" * (2 * len(tools))]
    for shape in SHAPES:
        mine = [r for r in runs if r["shape"] == shape]
        if not mine:
            continue
        recall, alarms = [], []
        for tool in tools:
            s = scoring.score_overall(mine, tool)
            h = scoring.score_kinds(mine, tool).get(HEALTHY)
            recall.append(f"{s.hits}/{s.runs}" if s.runs else "–")
            alarms.append(f"{h.verdicts} in {h.runs} runs" if h and h.runs else "–")
        lines.append(f"| {SHAPES[shape].title} | " + " | ".join(recall) + " | " + " | ".join(alarms) + " |")
    return lines


def _said(answer: dict) -> str:
    verdicts = answer.get("verdicts") or []
    if not verdicts:
        return "nothing"
    return "; ".join(f"`{v.get('kind')}` {v.get('ranks')}" for v in verdicts)


def misses(runs: list[dict], tool: str = "rankwatch") -> list[str]:
    """Every fault run without a correct verdict and every wrong verdict."""
    lines = []
    for run in runs:
        answer = scoring.scored(run, tool)
        if answer is None:
            continue
        verdicts = answer.get("verdicts") or []
        if run["kind"] == HEALTHY:
            for v in verdicts:
                lines.append(f"- `{run['run_id']}` (healthy): false alarm `{v.get('kind')}` {v.get('ranks')}: "
                             f"{(v.get('summary') or '')[:240]}")
            continue
        truth = f"rank {run['rank']}, step {answer['injected'].get('step')}"
        if not any(scoring.is_correct(v, run) for v in verdicts):
            lines.append(f"- `{run['run_id']}` ({run['kind']} on {truth}, expected `{run['expected']}`): "
                         f"missed; said {_said(answer)}"
                         + (f": {(verdicts[0].get('summary') or '')[:240]}" if verdicts else ""))
        for v in verdicts:
            if not scoring.is_correct(v, run) and any(scoring.is_correct(w, run) for w in verdicts):
                lines.append(f"- `{run['run_id']}` ({run['kind']} on {truth}): extra verdict `{v.get('kind')}` "
                             f"{v.get('ranks')}: {(v.get('summary') or '')[:200]}")
    not_injected = [r["run_id"] for r in runs if scoring.status(r, tool) == "not_injected"]
    if not_injected:
        lines.append(f"- fault never fired (left out of the scores): {', '.join(f'`{r}`' for r in not_injected)}")
    return lines or ["- none"]


# -------------------------------------------------------------------- plot --

def plot(runs: list[dict], path: Path) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    tools = tools_present(runs)
    kinds = [k for k in kinds_present(runs) if k != HEALTHY]
    colors = {"rankwatch": "#1f77b4", "torchrun": "#d62728", "ray": "#9467bd", "fr_trace": "#2ca02c"}
    fig, ax = plt.subplots(figsize=(9, 0.45 * max(len(kinds), 4) + 1.5))
    offsets = {t: (i - (len(tools) - 1) / 2) * 0.2 for i, t in enumerate(tools)}
    for tool in tools:
        scores = scoring.score_kinds(runs, tool)
        xs, ys = [], []
        for y, kind in enumerate(kinds):
            s = scores.get(kind)
            for latency in (s.latencies if s else []):
                xs.append(max(latency, 0.1))
                ys.append(y + offsets[tool])
        ax.scatter(xs, ys, s=18, color=colors.get(tool, "gray"), label=TOOLS[tool], alpha=0.8)
        for y, kind in enumerate(kinds):
            s = scores.get(kind)
            if s and s.latencies:
                m = s.median.value
                ax.plot([max(m, 0.1)] * 2, [y + offsets[tool] - 0.09, y + offsets[tool] + 0.09],
                        color=colors.get(tool, "gray"), linewidth=2.5)
    if any(scoring.score_kinds(runs, t).get(k) and scoring.score_kinds(runs, t)[k].latencies
           for t in tools for k in kinds):
        ax.set_xscale("log")
    else:
        ax.text(0.5, 0.5, "no correct verdict yet", transform=ax.transAxes, ha="center")
    ax.set_yticks(range(len(kinds)))
    ax.set_yticklabels(kinds)
    ax.invert_yaxis()
    ax.set_xlabel("time from injection to a correct verdict (s, log scale); bar: median")
    ax.set_title("Time to verdict per fault kind and tool (correct verdicts only)")
    ax.grid(axis="x", which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- document --

def markdown(runs: list[dict], settings: dict, info: dict, command: str, files: dict) -> str:
    faults = [r for r in runs if r["kind"] != HEALTHY]
    healthy = [r for r in runs if r["kind"] == HEALTHY]
    shapes = sorted({r["shape"] for r in runs}, key=list(SHAPES).index)
    out = [
        "# faultbench: rankwatch against what users have today",
        "",
        "<!-- Generated by bench/faultbench.py; edits here are overwritten. -->",
        "",
        f"Command: `{command}` ({len(runs)} runs: {len(faults)} with a fault, {len(healthy)} healthy; "
        f"{settings.get('elapsed_min', '?')} min).",
        "",
        f"Machine: {info.get('cpu')}, {info.get('cores')} cores, {info.get('ram_gib')} GiB RAM, {info.get('os')}; "
        f"Python {info.get('python')}, torch {info.get('torch')}, Lightning {info.get('lightning')}, "
        f"transformers {info.get('transformers')}, accelerate {info.get('accelerate')}, Ray {info.get('ray')}; "
        f"rankwatch at `{', '.join(commits(runs))}` (every run's commit, recorded in its line of the JSON Lines).",
        "",
        f"Jobs: {_ranks(settings, runs)} ranks (gloo, CPU), {settings['steps']} optimizer steps, shapes "
        f"{', '.join(SHAPES[s].title for s in shapes)}; fault seeds {settings['seeds']}, healthy seeds "
        f"{settings.get('healthy_seeds', settings['seeds'])}; collective timeout "
        f"{settings['collective_timeout']:.0f} s on both sides; a run still going after "
        f"{settings['cap_s']:.0f} s is killed.",
        "",
        "## Headline",
        "",
        "Correct verdicts (right kind, exactly the culprit rank) per fault kind, out of the runs where the "
        "fault fired:",
        "",
        *headline_table(runs),
        "",
        "A tool's ceiling is the recall it could reach at best: the share of fault runs whose expected verdict "
        "is a kind it can say at all (torchrun: `crash`; fr_trace: `hang`, `collective_mismatch`; the two "
        "together, reading the out-of-memory text torchrun prints: also `oom`). Medians here are over each "
        "tool's own correct runs; the paired comparison below uses the same runs for both.",
        "",
        "## Time to verdict on the same runs",
        "",
        "Runs that rankwatch and the other tool both named correctly; each median over those runs only.",
        "",
        *paired_table(runs),
        "",
        "## Per fault kind and tool",
        "",
        "Recall: a verdict of the expected kind naming exactly the culprit. Culprit accuracy: a verdict naming "
        "exactly the culprit, any kind. Precision: of all the tool's verdicts of that kind, on every run "
        "(healthy runs included), the correct ones. Times: from the injection (the injector's clock) to the "
        "first correct verdict. Proportions with Wilson 95 % intervals; medians and p95 with distribution-free "
        "order-statistic 95 % intervals (`…`: too few runs to bound it).",
        "",
        *kind_table(runs),
        "",
        "## Precision per verdict kind",
        "",
        *precision_table(runs),
        "",
        "## Per job shape",
        "",
        *shape_table(runs),
        "",
        *files.get("sensitivity", []),
        "## rankwatch's misses and false alarms",
        "",
        *misses(runs),
        "",
        f"![time to verdict]({files.get('plot', 'time_to_verdict.png')})",
        "",
        f"Every run (ground truth, each tool's answer and times): [`{files.get('jsonl', 'runs.jsonl')}`]"
        f"({files.get('jsonl', 'runs.jsonl')}), one JSON object per line; "
        "`bench/faultkit/scoring.py` scores any tool written into its `tools`.",
        "",
        METHOD,
    ]
    return "\n".join(out) + "\n"


SENSITIVITY_DOCS = (("sensitivity_jobs.md", "On real jobs (the agent's own digests: weights, NaN/Inf in one element, "
                                         "learning rate, duplicate data)"),
                    ("sensitivity.md", "On recorded step series (gradient spike, straggler, leak)"))


def sensitivity_section(docs: Path, commit: str, prefix: str = "") -> list[str]:
    """The sensitivity tables (bench/sensitivity_jobs.py, bench/sensitivity.py)
    as published in ``docs``, each with the commit it was made at and whether
    that is this table's commit. ``prefix``: the links' path to ``docs``."""
    import re

    out = ["## Sensitivity: the smallest fault each check names", ""]
    found = False
    for name, title in SENSITIVITY_DOCS:
        path = docs / name
        if not path.is_file():
            continue
        text = path.read_text()
        found = True
        made = re.search(r"rankwatch at `([^`]*)`", text)
        made_at = made.group(1).split()[0] if made else "unknown"
        same = made_at == commit.split("+")[0]
        out += [f"### {title}", "",
                f"From [`{name}`]({prefix}{name}), made at `{made_at}`"
                + (" (this table's commit)." if same else f": **not this table's commit** (`{commit}`); "
                   f"rerun it there for one commit throughout."), ""]
        out += _results_part(text, prefix) + [""]
    return out if found else []


def _results_part(text: str, prefix: str) -> list[str]:
    """A sensitivity doc's results: from its summary ("Smallest ...") or
    plot to the list of misses, headings one level down, links re-rooted."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(("Smallest", "!["))), len(lines))
    part = []
    for line in lines[start:]:
        if line.startswith(("Runs with the fault", "Every run")):
            break
        if line.startswith("#"):
            line = "#" + line
        part.append(line.replace("](benchmark/", f"]({prefix}benchmark/"))
    return part


METHOD = """## How it works

**Runs.** Each planned run (shape, fault kind, seed) draws its culprit rank
and fault step (0–14), and without `--world-size` its number of ranks (2–4; plain DDP also 8), from the seed and is run twice with the same plan:
once as a user runs the job today (plain `torchrun`, or the Ray driver
alone) and once watched by rankwatch (`rankwatch run` with the same torchrun
options; Ray: `RAY_TRAIN_CALLBACKS=rankwatch.ray.RankwatchCallback`, no code
change). Healthy runs of every shape go through the same two paths.

**Injection without touching the scripts.** `bench/faultkit/inject/` goes
first on `PYTHONPATH`; its `sitecustomize.py` loads the injector into every
Python process of the job (torchrun's and rankwatch's workers, Ray's
workers). After `import torch` it installs torch's global optimizer step
post-hook (the step clock and the end-of-step faults), global module forward
hooks on the culprit from the fault step on, a gradient hook
(`Tensor.register_hook`) on the first leaf module's output, and a wrapper of
`DataLoader`'s iterator. When the fault fires it appends the ground truth
(kind, rank, step, wall time) to a file, fsynced before the fault acts; each
tool is scored against the injection in the run it watched. The job
scripts (`bench/faultkit/jobs/`) know nothing of faults or rankwatch.

| fault | expected verdict | how |
|---|---|---|
""" + "\n".join(f"| {k.name} | `{k.expected}` | {k.how} |" for k in FAULTS.values()) + """

OOM is a host allocation failure raised by torch's own CPU allocator (a
request larger than the machine, what an oversized batch does), not an
`RLIMIT_AS` cap: a cap hits every thread of the rank (gloo's, the agent's)
wherever they next allocate, so the failure would not be the training's. A
kernel OOM kill is a SIGKILL, scored under `sigkill`.

**Collective timeout.** Every process group is created with the same short
timeout on both sides (the injector overrides `init_process_group`'s
`timeout`, as Lightning's `DDPStrategy(timeout=)`, HF's `ddp_timeout` or
Ray's `TorchConfig(timeout_s=)` would): without it a hung gloo job waits
30 minutes (NCCL: 10) and plain torchrun says nothing at all. rankwatch keeps
its defaults (adaptive hang timeout).

**The tools and how each is read.**
- *rankwatch*: the verdicts of `report.json` (kind, ranks, `detected_at`).
- *torchrun alone*: a failed job's error summary, "Root Cause (first
  observed failure)": that rank, kind `crash` (the only thing it reports).
  Nothing when the job exits 0 or is still hung. Its time is torchrun's exit.
- *Ray Train alone*: the ranks listed in the `WorkerGroupError` that
  `trainer.fit()` raises ("[Rank r Error Snippet]"), kind `crash`.
- *Flight Recorder + fr_trace*: in the plain run every rank dumps its
  Flight Recorder every second and at exit (gloo never dumps by itself; this
  is what torch's debug server does with `dump_interval`). When the job
  failed or hung (when a user would reach for it), torch's analyzer
  (`torch.distributed.flight_recorder.fr_trace`, run as
  `bench/faultkit/fr_trace_gloo.py DIR --prefix fr_ --allow-incomplete-ranks`)
  reads them; its first finding is its verdict:
  "Not all ranks joining collective ... missing ranks" → `hang` on those
  ranks, "has errors ... Culprit rank r" → `collective_mismatch` on r. One
  fix-up is needed to read gloo's dumps at all: `pg_config` is keyed by ''
  while the entries name group '0' (`KeyError: ('0', 0)` otherwise); the
  wrapper renames that key as fr_trace's loader reads each dump, and touches
  nothing else (each rename is logged in the run's `fixups`). Its time is
  the job's end plus the analysis.

**Left out.** NVIDIA Resiliency Extension needs heartbeat calls in the
training script and its straggler detector needs CUDA/CUPTI; TrainCheck
needs reference runs and instrumented (mostly GPU, single-process)
workloads; `TORCH_DISTRIBUTED_DEBUG=DETAIL` segfaults in the DDP
constructor on gloo in torch 2.13; NCCL RAS and Ray's NCCL hang detector
need NCCL; `torch.distributed.debug`'s server and py-spy show stacks and
traces but give no verdict.
"""
