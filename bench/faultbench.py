"""faultbench: an open fault benchmark for distributed PyTorch training.

Every fault kind crossed with every job shape (plain DDP, FSDP2, Lightning
Trainer, Hugging Face Trainer, Ray Train), several seeds each with a random
culprit rank and fault step, plus healthy runs; each run once as users run
jobs today and once under rankwatch. Scores rankwatch, torchrun, Ray Train and
torch's Flight Recorder analyzer on the same faults: recall, culprit accuracy,
precision, time to verdict, with 95 % intervals.

    python bench/faultbench.py                 # the full benchmark: docs/benchmark.md, docs/benchmark/
    python bench/faultbench.py --quick         # a slice (< 5 min), into --out or a temp dir
    python bench/faultbench.py --seeds 1 --shapes ddp,lightning --kinds hang,crash --out /tmp/fb
    python bench/faultbench.py --rescore DIR   # tables and plot again from DIR/runs.jsonl

Start-up runs under the machine-wide lock when started as documented in
docs/benchmark.md. --resume skips runs already in OUT/runs.jsonl.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faultkit import plan as planning  # noqa: E402
from faultkit import reanalyze, report, scoring, tools  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
HEADLINE_BEGIN = "<!-- faultbench:headline -->"
HEADLINE_END = "<!-- /faultbench:headline -->"

QUICK_SHAPES = ["ddp"]
QUICK_KINDS = ["healthy", "crash", "nan_loss", "collective_mismatch"]
FULL_SEEDS = 2  # fault runs per (shape, kind)
FULL_HEALTHY_SEEDS = 4  # healthy runs per shape


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"shapes {QUICK_SHAPES}, kinds {QUICK_KINDS}, one seed")
    p.add_argument("--seeds", type=int, default=None, help=f"seeds per cell (full run: {FULL_SEEDS})")
    p.add_argument("--healthy-seeds", type=int, default=None,
                   help=f"healthy runs per shape (full run: {FULL_HEALTHY_SEEDS}; otherwise as --seeds)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--shapes", default="", help=f"comma-separated, from {', '.join(planning.SHAPES)}")
    p.add_argument("--kinds", default="", help="comma-separated, from " + ", ".join(planning.KIND_ORDER))
    p.add_argument("--out", default="", help="work dir: runs.jsonl, benchmark.md, the plot, each run's files")
    p.add_argument("--docs", action="store_true", help="also write docs/benchmark.md and docs/benchmark/ "
                   "(the default for a full run)")
    p.add_argument("--no-docs", action="store_true")
    p.add_argument("--resume", action="store_true", help="skip runs already in OUT/runs.jsonl")
    p.add_argument("--collective-timeout", type=float, default=30.0,
                   help="seconds, every process group, with and without rankwatch")
    p.add_argument("--world-size", type=int, default=None,
                   help=f"ranks per job (default: drawn per run from {list(planning.WORLD_SIZES)})")
    p.add_argument("--steps", type=int, default=planning.STEPS)
    p.add_argument("--rescore", default="", metavar="DIR", help="only rebuild the outputs from DIR/runs.jsonl")
    p.add_argument("--reanalyze", default="", metavar="DIR",
                   help="analyse DIR's recorded rankwatch runs again with this checkout's collector and list "
                        "the verdicts that change (faultkit/reanalyze.py); writes nothing")
    a = p.parse_args(argv)
    for name, valid in (("shapes", planning.SHAPES), ("kinds", planning.KIND_ORDER)):
        bad = [x for x in filter(None, getattr(a, name).split(",")) if x not in valid]
        if bad:
            p.error(f"--{name}: unknown {', '.join(bad)}; choose from {', '.join(valid)}")
    if (a.seeds is not None and a.seeds < 1) or (a.healthy_seeds is not None and a.healthy_seeds < 1):
        p.error("--seeds and --healthy-seeds must be at least 1")
    return a


def ray_installed() -> bool:
    try:
        import ray.train.torch  # noqa: F401
    except Exception:
        return False
    return True


def execute(plan: planning.RunPlan, work: Path, timeout: float) -> dict:
    """One planned run: plain, then watched; every tool's answer."""
    cap = timeout + 120  # start-up of the heaviest shapes + the collective timeout + teardown
    shape = planning.SHAPES[plan.shape]
    plain = tools.run_job(plan, work / "plain", watched=False, pg_timeout=timeout, cap_s=cap)
    watched = tools.run_job(plan, work / "rankwatch", watched=True, pg_timeout=timeout, cap_s=cap)
    answers = {"rankwatch": tools.rankwatch_answer(watched)}
    if shape.launcher == "ray":
        answers["ray"] = tools.ray_answer(plain)
    else:
        answers["torchrun"] = tools.torchrun_answer(plain)
    answers["fr_trace"] = tools.fr_trace_answer(plain, work / "plain")
    if "torchrun" in answers:
        answers["torchrun+fr_trace"] = tools.combined_answer(answers["torchrun"], answers["fr_trace"], plain)
    return {**plan.to_json(), "tools": answers}


