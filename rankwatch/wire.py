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
import math
import re
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
    # Silent errors: the job runs to the end but trains wrong (CONTRACT "Additions (2026-11-23)").
    "config_divergence",
    "duplicate_data",
    "broken_update",
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


@dataclass(slots=True)  # one object a record, no __dict__: a big job's windows hold millions
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
    # Silent-error digests (agent/checks/batch_fingerprints.py, agent/checks/train_config.py):
    # a 52-bit hash of a few sampled elements of the step's input batches, a
    # 52-bit hash of every optimizer's per-group hyper-parameters, and the
    # lead optimizer's first learning rate. Never the data itself.
    batch_fp: Optional[int] = None
    optim_fp: Optional[int] = None
    lr: Optional[float] = None

    def nonfinite(self) -> bool:
        """Its local gradients or its loss are not finite (NaN/Inf: the
        signal). ``x - x`` is 0.0 for a finite number, nan otherwise."""
        loss = self.loss
        return bool(self.nonfinite_grads) or (loss is not None and loss - loss != 0.0)


@dataclass(slots=True)
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


@dataclass(slots=True)  # no __dict__: ~10,000 a second arrive at a big collector
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
    # Compact step records (added; older agents send `steps`): one row per
    # record, values in the order of `step_columns` (names of StepRecord
    # fields; unknown ones ignored). The collector turns each row into a
    # StepRecord through the same validating decoder.
    step_columns: list[str] = field(default_factory=list)
    step_rows: list[list[Any]] = field(default_factory=list)
    # Step records this beat left out (high step rates: every 2^k-th kept).
    steps_skipped: int = 0
    # While the rank has made no progress for a while (a stall): what its
    # process did, cumulative since it started, rankwatch's own threads left
    # out: CPU seconds of its threads and child processes, and bytes its
    # threads read and wrote through files (/proc rchar + wchar). The
    # collector tells a rank that works (an upload, an evaluation) from one
    # that is stuck by these (collector/stuck.py). None: not sampled.
    busy_cpu_s: Optional[float] = None
    io_bytes: Optional[int] = None
    wakeups: Optional[int] = None  # context switches of those threads (a thread waiting on a socket wakes)


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
class NodeReport:
    """The per-node relay (in `rankwatch run`) -> collector, one per node per
    interval (`POST /v1/node-report`): the supervisor's view and the node's
    ranks' heartbeats since the last report, in one request."""

    node: Optional[NodeHeartbeat] = None
    heartbeats: list[Heartbeat] = field(default_factory=list)
    version: int = WIRE_VERSION
    sent_at: float = 0.0  # the node's clock


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
    # One line per verdict the collector has issued for the run (newest
    # MAX_ANNOUNCED): a launcher behind a standalone collector prints them as
    # they happen, like the embedded collector's log line.
    verdicts: list[str] = field(default_factory=list)


@dataclass
class NodeReply:
    """Answer to a NodeReport: the node's commands and each rank's."""

    commands: list[Command] = field(default_factory=list)
    ranks: dict[str, list[Command]] = field(default_factory=dict)  # str(rank) -> commands
    version: int = WIRE_VERSION
    verdicts: list[str] = field(default_factory=list)  # as Reply.verdicts
    # Seconds between the node's reports the collector asks for (slower at scale).
    interval: Optional[float] = None
    # Step records the relay forwards at scale: every `step_stride`-th step of
    # each rank (the same steps on every rank) and every unusual one (a
    # non-finite value, a jump of the gradient norm). None or 1: every step.
    # Its collective marks and fingerprints alike: every `step_stride`-th of
    # each (the same on every rank), and every fingerprint with a non-finite
    # norm or of a moment of its own ("at").
    step_stride: Optional[int] = None


# Column order the agent uses for `Heartbeat.step_rows` (any order is
# accepted: the columns travel with the rows).
STEP_COLUMNS = ("step", "started_at", "ended_at", "forwards", "compute_s", "data_s", "loss", "grad_norm",
                "nonfinite_grads", "grad_check_stride", "rss_bytes", "device_allocated_bytes",
                "device_reserved_bytes", "device_peak_bytes", "batch_fp", "optim_fp", "lr")


