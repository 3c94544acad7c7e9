"""Each injected fault run twice, side by side: under plain torchrun and under
`rankwatch run`. Prints what each names as the culprit and how long rankwatch
took from the fault to its verdict.

    python bench/fault_matrix.py [--nproc 4] [--only hang,crash]

Plain torchrun is stopped after --plain-timeout seconds (a hung gloo job would
otherwise wait 30 minutes for its collective timeout).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[1] / "examples" / "train.py"

CASES = {
    "hang": ["--fault", "hang", "--fault-step", "10"],
    "dataloader_hang": ["--fault", "dataloader_hang", "--fault-step", "10", "--workers", "2"],
    "leave_loop": ["--fault", "leave_loop", "--fault-step", "10"],
    "crash": ["--fault", "crash", "--fault-step", "10"],
    "sigkill": ["--fault", "sigkill", "--fault-step", "10"],
    "extra_small": ["--fault", "extra_small", "--fault-step", "10"],
    "extra_large": ["--fault", "extra_large", "--fault-step", "10"],
    "extra_same": ["--fault", "extra_same", "--fault-size", "82689", "--fault-step", "10"],
    "nan": ["--fault", "nan", "--fault-step", "10"],
    "spike": ["--fault", "spike", "--fault-step", "15"],
    "perturb": ["--fault", "perturb", "--fault-step", "12"],
    "slow": ["--fault", "slow", "--fault-step", "5", "--fault-size", "200"],
    "leak": ["--fault", "leak", "--fault-step", "5", "--fault-size", "20"],
    "oom": ["--fault", "oom", "--fault-step", "10"],
}


def _t(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def plain(nproc: int, args: list[str], timeout: float) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(TRAIN),
           "--steps", "40", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        from rankwatch.node.supervisor import _descendants

        # torchrun's workers lead their own sessions: kill them by descent.
        for pid in [proc.pid, *_descendants(proc.pid)]:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        proc.communicate()
        return f"nothing for {timeout:.0f} s (still hung; gloo's timeout is 30 min)"
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", out, re.S)
    if root:
        return f"exit {proc.returncode}; Root Cause = rank {root.group(1)} (exitcode {root.group(2)})"
    return f"exit {proc.returncode}; no failure reported"


def watched(nproc: int, args: list[str], run_dir: Path) -> tuple[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "rankwatch.cli", "run", "--run-dir", str(run_dir), "--nproc-per-node", str(nproc),
           str(TRAIN), "--steps", "40", *args]
    started = time.time()
    subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    report = json.loads((run_dir / "report.json").read_text())
    if not report["verdicts"]:
        return "no verdict", f"{time.time() - started:.0f} s (whole run)"
    v = report["verdicts"][0]
    latency = _t(v["detected_at"]) - _t(v["first_seen_at"])
    return f"{v['kind']} rank(s) {v['ranks']} step {v['step']}: {v['summary'][:160]}", f"{latency:.1f} s"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--fault-rank", type=int, default=2)
    p.add_argument("--only", default="")
    p.add_argument("--plain-timeout", type=float, default=60)
    a = p.parse_args()
    cases = {k: v for k, v in CASES.items() if not a.only or k in a.only.split(",")}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in cases.items():
            args = [*args, "--fault-rank", str(a.fault_rank)]
            plain_result = plain(a.nproc, args, a.plain_timeout)
            verdict, latency = watched(a.nproc, args, Path(tmp) / name)
            print(f"| {name} | {latency} | {verdict} | {plain_result} |", flush=True)


if __name__ == "__main__":
    main()
