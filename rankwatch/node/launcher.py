"""``rankwatch run``: torchrun, watched.

Built on torch's own launcher: the arguments are parsed by torchrun's parser
(every option, ``PET_*`` env vars included) extended with rankwatch's options,
and the job is started by ``torch.distributed.run.run``. The only change is the
worker command: ``python -u -m rankwatch.agent.bootstrap SCRIPT ...`` instead of
``python -u SCRIPT ...``, which attaches the agent and then runs the script as
``__main__``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import secrets
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from rankwatch import config as config_mod
from rankwatch import slurm, wire

OUR_OPTIONS = ("run_dir", "collector", "hang_timeout", "on_hang", "config")
OUR_FLAGS = frozenset({"--run-dir", "--collector", "--hang-timeout", "--on-hang", "--config"})


def _exact_own_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Match rankwatch's own flags exactly, never by prefix.

    torchrun's parser accepts unambiguous prefixes of its options (``--nproc``
    for ``--nproc-per-node``, ``--run`` for ``--run-path``). Our flags must not
    change what a prefix means there, so they are left out of prefix matching:
    every command line plain torchrun accepts parses the same way here.
    """
    base = type(parser)

    class ExactOwnOptionsParser(base):  # type: ignore[misc, valid-type]
        def _get_option_tuples(self, option_string):  # argparse's prefix lookup
            found = super()._get_option_tuples(option_string)
            return [t for t in found if t[1] not in OUR_FLAGS]

    parser.__class__ = ExactOwnOptionsParser
    return parser


def build_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = _exact_own_options(get_args_parser())
    parser.prog = "rankwatch run"
    parser.description = "Launch a distributed PyTorch job with torchrun, watched by rankwatch."
    group = parser.add_argument_group("rankwatch")
    group.add_argument("--run-dir", dest="run_dir", default=None,
                       help="where report.json and bundles go (default ./rankwatch-runs/<run-id>)")
    group.add_argument("--collector", dest="collector", default=None,
                       help="URL of a standalone collector (default: embedded in this launcher)")
    group.add_argument("--hang-timeout", dest="hang_timeout", default=None,
                       help="seconds without progress before a hang verdict (default: adaptive)")
    group.add_argument("--on-hang", dest="on_hang", choices=("abort", "wait"), default=None,
                       help="abort (default): capture evidence, then end the job; wait: keep it running")
    group.add_argument("--config", dest="config", default=None, help="YAML file with rankwatch settings")
    return parser


def make_run_id(args: argparse.Namespace) -> str:
    """The run's id: the one place it is derived (contract, 2026-11-25: a
    rerun or requeue under the same rendezvous id is a new run, never one
    that inherits an earlier run's verdicts).

    - ``RANKWATCH_RUN_ID``: the deployment chose it (Kubernetes adds the
      job's UID, which is new per job);
    - a rendezvous id: ``<rdzv-id>-<launch nonce>``, the nonce agreed by every
      node of this launch through torch's rendezvous store (launch_nonce);
    - under srun: ``slurm-<job>.<step>[.r<requeue>]`` (rankwatch/slurm.py);
      Slurm never reuses a job id, so every launch is new by itself;
    - a rendezvous id: ``<rdzv-id>-<launch nonce>``, the nonce agreed by every
      node of this launch through torch's rendezvous store (launch_nonce);
    - one node without one: a fresh id per launch.

    Elastic restarts within a launch keep the id (the launcher and its store
    live on); they are attempts (TORCHELASTIC_RESTART_COUNT in each rank's
    identity)."""
    env_id = os.environ.get("RANKWATCH_RUN_ID")
    if env_id:
        return _safe(env_id)  # the collector accepts run ids of the wire pattern only (SECURITY.md)
    task = _slurm_task()
    if task is not None and task.in_step:
        # Under srun every node agrees on the job and step ids, which Slurm never
        # reuses, so no nonce is needed; a requeue is a new attempt of the same
        # run (SLURM_RESTART_COUNT in the id).
        return _safe(slurm.run_id(task))
    multi_node = not args.standalone and str(args.nnodes) not in ("1", "1:1")
    if args.rdzv_id and args.rdzv_id != "none":
        return _safe(f"{args.rdzv_id[:100]}-{launch_nonce(args)}")
    if multi_node:
        # Every node of a multi-node job must agree on the id: derive it from the rendezvous.
        endpoint = args.rdzv_endpoint or f"{args.master_addr}:{args.master_port}"
        return "job-" + hashlib.sha1(endpoint.encode()).hexdigest()[:12] + "-" + launch_nonce(args)
    return time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(3)


NONCE_KEY = "rankwatch.launch_nonce"
# The launcher's handle on the rendezvous store: kept for the whole launch so
# that torch's own rendezvous shares the same store server (multi_tenant) and a
# node joining late (elastic scale-up) still reads this launch's nonce.
_launch_stores: list[Any] = []


