"""Running one planned job twice (without and with rankwatch) and reading
each tool's answer.

- plain: the job as a user runs it today (`torchrun`, or the Ray driver
  alone), with the injector and, for the Flight Recorder, periodic FR dumps;
  read by `torchrun` (exit status and the "Root Cause" rank of its error
  summary) or `ray` (the ranks in Ray Train's WorkerGroupError), and by
  `fr_trace` (torch's Flight Recorder analyzer over the dumps, when the job
  failed or hung: when a user would reach for it);
- watched: the same job and fault under `rankwatch run` (Ray: Ray's own
  RAY_TRAIN_CALLBACKS=rankwatch.ray.RankwatchCallback), read from report.json.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from faultkit.plan import SHAPES, RunPlan

HERE = Path(__file__).resolve().parent
INJECT_DIR = HERE / "inject"
JOBS_DIR = HERE / "jobs"
SCRIPTS = {"ddp": "ddp.py", "fsdp2": "fsdp2.py", "lightning": "lightning_job.py", "hf": "hf_job.py",
           "ray": "ray_job.py"}


@dataclass
class Outcome:
    """One process tree's run: what a user sees of it."""
    exit_code: Optional[int]
    timed_out: bool
    started_at: float
    ended_at: float
    log: Path
    injected: Optional[dict]
    report: Optional[dict] = None
    notes: list = field(default_factory=list)
    hung_at_exit: bool = False

    def output(self, limit: int = 2_000_000) -> str:
        try:
            data = self.log.read_bytes()
        except OSError:
            return ""
        return data[-limit:].decode("utf-8", "replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------- process trees --

def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2:].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _start_time(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()[19]


def descendants(root: int) -> dict[int, str]:
    """pid -> start time of every process under root (pid reuse is checked
    against the start time before anything is killed)."""
    tree, out, todo = _children(), {}, [root]
    while todo:
        for child in tree.get(todo.pop(), []):
            started = _start_time(child)
            if started is not None and child not in out:
                out[child] = started
                todo.append(child)
    return out


def kill_all(pids: dict[int, str]) -> None:
    for pid, started in pids.items():
        if _start_time(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


FINISHED = {"ray": b"training finished"}  # what the job prints once training is over (others: "final loss:")
EXIT_GRACE_S = 20.0


def _stop(root: int, seen: dict[int, str]) -> None:
    """SIGTERM to the launcher first (rankwatch writes its report on it,
    torchrun stops its workers), SIGKILL to everything left 15 s later."""
    try:
        os.kill(root, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + 15
    while time.time() < deadline and _start_time(root) is not None and _state(root) != "Z":
        seen.update(descendants(root))
        time.sleep(0.25)
    seen.update(descendants(root))
    kill_all({root: _start_time(root) or "", **seen})


def _state(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split()[0]


@dataclass
class TreeResult:
    exit_code: Optional[int]
    timed_out: bool  # still running at the cap, or hung at exit
    hung_at_exit: bool  # training had finished (its final line printed), the processes never exited
    started_at: float
    ended_at: float


def run_tree(argv: list[str], env: dict, cwd: Path, log: Path, cap_s: float,
             finished: bytes = b"final loss:") -> TreeResult:
    """Runs argv in its own session until it exits, or until cap_s, or until
    EXIT_GRACE_S after it printed `finished` (a job that finished training
    and never exits: gloo's teardown deadlock, seen under plain torchrun);
    then stops it and everything it started (torchrun's workers and Ray's
    daemons lead sessions of their own, so they are found by descent,
    remembered while they live)."""
    seen: dict[int, str] = {}
    started = time.time()
    hung_at_exit = False
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        timed_out = False
        deadline = started + cap_s
        finished_at = None
        while proc.poll() is None:
            seen.update(descendants(proc.pid))
            if finished_at is None and finished in _tail(log):
                finished_at = time.time()
            if finished_at is not None and time.time() > finished_at + EXIT_GRACE_S:
                hung_at_exit = timed_out = True
            if time.time() > deadline:
                timed_out = True
            if timed_out:
                _stop(proc.pid, seen)
                break
            time.sleep(0.25)
        code = proc.wait()
        ended = time.time()
    kill_all(seen)  # leftovers: orphaned workers, a Ray daemon
    return TreeResult(None if timed_out else code, timed_out, hung_at_exit, started, ended)


def _tail(log: Path, size: int = 65536) -> bytes:
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - size))
            return f.read()
    except OSError:
        return b""


# ---------------------------------------------------------------- jobs --

def base_env(plan: RunPlan, truth: Path, pg_timeout: float, fr_dir: Optional[Path]) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANKWATCH_", "FAULTBENCH_", "PET_", "RAY_ADDRESS", "TORCHELASTIC_"))}
    env.update({
        "PYTHONPATH": os.pathsep.join([str(INJECT_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "FAULTBENCH_KIND": "none" if plan.rank is None else plan.kind,
        "FAULTBENCH_RANK": "" if plan.rank is None else str(plan.rank),
        "FAULTBENCH_STEP": "" if plan.step is None else str(plan.step),
        "FAULTBENCH_VARIANT": plan.variant,
        "FAULTBENCH_MAGNITUDE": plan.magnitude,
        "FAULTBENCH_SEED": str(plan.seed),
        "FAULTBENCH_TRUTH": str(truth),
        "FAULTBENCH_PG_TIMEOUT": str(pg_timeout),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    })
    if fr_dir is not None:
        env["FAULTBENCH_FR_DIR"] = str(fr_dir)
    return env


def job_argv(plan: RunPlan, workdir: Path, watched: bool) -> tuple[list[str], Optional[Path], dict]:
    """(argv, where rankwatch's report lands, extra env)."""
    script = str(JOBS_DIR / SCRIPTS[plan.shape])
    if SHAPES[plan.shape].launcher == "ray":
        storage = workdir / "ray_results"
        argv = [sys.executable, script, str(storage), "job", str(plan.steps), str(plan.world_size)]
        extra = {"RAY_TRAIN_CALLBACKS": "rankwatch.ray.RankwatchCallback"} if watched else {}
        return argv, storage / "job" / "rankwatch" / "report.json", extra
    args = [str(workdir / "hf-out"), str(plan.steps)] if plan.shape == "hf" else [str(plan.steps)]
    common = ["--nproc-per-node", str(plan.world_size), "--master-port", str(free_port())]
    if watched:
        run_dir = workdir / "rankwatch-run"
        return ([sys.executable, "-m", "rankwatch.cli", "run", "--run-dir", str(run_dir), *common, script, *args],
                run_dir / "report.json", {})
    return [sys.executable, "-m", "torch.distributed.run", *common, script, *args], None, {}


def read_truth(path: Path) -> Optional[dict]:
    """The first injection the injector recorded (one fault per run)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def run_job(plan: RunPlan, workdir: Path, watched: bool, pg_timeout: float, cap_s: float) -> Outcome:
    workdir.mkdir(parents=True, exist_ok=True)
    truth = workdir / "truth.jsonl"
    truth.unlink(missing_ok=True)
    fr_dir = None if watched else workdir / "fr"
    argv, report_path, extra = job_argv(plan, workdir, watched)
    env = {**base_env(plan, truth, pg_timeout, fr_dir), **extra}
    log = workdir / "output.log"
    tree = run_tree(argv, env, workdir, log, cap_s, FINISHED.get(plan.shape, b"final loss:"))
    outcome = Outcome(tree.exit_code, tree.timed_out, tree.started_at, tree.ended_at, log, read_truth(truth),
                      hung_at_exit=tree.hung_at_exit)
    if tree.hung_at_exit:
        outcome.notes.append(f"training finished but the job did not exit within {EXIT_GRACE_S:.0f} s: stopped")
    if report_path is not None:
        try:
            outcome.report = json.loads(report_path.read_text())
        except (OSError, ValueError) as exc:
            outcome.notes.append(f"no readable report.json: {exc}")
    return outcome


# ------------------------------------------------------------- answers --

def _epoch(iso: Optional[str]) -> Optional[float]:
    if not iso:
        return None
    return dt.datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def rankwatch_answer(outcome: Outcome) -> dict:
    verdicts = []
    for v in (outcome.report or {}).get("verdicts") or []:
        verdicts.append({"kind": v.get("kind"), "ranks": v.get("ranks") or [], "step": v.get("step"),
                         "time": _epoch(v.get("detected_at")), "first_seen": _epoch(v.get("first_seen_at")),
                         "summary": (v.get("summary") or "")[:400]})
    return _answer(outcome, verdicts)


ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)


def torchrun_answer(outcome: Outcome) -> dict:
    """torchrun's word: a failed job's "Root Cause" rank (kind: crash, the only
    thing it reports); nothing when the job succeeded or was still hung."""
    verdicts = []
    found = ROOT_CAUSE.search(outcome.output()) if not outcome.timed_out else None
    if found:
        verdicts.append({"kind": "crash", "ranks": [int(found.group(1))], "step": None, "time": outcome.ended_at,
                         "summary": f"Root Cause: rank {found.group(1)}, exitcode {found.group(2)}"})
    return _answer(outcome, verdicts)


OOM_TEXT = re.compile(r"OutOfMemoryError|CUDA out of memory|DefaultCPUAllocator: can't allocate memory|"
                      r"\bMemoryError\b")


def combined_answer(torchrun: dict, fr_trace: dict, outcome: Outcome) -> dict:
    """What users have, scored as one tool: torchrun's root-cause rank read
    with the error text it prints (an out-of-memory error there is `oom`, any
    other a `crash`), and Flight Recorder + fr_trace on a failed or hung job
    (hang, collective mismatch). Each verdict keeps its own time."""
    text = outcome.output()
    verdicts = []
    for v in torchrun.get("verdicts") or []:
        said = [line for line in text.splitlines() if f"[rank{v['ranks'][0]}]" in line] if v.get("ranks") else []
        oom = any(OOM_TEXT.search(line) for line in said) or (not said and OOM_TEXT.search(text))
        verdicts.append({**v, "kind": "oom" if oom else v["kind"]})
    verdicts += fr_trace.get("verdicts") or []
    return _answer(outcome, verdicts)


RAY_FAILED = re.compile(r"\[Rank ([\d,]+) Error Snippet\]")


def ray_answer(outcome: Outcome) -> dict:
    """Ray Train's word: the ranks its WorkerGroupError lists as failed."""
    verdicts = []
    text = outcome.output()
    if not outcome.timed_out and "Training failed due to worker errors" in text:
        ranks = sorted({int(r) for group in RAY_FAILED.findall(text) for r in group.split(",")})
        if ranks:
            verdicts.append({"kind": "crash", "ranks": ranks, "step": None, "time": outcome.ended_at,
                             "summary": f"WorkerGroupError: ranks {ranks} failed"})
    return _answer(outcome, verdicts)


def _answer(outcome: Outcome, verdicts: list[dict]) -> dict:
    return {"applies": True, "injected": outcome.injected, "verdicts": verdicts, "exit_code": outcome.exit_code,
            "timed_out": outcome.timed_out, "hung_at_exit": outcome.hung_at_exit, "started_at": outcome.started_at,
            "ended_at": outcome.ended_at, "notes": outcome.notes}


# --------------------------------------------------------------- fr_trace --

MISSING = re.compile(r"Not all ranks joining collective, sequence number: (\d+).*?missing ranks: \{([\d, ]*)\}", re.S)
ERRORS = re.compile(r"Collective sequence number: (\d+) has errors.*?error msg: ([^\n]*)", re.S)
CULPRIT = re.compile(r"Culprit rank (\d+)")


def parse_fr_trace(text: str) -> Optional[dict]:
    """fr_trace's first finding: "Not all ranks joining collective ...
    missing ranks: {r}" (a hang: the missing ranks) or "Collective sequence
    number: N has errors ... Culprit rank r" (a mismatch). Later findings
    follow from the first."""
    found = []
    for m in MISSING.finditer(text):
        ranks = sorted(int(r) for r in m.group(2).replace(" ", "").split(",") if r)
        found.append((m.start(), {"kind": "hang", "ranks": ranks, "summary": f"seq {m.group(1)}: missing {ranks}"}))
    for m in ERRORS.finditer(text):
        ranks = sorted({int(r) for r in CULPRIT.findall(m.group(2))})
        found.append((m.start(), {"kind": "collective_mismatch", "ranks": ranks,
                                  "summary": f"seq {m.group(1)}: {m.group(2)[:300]}"}))
    if not found:
        return None
    return min(found, key=lambda f: f[0])[1]


def fr_trace_answer(outcome: Outcome, workdir: Path) -> dict:
    """Run where a user would: the job failed or hung."""
    answer = {"applies": True, "injected": outcome.injected, "verdicts": [], "ran": False, "notes": []}
    if outcome.exit_code == 0 and not outcome.timed_out:
        answer["notes"].append("job succeeded: nothing prompts a Flight Recorder analysis")
        return answer
    if outcome.hung_at_exit:
        answer["notes"].append("training finished, then the job hung at exit: not a training failure to analyze")
        return answer
    fr_dir = workdir / "fr"
    ranks = sorted(int(p.name[3:]) for p in fr_dir.glob("fr_*") if p.name[3:].isdigit())
    answer["dump_ranks"] = ranks
    if not ranks:
        answer["notes"].append("no Flight Recorder dump")
        return answer
    argv = [sys.executable, str(HERE / "fr_trace_gloo.py"), str(fr_dir), "--prefix", "fr_",
            "--allow-incomplete-ranks"]
    began = time.time()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        text = proc.stdout + proc.stderr
        answer["exit_code"] = proc.returncode
    except subprocess.TimeoutExpired:
        text = "fr_trace did not finish in 120 s"
    answer["ran"] = True
    answer["analysis_s"] = round(time.time() - began, 3)
    (workdir / "fr_trace.log").write_text(text)
    answer["fixups"] = re.findall(r"\[faultbench fix-up\] ([^\n]*)", text)
    answer["output_tail"] = text[-1500:]
    finding = parse_fr_trace(text)
    if finding is not None:
        # Its answer is known once the job is over and the analyzer has run.
        finding.update({"step": None, "time": outcome.ended_at + answer["analysis_s"]})
        answer["verdicts"].append(finding)
    return answer