def _brief(run: dict, tool: str) -> str:
    answer = run["tools"].get(tool)
    if answer is None:
        return ""
    if run["kind"] != "healthy" and not answer.get("injected"):
        return f"{tool}: (fault did not fire)"
    verdicts = answer.get("verdicts") or []
    if not verdicts:
        said = "-"
    else:
        said = ", ".join(f"{v['kind']}{v['ranks']}" for v in verdicts[:3])
    ok = any(scoring.is_correct(v, run) for v in verdicts)
    mark = "ok" if ok else ("ok" if run["kind"] == "healthy" and not verdicts else "x")
    latency = scoring.time_to_verdict(run, answer) if ok else None
    return f"{tool}: {said} {mark}" + (f" {latency:.1f}s" if latency is not None else "")


def write_outputs(runs: list[dict], out: Path, settings: dict, command: str, docs: bool) -> list[Path]:
    if docs and len(report.commits(runs)) != 1:
        raise SystemExit(f"faultbench: the runs come from several commits ({', '.join(report.commits(runs))}); "
                         f"a published table is one run of one commit: run them all again at one commit")
    info = report.machine()
    written = []
    jsonl = out / "runs.jsonl"
    png = report.plot(runs, out / "time_to_verdict.png")
    md = out / "benchmark.md"
    commit = report.commits(runs)[0] if runs else "unknown"
    md.write_text(report.markdown(runs, settings, info, command, {
        "plot": "time_to_verdict.png", "jsonl": "runs.jsonl",
        "sensitivity": report.sensitivity_section(DOCS, commit, prefix=f"{DOCS}/")}))
    written += [md, jsonl] + ([png] if png else [])
    if docs:
        target = DOCS / "benchmark"
        target.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(jsonl, target / "runs.jsonl")
        if png:
            shutil.copyfile(png, target / "time_to_verdict.png")
        (DOCS / "benchmark.md").write_text(report.markdown(
            runs, settings, info, command, {"plot": "benchmark/time_to_verdict.png", "jsonl": "benchmark/runs.jsonl",
                                            "sensitivity": report.sensitivity_section(DOCS, commit)}))
        written += [DOCS / "benchmark.md", target / "runs.jsonl", target / "time_to_verdict.png"]
        update_readme(runs, command)
        written.append(README)
    return written


def update_readme(runs: list[dict], command: str) -> None:
    text = README.read_text()
    if HEADLINE_BEGIN not in text or HEADLINE_END not in text:
        return
    head, rest = text.split(HEADLINE_BEGIN, 1)
    _, tail = rest.split(HEADLINE_END, 1)
    block = "\n".join(["", f"`{command}` ({len(runs)} runs; details, machine and method in "
                           "[docs/benchmark.md](docs/benchmark.md)):", "", *report.headline_table(runs), ""])
    README.write_text(head + HEADLINE_BEGIN + block + HEADLINE_END + tail)


def checked_commit() -> str:
    """The commit every run records. The jobs import the installed rankwatch:
    it must be this checkout's, or the runs would not be this commit's."""
    import rankwatch

    installed = Path(rankwatch.__file__).resolve().parents[1]
    if installed != report.ROOT:
        print(f"faultbench: the jobs run the rankwatch installed at {installed}, not this checkout "
              f"({report.ROOT}); its commit is unknown (pip install -e {report.ROOT} to record it)", flush=True)
        return f"unknown (installed at {installed})"
    return report.checkout_commit()