def launch_nonce(args: argparse.Namespace) -> str:
    """A nonce every node of this launch agrees on, and a later launch does
    not see: the first node to ask sets it in the rendezvous's TCP store
    (c10d backend: hosted by the launcher on the endpoint's machine, for as
    long as that launch lives). Other backends (static, etcd) have no such
    store here: each launch of a single node draws its own; a multi-node
    launch of those keeps the rendezvous-derived id without a nonce ("-0"),
    as before (see ARCHITECTURE.md, "Run identity")."""
    single_node = args.standalone or str(args.nnodes) in ("1", "1:1")
    if args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
        return secrets.token_hex(4) if single_node else "0"
    candidate = secrets.token_hex(4)
    try:
        store = _rendezvous_store(args)
        key = f"{NONCE_KEY}.{args.rdzv_id}"
        agreed = store.compare_set(key, "", candidate)
        _launch_stores.append(store)
        return bytes(agreed).decode("ascii", "replace")[:16] or candidate
    except Exception as exc:
        _say(f"the launch nonce could not be agreed through the rendezvous store at {args.rdzv_endpoint} "
             f"({type(exc).__name__}: {str(exc)[:200]}); this node uses its own run id")
        return candidate


def _rendezvous_store(args: argparse.Namespace) -> Any:
    """The c10d rendezvous's TCP store, opened exactly as torch's c10d
    backend opens it (torch.distributed.elastic.rendezvous.
    c10d_rendezvous_backend._create_tcp_store): hosted here when the
    endpoint names this machine, multi_tenant so that torch's rendezvous
    later in this process shares it."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
    configs = dict(item.split("=", 1) for item in (args.rdzv_conf or "").split(",") if "=" in item)
    is_host_conf = configs.get("is_host")
    is_host = (is_host_conf.strip().lower() in ("1", "true", "yes", "y") if is_host_conf is not None
               else _matches_machine_hostname(host))
    # A node that is not the host waits for it as long as torch's rendezvous would (join_timeout).
    wait_s = float(configs.get("join_timeout", 600))
    for as_server in ([True, False] if is_host else [False]):
        try:
            return TCPStore(host, port, is_master=as_server, multi_tenant=True,
                            timeout=timedelta(seconds=wait_s if not as_server else 60))
        except (ValueError, RuntimeError, TimeoutError):
            # Like torch: another process on this machine may host it (two launchers on one host).
            if not as_server or is_host_conf is not None:
                raise
    raise RuntimeError("unreachable")


def _safe(text: str) -> str:
    # wire.ID_PATTERN: ASCII letters, digits, '-', '_', '.', no leading dot.
    cleaned = "".join(c if (c.isascii() and c.isalnum()) or c in "-_." else "-" for c in text)[:128].lstrip(".")
    return cleaned or "run"


def _slurm_task() -> Optional[slurm.SlurmTask]:
    """The Slurm task this launcher runs as (None outside Slurm, or with
    RANKWATCH_SLURM=0: then the allocation is ignored)."""
    if os.environ.get("RANKWATCH_SLURM", "").strip().lower() in ("0", "false", "no", "off"):
        return None
    return slurm.task_from_env(os.environ)


_NOT_GIVEN = object()


def _given_options(argv: list[str]) -> set[str]:
    """The torchrun options of slurm.FILLABLE the user set, by flag (any
    spelling torchrun accepts) or by its PET_* variable."""
    parser = build_parser()
    parser.set_defaults(**{name: _NOT_GIVEN for name in slurm.FILLABLE})
    with contextlib.redirect_stderr(open(os.devnull, "w")):
        parsed = parser.parse_args(argv)  # parsed once already: cannot fail here
    return {name for name in slurm.FILLABLE
            if getattr(parsed, name, _NOT_GIVEN) is not _NOT_GIVEN or f"PET_{name.upper()}" in os.environ}


def apply_slurm(args: argparse.Namespace, argv: list[str], task: Optional[slurm.SlurmTask]) -> list[str]:
    """``srun rankwatch run``: torchrun's node options from the step, where
    the user gave none. Outside a step (a batch script itself) nothing."""
    if task is None or not task.in_step:
        return []
    return slurm.fill_launch(args, _given_options(argv), task)


class _OutsideEnding:
    """The first signal from outside that the launcher got (the scheduler's
    SIGTERM, a --signal warning, a kill, Ctrl-C): what report.json's
    ``termination`` is made from."""

    def __init__(self) -> None:
        self.signal: Optional[str] = None
        self.at: float = 0.0
        for signum, at in slurm.early_warnings:  # a warning that came while rankwatch was starting
            self.note(signum, at)

    def note(self, signum: int, at: Optional[float] = None) -> None:
        if self.signal is None:
            self.signal, self.at = signal.Signals(signum).name, time.time() if at is None else at


@contextlib.contextmanager
def _noting_signals(ending: _OutsideEnding, task: Optional[slurm.SlurmTask]):
    """torchrun's termination handler, noting the signal first. Under Slurm a
    ``--signal=USR1@N`` warning is noted and the launcher goes on (without a
    handler, SIGUSR1 would end the launcher at once and lose the report); the
    workers get Slurm's signal themselves, as they would without rankwatch."""
    from torch.distributed.elastic.multiprocessing import api as mp_api

    original = mp_api._terminate_process_handler

    def handler(signum, frame):
        ending.note(signum)
        return original(signum, frame)

    mp_api._terminate_process_handler = handler
    previous = {}
    if task is not None and threading_main():
        for sig in (signal.SIGUSR1, signal.SIGUSR2):
            with contextlib.suppress(ValueError, OSError):
                previous[sig] = signal.signal(sig, lambda signum, frame: ending.note(signum))
    try:
        yield
    finally:
        mp_api._terminate_process_handler = original
        for sig, old in previous.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(sig, old)


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def outside_ending(ending: _OutsideEnding, task: Optional[slurm.SlurmTask],
                   exits: dict[int, tuple[int, float]],
                   state_of: Callable[[str], Optional[slurm.JobState]] = slurm.job_state) -> Optional[wire.Termination]:
    """report.json's ``termination``: None when the job ended by itself.

    Under Slurm, Slurm's view of the job (scontrol) says whether it ended the
    job (a cancel, a time limit, a preemption), asked when the launcher got a
    signal or a worker died by one (Slurm signals every process of the step;
    a worker may go first). A signal Slurm did not send, or any signal
    outside Slurm, is ``by: signal``."""
    signalled = sorted((at, -code) for code, at in exits.values() if code < 0)
    if ending.signal is None and not (task is not None and signalled):
        return None
    if task is not None:
        name = ending.signal or _signal_name(signalled[0][1])
        at = ending.at or signalled[0][0]
        found = slurm.scheduler_ending(task, name, at, state_of=state_of)
        if found is not None and (found.reason != "unknown" or ending.signal is not None):
            return found
    if ending.signal is None:
        return None  # a worker killed by something else: a crash, the analyses' to name
    return slurm.signal_ending(ending.signal, ending.at)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def write_termination(run_dir: Path, termination: Optional[wire.Termination]) -> None:
    """The ending, in the run dir for `rankwatch analyze` (collector.offline
    reads it back)."""
    if termination is None:
        return
    from rankwatch.collector.offline import TERMINATION_FILE

    with contextlib.suppress(OSError):
        (run_dir / TERMINATION_FILE).write_text(wire.json_text(wire.to_dict(termination), indent=2) + "\n")


