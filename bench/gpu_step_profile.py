"""Where rankwatch's host time per step goes on a GPU: the acceptance job's
healthy step, watched and plain, each under cProfile, one GPU. On Python
3.11 and older cProfile sees only the main thread (where the agent's hooks
run); from 3.12, built on sys.monitoring, it sees every thread, so the
agent's heartbeat and reader threads are in the figures too.

    python bench/gpu_step_profile.py                   # DDP, bfloat16, 400 steps
    python bench/gpu_step_profile.py --wrapper fsdp2 --steps 300
    python bench/gpu_step_profile.py --cpu             # the same on 1 CPU rank (gloo): checks the script

It prints, per run, the median step time (device time between CUDA events,
which for this host-bound job is the host's time per step), the profiled
time per step inside rankwatch's own code (tottime of functions in
its files, divided by the steps) and the top entries of the watched run by
own time and by cumulative time among rankwatch's functions. cProfile slows
what it profiles, most of all code of many small calls: read its figures as
shares, the unprofiled medians (the first two runs) as the cost. Per-step
figures are totals over the run divided by its steps, so a function called
once a step also carries its one-time costs (the first launch of a kernel
loads it): trust them for what is called many times a step.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import pstats
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _acceptance():
    spec = importlib.util.spec_from_file_location("gpu_acceptance", HERE / "gpu_acceptance.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _package_roots() -> tuple[str, ...]:
    """Where rankwatch's own code lies (editable or installed): the agent and
    the collector are packages of their own in an editable checkout."""
    import rankwatch

    roots = {str(Path(rankwatch.__file__).resolve().parent.parent)}
    for name in ("agent", "collector"):
        try:
            module = __import__(f"rankwatch.{name}", fromlist=["_"])
            roots.add(str(Path(module.__file__).resolve().parent))
        except Exception:
            pass
    return tuple(roots)


def _ours(filename: str, roots: tuple[str, ...]) -> bool:
    """A frame of rankwatch's own code."""
    path = str(Path(filename).resolve()) if filename and not filename.startswith("<") else ""
    return path.startswith(roots) and "/bench/" not in path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wrapper", default="ddp", choices=("ddp", "fsdp2"))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--cpu", action="store_true", help="1 CPU rank on gloo (checks this script; no GPU figures)")
    p.add_argument("--out", default="", help="folder for the .prof files (default: a temporary one)")
    a = p.parse_args(argv)
    acc = _acceptance()
    case = acc.Case("healthy", None, steps=a.steps)
    env = acc.case_env(case, a.wrapper, a.dtype if not a.cpu else "float32", 0)
    if a.cpu:
        env.update(ACC_DEVICE="cpu", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(a.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        job = Path(tmp) / "acceptance_job.py"
        job.write_text(acc.JOB)
        launch = {
            "plain": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"],
            "watched": [sys.executable, "-m", "rankwatch.cli", "run", "--run-dir", str(Path(tmp) / "run"),
                        "--nproc-per-node", "1"],
        }
        for profiled in (False, True):
            for name, cmd in launch.items():
                prof = out / f"{name}.prof"
                tail = ["-m", "cProfile", "-o", str(prof), str(job)] if profiled else [str(job)]
                if name == "plain":
                    cmd = cmd + ["--master-port", str(acc._free_port())]
                code, text, seconds = acc.run(cmd + tail, env, 300.0)
                found = re.search(r"STEP_MEDIAN (\S+)", text)
                label = f"{name}{' (cProfile)' if profiled else ''}"
                step = f"{float(found.group(1)) * 1e3:.3f} ms" if found else "n/a (CPU run or job failed)"
                print(f"[gpu_step_profile] {label}: exit {code} in {seconds:.0f} s, median step {step}", flush=True)
                if code != 0:
                    print(text[-3000:])
        roots = _package_roots()
        for name in launch:
            prof = out / f"{name}.prof"
            if not prof.exists():
                print(f"[gpu_step_profile] {name}: no profile written")
                continue
            stats = pstats.Stats(str(prof))
            ours = {k: v for k, v in stats.stats.items() if _ours(k[0], roots)}
            own = sum(v[2] for v in ours.values())
            print(f"[gpu_step_profile] {name}: in rankwatch's code {own * 1e3 / a.steps:.3f} ms per step "
                  f"(cProfile'd; {len(ours)} functions, of {stats.total_tt:.2f} s profiled in all)")
            if name != "watched":
                continue
            for key, title in ((2, "own time"), (3, "cumulative time")):
                rows = sorted(ours.items(), key=lambda kv: kv[1][key], reverse=True)[:a.top]
                print(f"\n[gpu_step_profile] watched, rankwatch's functions by {title} (us per step, calls per step)")
                for (filename, line, func), v in rows:
                    short = "/".join(Path(filename).parts[-2:])
                    print(f"  {v[key] * 1e6 / a.steps:9.1f}  {v[1] / a.steps:7.2f}  {short}:{line} {func}")
            buf = io.StringIO()
            pstats.Stats(str(prof), stream=buf).sort_stats("tottime").print_stats(a.top)
            print("\n[gpu_step_profile] watched, every function by own time:\n" + buf.getvalue()[-6000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
