"""The wire and on-disk formats shared by the agent, the launcher and the collector.

Every message is a typed, versioned dataclass. Messages cross process and
network boundaries as JSON only; `decode` validates untrusted input field by
field (types, sizes) and never evaluates or unpickles anything.

Versioning: each top-level message carries ``version``. A reader accepts its
own major version and ignores unknown fields, so an older collector keeps
working with a newer agent that adds fields.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

WIRE_VERSION = 1
REPORT_SCHEMA = "rankwatch.report/v1"
BUNDLE_SCHEMA = "rankwatch.bundle/v1"

# Bounds on untrusted input (a collector may face thousands of ranks).
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_BUNDLE_BYTES = 64 * 1024 * 1024
MAX_BUNDLE_MEMBER_BYTES = 32 * 1024 * 1024
MAX_LIST_ITEMS = 10_000
MAX_STRING_CHARS = 64 * 1024

VERDICT_KINDS = (
    "hang",
    "collective_mismatch",
    "crash",
    "nonfinite",
    "grad_spike",
    "weight_divergence",
    "straggler",
    "oom",
    "memory_growth",
)


class WireError(ValueError):
    """A message that does not match its format; the text says which field."""


# --------------------------------------------------------------------------
# Rank identity and per-step records
# --------------------------------------------------------------------------


@dataclass
class RankIdentity:
    run_id: str
    rank: int
    local_rank: int
    world_size: int
    node_rank: int = 0
    host: str = ""
    pid: int = 0
    attempt: int = 0


@dataclass
class StepRecord:
    """One completed optimizer step on one rank (times are unix seconds)."""

    step: int  # 0-based index of the step that just completed
    started_at: float
    ended_at: float
    forwards: int = 0  # forward passes during the step (gradient accumulation)
    # Time the rank spent on its own work (data + forward + backward up to the
    # moment it had to wait for peers); None when it could not be measured.
    compute_s: Optional[float] = None
    data_s: Optional[float] = None
    loss: Optional[float] = None
    grad_norm: Optional[float] = None  # local, before the allreduce
    nonfinite_grads: int = 0
    grad_check_stride: int = 1  # local gradients checked every N steps (cost budget)
    rss_bytes: Optional[int] = None
    device_allocated_bytes: Optional[int] = None
    device_reserved_bytes: Optional[int] = None
    device_peak_bytes: Optional[int] = None


@dataclass
class CollectiveMark:
    """Per process group, the last enqueued collective sequence number at the
    end of optimizer step ``step``. Ranks of one group must agree."""

    step: int
    seqs: dict[str, int] = field(default_factory=dict)


@dataclass
class Event:
    """Something that happened on a rank (exception, exit, non-finite, ...)."""

    kind: str
    at: float
    step: Optional[int] = None
    details: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------
# Agent -> collector
# --------------------------------------------------------------------------


@dataclass
class Heartbeat:
    identity: RankIdentity
    sent_at: float
    seq: int = 0
    step: int = 0  # optimizer steps completed so far
    forwards: int = 0  # forward passes so far (progress during eval loops too)
    phase: str = "startup"
    phase_since: float = 0.0
    last_progress_at: float = 0.0
    # pg id -> last enqueued / completed collective sequence number (Flight Recorder)
    collectives_enqueued: dict[str, int] = field(default_factory=dict)
    collectives_completed: dict[str, int] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    marks: list[CollectiveMark] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    fingerprints: list[dict[str, Any]] = field(default_factory=list)
    # MemTotal / MemAvailable / CgroupLimit / RSS, bytes (host OOM evidence)
    host_memory: dict[str, int] = field(default_factory=dict)
    version: int = WIRE_VERSION


@dataclass
class WorkerStatus:
    local_rank: int
    rank: int
    pid: int
    alive: bool = True
    exit_code: Optional[int] = None  # negative: killed by that signal
    exited_at: Optional[float] = None


@dataclass
class NodeHeartbeat:
    """The launcher's node supervisor, watching its local ranks from outside."""

    run_id: str
    host: str
    node_rank: int
    world_size: int
    sent_at: float
    hang_timeout: Optional[float] = None  # None: adaptive
    on_hang: str = "abort"
    workers: list[WorkerStatus] = field(default_factory=list)
    finished: bool = False
    launcher_pid: int = 0  # several launchers may share a host (and not know their node rank)
    version: int = WIRE_VERSION


@dataclass
class Command:
    """Collector -> agent or supervisor, carried in a heartbeat's reply."""

    kind: str  # "dump" (agent: send a bundle), "capture" (supervisor: stacks from outside), "abort"
    incident: str = ""
    reason: str = ""
    ranks: list[int] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Reply:
    commands: list[Command] = field(default_factory=list)
    version: int = WIRE_VERSION


@dataclass
class ExitRecord:
    exit_code: int
    exited_at: float


@dataclass
class FinishRequest:
    """Launcher -> collector: the job is over; what torchrun saw of the exits."""

    interrupted: bool = False
    exits: dict[str, ExitRecord] = field(default_factory=dict)
    version: int = WIRE_VERSION


# --------------------------------------------------------------------------
# Diagnostic bundle (one archive per rank per incident)
# --------------------------------------------------------------------------


@dataclass
class BundleManifest:
    run_id: str
    rank: int
    local_rank: int
    world_size: int
    host: str
    pid: int
    step: Optional[int]
    created_at: float
    reason: str  # hang | crash | exit | request | collective_mismatch | oom | ...
    incident: str = ""
    source: str = "agent"  # "agent" (inside the rank) or "supervisor" (from outside)
    torch_version: str = ""
    rankwatch_version: str = ""
    python_version: str = ""
    node_rank: int = 0
    attempt: int = 0
    members: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    schema: str = BUNDLE_SCHEMA
    version: int = WIRE_VERSION