def worker_environment(run_dir: Path) -> dict[str, str]:
    """torch settings for evidence, set only where the user has not set them
    (both the old TORCH_NCCL_* and the new TORCH_FR_* names: see
    rankwatch.agent.watch.collectives.fr_environment)."""
    from rankwatch.agent.watch.collectives import FR_DIR, fr_environment

    out = fr_environment(run_dir)
    try:
        (run_dir / FR_DIR).mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # torch then writes no dump there; the job runs the same
    return out


@contextlib.contextmanager
def _bootstrap_entrypoint():
    """Swap the worker command torchrun builds for our bootstrap."""
    import torch.distributed.run as torch_run

    original = torch_run.config_from_args

    def config_from_args(args):
        config, cmd, cmd_args = original(args)
        if callable(cmd):  # --run-path: a function entrypoint
            from rankwatch.agent.bootstrap import run_script_path

            return config, run_script_path, cmd_args
        if args.no_python:
            sys.stderr.write("[rankwatch] --no-python: the workers are not Python; only the launcher watches them\n")
            return config, cmd, cmd_args
        rest = list(cmd_args)
        if rest and rest[0] == "-u":
            rest = rest[1:]
        return config, cmd, ["-u", "-m", "rankwatch.agent.bootstrap", *rest]

    torch_run.config_from_args = config_from_args
    try:
        yield
    finally:
        torch_run.config_from_args = original


HUNG_STOP_GRACE_S = 5  # seconds a hung job's workers get after Ctrl-C before SIGKILL


@contextlib.contextmanager
def _interrupt_handling(hung):
    """Ctrl-C while rankwatch watches: say what happens next.

    torchrun sends the workers SIGINT and waits 30 s before SIGKILL. Workers
    stuck in a C call (a collective that will never complete) ignore SIGINT,
    so a user who pressed Ctrl-C on a hung job (``--on-hang wait``) would
    stare at a silent terminal. When rankwatch has diagnosed a hang, the
    wait is HUNG_STOP_GRACE_S; otherwise torchrun's own wait stands (a
    worker may be saving a checkpoint on KeyboardInterrupt). Either way one
    line says what is happening, and a second Ctrl-C kills the workers at
    once."""
    from torch.distributed.elastic.multiprocessing import api as mp_api

    original = mp_api.PContext.close

    def close(self, death_sig=None, timeout=30):
        if death_sig != signal.SIGINT:
            return original(self, death_sig, timeout)
        try:
            stuck = bool(hung())
        except Exception:
            stuck = False
        if stuck and timeout > HUNG_STOP_GRACE_S:
            timeout = HUNG_STOP_GRACE_S
            _say(f"Ctrl-C: the job is hung (see the verdict above); workers still running in {timeout} s "
                 f"are killed (SIGKILL). Ctrl-C again to kill them now.")
        else:
            _say(f"Ctrl-C: the workers got SIGINT; torchrun kills those still running in {timeout} s "
                 f"(SIGKILL). Ctrl-C again to kill them now.")
        try:
            return original(self, death_sig, timeout)
        except (mp_api.SignalException, KeyboardInterrupt):
            _say("second Ctrl-C: killing the workers now")
            with contextlib.suppress(Exception):
                original(self, signal.SIGKILL, 2)
            raise

    mp_api.PContext.close = close
    try:
        yield
    finally:
        mp_api.PContext.close = original


