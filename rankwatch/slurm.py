"""Slurm: what an allocation tells a launcher, and how Slurm ended a job.

Read from the environment ``srun`` gives every task (``SLURM_JOB_ID``,
``SLURM_STEP_ID``, ``SLURM_STEP_NODELIST``, ``SLURMD_NODENAME``,
``SLURM_PROCID``, ...). Node lists and node addresses come from Slurm's own
``scontrol`` (``show hostnames``, ``show node``): its parser knows every
node-list syntax (``n[01-04,7]``, several bracket groups, suffixes) and a
node's ``NodeAddr``, which is how Slurm itself reaches a node and need not be
its name. ``scontrol`` is on every node that can run ``srun``.

How a job ended (``scontrol show job``'s ``JobState`` and ``Reason``) tells a
cancel, a time limit and a preemption apart. While the job's processes still
run (the report is written then, in Slurm's KillWait grace) the state is
``COMPLETING``: a time limit says ``Reason=TimeLimit``, a preemption a
``Preempt...`` reason, a cancel none. What cannot be told: who sent a signal
(Python's handlers do not see the sender); a cancel from a batch script that
ended under its steps; a ``--signal`` warning is told apart from any other
signal only by the job still running with a time limit set.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from rankwatch import wire

SCONTROL_TIMEOUT_S = 5.0  # a slurmctld that does not answer must not hold up the report
# Ports of the rendezvous a launch derives from the job and step ids, so every
# node agrees without talking first; kept below Linux's ephemeral range
# (32768+) so no outgoing connection holds one by chance.
RDZV_PORT_BASE = 20000
RDZV_PORT_SPAN = 10000


# A `--signal=USR1@N` warning (or USR2) can come while `rankwatch run` or
# `rankwatch exec` is still starting: slurmctld's timer ticks every 30 s, so
# with a short job it comes 10 s in, while the launcher still imports torch
# on a loaded node. Without a handler it ends rankwatch at once (CI: "srun:
# error: task 0: User defined signal 1", no report). So it is noted from the
# CLI's first lines, and the launcher's record of outside signals starts
# with it.
WARNING_SIGNALS = ("SIGUSR1", "SIGUSR2")
early_warnings: list[tuple[int, float]] = []  # (signal number, time), before the launcher took over


def note_warnings_early(env: Mapping[str, str]) -> None:
    """Inside a Slurm job, note its warning signals from now on (signals
    that already have a handler keep it)."""
    if not env.get("SLURM_JOB_ID") or threading.current_thread() is not threading.main_thread():
        return
    for name in WARNING_SIGNALS:
        sig = getattr(signal, name, None)
        try:
            if sig is not None and signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _note_early)
        except (ValueError, OSError):
            pass


def _note_early(signum: int, frame: object) -> None:
    early_warnings.append((signum, time.time()))


class SlurmError(RuntimeError):
    """An allocation rankwatch cannot launch in; the text says what to change."""


@dataclass
class SlurmTask:
    """One task of a Slurm job step, as its environment describes it."""

    job_id: str
    step_id: str  # "" in a batch script outside srun
    restart_count: int  # > 0 once the job was requeued
    node_name: str  # SLURMD_NODENAME: this node's name in the node list
    step_nodelist: str  # compressed, as Slurm writes it
    step_num_nodes: int
    step_num_tasks: int
    proc_id: int  # global rank of this task
    local_id: int  # rank of this task on its node
    node_id: int  # index of this node in the job's nodes
    tasks_per_node: list[int] = field(default_factory=list)  # expanded SLURM_STEP_TASKS_PER_NODE
    gpus: list[str] = field(default_factory=list)

    @property
    def in_step(self) -> bool:
        return bool(self.step_id) and self.step_id not in ("batch", "extern")


def task_from_env(env: Mapping[str, str]) -> Optional[SlurmTask]:
    """The Slurm task this process runs as; None outside Slurm."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        return None
    step_id = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or ""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    return SlurmTask(
        job_id=job_id,
        step_id=step_id,
        restart_count=_int(env.get("SLURM_RESTART_COUNT"), 0),
        node_name=env.get("SLURMD_NODENAME") or "",
        step_nodelist=nodelist,
        step_num_nodes=_int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES"), 1),
        step_num_tasks=_int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS"), 1),
        proc_id=_int(env.get("SLURM_PROCID"), 0),
        local_id=_int(env.get("SLURM_LOCALID"), 0),
        node_id=_int(env.get("SLURM_NODEID"), 0),
        tasks_per_node=expand_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""),
        gpus=visible_gpus(env),
    )


def _int(text: Optional[str], default: int) -> int:
    try:
        return int(str(text).strip())
    except (TypeError, ValueError):
        return default


