"""Ray Train: the same verdicts for ``TorchTrainer`` jobs.

One line in the driver (or none, with Ray's own ``RAY_TRAIN_CALLBACKS`` env var):

    from rankwatch.ray import RankwatchCallback
    run_config = ray.train.RunConfig(..., callbacks=[RankwatchCallback()])

    RAY_TRAIN_CALLBACKS=rankwatch.ray.RankwatchCallback python driver.py   # no code change

Ray Train V2 runs a controller actor on the driver's node and the workers as
actors; ``train_loop_per_worker`` runs in a thread of each worker actor, and
Ray itself sets up the process group. `RankwatchCallback` is one object with
three roles, each in the process where Ray calls it:

- controller (`ControllerCallback`, `WorkerGroupCallback`): starts the
  collector (the same embedded collector `rankwatch run` uses) in the
  controller process, puts its URL, the run's token and the configuration in
  every worker's runtime env, registers the workers (world rank, node, Ray
  node id, actor id, pid), reports their state to the collector every health
  check (~2 s) like a node supervisor, forwards the collector's `capture`
  commands to a per-node helper actor (py-spy, faulthandler, black box), ends
  the run with `RankwatchAbort` when the collector asks for an abort, and
  writes ``report.json`` when the run ends;
- worker (`WorkerCallback`): attaches the agent before the training function
  starts, and watches that function's thread (exceptions, exit).

The run dir (report, bundles, collector index) is
``<storage_path>/<name>/rankwatch`` for local storage; for remote storage it is
a local folder on the driver's node and ``report.json`` (and ``report.html``)
are also copied to ``<storage_path>/<name>/rankwatch/`` on the storage filesystem.

Imports are absolute: this module is ``rankwatch.ray`` and must not shadow ``ray``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerCallback, WorkerGroupCallback

from rankwatch import config as config_mod
from rankwatch import wire

__all__ = ["RankwatchAbort", "RankwatchCallback", "report_path"]

# Ray names the thread that runs train_loop_per_worker "TrainingThread(<fn>)".
TRAINING_THREAD_PREFIX = "TrainingThread"
_RUNNER_FILE = "thread_runner.py"


class RankwatchAbort(RuntimeError):
    """rankwatch ended the Ray Train run after diagnosing it (``on_hang=abort``
    or ``on_<kind>=abort``). The message names the verdict, culprit ranks and
    step; ``report`` is the path of ``report.json``. Ray raises it from
    ``trainer.fit()`` as the ``controller_failure`` of a ``ControllerError``."""

    def __init__(self, message: str, report: str = ""):
        super().__init__(message)
        self.report = report

    def __reduce__(self):
        return (self.__class__, (str(self), self.report))


def report_path(storage_path: str, name: str) -> Path:
    """Where `RankwatchCallback` writes ``report.json`` for local storage."""
    return Path(storage_path).expanduser() / name / "rankwatch" / "report.json"


def _guarded(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A rankwatch failure must never fail the user's run: Ray turns any
    exception in a callback into a ControllerError that ends training. Only
    `RankwatchAbort` (a decision, not a failure) goes through."""
    @functools.wraps(hook)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return hook(self, *args, **kwargs)
        except RankwatchAbort:
            raise
        except Exception as exc:
            _say(f"{hook.__name__} failed ({type(exc).__name__}: {exc}); rankwatch goes on without it")
            return None

    return wrapper


@dataclass
class _WorkerInfo:
    rank: int
    local_rank: int
    node_rank: int
    world_size: int
    pid: int
    host: str
    node_id: str
    node_ip: str
    actor_id: str
    alive: bool = True
    exit_code: Optional[int] = None
    exited_at: Optional[float] = None
    cause: str = ""


