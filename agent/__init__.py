"""rankwatch.agent: the per-rank agent.

Attached automatically by ``rankwatch run`` (no code change). The explicit API
is for what cannot be seen from outside:

    import rankwatch.agent as rw
    rw.observe(loss=loss)        # the loss as the script defines it
    rw.expect_same("tokenizer", sha)  # a value every rank must share (else: config_divergence)

and for launchers other than ``rankwatch run`` (plain torchrun, Ray Train
workers, Slurm's srun), called before the process group is created:

    rw.attach()                  # reads RANKWATCH_* and torch's RANK/WORLD_SIZE env

attach() also sets what `rankwatch run` sets for its workers where the user
set nothing: Flight Recorder on, under both the old TORCH_NCCL_* and the new
TORCH_FR_* names, with its dump on timeout in the run dir.

Environment read by the agent: RANKWATCH_COLLECTOR (collector URL; the older
RANKWATCH_COLLECTOR_URL is accepted too), RANKWATCH_TOKEN, RANKWATCH_RUN_ID
(else TORCHELASTIC_RUN_ID), RANKWATCH_RUN_DIR, RANKWATCH_HOST, every other
RANKWATCH_<KEY> of the configuration, and torch's RANK, LOCAL_RANK,
WORLD_SIZE, GROUP_RANK, TORCHELASTIC_RESTART_COUNT.
"""

from __future__ import annotations

from typing import Any, Optional

from .runtime import Agent, current

__all__ = ["Agent", "attach", "current", "expect_same", "observe"]


def attach() -> Optional[Agent]:
    """Attach the agent to this process if it is not attached yet."""
    agent = current()
    if agent is not None:
        return agent
    try:
        agent = Agent.from_env()
        _set_flight_recorder_environment(agent.run_dir)
        agent.install()
        agent.watch_exit()  # no bootstrap around the script: see its end ourselves
        return agent
    except Exception as exc:
        from .core.safety import log

        log(f"agent not attached: {type(exc).__name__}: {exc}")
        return None


def _set_flight_recorder_environment(run_dir: Optional[str]) -> None:
    """What `rankwatch run` sets for its workers (Flight Recorder on for the
    whole torch range, its dump on timeout into the run dir): torch reads
    these when the process group is created, after this call."""
    import os

    from .watch.collectives import FR_DIR, fr_environment

    os.environ.update(fr_environment(run_dir))
    if run_dir:
        try:
            os.makedirs(os.path.join(run_dir, FR_DIR), exist_ok=True)
        except OSError:
            pass


def observe(loss: Any = None, **metrics: Any) -> None:
    """Report this step's loss (a float or a 0-d tensor). Never raises."""
    agent = current()
    if agent is None or loss is None:
        return
    try:
        if hasattr(loss, "detach"):
            agent.progress.observe_loss_tensor(loss.detach())  # a deferred read, never a sync
            return
        agent.progress.observe_loss(float(loss))
    except Exception:
        pass


def expect_same(name: str, value: Any) -> None:
    """Declare a value that must be equal on every rank (a tokenizer's hash, a
    dataset version, a config digest). Ranks that disagree are named in a
    `config_divergence` verdict, with the line of this call. Short values are
    compared as text, long ones by their SHA-256. Never raises."""
    agent = current()
    if agent is None or agent.train_config is None:
        return
    try:
        agent.train_config.expect_same(name, value)
    except Exception:
        pass