def main(argv=None) -> int:
    a = parse_args(argv)
    command = "python bench/faultbench.py" + ("" if argv is None and len(sys.argv) == 1 else
                                               " " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:])))
    if a.reanalyze:
        work = Path(a.reanalyze)
        runs = [json.loads(line) for line in (work / "runs.jsonl").read_text().splitlines() if line.strip()]
        rows = reanalyze.reanalyze(work, runs)
        print(reanalyze.text(rows, len(runs)))
        return 1 if any(r["right_before"] and not r["right_after"] for r in rows) else 0

    if a.rescore:
        out = Path(a.rescore)
        runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines() if line.strip()]
        settings = json.loads((out / "settings.json").read_text())
        for path in write_outputs(runs, out, settings, settings.get("command", command), a.docs):
            print(f"wrote {path}")
        return 0

    shapes = [s for s in a.shapes.split(",") if s] or (QUICK_SHAPES if a.quick else list(planning.SHAPES))
    kinds = [k for k in a.kinds.split(",") if k] or (QUICK_KINDS if a.quick else list(planning.KIND_ORDER))
    if "ray" in shapes and not ray_installed():
        print("Ray Train is not installed: the Ray shape is left out", flush=True)
        shapes.remove("ray")
    full = not (a.quick or a.shapes or a.kinds or a.seeds)
    seeds = list(range(a.first_seed, a.first_seed + (a.seeds or (1 if a.quick else FULL_SEEDS))))
    healthy_count = a.healthy_seeds or (FULL_HEALTHY_SEEDS if full else len(seeds))
    healthy_seeds = list(range(a.first_seed, a.first_seed + healthy_count))
    docs = (a.docs or full) and not a.no_docs
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="faultbench-"))
    out.mkdir(parents=True, exist_ok=True)
    if a.quick and a.world_size is None:
        a.world_size = planning.WORLD_SIZE  # the CI slice: one size, its cost known
    plans = planning.plan_all(shapes, kinds, seeds, a.world_size, a.steps, healthy_seeds)
    commit = checked_commit()
    jsonl = out / "runs.jsonl"
    done: dict[str, dict] = {}
    if a.resume and jsonl.exists():
        for line in jsonl.read_text().splitlines():
            if line.strip():
                run = json.loads(line)
                done[run["run_id"]] = run
        others = sorted({str(r.get("commit")) for r in done.values()} - {commit})
        if others:
            raise SystemExit(f"faultbench: {jsonl} holds runs made at {', '.join(others)}, this checkout is at "
                             f"{commit}: resume from a checkout of that commit (git worktree add DIR COMMIT; "
                             f"pip install -e DIR), or start a new --out")
    elif jsonl.exists():
        jsonl.unlink()
    settings = {"world_size": a.world_size, "steps": a.steps, "seeds": seeds, "healthy_seeds": healthy_seeds,
                "shapes": shapes, "kinds": kinds,
                "collective_timeout": a.collective_timeout, "cap_s": a.collective_timeout + 120,
                "command": command}
    print(f"faultbench: {len(plans)} runs ({len(done)} already done), each plain and under rankwatch; "
          f"out {out}", flush=True)
    began = time.time()
    runs = [done[p.run_id] for p in plans if p.run_id in done]
    todo = [p for p in plans if p.run_id not in done]
    for i, p in enumerate(todo, 1):
        started = time.time()
        run = execute(p, out / "work" / p.run_id, a.collective_timeout)
        run["elapsed_s"] = round(time.time() - started, 1)
        run["commit"] = commit
        runs.append(run)
        with open(jsonl, "a") as f:
            f.write(json.dumps(run) + "\n")
        spent = time.time() - began
        eta = spent / i * (len(todo) - i)
        where = f"rank {p.rank} step {p.step}" if p.rank is not None else "no fault"
        print(f"[{i}/{len(todo)} {spent / 60:.0f} min, ~{eta / 60:.0f} min left] {p.run_id} ({where}; "
              f"{run['elapsed_s']:.0f} s): " + " | ".join(filter(None, (_brief(run, t) for t in report.TOOLS))),
              flush=True)
    settings["elapsed_min"] = round(sum(r.get("elapsed_s") or 0 for r in runs) / 60, 1)  # resumed runs too
    (out / "settings.json").write_text(json.dumps(settings, indent=1))
    runs.sort(key=lambda r: [x.run_id for x in plans].index(r["run_id"]) if r["run_id"] in
              {x.run_id for x in plans} else 0)
    for path in write_outputs(runs, out, settings, command, docs):
        print(f"wrote {path}", flush=True)
    print("\n".join(report.headline_table(runs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