def _hang_diagnosed(embedded, run_id: str) -> bool:
    """Whether this run's (embedded) collector has diagnosed a hang."""
    if embedded is None:
        return False
    run = embedded.runs.get(run_id)
    return run is not None and any(i.kind == "hang" and i.ready for i in run.incidents)


class _RemoteCollector:
    """The launcher's client of a standalone collector: kept-alive
    connections, the bearer token, never a redirect (the agent's transport)."""

    def __init__(self, url: str, token: Optional[str]):
        from rankwatch.agent.core.transport import Transport

        self.url = url.rstrip("/")
        self._token = token
        self._transport = Transport(self.url, token=token, timeout=5.0)

    def post(self, path: str, body: bytes, content_type: str, timeout: float = 5.0,
             headers: Optional[dict[str, str]] = None) -> Any:
        return self._transport.post(path, body, content_type=content_type, headers=headers, timeout=timeout)

    def get(self, path: str, timeout: float = 30.0, limit: int = 64 * 1024 * 1024) -> bytes:
        """A GET of the collector's API (the run's page data at the end)."""
        import urllib.request

        class NoRedirect(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, *args, **kwargs):
                return None  # the token goes to one address only

        request = urllib.request.Request(self.url + path)
        if self._token:
            request.add_header("Authorization", f"Bearer {self._token}")
        with urllib.request.build_opener(NoRedirect).open(request, timeout=timeout) as response:
            data = response.read(limit + 1)
        if len(data) > limit:
            raise ValueError(f"answer of more than {limit} bytes")
        return data