def expand_tasks_per_node(text: str) -> list[int]:
    """``2(x3),1`` -> [2, 2, 2, 1] (Slurm's own compressed count list)."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if match is None:
            return []
        out.extend([int(match.group(1))] * int(match.group(2) or 1))
    return out


def visible_gpus(env: Mapping[str, str]) -> list[str]:
    """The GPUs of this step on this node: SLURM_STEP_GPUS (what Slurm bound),
    else CUDA_VISIBLE_DEVICES. Empty on a CPU allocation."""
    for name in ("SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES"):
        value = (env.get(name) or "").strip()
        if value and value not in ("NoDevFiles", "-1"):
            return [g.strip() for g in value.split(",") if g.strip()]
    return []


def run_id(task: SlurmTask) -> str:
    """The run id every task of the step agrees on without talking: the job
    and step ids; a requeued job (SLURM_RESTART_COUNT > 0) is a new attempt
    of the same run, so its run id says which (it never inherits the earlier
    attempt's verdicts)."""
    base = f"slurm-{task.job_id}" + (f".{task.step_id}" if task.step_id else "")
    return base + (f".r{task.restart_count}" if task.restart_count > 0 else "")


def rendezvous_port(task: SlurmTask) -> int:
    """A port every node derives alike from the job and step ids."""
    digest = hashlib.sha1(f"{task.job_id}.{task.step_id}.{task.restart_count}".encode()).digest()
    return RDZV_PORT_BASE + int.from_bytes(digest[:4], "big") % RDZV_PORT_SPAN


# -- scontrol ------------------------------------------------------------------------------

Runner = Callable[[list[str]], str]


def scontrol(args: list[str]) -> str:
    """``scontrol ARGS`` output; SlurmError when it is missing or fails."""
    exe = shutil.which("scontrol")
    if exe is None:
        raise SlurmError("scontrol is not on PATH")
    try:
        done = subprocess.run([exe, *args], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmError(f"scontrol {' '.join(args)}: {exc}") from None
    if done.returncode != 0:
        raise SlurmError(f"scontrol {' '.join(args)}: {(done.stderr or done.stdout).strip()[:300]}")
    return done.stdout


def expand_nodelist(nodelist: str, runner: Runner = scontrol) -> list[str]:
    """``n[1-3]`` -> ['n1', 'n2', 'n3'], by Slurm's own parser."""
    return [line.strip() for line in runner(["show", "hostnames", nodelist]).splitlines() if line.strip()]


def node_address(name: str, runner: Runner = scontrol) -> str:
    """How Slurm reaches node ``name`` (its NodeAddr); the name itself when
    Slurm does not say."""
    try:
        fields = _fields(runner(["show", "node", "-o", name]))
    except SlurmError:
        return name
    return fields.get("NodeAddr") or name


def _fields(text: str) -> dict[str, str]:
    """``Key=Value Key2=Value2`` (scontrol -o) -> dict; values hold no blanks
    except the last free-text ones, which are not read here."""
    out: dict[str, str] = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep and key and key not in out:
            out[key] = value
    return out


# -- torchrun's arguments under srun -------------------------------------------------------

# torchrun options an allocation can fill; explicit flags (or PET_* vars) win.
FILLABLE = ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "master_addr", "master_port",
            "standalone", "nproc_per_node")


def fill_launch(args, given: set[str], task: SlurmTask, runner: Runner = scontrol) -> list[str]:
    """Fill torchrun's node options from the step (``srun rankwatch run``: one
    launcher per node). ``given`` names the options the user set. Returns one
    line per option filled, for the launcher to print."""
    filled: list[str] = []
    if task.step_num_tasks != task.step_num_nodes and not {"nnodes", "node_rank"} <= given:
        raise SlurmError(f"this step runs {task.step_num_tasks} tasks on {task.step_num_nodes} node(s): "
                         f"`srun rankwatch run` starts one torchrun per node, so give srun --ntasks-per-node=1 "
                         f"(torchrun starts the node's workers); for one task per GPU use `srun rankwatch exec`")
    nodes = expand_nodelist(task.step_nodelist, runner) if task.step_nodelist else []
    if not nodes:
        nodes = [task.node_name or "localhost"]
    if "nnodes" not in given:
        args.nnodes = str(len(nodes))
        filled.append(f"--nnodes {args.nnodes}")
    if "node_rank" not in given:
        if task.node_name in nodes:
            args.node_rank = nodes.index(task.node_name)
        else:
            args.node_rank = task.proc_id  # one task per node: its task rank is its node rank
        filled.append(f"--node-rank {args.node_rank}")
    if "nproc_per_node" not in given and task.gpus:
        args.nproc_per_node = str(len(task.gpus))
        filled.append(f"--nproc-per-node {args.nproc_per_node} (GPUs {','.join(task.gpus)})")
    rendezvous_given = given & {"rdzv_endpoint", "master_addr", "master_port", "standalone", "rdzv_backend"}
    if not rendezvous_given:
        if len(nodes) == 1:
            # One node: torchrun's own free-port rendezvous; a fixed default
            # port would collide with another job sharing the node.
            args.standalone = True
            filled.append("--standalone")
        else:
            address = node_address(nodes[0], runner)
            args.rdzv_backend = "c10d"
            args.rdzv_endpoint = f"{address}:{rendezvous_port(task)}"
            filled.append(f"--rdzv-backend c10d --rdzv-endpoint {args.rdzv_endpoint} (first node {nodes[0]})")
    if "rdzv_id" not in given and not getattr(args, "standalone", False):
        args.rdzv_id = run_id(task)
        filled.append(f"--rdzv-id {args.rdzv_id}")
    return filled


# -- how Slurm ended a job -----------------------------------------------------------------

STATE_REASONS = {
    "CANCELLED": "cancelled",
    "TIMEOUT": "time_limit",
    "DEADLINE": "time_limit",
    "PREEMPTED": "preempted",
}


@dataclass
class JobState:
    state: str  # JobState, e.g. RUNNING, CANCELLED, TIMEOUT
    reason: str = ""
    time_limit: str = ""
    run_time: str = ""
    restarts: int = 0


def job_state(job_id: str, runner: Runner = scontrol) -> Optional[JobState]:
    """``scontrol show job``'s view of the job; None when Slurm cannot say."""
    try:
        fields = _fields(runner(["show", "job", "-o", job_id]))
    except SlurmError:
        return None
    if "JobState" not in fields:
        return None
    return JobState(state=fields["JobState"], reason=fields.get("Reason", ""),
                    time_limit=fields.get("TimeLimit", ""), run_time=fields.get("RunTime", ""),
                    restarts=_int(fields.get("Restarts"), 0))


# Job states in which Slurm, not the job, ended it, though the reason is none
# of the contract's (a requeue: the next attempt is run <id>.r<N>; a node
# failure).
ENDED_BY_SLURM = ("REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "NODE_FAIL", "BOOT_FAIL", "SUSPENDED", "RESV_DEL_HOLD")


def scheduler_ending(task: SlurmTask, signal_name: str, at: float,
                     state_of: Callable[[str], Optional[JobState]] = job_state) -> Optional[wire.Termination]:
    """How Slurm ended this job, from its JobState at the end; None when Slurm
    says it did not (the job still runs, or ended by itself). A signal that is
    not a termination signal (``--signal=USR1@90``) while the job still runs
    with a time limit is the time-limit warning. When scontrol cannot answer:
    reason ``unknown``."""
    state = state_of(task.job_id)
    said = f"SLURM_JOB_ID {task.job_id}" + (f" step {task.step_id}" if task.step_id else "")
    if state is None:
        return wire.Termination(by="scheduler", reason="unknown", signal=signal_name, at=iso(at),
                                source=f"{said} (scontrol could not tell how the job ended)"[:256])
    name = state.state.split("+")[0]
    reason = STATE_REASONS.get(name)
    if reason is None and name == "COMPLETING":
        # Slurm is ending the job while its steps run: scontrol shows only
        # COMPLETING then (the CANCELLED/TIMEOUT state comes once every
        # process is gone, too late for the report); its Reason tells a time
        # limit or a preemption; without one, a cancel (a batch script that
        # ended under its steps looks the same: that cannot be told).
        said_reason = state.reason.lower()
        if "timelimit" in said_reason or "time_limit" in said_reason or "deadline" in said_reason:
            reason = "time_limit"
        elif "preempt" in said_reason:
            reason = "preempted"
        elif signal_name in TERMINATION_SIGNALS and state.restarts <= task.restart_count:
            reason = "cancelled"
    if reason is None and name in ("RUNNING", "COMPLETING") and signal_name not in TERMINATION_SIGNALS \
            and state.time_limit not in ("", "UNLIMITED", "Partition_Limit"):
        reason = "time_limit"
    requeued = state.restarts > task.restart_count
    if reason is None and (name in ENDED_BY_SLURM or requeued):
        reason = "preempted" if "preempt" in state.reason.lower() else "unknown"
    if reason is None:
        return None
    detail = f"JobState={state.state}" + (f" Reason={state.reason}" if state.reason and state.reason != "None" else "")
    if state.time_limit:
        detail += f" TimeLimit={state.time_limit} RunTime={state.run_time}"
    if requeued:
        detail += f"; requeued: the next attempt is run {run_id(dataclasses.replace(task, restart_count=state.restarts))}"
    return wire.Termination(by="scheduler", reason=reason, signal=signal_name, at=iso(at),
                            source=f"{said} (scontrol: {detail})"[:256])


TERMINATION_SIGNALS = ("SIGTERM", "SIGKILL", "SIGINT", "SIGHUP", "SIGQUIT")


def signal_ending(signal_name: str, at: float) -> wire.Termination:
    """A signal from outside, no scheduler: its sender cannot be known from
    Python, so the source names the process that got it."""
    return wire.Termination(by="signal", reason="unknown", signal=signal_name, at=iso(at),
                            source=f"{signal_name} to the launcher (pid {os.getpid()}); sender unknown")


def iso(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d}Z"