def step_records(hb: Heartbeat) -> list[StepRecord]:
    """Every step record a heartbeat carries (`steps` and `step_rows`), each
    validated as a StepRecord."""
    if not hb.step_rows:
        return hb.steps
    columns = hb.step_columns
    if len(set(columns)) != len(columns):
        raise WireError("Heartbeat.step_columns: repeated column")
    decode_record = _decoder(StepRecord)
    out = list(hb.steps)
    for i, row in enumerate(hb.step_rows):
        if len(row) != len(columns):
            raise WireError(f"Heartbeat.step_rows[{i}]: {len(row)} values for {len(columns)} columns")
        out.append(decode_record(dict(zip(columns, row)), f"Heartbeat.step_rows[{i}]"))
    return out


@dataclass
class ExitRecord:
    exit_code: int
    exited_at: float


@dataclass
class Termination:
    """How something outside the job ended it (CONTRACT additions 2026-11-25):
    a scheduler (Slurm's scancel, time limit, preemption) or a signal from
    elsewhere. Not a verdict: it names no culprit."""

    by: str  # "scheduler" | "signal"
    reason: str  # "cancelled" | "time_limit" | "preempted" | "unknown"
    signal: str  # "SIGTERM", "SIGUSR1", ...
    at: str  # ISO-8601 UTC: when the launcher first saw it
    source: str  # "SLURM_JOB_ID 4242 (scontrol: JobState=CANCELLED)", "a signal to the launcher (pid 77)"


TERMINATION_BY = ("scheduler", "signal")
TERMINATION_REASONS = ("cancelled", "time_limit", "preempted", "unknown")


@dataclass
class FinishRequest:
    """Launcher -> collector: the job is over; what torchrun saw of the exits."""

    interrupted: bool = False
    exits: dict[str, ExitRecord] = field(default_factory=dict)
    version: int = WIRE_VERSION
    termination: Optional[Termination] = None  # newer launchers: how an outside ending came


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
    # Unique within a report, the same live and offline (kind, step, culprits):
    # what a consequence's "cause" points at (contract additions, project 2026-11-24).
    id: str = ""


def verdict_id(kind: str, step: Optional[int], ranks: list[int]) -> str:
    shown = "-".join(str(r) for r in ranks[:4]) + ("-etc" if len(ranks) > 4 else "")
    return f"{kind}@{'none' if step is None else step}:r{shown or 'none'}"


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
    # Per check (analysis), how close its statistic came to firing at its worst
    # moment: {"margin": 0..1 (1.0 = fired), "step", "rank", "graded"}; added to
    # the contract (docs/contract.md, project section).
    margins: dict[str, dict[str, Any]] = field(default_factory=dict)
    # null when the job ended by itself; how something outside ended it otherwise.
    termination: Optional[Termination] = None


# --------------------------------------------------------------------------
# The trust boundary: limits of untrusted input (SECURITY.md lists them)
# --------------------------------------------------------------------------

MAX_WORLD_SIZE = 1_000_000
MAX_PID = 2**31 - 1
MAX_COUNT = 2**53  # steps, forwards, sequence numbers: exact in any JSON reader's double
MAX_INT = 2**63 - 1  # every integer fits SQLite's INTEGER
MAX_TIME = 1e11  # unix seconds (year 5138): a timestamp beyond is garbage
MAX_DURATION = 1e9
MAX_EXIT_CODE = 255  # negative down to -255: killed by that signal
MAX_ID_CHARS = 128
MAX_HOST_CHARS = 255
MAX_TOKEN_CHARS = 64  # kinds, phases, reasons
# JSON text, checked *before* it is parsed (json.loads recurses: 100k nested
# brackets would be a RecursionError, millions of tiny objects gigabytes).
MAX_JSON_DEPTH = 32
MAX_JSON_CONTAINERS = 200_000
MAX_JSON_VALUES = 1_000_000
MAX_FREEFORM_DEPTH = 16  # details, evidence: free-form JSON inside a message

