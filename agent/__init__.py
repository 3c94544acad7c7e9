"""rankwatch.agent: the per-rank agent.

Attached automatically by ``rankwatch run`` (no code change). The explicit API
is for what cannot be seen from outside:

    import rankwatch.agent as rw
    rw.observe(loss=loss)        # the loss as the script defines it
    rw.expect_same("tokenizer", sha)  # a value every rank must share (else: config_divergence)

and for launchers other than ``rankwatch run`` (plain torchrun, Ray Train
workers, Slurm's srun), called before the model is wrapped in DDP:

    rw.attach()                  # reads RANKWATCH_* and torch's RANK/WORLD_SIZE env

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
        agent.install()
        agent.watch_exit()  # no bootstrap around the script: see its end ourselves
        return agent
    except Exception as exc:
        from .safety import log

        log(f"agent not attached: {type(exc).__name__}: {exc}")
        return None


def observe(loss: Any = None, **metrics: Any) -> None:
    """Report this step's loss (a float or a 0-d tensor). Never raises."""
    agent = current()
    if agent is None or loss is None:
        return
    try:
        if hasattr(loss, "detach"):
            if loss.device.type != "cpu":
                agent.progress._loss = loss.detach()  # read later without a sync
                return
            loss = float(loss.detach())
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
