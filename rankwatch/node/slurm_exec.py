"""``srun rankwatch exec -- python train.py``: jobs Slurm launches directly,
one task per GPU, no torchrun (Lightning's SLURMEnvironment, NeMo,
Megatron-LM, DeepSpeed, a plain script reading ``SLURM_PROCID``).

Each task's ``rankwatch exec`` starts the training command as its child, with
the agent attached by the same bootstrap ``rankwatch run`` gives torchrun's
workers (``python -u -m rankwatch.agent.bootstrap SCRIPT ...``), and watches it
from outside with a node supervisor of its own: the supervisor of a task-per-GPU
layout is per task, because a task's process can only wait for (and see the
exit status of) its own children. The worker's identity is the one torchrun
would give it, from the step: ``RANK`` = ``SLURM_PROCID``, ``WORLD_SIZE`` =
``SLURM_STEP_NUM_TASKS``, ``LOCAL_RANK`` = ``SLURM_LOCALID``, ``GROUP_RANK`` =
the node's index, ``MASTER_ADDR``/``MASTER_PORT`` = the first node's address and
a port derived from the job (each only where the environment has none: a
script or framework that sets its own keeps it). The ``SLURM_*`` variables
stay as they are, so Lightning's SLURMEnvironment reads what it always reads.

The collector: one task alone embeds it; a step of several tasks needs a
collector every task reaches (``--collector URL``: ``rankwatch collector
serve``, started by the batch script, see examples/slurm/). Every task tells
it its rank's exit at the end; task 0 writes report.json and report.html.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

from rankwatch import config as config_mod
from rankwatch import slurm

from . import launcher

OUTSIDE_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rankwatch exec",
        description="Watch one task of a Slurm step that runs the training directly (srun rankwatch exec -- "
                    "python train.py): the agent in the task's Python, a supervisor beside it.")
    parser.add_argument("--run-dir", dest="run_dir", default=None,
                        help="where report.json and bundles go (default ./rankwatch-runs/<run-id>)")
    parser.add_argument("--collector", dest="collector", default=None,
                        help="URL of a standalone collector (required for a step of more than one task)")
    parser.add_argument("--hang-timeout", dest="hang_timeout", default=None,
                        help="seconds without progress before a hang verdict (default: adaptive)")
    parser.add_argument("--on-hang", dest="on_hang", choices=("abort", "wait"), default=None,
                        help="abort (default): capture evidence, then end the job; wait: keep it running")
    parser.add_argument("--config", dest="config", default=None, help="YAML file with rankwatch settings")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- python [-u] SCRIPT [ARGS...] | -- python [-u] -m MODULE [ARGS...]")
    return parser


def worker_command(command: list[str]) -> list[str]:
    """``python [-u] SCRIPT|-m MODULE ARGS`` -> the same with the bootstrap
    attaching the agent first. Anything else is refused with the reason."""
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError("no command: rankwatch exec [OPTIONS] -- python train.py [ARGS...]")
    interpreter, rest = command[0], list(command[1:])
    if not Path(interpreter).name.startswith("python"):
        raise ValueError(f"{interpreter!r} is not a Python interpreter: rankwatch exec runs "
                         f"`python SCRIPT ...` or `python -m MODULE ...` (the agent lives in the training's Python)")
    while rest and rest[0] == "-u":
        rest = rest[1:]
    if not rest or (rest[0].startswith("-") and rest[0] != "-m"):
        raise ValueError(f"unsupported Python option {rest[0] if rest else '(none)'!r}: give "
                         f"`python [-u] SCRIPT ...` or `python [-u] -m MODULE ...` (set other interpreter "
                         f"options through PYTHON* environment variables)")
    if rest[0] == "-m" and len(rest) < 2:
        raise ValueError("-m needs a module name")
    return [interpreter, "-u", "-m", "rankwatch.agent.bootstrap", *rest]


def worker_identity(task: slurm.SlurmTask, env: dict[str, str],
                    runner: slurm.Runner = slurm.scontrol) -> dict[str, str]:
    """What torchrun would tell the worker, from the step; the environment's
    own values win (a framework or script that sets them)."""
    nodes = slurm.expand_nodelist(task.step_nodelist, runner) if task.step_nodelist else []
    node_index = nodes.index(task.node_name) if task.node_name in nodes else task.node_id
    out = {"RANK": str(task.proc_id), "WORLD_SIZE": str(task.step_num_tasks), "LOCAL_RANK": str(task.local_id),
           "GROUP_RANK": str(node_index),
           "MASTER_ADDR": slurm.node_address(nodes[0], runner) if nodes else "127.0.0.1",
           "MASTER_PORT": str(slurm.rendezvous_port(task))}
    if task.node_name:
        out["RANKWATCH_HOST"] = task.node_name  # the name scontrol, sinfo and the user know the node by
    return {k: v for k, v in out.items() if not env.get(k)}


def run(argv: list[str]) -> int:
    from rankwatch.redact import install_log_redaction

    install_log_redaction()
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        command = worker_command(args.command)
    except ValueError as exc:
        parser.error(str(exc))
    task = launcher._slurm_task()
    if task is None or not task.in_step:
        parser.error("rankwatch exec runs inside a Slurm step (srun rankwatch exec -- python train.py); "
                     "outside Slurm use rankwatch run")
    flags = {name: getattr(args, name) for name in launcher.OUR_OPTIONS}
    try:
        cfg = config_mod.load(flags=flags, env=os.environ, file=flags.get("config"))
    except config_mod.ConfigError as exc:
        parser.error(str(exc))
    if not cfg.collector and task.step_num_tasks > 1:
        parser.error(f"this step runs {task.step_num_tasks} tasks: they need one collector they all reach, "
                     f"--collector URL (rankwatch collector serve; see examples/slurm/)")
    try:
        identity = worker_identity(task, dict(os.environ))
    except slurm.SlurmError as exc:
        parser.error(str(exc))

    run_id = launcher._safe(os.environ.get("RANKWATCH_RUN_ID") or slurm.run_id(task))
    run_dir = launcher._usable_run_dir(Path(cfg.run_dir or Path("rankwatch-runs") / run_id).resolve(), run_id)
    cfg.run_dir = str(run_dir)

    embedded = server = None
    agent_token = cfg.token
    if cfg.collector:
        collector_url = cfg.collector
        remote = launcher._RemoteCollector(collector_url, cfg.token)
    else:
        from rankwatch.collector.embedded import InProcessClient, start_embedded

        metrics_open = cfg.metrics_open or not cfg.token
        if not cfg.token:
            cfg.token = agent_token = secrets.token_urlsafe(32)
        embedded, server = start_embedded(cfg, run_dir, metrics_open=metrics_open)
        collector_url = server.url
        remote = InProcessClient(server.routes, collector_url)

    env = dict(os.environ)
    env.update(identity)
    env.update(launcher.worker_environment(run_dir))
    env.update(config_mod.to_env(cfg))
    env.pop("RANKWATCH_TOKEN", None)
    if agent_token:
        env["RANKWATCH_TOKEN"] = agent_token
    env.update({"RANKWATCH_RUN_ID": run_id, "RANKWATCH_RUN_DIR": str(run_dir),
                "RANKWATCH_COLLECTOR": collector_url, "RANKWATCH_COLLECTOR_URL": collector_url})

    from .supervisor import NodeSupervisor

    host = env.get("RANKWATCH_HOST") or socket.gethostname()
    # One supervisor per task: its "node" is the task (node_rank = the task's
    # rank), so two tasks of one node never stand for each other.
    supervisor = NodeSupervisor(run_id=run_id, run_dir=run_dir, post=remote.post, node_rank=task.proc_id,
                                world_size=task.step_num_tasks, on_hang=cfg.on_hang, hang_timeout=cfg.hang_timeout,
                                host=host, expected_workers=1, announce=embedded is None)
    ending = launcher._OutsideEnding()
    # Slurm signals every process of the step (scancel, a time limit, a
    # --signal warning): the worker gets it from Slurm, as without rankwatch.
    # This process notes it and stays to write the report.
    previous = {sig: signal.signal(sig, lambda signum, frame: ending.note(signum)) for sig in OUTSIDE_SIGNALS}
    supervisor.start()
    if task.proc_id == 0:
        launcher._say(f"run {run_id}: collector {collector_url}{' (embedded)' if embedded else ''}, "
                      f"run dir {run_dir}, {task.step_num_tasks} task(s) of Slurm job {task.job_id} "
                      f"step {task.step_id}")
    exits: dict[int, tuple[int, float]] = {}
    code = 1
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as exc:
        launcher._say(f"cannot start {command[0]}: {exc}")
        child = None
    if child is not None:
        supervisor.poll_workers()  # known at once: its exit is waited for from now
        code = child.wait()
        exits[task.proc_id] = (code, time.time())
    launcher._finish(run_id, run_dir, supervisor, embedded, server, remote, False, exits,
                     ending=lambda merged: launcher.outside_ending(ending, task, merged),
                     write_files=task.proc_id == 0)
    for sig, old in previous.items():
        signal.signal(sig, old)
    if supervisor.aborted and code == 0:
        return 1
    return code if code >= 0 else 128 - code
