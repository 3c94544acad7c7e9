"""rankwatch's configuration: one dataclass, four sources.

Precedence (CONTRACT.md): flag > env (``RANKWATCH_<KEY>``) > YAML file > default.
The launcher resolves the configuration once and hands it to every worker
through ``RANKWATCH_*`` environment variables, so the agent reads env only.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

ENV_PREFIX = "RANKWATCH_"


# What the collector does on a verdict of a kind (on_<kind>); "ignore" silences
# that check for the run (no verdict), for a known false alarm.
ACTIONS = ("report", "dump", "abort", "ignore")


class ConfigError(ValueError):
    pass


@dataclass
class Config:
    # Where the run's report, bundles and collector index go.
    run_dir: Optional[str] = None
    # URL of a standalone collector; None starts one embedded in the launcher.
    collector: Optional[str] = None
    # Seconds without progress before a hang verdict; None = adaptive.
    hang_timeout: Optional[float] = None
    # What to do once a hang is diagnosed: "abort" ends the job, "wait" keeps it.
    on_hang: str = "abort"
    # Agent -> collector heartbeat period.
    heartbeat_interval: float = 1.0
    # Adaptive hang timeout (when a stall is named): before the first steps
    # `startup_timeout`; after, max(adaptive_floor, adaptive_multiplier x the
    # run's p99 step time + adaptive_margin).
    startup_timeout: float = 50.0
    adaptive_floor: float = 5.0
    adaptive_multiplier: float = 3.0
    adaptive_margin: float = 2.0
    # on_hang abort ends the job only once the stalled rank is shown stuck
    # (collector/stuck.py): no CPU and no file I/O in its process for a
    # window as long as the hang timeout, its interpreter frozen that long,
    # or, while it keeps busy, no progress past this bound (None: adaptive,
    # max(300 s, 10 x the hang timeout); checkpoint/compile phases:
    # checkpoint_timeout).
    hang_abort_timeout: Optional[float] = None
    # While any rank writes a checkpoint (torch.save, torch.distributed.checkpoint).
    checkpoint_timeout: float = 900.0
    # Seconds the collector waits for bundles after it asked for them.
    evidence_window: float = 3.0
    # Local-gradient checks before the allreduce (norm, finiteness).
    grad_checks: bool = True
    # Largest fraction of step time the gradient checks may take before they
    # sample every N-th step (matters on CPUs; on GPUs they are asynchronous).
    grad_check_budget: float = 0.005
    # Parameter fingerprints every N optimizer steps (0: off).
    fingerprint_every: int = 10
    # Silent-error checks in the agent: training configuration facts, input
    # batch fingerprints, update checks (agent/checks/train_config.py, ...).
    silent_checks: bool = True
    # Collective sequence marks every N optimizer steps (detects an extra collective).
    collective_mark_every: int = 5
    # Record CUDA allocator history for memory snapshots (costly; off by default).
    memory_history: bool = False
    memory_history_max_entries: int = 100_000
    # What the collector does on a verdict: report (only), dump (bundles from
    # every rank), abort (bundles, then end the job). Hangs: see on_hang.
    on_collective_mismatch: str = "dump"
    on_nonfinite: str = "dump"
    on_grad_spike: str = "report"
    on_weight_divergence: str = "dump"
    on_straggler: str = "dump"
    on_memory_growth: str = "dump"
    # Silent errors (the job runs but trains wrong): reported, never ending the
    # job unless set to "abort".
    on_config_divergence: str = "report"
    on_duplicate_data: str = "report"
    on_broken_update: str = "report"
    # A dead run (every rank's loss non-finite at 3 optimizer steps in a row:
    # the weights are non-finite, nothing recovers): "report" says it in one
    # loud live line and the nonfinite verdict's evidence; "abort" ends the job
    # (bundles first); "ignore" says nothing more than the nonfinite verdict.
    on_dead_run: str = "report"
    # On a nonfinite verdict, turn on autograd anomaly detection on the origin
    # rank(s) only, so the next occurrence names the operation. Off by default:
    # anomaly mode makes backward raise on the next NaN, which changes the
    # job's exit code; the default captures evidence (bundles) instead.
    anomaly_mode_on_nonfinite: bool = False
    # Bound of the per-step metrics kept in memory and in bundles.
    metrics_window: int = 512
    # Bearer token the collector requires from agents (standalone service).
    token: Optional[str] = None
    # Bind address and port of the embedded collector and metrics endpoint.
    bind: str = "127.0.0.1"
    # Grafana to annotate with every verdict (optional).
    grafana_url: Optional[str] = None
    grafana_token: Optional[str] = None
    metrics_port: Optional[int] = None
    # Serve /metrics without the token (a scraper that cannot send it).
    metrics_open: bool = False
    # With a standalone collector, the launcher relays its node's heartbeats
    # (one batched report per node per interval) instead of every rank posting.
    relay: bool = True

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def _coerce(name: str, raw: Any) -> Any:
    field = {f.name: f for f in dataclasses.fields(Config)}[name]
    default = field.default
    if raw is None:
        return None
    tp = field.type if isinstance(field.type, str) else str(field.type)
    try:
        if "bool" in tp:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if "float" in tp:
            if isinstance(raw, str) and raw.strip().lower() in ("", "auto", "adaptive", "none"):
                return None
            return float(raw)
        if "int" in tp:
            if isinstance(raw, str) and raw.strip().lower() in ("", "none") and default is None:
                return None
            return int(raw)
        return str(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: cannot use {raw!r} ({tp})") from None


def load(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    file: str | os.PathLike | None = None,
) -> Config:
    env = os.environ if env is None else env
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    values: dict[str, Any] = {}
    file = file or flags.get("config") or env.get(ENV_PREFIX + "CONFIG")
    if file:
        values.update(_read_yaml(Path(file)))
    for key in Config.keys():
        env_value = env.get(ENV_PREFIX + key.upper())
        if env_value is not None:
            values[key] = env_value
    for key, value in flags.items():
        if key in Config.keys():
            values[key] = value
    config = Config(**{k: _coerce(k, v) for k, v in values.items()})
    validate(config)
    return config


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of keys to values")
    data = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - set(Config.keys()))
    if unknown:
        raise ConfigError(f"config file {path}: unknown keys {unknown}; known: {Config.keys()}")
    return data


def validate(config: Config) -> None:
    if config.on_hang not in ("abort", "wait"):
        raise ConfigError(f"on_hang must be 'abort' or 'wait', not {config.on_hang!r}")
    for key in Config.keys():
        if key.startswith("on_") and key != "on_hang" and getattr(config, key) not in ACTIONS:
            raise ConfigError(f"{key} must be one of {ACTIONS}, not {getattr(config, key)!r}")
    if config.hang_timeout is not None and config.hang_timeout <= 0:
        raise ConfigError("hang_timeout must be positive seconds")
    if config.hang_abort_timeout is not None and config.hang_abort_timeout <= 0:
        raise ConfigError("hang_abort_timeout must be positive seconds")
    if config.heartbeat_interval <= 0:
        raise ConfigError("heartbeat_interval must be positive seconds")


def ignored_kinds(config: Config) -> frozenset[str]:
    """Verdict kinds the user silenced with ``on_<kind>: ignore``."""
    return frozenset(key[3:] for key in Config.keys()
                     if key.startswith("on_") and getattr(config, key) == "ignore")


def to_env(config: Config) -> dict[str, str]:
    """The environment that hands this configuration to the workers."""
    out = {}
    for key in Config.keys():
        value = getattr(config, key)
        if value is not None:
            out[ENV_PREFIX + key.upper()] = str(value)
    return out