# Run ids and incident ids become directory names: a strict pattern, never
# "." or ".." (no leading dot at all), no separators.
ID_PATTERN = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")
_TOKEN = re.compile(r"^[A-Za-z0-9_.:-]{0,64}$")
_SURROGATE = re.compile(r"[\ud800-\udfff]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_UNSAFE_TEXT = re.compile(r"[\ud800-\udfff\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")

# Non-finite numbers are written as these strings (strict JSON has no NaN or
# Infinity); readers map them back where a field allows non-finite values.
NONFINITE_STRINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def valid_id(value: Any) -> bool:
    return isinstance(value, str) and bool(ID_PATTERN.match(value))


def valid_token(value: Any) -> bool:
    """A short identifier-like text (kinds, phases, reasons): no spaces, no control characters."""
    return isinstance(value, str) and bool(_TOKEN.match(value))


def check_id(value: str, what: str = "id") -> str:
    if not valid_id(value):
        raise WireError(f"invalid {what} {value!r:.80} (letters, digits, '_', '-', '.', "
                        f"at most {MAX_ID_CHARS}, no leading dot)")
    return value


def number(value: Any) -> Optional[float]:
    """A float from JSON that may carry a non-finite value as a string; None if not a number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return NONFINITE_STRINGS.get(value)
    return None


def all_finite(values: list) -> bool:
    """Every value a finite number: False for a non-finite one (sent as a
    string, "NaN"), anything not a number, or an integer past a float's range."""
    try:
        return all(map(math.isfinite, values))
    except (TypeError, OverflowError):
        return False


# --------------------------------------------------------------------------
# Encoding: strict JSON only
# --------------------------------------------------------------------------


def to_dict(obj: Any) -> Any:
    return dataclasses.asdict(obj)


def _nonfinite_text(x: float) -> str:
    return "NaN" if x != x else ("Infinity" if x > 0 else "-Infinity")


def json_safe(obj: Any, _depth: int = 0) -> Any:
    """``obj`` with every non-finite float replaced by its string (see
    NONFINITE_STRINGS); dataclasses become dicts."""
    if _depth > 200:
        raise ValueError("structure nested too deeply to encode")
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else _nonfinite_text(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v, _depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v, _depth + 1) for v in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return json_safe(dataclasses.asdict(obj), _depth + 1)
    return obj


def json_text(obj: Any, indent: Optional[int] = None, compact: bool = False) -> str:
    """The one JSON encoder of rankwatch: strict JSON (``allow_nan=False``),
    non-finite numbers as the strings "NaN", "Infinity", "-Infinity"."""
    separators = (",", ":") if compact else None
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    try:
        return json.dumps(obj, allow_nan=False, default=str, indent=indent, separators=separators)
    except ValueError:  # a non-finite float somewhere: the slow path
        return json.dumps(json_safe(obj), allow_nan=False, default=str, indent=indent, separators=separators)


def dumps(obj: Any) -> bytes:
    return json_text(to_dict(obj), compact=True).encode()


# --------------------------------------------------------------------------
# Decoding: bounded JSON text, then typed, range-checked fields
# --------------------------------------------------------------------------

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


_STRING_REST = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # the end of a string begun earlier
_SCAN_CHUNK = 1 << 20


def check_json_text(raw: bytes | str, what: str, max_depth: int = MAX_JSON_DEPTH,
                    max_containers: int = MAX_JSON_CONTAINERS, max_values: int = MAX_JSON_VALUES) -> tuple[int, int]:
    """Bound the nesting depth and the number of objects of a JSON text
    without parsing it (no recursion, linear time, memory bounded by one
    chunk): strings are blanked out chunk by chunk, then brackets and commas
    are counted. Returns (objects and arrays, values)."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    containers = values = depth = deepest = 0
    in_string = False
    pos, size = 0, len(raw)
    while pos < size:
        end = min(size, pos + _SCAN_CHUNK)
        while end < size and raw[end - 1] == 0x5C:  # never cut an escape (backslash) in two
            end += 1
        chunk = raw[pos:end]
        pos = end
        if in_string:
            rest = _STRING_REST.match(chunk)
            if rest is None:
                continue  # the whole chunk is inside one string
            chunk = chunk[rest.end():]
            in_string = False
        # Complete strings become one NUL byte (never valid outside a string);
        # a quote left over opens a string that goes on in the next chunk.
        stripped = _JSON_STRING.sub(b"\0", chunk)
        opened = stripped.find(b'"')
        if opened >= 0:
            stripped, in_string = stripped[:opened], True
        containers += stripped.count(b"{") + stripped.count(b"[")
        if containers > max_containers:
            raise WireError(f"{what}: JSON objects/arrays exceed the limit of {max_containers}")
        values += stripped.count(b",")
        if containers + values > max_values:
            raise WireError(f"{what}: JSON values exceed the limit of {max_values}")
        for c in stripped.translate(None, _NOT_BRACKETS):
            if c == 91 or c == 123:  # [ {
                depth += 1
                if depth > deepest:
                    deepest = depth
                    if deepest > max_depth:
                        raise WireError(f"{what}: JSON nested deeper than {max_depth} levels")
            else:
                depth -= 1
    return containers, containers + values


def parse_json(raw: bytes | str, what: str, limit: int = MAX_MESSAGE_BYTES, max_depth: int = MAX_JSON_DEPTH,
               max_containers: int = MAX_JSON_CONTAINERS, max_values: int = MAX_JSON_VALUES) -> Any:
    """Untrusted JSON text -> Python data, bounded in size, depth and object count."""
    if len(raw) > limit:
        raise WireError(f"{what}: {len(raw)} bytes exceed the {limit}-byte limit")
    check_json_text(raw, what, max_depth, max_containers, max_values)
    try:
        return json.loads(raw)
    except RecursionError:  # defence in depth: check_json_text bounds the depth already
        raise WireError(f"{what}: JSON nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"{what}: not valid JSON ({str(exc)[:200]})") from None


def loads(cls: type, raw: bytes | str, limit: int = MAX_MESSAGE_BYTES):
    return decode(cls, parse_json(raw, cls.__name__, limit))


def decode(cls: type, data: Any, path: str = ""):
    """Build dataclass ``cls`` from untrusted JSON data, checking every field:
    types, ranges, finiteness, string content, sizes."""
    try:
        return _decoder(cls)(data, path or cls.__name__)
    except RecursionError:
        raise WireError(f"{path or cls.__name__}: nested too deeply") from None


# One decoder function per type, built once: the collector decodes thousands
# of heartbeats a second, so the type inspection must not run per message.
_DECODERS: dict[Any, Any] = {}


def _decoder(tp: Any):
    fn = _DECODERS.get(tp)
    if fn is None:
        fn = _DECODERS[tp] = _build_decoder(tp)
    return fn


# -- value rules: applied to a field after its type is checked --------------


def _int_range(lo: int, hi: int):
    def check(value, path):
        if value is not None and not lo <= value <= hi:
            raise WireError(f"{path}: {value} is outside {lo}..{hi}")
        return value
    return check


def _float_range(lo: float, hi: float):
    def check(value, path):
        if value is not None and not lo <= value <= hi:
            raise WireError(f"{path}: {value:.6g} is outside {lo:g}..{hi:g}")
        return value
    return check


def _one_of(*choices: str):
    def check(value, path):
        if value not in choices:
            raise WireError(f"{path}: {value!r:.40} is not one of {', '.join(choices)}")
        return value
    return check


def _id_or_empty(value, path):
    if value and not ID_PATTERN.match(value):
        what = "run id" if path.endswith("run_id") else "incident id" if path.endswith("incident") else "id"
        raise WireError(f"{path}: invalid {what} {value!r:.80} (letters, digits, '_', '-', '.', at most "
                        f"{MAX_ID_CHARS}, no leading dot)")
    return value


def _id(value, path):
    if not value:
        raise WireError(f"{path}: empty id")
    return _id_or_empty(value, path)


def _token(value, path):
    if not _TOKEN.match(value):
        raise WireError(f"{path}: {value!r:.80} is not a plain name (letters, digits, '_', '.', ':', '-', "
                        f"at most {MAX_TOKEN_CHARS})")
    return value


def _host(value, path):
    if _SURROGATE.search(value) or len(value) > MAX_HOST_CHARS or _CONTROL.search(value) or value.strip() != value:
        raise WireError(f"{path}: {value!r:.80} is not a host name (no control characters or surrounding blanks, "
                        f"at most {MAX_HOST_CHARS})")
    return value


def _short_text(value, path):
    if len(value) > 256 or _CONTROL.search(value):
        raise WireError(f"{path}: {value!r:.80} must be one line of at most 256 characters")
    return value


def _each(rule):
    def check(value, path):
        if isinstance(value, dict):
            for k, v in value.items():
                rule(v, f"{path}[{k!r:.40}]")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                rule(v, f"{path}[{i}]")
        return value
    return check


def _keys(rule):
    def check(value, path):
        for k in value:
            rule(k, f"{path}.<key {k!r:.40}>")
        return value
    return check


def _both(*rules):
    def check(value, path):
        for rule in rules:
            value = rule(value, path)
        return value
    return check


def _rank_key(value, path):
    if not (value.isdigit() and len(value) <= 7 and int(value) < MAX_WORLD_SIZE):
        raise WireError(f"{path}: {value!r:.40} is not a rank")
    return value


def checksums_ok(sums, count: int) -> bool:
    """A fingerprint's `sums`: one unsigned 32-bit checksum per norm (both roads use this)."""
    return type(sums) is list and len(sums) == count and all(type(v) is int and 0 <= v <= 0xFFFFFFFF for v in sums)


def fingerprint_model(fingerprint: dict) -> int:
    """Which of a rank's fingerprinted models a print is of (a GAN's generator
    and discriminator): its `model`, 0 when the agent leaves it out or sends
    something else (the relay, ingest and the analyses read it alike)."""
    model = fingerprint.get("model", 0)
    return model if type(model) is int else 0


def _fingerprints(value, path):
    """Parameter fingerprints (free-form in the dataclass): step, names, norms,
    and optionally one bit checksum per norm (`sums`, agent/checks/fingerprints.py)."""
    for i, fp in enumerate(value):
        where = f"{path}[{i}]"
        step = fp.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_COUNT:
            raise WireError(f"{where}.step: expected a step number, got {step!r:.40}")
        names, norms = fp.get("names", []), fp.get("norms")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise WireError(f"{where}.names: expected a list of names")
        if not isinstance(norms, list):
            raise WireError(f"{where}.norms: expected a list of numbers")
        floats = [number(v) for v in norms]
        if any(f is None for f in floats):
            raise WireError(f"{where}.norms: expected a list of numbers")
        if names and len(names) != len(norms):
            raise WireError(f"{where}: {len(names)} names for {len(norms)} norms")
        sums = fp.get("sums")
        if sums is not None and not checksums_ok(sums, len(norms)):
            raise WireError(f"{where}.sums: expected one 32-bit checksum per norm")
        fp["norms"] = floats  # "NaN" strings back to floats: the analysis compares them
    return value


_rank = _int_range(0, MAX_WORLD_SIZE - 1)
_count = _int_range(0, MAX_COUNT)
_seq = _int_range(-1, MAX_INT)
_bytes = _int_range(0, MAX_INT)
_time = _float_range(0.0, MAX_TIME)
_duration = _float_range(0.0, MAX_DURATION)
_exit_code = _int_range(-MAX_EXIT_CODE, MAX_EXIT_CODE)
_pid_or_unknown = _int_range(0, MAX_PID)

# "Class.field" -> rule. Fields not listed get the type checks only (64-bit
# integers, finite floats, strings without lone surrogates, bounded sizes).
_RULES: dict[str, Any] = {
    "RankIdentity.run_id": _id, "RankIdentity.rank": _rank, "RankIdentity.local_rank": _rank,
    "RankIdentity.world_size": _int_range(1, MAX_WORLD_SIZE), "RankIdentity.node_rank": _rank,
    "RankIdentity.host": _host, "RankIdentity.pid": _pid_or_unknown, "RankIdentity.attempt": _count,
    "StepRecord.step": _count, "StepRecord.started_at": _time, "StepRecord.ended_at": _time,
    "StepRecord.forwards": _count, "StepRecord.compute_s": _duration, "StepRecord.data_s": _duration,
    "StepRecord.nonfinite_grads": _count, "StepRecord.grad_check_stride": _count,
    "StepRecord.rss_bytes": _bytes, "StepRecord.device_allocated_bytes": _bytes,
    "StepRecord.device_reserved_bytes": _bytes, "StepRecord.device_peak_bytes": _bytes,
    "StepRecord.batch_fp": _count, "StepRecord.optim_fp": _count, "StepRecord.lr": _float_range(0.0, 1e12),
    "CollectiveMark.step": _count, "CollectiveMark.seqs": _each(_seq),
    "Event.kind": _token, "Event.at": _time, "Event.step": _int_range(-1, MAX_COUNT),
    "Heartbeat.sent_at": _time, "Heartbeat.seq": _count, "Heartbeat.step": _count, "Heartbeat.forwards": _count,
    "Heartbeat.phase": _token, "Heartbeat.phase_since": _time, "Heartbeat.last_progress_at": _time,
    "Heartbeat.collectives_enqueued": _both(_keys(_short_text), _each(_seq)),
    "Heartbeat.collectives_completed": _both(_keys(_short_text), _each(_seq)),
    "Heartbeat.host_memory": _both(_keys(_token), _each(_bytes)),
    "Heartbeat.fingerprints": _fingerprints, "Heartbeat.steps_skipped": _count,
    "Heartbeat.busy_cpu_s": _float_range(0.0, MAX_TIME), "Heartbeat.io_bytes": _int_range(0, MAX_INT),
    "Heartbeat.wakeups": _int_range(0, MAX_INT),
    "Heartbeat.step_columns": _each(_token),
    "WorkerStatus.local_rank": _rank, "WorkerStatus.rank": _rank, "WorkerStatus.pid": _int_range(1, MAX_PID),
    "WorkerStatus.exit_code": _exit_code, "WorkerStatus.exited_at": _time,
    "NodeHeartbeat.run_id": _id, "NodeHeartbeat.host": _host, "NodeHeartbeat.node_rank": _rank,
    "NodeHeartbeat.world_size": _int_range(0, MAX_WORLD_SIZE),  # 0: not known yet (the launcher's supervisor)
    "NodeHeartbeat.sent_at": _time, "NodeHeartbeat.hang_timeout": _float_range(1e-3, MAX_DURATION),
    "NodeHeartbeat.on_hang": _one_of("abort", "wait"), "NodeHeartbeat.launcher_pid": _pid_or_unknown,
    "Command.kind": _token, "Command.incident": _id_or_empty, "Command.ranks": _each(_rank),
    "ExitRecord.exit_code": _exit_code, "ExitRecord.exited_at": _time,
    "FinishRequest.exits": _keys(_rank_key),
    "Termination.by": _one_of(*TERMINATION_BY), "Termination.reason": _one_of(*TERMINATION_REASONS),
    "Termination.signal": _token, "Termination.at": _short_text, "Termination.source": _short_text,
    "BundleManifest.run_id": _id, "BundleManifest.rank": _rank, "BundleManifest.local_rank": _rank,
    "BundleManifest.world_size": _int_range(1, MAX_WORLD_SIZE), "BundleManifest.host": _host,
    "BundleManifest.pid": _pid_or_unknown, "BundleManifest.step": _count, "BundleManifest.created_at": _time,
    "BundleManifest.reason": _token, "BundleManifest.incident": _id_or_empty,
    "BundleManifest.source": _one_of("agent", "supervisor"), "BundleManifest.torch_version": _short_text,
    "BundleManifest.rankwatch_version": _short_text, "BundleManifest.python_version": _short_text,
    "BundleManifest.node_rank": _rank, "BundleManifest.attempt": _count,
    "Verdict.ranks": _each(_rank), "Report.world_size": _int_range(0, MAX_WORLD_SIZE),
    "NodeReply.step_stride": _int_range(1, 1024),
    "Reply.verdicts": _each(_short_text), "NodeReply.verdicts": _each(_short_text),
}

# Float fields whose non-finite values are the signal (a NaN loss): kept.
# Other optional floats map a non-finite value to None; required ones refuse it.
_NONFINITE_KEPT = {"StepRecord.loss", "StepRecord.grad_norm"}


def _rank_in_world(obj, path):
    for name in ("rank", "local_rank", "node_rank"):
        value = getattr(obj, name)
        if value >= obj.world_size:
            raise WireError(f"{path}.{name}: {value} is outside the world size {obj.world_size}")


def _workers_in_world(obj, path):
    if obj.world_size:
        for i, worker in enumerate(obj.workers):
            if worker.rank >= obj.world_size:
                raise WireError(f"{path}.workers[{i}].rank: {worker.rank} is outside the world size {obj.world_size}")


# Class name -> check across fields, after every field passed.
_CHECKS: dict[str, Any] = {
    "RankIdentity": _rank_in_world,
    "BundleManifest": lambda m, path: _rank_in_world(m, path) if m.world_size else None,
    "NodeHeartbeat": _workers_in_world,
}


def _float_decoder(nonfinite: str):
    """nonfinite: "keep" (the value is the signal), "none" (maps to None), "refuse"."""
    def as_float(value, path):
        if isinstance(value, bool):
            raise WireError(f"{path}: expected a number, got {value!r:.40}")
        if isinstance(value, (int, float)):
            try:
                value = float(value)
            except OverflowError:
                raise WireError(f"{path}: number out of range") from None
        elif isinstance(value, str) and value in NONFINITE_STRINGS:
            value = NONFINITE_STRINGS[value]
        else:
            raise WireError(f"{path}: expected a number, got {value!r:.40}")
        if not math.isfinite(value):
            if nonfinite == "none":
                return None
            if nonfinite == "refuse":
                raise WireError(f"{path}: {value} is not a finite number")
        return value
    return as_float


def _field_decoder(cls_name: str, name: str, hint: Any):
    key = f"{cls_name}.{name}"
    args = typing.get_args(hint)
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args
    base = [a for a in args if a is not type(None)] if optional else [hint]
    if base == [float]:
        policy = "keep" if key in _NONFINITE_KEPT else ("none" if optional else "refuse")
        inner = _float_decoder(policy)
        decode_one = (lambda v, p: None if v is None else inner(v, p)) if optional else inner
    elif base == [str] and key in _RULES:
        # Ids, hosts, names: refused (not repaired) when not clean text.
        decode_one = (lambda v, p: None if v is None else _strict_str(v, p)) if optional else _strict_str
    else:
        decode_one = _decoder(hint)
    rule = _RULES.get(key)
    if rule is None:
        return decode_one

    def checked(value, path):
        value = decode_one(value, path)
        return value if value is None else rule(value, path)

    return checked


def _build_decoder(tp: Any):
    origin = typing.get_origin(tp)
    if tp is Any:
        return lambda value, path: _bounded_json(value, path)
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
        cls_name = tp.__name__
        cross_check = _CHECKS.get(cls_name)
        field_decoders: dict[str, Any] = {}

        def record(value, path):
            if not isinstance(value, dict):
                raise WireError(f"{path}: expected an object, got {type(value).__name__}")
            version = value.get("version")
            if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                                        or not 0 <= version <= WIRE_VERSION):
                raise WireError(f"{path}: unsupported version {version!r:.40} (this reader knows {WIRE_VERSION})")
            if not field_decoders:  # built on first use: the field types may refer to later classes
                # all or nothing: a field whose type has no decoder must fail every
                # call the same way, not leave a half-built table behind
                field_decoders.update({name: _field_decoder(cls_name, name, hints[name]) for name, _ in fields})
            kwargs = {}
            for name, required in fields:
                if name in value:
                    kwargs[name] = field_decoders[name](value[name], f"{path}.{name}")
                elif required:
                    raise WireError(f"{path}: missing field {name!r}")
            obj = tp(**kwargs)
            if cross_check is not None:
                cross_check(obj, path)
            return obj

        return record
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        item = _decoder(item_tp)

        def as_list(value, path):
            if not isinstance(value, list):
                raise WireError(f"{path}: expected a list, got {type(value).__name__}")
            if len(value) > MAX_LIST_ITEMS:
                raise WireError(f"{path}: {len(value)} items exceed the limit of {MAX_LIST_ITEMS}")
            return [item(v, f"{path}[{i}]") for i, v in enumerate(value)]

        return as_list
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        key, val = _decoder(key_tp), _decoder(val_tp)

        def as_dict(value, path):
            if not isinstance(value, dict):
                raise WireError(f"{path}: expected an object, got {type(value).__name__}")
            if len(value) > MAX_LIST_ITEMS:
                raise WireError(f"{path}: {len(value)} keys exceed the limit of {MAX_LIST_ITEMS}")
            return {key(k, f"{path}.<key>"): val(v, f"{path}[{k!r:.40}]") for k, v in value.items()}

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
            if not -MAX_INT - 1 <= value <= MAX_INT:
                raise WireError(f"{path}: integer out of the 64-bit range")
            return value
        return as_int
    if tp is float:
        return _float_decoder("refuse")
    if tp is str:
        return _check_str
    raise WireError(f"unsupported type {tp!r}")


def _check_str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise WireError(f"{path}: expected a string, got {type(value).__name__}")
    if len(value) > MAX_STRING_CHARS:
        raise WireError(f"{path}: string of {len(value)} characters exceeds {MAX_STRING_CHARS}")
    # Free text (an exception message) is kept, made safe: lone surrogates
    # (not encodable) and control characters other than tab and newline
    # become U+FFFD. Ids, hosts and names are refused instead (their rules).
    if _UNSAFE_TEXT.search(value):
        value = _UNSAFE_TEXT.sub("\ufffd", value)
    return value


def _strict_str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise WireError(f"{path}: expected a string, got {type(value).__name__}")
    if len(value) > MAX_STRING_CHARS:
        raise WireError(f"{path}: string of {len(value)} characters exceeds {MAX_STRING_CHARS}")
    if _UNSAFE_TEXT.search(value):
        raise WireError(f"{path}: {value!r:.80} holds a lone surrogate or a control character")
    return value


def decode_json(value: Any, path: str, max_depth: int = MAX_JSON_DEPTH, max_items: int = MAX_LIST_ITEMS) -> Any:
    """Parsed untrusted JSON made safe to keep: see _bounded_json."""
    return _bounded_json(value, path, 0, max_depth, max_items)


def _bounded_json(value: Any, path: str, depth: int = 0, max_depth: int = MAX_FREEFORM_DEPTH,
                  max_items: int = MAX_LIST_ITEMS) -> Any:
    """Free-form JSON (evidence, details): bounded depth, length and size;
    strings checked like every other string; non-finite numbers become their
    strings (so what is kept is what is stored and reported)."""
    if depth > max_depth:
        raise WireError(f"{path}: nested too deeply")
    if isinstance(value, dict):
        if len(value) > max_items:
            raise WireError(f"{path}: {len(value)} keys exceed the limit of {max_items}")
        return {_check_str(k, f"{path}.<key>"): _bounded_json(v, f"{path}.{k:.40}", depth + 1, max_depth, max_items)
                for k, v in value.items()}
    if isinstance(value, list):
        if len(value) > max_items:
            raise WireError(f"{path}: {len(value)} items exceed the limit of {max_items}")
        return [_bounded_json(v, path, depth + 1, max_depth, max_items) for v in value]
    if isinstance(value, str):
        return _check_str(value, path)
    if isinstance(value, float):
        return value if math.isfinite(value) else _nonfinite_text(value)
    if isinstance(value, int) and not isinstance(value, bool) and not -MAX_INT - 1 <= value <= MAX_INT:
        raise WireError(f"{path}: integer out of the 64-bit range")
    if value is None or isinstance(value, (int, bool)):
        return value
    raise WireError(f"{path}: unsupported value {type(value).__name__}")
