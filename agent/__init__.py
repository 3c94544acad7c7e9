"""rankwatch.agent: the per-rank agent.

Attached automatically by ``rankwatch run`` (no code change). The explicit API
is for what cannot be seen from outside:

    import rankwatch.agent as rw
    rw.observe(loss=loss)        # the loss as the script defines it

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

__all__ = ["Agent", "attach", "current", "observe"]


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
            agent.progress.observe_loss_tensor(loss.detach())  # a deferred read, never a sync
            return
        agent.progress.observe_loss(float(loss))
    except Exception:
        pass