def run(argv: list[str]) -> int:
    from rankwatch.redact import install_log_redaction

    install_log_redaction()  # the embedded collector's log lines (this process only, not the workers)
    parser = build_parser()
    args = parser.parse_args(argv)
    flags = {name: getattr(args, name) for name in OUR_OPTIONS}
    for name in OUR_OPTIONS:
        delattr(args, name)
    try:
        cfg = config_mod.load(flags=flags, env=os.environ, file=flags.get("config"))
    except config_mod.ConfigError as exc:
        parser.error(str(exc))
    if not args.training_script:
        parser.error("a training script (or -m MODULE) is required")
    task = _slurm_task()
    try:
        filled = apply_slurm(args, argv, task)
    except slurm.SlurmError as exc:
        parser.error(str(exc))
    if task is not None and task.in_step and task.node_name and not os.environ.get("RANKWATCH_HOST"):
        os.environ["RANKWATCH_HOST"] = task.node_name  # verdicts name the node as Slurm (and its user) knows it

    run_id = make_run_id(args)
    run_dir = _usable_run_dir(Path(cfg.run_dir or Path("rankwatch-runs") / run_id).resolve(), run_id)
    cfg.run_dir = str(run_dir)

    embedded = None
    server = None
    relay = None
    agent_token = cfg.token
    if cfg.collector:
        collector_url = cfg.collector
        remote = _RemoteCollector(collector_url, cfg.token)
        agents_url = collector_url
        if cfg.relay:
            # The node's agents beat to this launcher's relay, which sends one
            # report per node per interval. They get a token of their own: the
            # collector's token never enters the workers' environment.
            from rankwatch.node.relay import Relay

            agent_token = secrets.token_urlsafe(32)
            relay = Relay(remote.post, run_id, token=agent_token, interval=cfg.heartbeat_interval,
                          world_size=_job_world_size(args), hang_timeout=cfg.hang_timeout).start()
            agents_url = relay.url
    else:
        from rankwatch.collector.embedded import InProcessClient, start_embedded

        # The embedded collector authenticates its clients: a random token per
        # run that only this launcher and its workers (through their
        # environment) know, unless the user set one (a scraper must know it).
        metrics_open = cfg.metrics_open or not cfg.token
        if not cfg.token:
            cfg.token = agent_token = secrets.token_urlsafe(32)
        embedded, server = start_embedded(cfg, run_dir, metrics_open=metrics_open)
        collector_url = agents_url = server.url
        remote = InProcessClient(server.routes, collector_url)

    env = worker_environment(run_dir)
    env.update(config_mod.to_env(cfg))
    env.pop("RANKWATCH_TOKEN", None)
    if agent_token:
        env["RANKWATCH_TOKEN"] = agent_token
    # RANKWATCH_<KEY> for every key; RANKWATCH_COLLECTOR_URL is the old name, kept for older agents.
    env.update({"RANKWATCH_RUN_ID": run_id, "RANKWATCH_RUN_DIR": str(run_dir),
                "RANKWATCH_COLLECTOR": agents_url, "RANKWATCH_COLLECTOR_URL": agents_url})
    os.environ.update(env)

    from rankwatch.node.supervisor import NodeSupervisor

    node_rank = int(os.environ.get("GROUP_RANK", getattr(args, "node_rank", 0) or 0))
    supervisor = NodeSupervisor(run_id=run_id, run_dir=run_dir, post=relay.supervisor_post if relay else remote.post,
                                node_rank=node_rank,
                                world_size=0, on_hang=cfg.on_hang, hang_timeout=cfg.hang_timeout,
                                host=os.environ.get("RANKWATCH_HOST") or socket.gethostname(),
                                expected_workers=_local_world_size(args), announce=embedded is None)
    supervisor.start()
    if filled:
        _say(f"Slurm job {task.job_id} step {task.step_id}: " + ", ".join(filled))
    if task is not None and task.in_step and str(args.nnodes) not in ("1", "1:1") and embedded is not None:
        _say("a multi-node job with the embedded collector: this node's report covers its own ranks only; "
             "give --collector URL (a `rankwatch collector serve` every node reaches, see examples/slurm/) "
             "for one report of the whole job")
    _say(f"run {run_id}: collector {collector_url}{' (embedded)' if embedded else ''}, run dir {run_dir}"
         + (f", metrics {collector_url}/metrics" if embedded else ""))
    _announce_page(run_id, collector_url, embedded, server, remote, make_known=supervisor.report_now)

    exit_code = 0
    interrupted = False
    ending = _OutsideEnding()
    exits: dict[int, tuple[int, float]] = {}
    import torch.distributed.run as torch_run
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        with _bootstrap_entrypoint(), _interrupt_handling(lambda: _hang_diagnosed(embedded, run_id)), \
                _noting_signals(ending, task):
            torch_run.run(args)
    except ChildFailedError as exc:
        exit_code = 1
        for rank, failure in exc.failures.items():
            exits[int(rank)] = (int(failure.exitcode), float(failure.timestamp))
        if supervisor.aborted:
            # torchrun has just logged "failed (exitcode: -15)" and its error summary: say whose doing it was.
            _say(f"the failures above (exitcode -15: SIGTERM, -9: SIGKILL) are rankwatch ending the job: "
                 f"{supervisor.abort_reason or 'a verdict whose action is abort'}; the verdict is below")
    except SignalException as exc:
        interrupted = True
        exit_code = 128 + int(exc.sigval)
    except KeyboardInterrupt:
        interrupted = True
        ending.note(signal.SIGINT)
        exit_code = 128 + signal.SIGINT
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:
        exit_code = 1
        _say(f"launch failed: {type(exc).__name__}: {exc}")
    finally:
        _finish(run_id, run_dir, supervisor, embedded, server, remote, interrupted, exits, relay=relay,
                ending=lambda merged: outside_ending(ending, task, merged))
    if supervisor.aborted and exit_code == 0:
        exit_code = 1
    return exit_code


def _finish(run_id, run_dir, supervisor, embedded, server, remote, interrupted, exits,
            relay=None, ending: Callable[[dict], Optional[wire.Termination]] = lambda exits: None,
            write_files: bool = True) -> Optional[wire.Report]:
    """Always write report.json: collect late bundles, analyse a last time.

    Nothing here may change the job's exit status or end in a traceback: a
    collector that is down or answers garbage gives a report built from what
    this node saw; a run dir that cannot be written gives the report in the
    temp dir (or only the printed summary)."""
    report = None
    termination: Optional[wire.Termination] = None
    collector_used = embedded is not None  # a standalone collector's: once its report is taken
    try:
        supervisor.stop()
        if relay is not None:
            relay.stop()  # the node's last report (the supervisor's final view) goes first
        _upload_spool(run_dir, remote)
        _wait_for_crash_bundles(embedded, run_id)
        exits = _node_exits(exits, supervisor)
        try:
            termination = ending(exits)
        except Exception as exc:  # never in the way of the report
            _say(f"how the job ended could not be told ({type(exc).__name__}: {exc})")
        if termination is not None:
            interrupted = True  # the ranks' signal deaths follow from it: no culprit
            if write_files:
                write_termination(run_dir, termination)
        if embedded is not None:
            report = embedded.finish(run_id, interrupted=interrupted, exits=exits, termination=termination)
        else:
            report, problem = _collector_report(run_id, remote, interrupted, exits, termination)
            collector_used = problem is None
            if problem is not None:
                _say(f"the collector at {remote.url} could not be used at the end ({problem}); "
                     f"reporting what this node saw")
                report = node_report(run_id, run_dir, exits, interrupted,
                                     note=f"the central collector ({remote.url}) could not be used: {problem}; "
                                          f"this report is built from what this node saw")
    except Exception as exc:
        collector_used = False
        _say(f"analysis failed ({type(exc).__name__}: {exc}); reporting what this node saw")
        try:
            report = node_report(run_id, run_dir, _node_exits(exits, supervisor), interrupted,
                                 note=f"the analysis failed ({type(exc).__name__}); "
                                      f"this report is built from what this node saw")
        except Exception as inner:
            _say(f"node-side analysis failed too ({type(inner).__name__}: {inner})")
            report = exits_report(run_id, exits)
    finally:
        if report is not None and report.termination is None:
            report.termination = termination  # a report built on this node, or an older collector's
        if report is not None and write_files:
            written = _write_report(report, run_dir)
            _write_page(report, run_dir, written,
                        embedded.runs.get(run_id) if embedded is not None and collector_used else None,
                        remote if embedded is None and collector_used else None)
        if server is not None:
            server.stop()
        if embedded is not None:
            embedded.stop()
    return report