class RankwatchCallback(ControllerCallback, WorkerGroupCallback, WorkerCallback):
    """rankwatch for Ray Train (see the module docstring).

    Settings: the same keys as ``rankwatch run`` (``RANKWATCH_*`` env in the
    driver, a YAML file in ``config=``, or keyword arguments here, e.g.
    ``RankwatchCallback(on_hang="wait", hang_timeout=60)``); keyword > env > file.
    ``collector="http://host:8765"`` (with ``token=``) reports to a standalone
    collector instead of the embedded one.
    """

    def __init__(self, config: Optional[str] = None, **settings: Any):
        # Runs in the driver (where the user builds the RunConfig); only plain
        # data is kept: Ray pickles this object to the controller and workers.
        unknown = sorted(set(settings) - set(config_mod.Config.keys()))
        if unknown:
            raise TypeError(f"RankwatchCallback: unknown settings {unknown}; known: {config_mod.Config.keys()}")
        self.config = config_mod.load(flags=settings, env=os.environ, file=config)
        self.run_id = os.environ.get("RANKWATCH_RUN_ID") or ""
        self._attempt = 0
        self._init_controller_state()

    def _init_controller_state(self) -> None:
        self._collector = None
        self._server = None
        self._url = ""
        self._token: Optional[str] = None
        self._run_dir: Optional[Path] = None
        self._storage = None  # (filesystem, path) for remote storage
        self._workers: dict[int, _WorkerInfo] = {}
        self._helpers: dict[str, Any] = {}
        self._abort: Optional[RankwatchAbort] = None
        self._finished = False
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # What reaches the controller (driver -> controller: the settings, a
        # standalone collector's token included) and the workers (controller ->
        # workers: never the token, which travels in their runtime env; never
        # live objects).
        config = replace(self.config, token=None) if self._url else self.config
        return {"config": config, "run_id": self.run_id, "_attempt": self._attempt}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.config = state["config"]
        self.run_id = state["run_id"]
        self._attempt = state["_attempt"]
        self._init_controller_state()

    # == controller ==================================================================
    @_guarded
    def after_controller_start(self, train_run_context) -> None:
        try:
            self._start(train_run_context.run_config)
        except BaseException:
            self._url = ""  # off for this run: the workers get no collector to report to
            if self._server is not None:
                self._server.stop()
            if self._collector is not None:
                self._collector.stop()
            raise

    def _start(self, run_config) -> None:
        if not self.run_id:
            self.run_id = _safe(run_config.name)[:100] + "-" + secrets.token_hex(3)
        self._run_dir = self._resolve_run_dir(run_config)
        self._run_dir.mkdir(parents=True, exist_ok=True)
        cfg = replace(self.config, run_dir=str(self._run_dir))
        if cfg.collector:
            self._url = cfg.collector.rstrip("/")
            self._token = cfg.token
        else:
            from rankwatch.collector.embedded import start_embedded

            # A per-run token: only this run's workers and helpers get it.
            self._token = cfg.token or secrets.token_urlsafe(24)
            cfg = replace(cfg, token=self._token, bind=self._bind_address(cfg.bind))
            self._collector, self._server = start_embedded(cfg, self._run_dir)
            self._url = self._server.url
            if cfg.bind in ("0.0.0.0", "::", ""):  # every interface: the workers use the node's address
                self._url = f"http://{ray.util.get_node_ip_address()}:{self._server.httpd.server_address[1]}"
        self.config = cfg
        env = self._worker_env()
        runtime_env = run_config.worker_runtime_env
        merged = dict(runtime_env.get("env_vars") or {})
        merged.update(env)
        runtime_env["env_vars"] = merged
        _say(f"run {self.run_id}: collector {self._url}{' (embedded in the Ray Train controller)' if self._collector else ''}"
             f", run dir {self._run_dir}")

    def _resolve_run_dir(self, run_config) -> Path:
        if self.config.run_dir:
            return Path(self.config.run_dir).expanduser().resolve()
        storage = run_config.storage_context
        fs = storage.storage_filesystem
        if getattr(fs, "type_name", "") == "local":
            return Path(storage.experiment_fs_path) / "rankwatch"
        # Remote storage (S3, GCS, NFS through fsspec): evidence stays on the
        # driver's node; the report is copied to the storage at the end.
        self._storage = (fs, f"{storage.experiment_fs_path}/rankwatch/report.json")
        return Path(tempfile.gettempdir()) / "rankwatch-ray" / self.run_id

    @staticmethod
    def _bind_address(bind: str) -> str:
        """Loopback is enough on one machine; on a multi-node cluster the
        workers must reach the collector at the driver node's address."""
        if bind not in ("127.0.0.1", "localhost"):
            return bind
        try:
            alive = [n for n in ray.nodes() if n.get("Alive")]
        except Exception:
            alive = []
        return ray.util.get_node_ip_address() if len(alive) > 1 else bind

    def _worker_env(self) -> dict[str, str]:
        from rankwatch.node.launcher import worker_environment

        assert self._run_dir is not None
        env = worker_environment(self._run_dir)  # Flight Recorder settings, where the user set none
        env.update(config_mod.to_env(self.config))
        env.update({
            "RANKWATCH_RUN_ID": self.run_id,
            "RANKWATCH_RUN_DIR": str(self._run_dir),
            "RANKWATCH_COLLECTOR": self._url,
            "RANKWATCH_COLLECTOR_URL": self._url,
        })
        if self._token:
            env["RANKWATCH_TOKEN"] = self._token
        return env

    @_guarded
    def before_worker_group_start(self, worker_group_context) -> None:
        self._attempt += 1  # Ray restarts the whole group on a retried failure: a fresh attempt

    @_guarded
    def after_worker_group_start(self, worker_group) -> None:
        if not self._url:
            return  # the collector did not start: rankwatch is off for this run
        workers = {}
        for w in worker_group.get_workers():
            ctx, meta = w.distributed_context, w.metadata
            try:
                actor_id = w.actor._actor_id.hex()
            except Exception:
                actor_id = ""
            workers[ctx.world_rank] = _WorkerInfo(
                rank=ctx.world_rank, local_rank=ctx.local_rank, node_rank=ctx.node_rank,
                world_size=ctx.world_size, pid=meta.pid, host=meta.hostname, node_id=meta.node_id,
                node_ip=meta.node_ip, actor_id=actor_id)
        with self._lock:
            self._workers = workers
        self._start_helpers({w.node_id for w in workers.values()})

    def _start_helpers(self, node_ids: set[str]) -> None:
        """One small actor per node (no CPU reserved) that looks at the workers
        from outside: py-spy, faulthandler, black box. Started with the group
        so it is ready before an incident needs it."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        env = {"RANKWATCH_TOKEN": self._token} if self._token else {}
        remote = ray.remote(num_cpus=0, max_restarts=0)(_NodeHelper)
        for node_id in node_ids - set(self._helpers):
            try:
                self._helpers[node_id] = remote.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                    runtime_env={"env_vars": env}, name=None,
                ).remote(self.run_id, str(self._run_dir), self._url, self.config.on_hang, self.config.hang_timeout)
            except Exception as exc:
                _say(f"no helper on node {node_id[:12]} ({type(exc).__name__}: {exc}): no stacks from outside there")

    @_guarded
    def after_worker_group_poll_status(self, worker_group_status) -> None:
        if not self._url:
            return
        now = time.time()
        newly_dead = []
        with self._lock:
            for rank, status in worker_group_status.worker_statuses.items():
                info = self._workers.get(rank)
                if info is None or not info.alive:
                    continue
                code, cause = _exit_of(status)
                if code is None:
                    continue
                info.alive, info.exit_code, info.exited_at, info.cause = False, code, now, cause
                if cause == "actor died":
                    newly_dead.append(info)
        for info in newly_dead:
            # Ray gives the controller "the actor died", never the exit status.
            # A fatal signal Python's faulthandler caught (SIGSEGV, SIGABRT, ...)
            # is in the agent's fatal file, which the node's helper reads; a
            # death that left no record there is reported as SIGKILL (the OOM
            # killer, kill -9), the one signal no process can record.
            code = -int(signal.SIGKILL)
            helper = self._helpers.get(info.node_id)
            if helper is not None:
                try:
                    code = ray.get(helper.post_mortem.remote(_as_dict(info)), timeout=5.0) or code
                except Exception:
                    pass
            with self._lock:
                info.exit_code = code
        self._report_nodes(finished=False)
        if self._abort is not None:
            raise self._abort

    def _report_nodes(self, finished: bool) -> None:
        """What `rankwatch run`'s node supervisor posts, per Ray node."""
        with self._lock:
            by_node: dict[str, list[_WorkerInfo]] = {}
            for info in self._workers.values():
                by_node.setdefault(info.node_id, []).append(info)
        for node_id, infos in by_node.items():
            node = wire.NodeHeartbeat(
                run_id=self.run_id, host=infos[0].host, node_rank=infos[0].node_rank,
                world_size=infos[0].world_size, sent_at=time.time(), hang_timeout=self.config.hang_timeout,
                on_hang=self.config.on_hang, finished=finished, launcher_pid=0,
                workers=[wire.WorkerStatus(local_rank=i.local_rank, rank=i.rank, pid=i.pid, alive=i.alive,
                                           exit_code=i.exit_code, exited_at=i.exited_at) for i in infos])
            try:
                reply = wire.decode(wire.Reply, self._post("/v1/nodes", wire.dumps(node)))
            except Exception as exc:
                _say(f"collector unreachable ({type(exc).__name__}: {exc})")
                continue
            for command in reply.commands:
                if command.kind == "capture":
                    helper = self._helpers.get(node_id)
                    if helper is not None:
                        workers = [_as_dict(i) for i in infos if i.alive and (not command.ranks or i.rank in command.ranks)]
                        helper.capture.remote(wire.to_dict(command), workers)
                elif command.kind == "abort" and not finished and self._abort is None:
                    self._abort = self._abort_error(command.reason)

    def _abort_error(self, reason: str) -> RankwatchAbort:
        """The verdict that made the collector end the run, in one message."""
        # The collector's reason names the incident ("... incident hang-1"): its kind is the verdict's.
        match = re.search(r"incident ([A-Za-z_]+)-\d+", reason or "")
        kind = match.group(1) if match else None
        deadline = time.time() + 5.0
        found: list[dict[str, Any]] = []
        while time.time() < deadline:  # the analysis runs on the collector's next tick
            try:
                verdicts = self._get(f"/v1/runs/{self.run_id}/report").get("verdicts") or []
            except Exception:
                verdicts = []
            found = [v for v in verdicts if kind is None or v.get("kind") == kind]
            if found:
                break
            time.sleep(0.2)
        report = str(self._run_dir / "report.json") if self._run_dir else ""
        if found:
            v = found[0]
            ranks = ", ".join(str(r) for r in v.get("ranks", []))
            message = (f"rankwatch ended the run: {v.get('kind')} on rank {ranks} at step {v.get('step')}: "
                       f"{v.get('summary')} Report: {report}")
        else:
            message = f"rankwatch ended the run: {reason}. Report: {report}"
        _say(message)
        return RankwatchAbort(message, report)

    @_guarded
    def before_worker_group_shutdown(self, worker_group) -> None:
        # Ray tears the group down (a peer failed, the run ends or rankwatch
        # aborted it): the ranks still running die by Ray's hand, not their own.
        now = time.time()
        with self._lock:
            for info in self._workers.values():
                if info.alive:
                    info.alive, info.exit_code, info.exited_at, info.cause = False, -int(signal.SIGTERM), now, "teardown"
        self._report_nodes(finished=False)

    @_guarded
    def after_controller_finish(self, result) -> None:
        self._finish(interrupted=False)

    @_guarded
    def before_controller_abort(self) -> None:
        self._finish(interrupted=True)  # the user stopped the run (Ctrl-C in the driver)

    def _finish(self, interrupted: bool) -> None:
        if self._finished or self._run_dir is None or not self._url:
            return
        self._finished = True
        from rankwatch.outputs import report as report_mod

        report = None
        try:
            self._report_nodes(finished=True)
            self._wait_for_crash_bundles()
            with self._lock:
                exits = {str(i.rank): wire.ExitRecord(exit_code=i.exit_code, exited_at=i.exited_at)
                         for i in self._workers.values() if i.exit_code is not None and i.exited_at is not None}
            request = wire.FinishRequest(interrupted=interrupted, exits=exits)
            report = wire.decode(wire.Report, self._post(f"/v1/runs/{self.run_id}/finish", wire.dumps(request),
                                                         timeout=30))
        except Exception as exc:
            _say(f"could not finish with the collector ({type(exc).__name__}: {exc}); analysing the run dir")
            try:
                from rankwatch.collector.offline import analyze_path

                report = analyze_path(self._run_dir)
            except Exception:
                report = wire.Report(run_id=self.run_id, world_size=len(self._workers), status="healthy", verdicts=[])
        finally:
            if report is not None:
                path = self._run_dir / "report.json"
                report_mod.write(report, path)
                self._write_page(report)
                if self._storage is not None:
                    fs, target = self._storage
                    try:
                        fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
                        with fs.open_output_stream(target) as out:
                            out.write(path.read_bytes())
                        page = path.with_name("report.html")
                        if page.is_file():
                            with fs.open_output_stream(target.rsplit("/", 1)[0] + "/report.html") as out:
                                out.write(page.read_bytes())
                    except Exception as exc:
                        _say(f"could not copy the report to the storage ({type(exc).__name__}: {exc})")
                print(report_mod.text(report), file=sys.stderr, flush=True)
                _say(f"report: {path}")
            for helper in self._helpers.values():
                try:
                    ray.kill(helper)
                except Exception:
                    pass
            self._helpers = {}
            if self._server is not None:
                self._server.stop()
            if self._collector is not None:
                self._collector.stop()

    def _write_page(self, report: wire.Report) -> None:
        """report.html next to report.json (one line if it cannot be made)."""
        try:
            from rankwatch.outputs import html

            run = self._collector.runs.get(self.run_id) if self._collector is not None else None
            if run is None:
                from rankwatch.collector.offline import load

                try:
                    run, _ = load(self._run_dir)
                except Exception:
                    run = None
            page = html.write(report, self._run_dir / "report.html", run, argv=sys.argv)
            _say(f"page: {page}")
        except Exception as exc:
            _say(f"report.html not written ({type(exc).__name__}: {exc})")

    def _wait_for_crash_bundles(self, timeout: float = 3.0) -> None:
        """A rank whose loop raised sends its bundle on the way out."""
        if self._collector is None:
            return
        deadline = time.time() + timeout
        while time.time() < deadline:
            run = self._collector.runs.get(self.run_id)
            if run is None:
                return
            if not [s for s in run.ranks.values()
                    if s.exception_event() is not None and not any(e.reason == "crash" for e in s.evidence.values())]:
                return
            time.sleep(0.1)

    # -- HTTP to the collector (embedded or standalone alike) --------------------------
    def _post(self, path: str, body: bytes, timeout: float = 5.0) -> Any:
        return _http(self._url + path, self._token, body, timeout)

    def _get(self, path: str, timeout: float = 5.0) -> Any:
        return _http(self._url + path, self._token, None, timeout)

    # == worker ==========================================================================
    def after_init_train_context(self) -> None:
        """In each worker actor, before the training function starts (and
        before Ray initialises the process group): attach the agent."""
        try:
            _attach_in_worker(self._attempt)
        except Exception as exc:  # a broken agent must never stop the training
            sys.stderr.write(f"[rankwatch] agent not attached: {type(exc).__name__}: {exc}\n")