# --------------------------------------------------------------------------
# Verdicts and the report (the public contract, CONTRACT.md)
# --------------------------------------------------------------------------


@dataclass
class Verdict:
    kind: str
    ranks: list[int]
    step: Optional[int]
    first_seen_at: str
    detected_at: str
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass
class Report:
    run_id: str
    world_size: int
    status: str
    verdicts: list[Verdict] = field(default_factory=list)
    schema: str = REPORT_SCHEMA
    # Observations that are not faults (added to the contract, not changing it):
    # parameters without gradients, always-zero gradients.
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------
# Encoding and validating decoding
# --------------------------------------------------------------------------


def to_dict(obj: Any) -> Any:
    return dataclasses.asdict(obj)


def dumps(obj: Any) -> bytes:
    return json.dumps(to_dict(obj), separators=(",", ":"), default=str).encode()


def loads(cls: type, raw: bytes | str, limit: int = MAX_MESSAGE_BYTES):
    if len(raw) > limit:
        raise WireError(f"{cls.__name__}: message of {len(raw)} bytes exceeds the {limit}-byte limit")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"{cls.__name__}: not valid JSON ({exc})") from None
    return decode(cls, data)


def decode(cls: type, data: Any, path: str = ""):
    """Build dataclass ``cls`` from untrusted JSON data, checking every field."""
    return _decoder(cls)(data, path or cls.__name__)


# One decoder function per type, built once: the collector decodes thousands
# of heartbeats a second, so the type inspection must not run per message.
_DECODERS: dict[Any, Any] = {}


def _decoder(tp: Any):
    fn = _DECODERS.get(tp)
    if fn is None:
        fn = _DECODERS[tp] = _build_decoder(tp)
    return fn


def _build_decoder(tp: Any):
    origin = typing.get_origin(tp)
    if tp is Any:
        return _bounded_json
    if origin in (typing.Union, types.UnionType):
        options = [_decoder(a) for a in typing.get_args(tp) if a is not type(None)]
        nullable = type(None) in typing.get_args(tp)

        def union(value, path):
            if value is None and nullable:
                return None
            errors = []
            for option in options:
                try:
                    return option(value, path)
                except WireError as exc:
                    errors.append(str(exc))
            raise WireError("; ".join(errors) or f"{path}: unexpected null")

        return union
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = [(f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                  for f in dataclasses.fields(tp)]

        def record(value, path):
            if not isinstance(value, dict):
                raise WireError(f"{path}: expected an object, got {type(value).__name__}")
            version = value.get("version")
            if version is not None and (not isinstance(version, int) or version > WIRE_VERSION):
                raise WireError(f"{path}: unsupported version {version!r} (this reader knows {WIRE_VERSION})")
            kwargs = {}
            for name, required in fields:
                if name in value:
                    kwargs[name] = _decoder(hints[name])(value[name], f"{path}.{name}")
                elif required:
                    raise WireError(f"{path}: missing field {name!r}")
            return tp(**kwargs)

        return record
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        item = _decoder(item_tp)

        def as_list(value, path):
            if not isinstance(value, list):
                raise WireError(f"{path}: expected a list, got {type(value).__name__}")
            if len(value) > MAX_LIST_ITEMS:
                raise WireError(f"{path}: {len(value)} items exceed the limit of {MAX_LIST_ITEMS}")
            return [item(v, path) for v in value]

        return as_list
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        key, val = _decoder(key_tp), _decoder(val_tp)

        def as_dict(value, path):
            if not isinstance(value, dict):
                raise WireError(f"{path}: expected an object, got {type(value).__name__}")
            if len(value) > MAX_LIST_ITEMS:
                raise WireError(f"{path}: {len(value)} keys exceed the limit of {MAX_LIST_ITEMS}")
            return {key(k, f"{path}.<key>"): val(v, f"{path}[{k!r}]") for k, v in value.items()}

        return as_dict
    if tp is bool:
        def as_bool(value, path):
            if not isinstance(value, bool):
                raise WireError(f"{path}: expected true/false, got {value!r:.40}")
            return value
        return as_bool
    if tp is int:
        def as_int(value, path):
            if isinstance(value, bool) or not isinstance(value, int):
                raise WireError(f"{path}: expected an integer, got {value!r:.40}")
            return value
        return as_int
    if tp is float:
        def as_float(value, path):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise WireError(f"{path}: expected a number, got {value!r:.40}")
            return float(value)
        return as_float
    if tp is str:
        def as_str(value, path):
            if not isinstance(value, str):
                raise WireError(f"{path}: expected a string, got {type(value).__name__}")
            if len(value) > MAX_STRING_CHARS:
                raise WireError(f"{path}: string of {len(value)} characters exceeds {MAX_STRING_CHARS}")
            return value
        return as_str
    raise WireError(f"unsupported type {tp!r}")


def _bounded_json(value: Any, path: str, depth: int = 0) -> Any:
    """Free-form JSON (evidence, details): bounded depth, length and size."""
    if depth > 16:
        raise WireError(f"{path}: nested too deeply")
    if isinstance(value, dict):
        if len(value) > MAX_LIST_ITEMS:
            raise WireError(f"{path}: too many keys")
        return {str(k): _bounded_json(v, f"{path}.{k}", depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        if len(value) > MAX_LIST_ITEMS:
            raise WireError(f"{path}: too many items")
        return [_bounded_json(v, path, depth + 1) for v in value]
    if isinstance(value, str) and len(value) > MAX_STRING_CHARS:
        raise WireError(f"{path}: string too long")
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise WireError(f"{path}: unsupported value {type(value).__name__}")