def _node_exits(exits: dict[int, tuple[int, float]], supervisor: Any) -> dict[int, tuple[int, float]]:
    """torchrun's failures, completed by what the supervisor saw of each local
    worker's exit (torchrun lists only the failed ones, and only when it
    raises)."""
    merged = dict(exits)
    try:
        workers = list(supervisor.workers.values())
    except Exception:
        return merged
    for worker in workers:
        if worker.exit_code is not None and worker.rank not in merged:
            merged[worker.rank] = (int(worker.exit_code), float(worker.exited_at or time.time()))
    return merged


def _collector_report(run_id: str, remote: Any, interrupted: bool, exits: dict[int, tuple[int, float]],
                      termination: Optional[wire.Termination] = None
                      ) -> tuple[Optional[wire.Report], Optional[str]]:
    """The standalone collector's final report, or why it cannot be used: it
    is down, answers something that is not a report, a report of another
    run, or a report that calls a job healthy while one of its ranks failed."""
    request = wire.FinishRequest(interrupted=interrupted, termination=termination,
                                 exits={str(r): wire.ExitRecord(exit_code=c, exited_at=t) for r, (c, t) in exits.items()})
    try:
        raw = remote.post(f"/v1/runs/{run_id}/finish", wire.dumps(request), "application/json", timeout=30)
        report = wire.decode(wire.Report, raw)
    except Exception as exc:
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"
    if report.run_id != run_id:
        return None, f"it answered with the report of another run ({report.run_id[:80]!r})"
    failed = [] if interrupted else failed_ranks(exits)  # Ctrl-C'd workers end by SIGINT: no failure
    if failed and report.status == "healthy":
        return None, f"it called the run healthy although rank(s) {', '.join(map(str, failed))} failed"
    return report, None


def failed_ranks(exits: dict[int, tuple[int, float]]) -> list[int]:
    """Ranks that ended with a non-zero status or a signal."""
    return sorted(rank for rank, (code, _at) in exits.items() if code != 0)


def node_report(run_id: str, run_dir: Path, exits: dict[int, tuple[int, float]], interrupted: bool,
                note: str) -> wire.Report:
    """The same analyses as the collector's, over what this node has: the
    bundles its agents and supervisor wrote or spooled in the run dir, and
    the exits its supervisor saw. Never healthy when a rank failed."""
    from rankwatch.collector import analyses, report as report_mod
    from rankwatch.collector.offline import AnalyzeError, load
    from rankwatch.collector.state import RunState

    try:
        run, _problems = load(run_dir)
        if run.run_id != run_id:
            raise AnalyzeError("another run's files")
    except (AnalyzeError, OSError):
        run = RunState(run_id=run_id)
    for rank, (code, at) in exits.items():
        state = run.rank(rank)
        if state.exit_code is None:
            state.exit_code, state.exited_at = code, at
    run.world_size = max(run.world_size, max(exits, default=-1) + 1)
    run.interrupted = run.interrupted or interrupted
    run.finished = True
    verdicts = analyses.run_all(run, time.time(), final=True)
    report = report_mod.build(run, verdicts)
    if failed_ranks(exits) and not report.verdicts and not interrupted:
        report = exits_report(run_id, exits, world_size=report.world_size)
    report.notes.append(note)
    return report


def exits_report(run_id: str, exits: dict[int, tuple[int, float]], world_size: int = 0) -> wire.Report:
    """The last resort, when no analysis could run: a crash verdict for the
    ranks that failed (torchrun's own knowledge), or a healthy report when
    none did."""
    from rankwatch.collector.analyses.common import verdict

    failed = failed_ranks(exits)
    world = max(world_size, max(exits, default=-1) + 1)
    if not failed:
        return wire.Report(run_id=run_id, world_size=world, status="healthy", verdicts=[])
    first = min(exits[r][1] for r in failed)
    how = "; ".join(f"rank {r}: " + (f"killed by signal {-exits[r][0]}" if exits[r][0] < 0 else f"exit code {exits[r][0]}")
                    for r in failed[:16])
    found = verdict("crash", failed, None, first, time.time(),
                    f"Rank(s) {', '.join(map(str, failed[:16]))} failed ({how}); no other evidence was available.",
                    {"exits": {str(r): {"exit_code": exits[r][0], "exited_at": exits[r][1]} for r in failed},
                     "consequences": []})
    return wire.Report(run_id=run_id, world_size=world, status="faulty", verdicts=[found])