# == worker side ===========================================================================
def _attach_in_worker(attempt: int) -> None:
    from ray.train.v2._internal.execution.context import get_train_context

    from rankwatch.agent.runtime import Agent, current

    url = os.environ.get("RANKWATCH_COLLECTOR") or os.environ.get("RANKWATCH_COLLECTOR_URL")
    if current() is not None or not url:
        return
    ctx = get_train_context()
    identity = wire.RankIdentity(
        run_id=os.environ.get("RANKWATCH_RUN_ID") or "ray", rank=ctx.get_world_rank(),
        local_rank=ctx.get_local_rank(), world_size=ctx.get_world_size(), node_rank=ctx.get_node_rank(),
        host=os.environ.get("RANKWATCH_HOST") or socket.gethostname(), pid=os.getpid(),
        attempt=max(0, attempt - 1))
    agent = Agent(config_mod.load(env=os.environ), identity, url)
    agent.install()
    runtime = ray.get_runtime_context()
    agent.record_event("ray_worker", node_id=runtime.get_node_id(), actor_id=runtime.get_actor_id() or "",
                       node_ip=ray.util.get_node_ip_address(), local_world_size=ctx.get_local_world_size())
    runner = ctx.execution_context.training_thread_runner
    original_run = runner.run

    def run(target: Callable[[], Any]) -> None:
        # Same name as Ray's own target: Ray names the thread and logs after it.
        @functools.wraps(target)
        def train_fn_watched_by_rankwatch():
            from rankwatch.agent.core import stacks

            # The loop runs here, not in the process's main thread: the stacks
            # the analyses read as "main" are this thread's.
            stacks.training_thread_ident = threading.get_ident()
            try:
                result = target()
            except SystemExit as exc:
                # sys.exit() in the training function: Ray reports it as the
                # function's error, but it is the exit a process would make
                # (sys.exit(0): a clean exit, e.g. a rank whose data ran out).
                agent.shutdown(_exit_code_of(exc))
                raise
            except BaseException as exc:
                agent.on_exception(exc)
                agent.shutdown(1)
                raise
            agent.shutdown(0)
            return result

        return original_run(train_fn_watched_by_rankwatch)

    runner.run = run