def _write_report(report: wire.Report, run_dir: Path) -> Optional[Path]:
    """report.json in the run dir; when that cannot be written (a full or
    read-only disk), in the temp dir, said in one line; the summary is
    printed either way. Returns where it went."""
    import tempfile

    from rankwatch.outputs import report as report_mod

    target = run_dir / "report.json"
    written: Optional[Path] = None
    try:
        report_mod.write(report, target)
        written = target
    except OSError as exc:
        fallback = Path(tempfile.gettempdir()) / f"rankwatch-{report.run_id}-report.json"
        try:
            report_mod.write(report, fallback)
            written = fallback
            _say(f"report.json could not be written to {target} ({exc.strerror or exc}); written to {fallback}")
        except OSError as exc2:
            _say(f"report.json could not be written to {target} ({exc.strerror or exc}) nor to {fallback} "
                 f"({exc2.strerror or exc2}); only the summary below is available")
    try:
        from rankwatch.outputs import report as report_mod

        print(report_mod.text(report), file=sys.stderr, flush=True)
    except Exception as exc:
        _say(f"summary not printed ({type(exc).__name__}: {exc})")
    if written is not None:
        _say(f"report: {written}")
    return written


def _write_page(report: wire.Report, run_dir: Path, report_json: Optional[Path], run: Any,
                remote: Any = None) -> Optional[Path]:
    """report.html next to report.json (the temp dir's too). Made from the
    report and the run's state: the embedded collector's, or a standalone
    collector's page data, or what this node has (its run dir's bundles).
    A page that cannot be made is one line, never a traceback or another
    exit status."""
    import tempfile

    target = run_dir / "report.html"
    fallback = Path(tempfile.gettempdir()) / f"rankwatch-{report.run_id}-report.html"
    try:
        from rankwatch.outputs import html

        model_source = None
        if run is None and remote is not None:
            model_source = _collector_page_model(report, remote)
        if run is None and model_source is None:
            run = _node_state(report.run_id, run_dir)
        for path in ([target, fallback] if report_json is None or report_json.parent == run_dir else [fallback]):
            try:
                if model_source is not None:
                    html.write_model(model_source, path)
                else:
                    html.write(report, path, run, argv=sys.argv, env=dict(os.environ))
            except OSError as exc:
                _say(f"report.html could not be written to {path} ({exc.strerror or exc})"
                     + ("; trying the temp dir" if path != fallback else ""))
                continue
            _say(f"page: {path}")
            return path
    except Exception as exc:
        _say(f"report.html not written ({type(exc).__name__}: {exc})")
    return None


def _loopback(url: str) -> bool:
    import urllib.parse

    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


def _collector_page_model(report: wire.Report, remote: Any) -> Optional[dict]:
    """A standalone collector's page data of the run (it holds every node's
    evidence), when it says what the report says; None otherwise (the node's
    own view is used)."""
    from rankwatch.outputs import pagedata

    try:
        raw = remote.get(f"/v1/runs/{report.run_id}/page", timeout=30)
        model = wire.parse_json(raw, "page data", limit=64 * 1024 * 1024)
    except Exception:
        return None
    if not isinstance(model, dict) or model.get("schema") != pagedata.SCHEMA or model.get("run_id") != report.run_id:
        return None
    said = [(v.get("kind"), v.get("ranks")) for v in model.get("verdicts") or [] if isinstance(v, dict)]
    if said != [(v.kind, list(v.ranks)) for v in report.verdicts]:
        return None
    return model


def _node_state(run_id: str, run_dir: Path) -> Any:
    """What this node has of the run: the bundles in its run dir."""
    from rankwatch.collector.offline import AnalyzeError, load

    try:
        run, _problems = load(run_dir)
    except (AnalyzeError, OSError, ValueError):
        return None
    return run if run.run_id == run_id else None


def _announce_page(run_id: str, collector_url: str, embedded: Any, server: Any, remote: Any,
                   make_known: Optional[Callable[[], None]] = None) -> None:
    """Print a one-time link to the run's live page (the token never goes in
    a URL), once; a fresh one on demand (SIGUSR1, see _link_on_demand).

    A link is a credential for its 10 minutes: it is printed where only this
    machine can use it (a collector on loopback) or to a person (a terminal),
    never into a log a collector reachable from elsewhere would honour.

    ``make_known`` (the node supervisor's first report) runs before a link is
    printed: the collector learns of a run from its reports, and a link opened
    at once would otherwise show "No such run", a page that never updates
    (workers take seconds to start and beat)."""
    try:
        if not (_loopback(collector_url) or sys.stderr.isatty()):
            _say(f"page: {collector_url.rstrip('/')}/runs/{run_id} (open it in a browser with a one-time link: "
                 f"rankwatch collector link --url {collector_url.rstrip('/')} --run {run_id})")
            return
        if server is not None:
            if make_known is not None:
                make_known()  # in this process: at once
            sessions = server.routes.pages.sessions
            if not server.routes.token:
                _say(f"page: {collector_url}/runs/{run_id}")
                return

            def link() -> str:
                code, ttl = sessions.mint(f"/runs/{run_id}")
                return f"{collector_url}/login/{code} (one-time link, valid {int(ttl // 60)} min)"

            # Once: a link in every verdict flooded job logs. A fresh one on demand (a link
            # opens once and lasts 10 min) with SIGUSR1, which torchrun leaves alone.
            on_demand = _link_on_demand(lambda: _say(f"page: {link()}"))
            _say(f"page: {link()}" + (f" (a fresh link: kill -USR1 {os.getpid()})" if on_demand else ""))
            return
        answer = remote.post("/v1/login-links", json.dumps({"run_id": run_id}).encode(), "application/json",
                             timeout=5)
        if isinstance(answer, dict) and isinstance(answer.get("path"), str) and answer["path"].startswith("/login/"):
            minutes = int(float(answer.get("expires_in_s") or 600) // 60)
            if make_known is not None:
                make_known()  # the collector answered: one quick report
            _say(f"page: {collector_url.rstrip('/')}{answer['path']} (one-time link, valid {minutes} min)")
    except Exception:
        pass  # an older collector without pages: the run goes on, report.html is written at the end


def _link_on_demand(say_link: Callable[[], None]) -> bool:
    """SIGUSR1 to this launcher prints a fresh one-time link. Only from the
    main thread (Python's rule for signal handlers); False when not set."""
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGUSR1"):
        return False
    try:
        current = signal.getsignal(signal.SIGUSR1)
        if current not in (signal.SIG_DFL, None) and not getattr(current, "rankwatch_link", False):
            return False  # the user's own handler stays

        def handler(signum, frame) -> None:
            say_link()

        handler.rankwatch_link = True  # type: ignore[attr-defined]  # ours: replaced by a later launch in-process
        signal.signal(signal.SIGUSR1, handler)
    except (ValueError, OSError):
        return False
    return True


def _upload_spool(run_dir: Path, remote: Any) -> None:
    """Bundles that could not be sent during the run (collector down) go now."""
    spool = run_dir / "spool"
    if not spool.is_dir():
        return
    for path in sorted(spool.glob("*/*.tar.gz")):
        try:
            remote.post("/v1/bundles", path.read_bytes(), "application/gzip")
            path.unlink()
        except Exception:
            continue  # stays in the spool; `rankwatch analyze` reads it there


def _wait_for_crash_bundles(collector, run_id: str, timeout: float = 3.0) -> None:
    """A rank that raised sends its bundle on the way out; give it a moment."""
    if collector is None:
        return
    deadline = time.time() + timeout
    while time.time() < deadline:
        run = collector.runs.get(run_id)
        if run is None:
            return
        pending = [s for s in run.ranks.values()
                   if s.exception_event() is not None and not any(e.reason == "crash" for e in s.evidence.values())]
        if not pending:
            return
        time.sleep(0.1)


def _usable_run_dir(run_dir: Path, run_id: str) -> Path:
    """The run dir, or a fresh one in the temp dir when it cannot be created
    (a read-only or full file system): the job runs either way."""
    import tempfile

    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir
    except OSError as exc:
        fallback = Path(tempfile.mkdtemp(prefix=f"rankwatch-{run_id}-"))
        _say(f"run dir {run_dir} cannot be created ({exc.strerror or exc}); using {fallback}")
        return fallback


def _local_world_size(args: argparse.Namespace) -> int:
    try:
        from torch.distributed.run import determine_local_world_size

        return int(determine_local_world_size(args.nproc_per_node))
    except Exception:
        return 0


def _job_world_size(args: argparse.Namespace) -> int:
    """The job's world size as far as the launcher knows it: nodes (the
    largest of an elastic range) times this node's workers, or WORLD_SIZE
    when the environment gives it (a scheduler's launch); 0 if unknown."""
    try:
        env = int(os.environ.get("WORLD_SIZE", "0"))
    except ValueError:
        env = 0
    try:
        nodes = int(str(args.nnodes).split(":")[-1])
    except (TypeError, ValueError):
        nodes = 1
    return max(env, nodes * _local_world_size(args))


def _say(message: str) -> None:
    from rankwatch.redact import redact_text  # exception texts may carry secrets (SECURITY.md, redaction rule)

    print(f"[rankwatch] {redact_text(message)}", file=sys.stderr, flush=True)