# == per-node helper ===========================================================================
class _NodeHelper:
    """A Ray actor on each node with workers: the outside view `rankwatch
    run`'s node supervisor gives (py-spy and faulthandler stacks of a frozen
    worker, the black box of a dead one), sent to the collector as
    ``supervisor`` bundles. Exit statuses come from the controller instead:
    the workers are not this process's children."""

    def __init__(self, run_id: str, run_dir: str, url: str, on_hang: str, hang_timeout: Optional[float]):
        from rankwatch.node.supervisor import NodeSupervisor

        token = os.environ.get("RANKWATCH_TOKEN")

        def post(path: str, body: bytes, content_type: str, timeout: float = 10.0) -> Any:
            return _http(url + path, token, body, timeout, content_type)

        class RaySupervisor(NodeSupervisor):
            def _send_bundle(self, worker, incident, reason, members, notes, step=None):
                if isinstance(members.get("stacks.json"), list):
                    mark_training_thread(members["stacks.json"])
                notes = notes + ["Ray Train worker: the loop runs in Ray's TrainingThread, read as the main thread"]
                return super()._send_bundle(worker, incident, reason, members, notes, step=step)

        self.supervisor = RaySupervisor(run_id=run_id, run_dir=Path(run_dir), post=post, node_rank=0, world_size=0,
                                        on_hang=on_hang, hang_timeout=hang_timeout)

    def _worker(self, info: dict[str, Any]):
        from rankwatch.node.supervisor import Worker

        return Worker(pid=int(info["pid"]), rank=int(info["rank"]), local_rank=int(info["local_rank"]),
                      world_size=int(info["world_size"]))

    def capture(self, command: dict[str, Any], workers: list[dict[str, Any]]) -> int:
        sup = self.supervisor
        sup.workers = {int(w["pid"]): self._worker(w) for w in workers}
        sup.node_rank = int(workers[0]["node_rank"]) if workers else 0
        sup.capture(wire.decode(wire.Command, command))
        return len(workers)

    def post_mortem(self, info: dict[str, Any]) -> Optional[int]:
        """Send the dead worker's black box and fatal stacks; return minus the
        fatal signal its faulthandler recorded, if any."""
        self.supervisor.node_rank = int(info["node_rank"])
        self.supervisor.post_mortem(self._worker(info))
        path = Path(self.supervisor.run_dir) / "stacks" / f"rank-{int(info['rank']):05d}.fatal.txt"
        try:
            text = path.read_text(errors="replace")[-200_000:]
        except OSError:
            return None
        for message, sig in _FATAL_SIGNALS.items():
            if f"Fatal Python error: {message}" in text:
                return -int(sig)
        return None


# What faulthandler prints for each fatal signal it handles.
_FATAL_SIGNALS = {"Segmentation fault": signal.SIGSEGV, "Aborted": signal.SIGABRT, "Bus error": signal.SIGBUS,
                  "Floating-point exception": signal.SIGFPE, "Floating point exception": signal.SIGFPE,
                  "Illegal instruction": signal.SIGILL}


def mark_training_thread(threads: list[dict[str, Any]]) -> None:
    """Mark Ray's training thread as the "main" one in stacks taken from
    outside (py-spy names it; faulthandler does not, its frames tell)."""
    def is_training(thread: dict[str, Any]) -> bool:
        if str(thread.get("name") or "").startswith(TRAINING_THREAD_PREFIX):
            return True
        return any(str(f.get("file", "")).endswith(_RUNNER_FILE) and f.get("name") == "_run_target"
                   for f in thread.get("frames") or [])

    found = [t for t in threads if is_training(t)]
    if found:
        for thread in threads:
            thread["main"] = thread is found[0]


# == helpers =====================================================================================
def _exit_of(status) -> tuple[Optional[int], str]:
    """(exit code, cause) of a rank from Ray's poll status; (None, "") while it runs."""
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback, WorkerHealthCheckTimeoutError

    error = status.error
    if error is None:
        return (0, "finished") if not status.running else (None, "")
    if isinstance(error, WorkerHealthCheckTimeoutError):
        return None, ""  # still there, only slow to answer Ray
    if isinstance(error, UserExceptionWithTraceback):
        base = getattr(error, "_base_exc", None)
        if isinstance(base, SystemExit):  # sys.exit() in the training function: the exit a process makes
            code = _exit_code_of(base)
            return code, "finished" if code == 0 else "exit"
        return 1, "exception"  # the agent reported the exception itself
    # The actor died (a signal, os._exit, the OOM killer): Ray's message lists
    # possible causes, not the exit status; the controller asks the node's
    # helper for what the process recorded (see after_worker_group_poll_status).
    return -int(signal.SIGKILL), "actor died"


def _exit_code_of(exc: SystemExit) -> int:
    """The exit status Python gives ``raise SystemExit(code)``: 0 for None,
    the number itself, 1 for anything else (a message it prints)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1


def _as_dict(info: _WorkerInfo) -> dict[str, Any]:
    return dict(info.__dict__)


def _http(url: str, token: Optional[str], body: Optional[bytes], timeout: float,
          content_type: str = "application/json") -> Any:
    request = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    if body is not None:
        request.add_header("Content-Type", content_type)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read() or b"{}")


def _safe(text: str) -> str:
    # wire.ID_PATTERN (the collector refuses other run ids): ASCII, no leading dot.
    cleaned = "".join(c if (c.isascii() and c.isalnum()) or c in "-_." else "-" for c in str(text)).lstrip(".")
    return cleaned or "ray-train"


def _say(message: str) -> None:
    print(f"[rankwatch] {message}", file=sys.stderr, flush=True)
