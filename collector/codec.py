"""Fast decoding of the collector's hot messages (heartbeats, node reports).

`rankwatch.wire.loads` checks every field of every message through generic
per-field rules: ~75 us per heartbeat, which caps one collector process near
10,000 ranks. This module decodes the common shape of a heartbeat with
straight-line checks (the same limits, from `wire`'s constants and patterns)
and hands everything else to `wire`'s own decoders:

- accepted here only when every value passes checks at least as strict as
  `wire`'s rules, with the same resulting values;
- anything unusual (a value out of range, a non-finite number, a string where
  a number goes, unknown step columns, events, marks, fingerprints, the older
  `steps` list) goes through `wire`'s decoder, which gives the canonical
  result or error.

So the trust boundary stays `wire`'s; this is only a faster road through it.
"""

from __future__ import annotations

from typing import Any, Optional

from rankwatch import wire

try:  # the collector's extra (pip install 'rankwatch[collector]'); json otherwise
    import msgspec as _msgspec

    _msgspec_decode = _msgspec.json.Decoder().decode
except ImportError:  # pragma: no cover
    _msgspec = None

_STEP_COLUMNS = list(wire.STEP_COLUMNS)
_MAX_TIME = wire.MAX_TIME
_MAX_COUNT = wire.MAX_COUNT
_MAX_INT = wire.MAX_INT
_MAX_DURATION = wire.MAX_DURATION
_MAX_WORLD = wire.MAX_WORLD_SIZE
_ID = wire.ID_PATTERN.match
_TOKEN = wire._TOKEN.match
_HOST_RULE = wire._RULES["RankIdentity.host"]
_HEARTBEAT_FIELDS = {f for f in wire.Heartbeat.__dataclass_fields__}
_IDENTITY_FIELDS = {f for f in wire.RankIdentity.__dataclass_fields__}
_SLOW_LISTS = {
    "steps": wire._decoder(list[wire.StepRecord]),
    "marks": wire._decoder(list[wire.CollectiveMark]),
    "events": wire._decoder(list[wire.Event]),
}
_StepRecord = wire.StepRecord
_Heartbeat = wire.Heartbeat
_RankIdentity = wire.RankIdentity


class _Slow(Exception):
    """Not the common shape: let wire's decoder judge."""


def _count(v: Any) -> int:
    if type(v) is not int or not 0 <= v <= _MAX_COUNT:
        raise _Slow
    return v


def _time(v: Any) -> float:
    t = type(v)
    if (t is not float and t is not int) or not 0.0 <= v <= _MAX_TIME:
        raise _Slow
    return float(v)


def _opt_duration(v: Any):
    if v is None:
        return None
    t = type(v)
    if (t is not float and t is not int) or not 0.0 <= v <= _MAX_DURATION:
        raise _Slow
    return float(v)


def _opt_signal(v: Any):
    """loss, grad_norm: any finite number (non-finite ones take wire's road)."""
    if v is None:
        return None
    t = type(v)
    if (t is not float and t is not int) or not -1e308 <= v <= 1e308:
        raise _Slow
    return float(v)


def _opt_bytes(v: Any) -> Optional[int]:
    if v is None:
        return None
    if type(v) is not int or not 0 <= v <= _MAX_INT:
        raise _Slow
    return v


def _opt_count(v: Any):
    if v is None:
        return None
    if type(v) is not int or not 0 <= v <= _MAX_COUNT:
        raise _Slow
    return v


def _opt_rate(v: Any):
    """A learning rate: a finite number in 0..1e12 (wire's rule)."""
    if v is None:
        return None
    t = type(v)
    if (t is not float and t is not int) or not 0.0 <= v <= 1e12:
        raise _Slow
    return float(v)


def _row(row: Any) -> wire.StepRecord:
    if type(row) is not list or len(row) != 17:
        raise _Slow
    (step, started, ended, forwards, compute_s, data_s, loss, grad_norm, nonfinite, stride, rss, dev_a, dev_r,
     dev_p, batch_fp, optim_fp, lr) = row
    return _StepRecord(_count(step), _time(started), _time(ended), _count(forwards), _opt_duration(compute_s),
                       _opt_duration(data_s), _opt_signal(loss), _opt_signal(grad_norm), _count(nonfinite),
                       _count(stride), _opt_bytes(rss), _opt_bytes(dev_a), _opt_bytes(dev_r), _opt_bytes(dev_p),
                       _opt_count(batch_fp), _opt_count(optim_fp), _opt_rate(lr))


def _seqs(d: Any) -> dict[str, int]:
    if type(d) is not dict or len(d) > 64:
        raise _Slow
    for k, v in d.items():
        if len(k) > 64 or not _TOKEN(k) or type(v) is not int or not -1 <= v <= _MAX_INT:
            raise _Slow
    return d


def _host_memory(d: Any) -> dict[str, int]:
    if type(d) is not dict or len(d) > 16:
        raise _Slow
    for k, v in d.items():
        if not _TOKEN(k) or type(v) is not int or not 0 <= v <= _MAX_INT:
            raise _Slow
    return d


_identities: dict[tuple, wire.RankIdentity] = {}


def _identity(d: Any) -> wire.RankIdentity:
    """A rank sends the same identity every beat: checked once, then shared."""
    if type(d) is not dict:
        raise _Slow
    try:
        key = tuple(d.items())
        cached = _identities.get(key)
    except TypeError:  # an unhashable value: not a valid identity anyway
        raise _Slow from None
    if cached is not None:
        return cached
    identity = _check_identity(d)
    if len(_identities) >= 1_100_000:
        _identities.clear()
    _identities[key] = identity
    return identity


def _check_identity(d: dict) -> wire.RankIdentity:
    if not d.keys() <= _IDENTITY_FIELDS:
        raise _Slow
    run_id, host = d.get("run_id"), d.get("host", "")
    rank, local_rank, world = d.get("rank"), d.get("local_rank"), d.get("world_size")
    node_rank, pid, attempt = d.get("node_rank", 0), d.get("pid", 0), d.get("attempt", 0)
    if (type(run_id) is not str or not run_id or not _ID(run_id)
            or type(world) is not int or not 1 <= world <= _MAX_WORLD
            or type(rank) is not int or not 0 <= rank < world
            or type(local_rank) is not int or not 0 <= local_rank < world
            or type(node_rank) is not int or not 0 <= node_rank < world
            or type(pid) is not int or not 0 <= pid <= wire.MAX_PID
            or type(attempt) is not int or not 0 <= attempt <= _MAX_COUNT
            or type(host) is not str or (host and (not host.isprintable() or len(host) > 255))):
        raise _Slow
    if host:
        try:
            _HOST_RULE(host, "RankIdentity.host")
        except wire.WireError:
            raise _Slow from None
    return _RankIdentity(run_id, rank, local_rank, world, node_rank, host, pid, attempt)


_FINGERPRINT_KEYS = frozenset(("step", "names", "norms", "sums"))
_MARK_KEYS = frozenset(("step", "seqs"))
_CollectiveMark = wire.CollectiveMark
_MAX_NAME = 1024  # a parameter's name; a longer one takes wire's road (its limit is wire.MAX_STRING_CHARS)


def _fingerprints(value: Any) -> list:
    """Parameter fingerprints of the common shape: a step, printable names
    (or none: the rank's last ones), finite norms, as many of each, and
    optionally as many bit checksums (32-bit unsigned integers). Anything
    else (a non-finite norm sent as a string, other keys) takes wire's road."""
    if type(value) is not list or len(value) > wire.MAX_LIST_ITEMS:
        raise _Slow
    for fp in value:
        if type(fp) is not dict or not fp.keys() <= _FINGERPRINT_KEYS:
            raise _Slow
        _count(fp.get("step"))
        norms = fp.get("norms")
        if type(norms) is not list or len(norms) > wire.MAX_LIST_ITEMS:
            raise _Slow
        for v in norms:
            t = type(v)
            if not ((t is float and -1e308 <= v <= 1e308) or (t is int and -_MAX_INT <= v <= _MAX_INT)):
                raise _Slow
        names = fp.get("names")
        if names is not None:
            if type(names) is not list or (names and len(names) != len(norms)):
                raise _Slow
            for n in names:
                if type(n) is not str or len(n) > _MAX_NAME or not n.isprintable():
                    raise _Slow
        sums = fp.get("sums")
        if sums is not None and not wire.checksums_ok(sums, len(norms)):
            raise _Slow
        fp["norms"] = [float(v) for v in norms]
    return value


def _marks(value: Any) -> list:
    if type(value) is not list or len(value) > wire.MAX_LIST_ITEMS:
        raise _Slow
    out = []
    for mark in value:
        if type(mark) is not dict or not mark.keys() <= _MARK_KEYS:
            raise _Slow
        out.append(_CollectiveMark(_count(mark.get("step")), _seqs(mark.get("seqs", {}))))
    return out


def _phase(v: Any) -> str:
    if type(v) is not str or not _TOKEN(v):
        raise _Slow
    return v


def decode_heartbeat(data: Any, path: str = "Heartbeat") -> wire.Heartbeat:
    """A parsed heartbeat (JSON data) -> wire.Heartbeat, its step rows turned
    into StepRecords. Raises wire.WireError for a bad one."""
    try:
        return _fast(data)
    except _Slow:
        hb = wire.decode(wire.Heartbeat, data, path)
        if hb.step_rows:
            hb.steps = wire.step_records(hb)
        hb.step_rows, hb.step_columns = [], []  # expanded: the records are in `steps`
        return hb


def _fast(data: Any) -> wire.Heartbeat:
    if type(data) is not dict or not data.keys() <= _HEARTBEAT_FIELDS:
        raise _Slow
    version = data.get("version", 1)
    if type(version) is not int or not 0 <= version <= wire.WIRE_VERSION:
        raise _Slow
    get = data.get
    fingerprints = get("fingerprints")
    fingerprints = _fingerprints(fingerprints) if fingerprints else []
    marks = get("marks")
    marks = _marks(marks) if marks else []
    steps: list = []
    rows = get("step_rows")
    if rows:
        if get("step_columns") != _STEP_COLUMNS or type(rows) is not list or len(rows) > wire.MAX_LIST_ITEMS:
            raise _Slow
        steps = [_row(r) for r in rows]
    lists = {}
    for name, decode in _SLOW_LISTS.items():
        if name == "marks":
            continue  # above
        value = get(name)
        if value:  # rare (events) or every few steps (marks): wire's own decoder
            lists[name] = decode(value, f"Heartbeat.{name}")
    if "steps" in lists:
        steps = lists["steps"] + steps
    enqueued = get("collectives_enqueued")
    completed = get("collectives_completed")
    memory = get("host_memory")
    return _Heartbeat(
        identity=_identity(get("identity")),
        sent_at=_time(get("sent_at")),
        seq=_count(get("seq", 0)),
        step=_count(get("step", 0)),
        forwards=_count(get("forwards", 0)),
        phase=_phase(get("phase", "startup")),
        phase_since=_time(get("phase_since", 0.0)),
        last_progress_at=_time(get("last_progress_at", 0.0)),
        collectives_enqueued=_seqs(enqueued) if enqueued else {},
        collectives_completed=_seqs(completed) if completed else {},
        steps=steps,
        marks=marks,
        events=lists.get("events", []),
        fingerprints=fingerprints,
        host_memory=_host_memory(memory) if memory else {},
        version=version,
        steps_skipped=_count(get("steps_skipped", 0)),
        busy_cpu_s=_opt_seconds(get("busy_cpu_s")),
        io_bytes=_opt_bytes(get("io_bytes")),
        wakeups=_opt_bytes(get("wakeups")),
    )


def _opt_seconds(v: Any) -> Optional[float]:
    if v is None:
        return None
    if type(v) not in (float, int) or not 0.0 <= v <= _MAX_TIME:
        raise _Slow  # wire's decoder says why
    return float(v)


def parse(raw: bytes, what: str, limit: int = wire.MAX_MESSAGE_BYTES) -> Any:
    """JSON text -> data, within wire's bounds. msgspec parses (about twice
    as fast as json, no recursion into deep nesting); whatever it refuses or
    what might be near a bound goes through wire.parse_json for the canonical
    answer (a NaN token, a precise count of objects, the error text)."""
    if len(raw) > limit:
        raise wire.WireError(f"{what}: {len(raw)} bytes exceed the {limit}-byte limit")
    if _msgspec is None or _near_bounds(raw):
        return wire.parse_json(raw, what, limit)
    try:
        return _msgspec_decode(raw)
    except (_msgspec.DecodeError, RecursionError, UnicodeDecodeError):
        return wire.parse_json(raw, what, limit)


def _near_bounds(raw: bytes) -> bool:
    """Might the text hold more containers or values than wire allows? Then
    wire.parse_json counts them exactly (and says so)."""
    if len(raw) <= wire.MAX_JSON_CONTAINERS // 2:  # fewer bytes than either count could exceed
        return False
    return (raw.count(b"{") + raw.count(b"[") > wire.MAX_JSON_CONTAINERS // 2
            or raw.count(b",") > wire.MAX_JSON_VALUES // 2)


def loads_heartbeat(raw: bytes) -> wire.Heartbeat:
    return decode_heartbeat(parse(raw, "Heartbeat"))


_decode_node_slow = wire._decoder(wire.NodeHeartbeat)
_NODE_FIELDS = {f for f in wire.NodeHeartbeat.__dataclass_fields__}
_WORKER_FIELDS = {f for f in wire.WorkerStatus.__dataclass_fields__}
_workers: dict[tuple, wire.WorkerStatus] = {}


def _worker(d: Any, world: int) -> wire.WorkerStatus:
    if type(d) is not dict or not d.keys() <= _WORKER_FIELDS:
        raise _Slow
    try:
        key = (world, *d.items())
        cached = _workers.get(key)
    except TypeError:
        raise _Slow from None
    if cached is not None:
        return cached
    local_rank, rank, pid = d.get("local_rank"), d.get("rank"), d.get("pid")
    alive, code, at = d.get("alive", True), d.get("exit_code"), d.get("exited_at")
    if (type(local_rank) is not int or not 0 <= local_rank < _MAX_WORLD
            or type(rank) is not int or not 0 <= rank < _MAX_WORLD or (world and rank >= world)
            or type(pid) is not int or not 1 <= pid <= wire.MAX_PID or type(alive) is not bool
            or (code is not None and (type(code) is not int or not -wire.MAX_EXIT_CODE <= code <= wire.MAX_EXIT_CODE))
            or (at is not None and (type(at) not in (int, float) or not 0.0 <= at <= _MAX_TIME))):
        raise _Slow
    worker = wire.WorkerStatus(local_rank, rank, pid, alive, code, None if at is None else float(at))
    if len(_workers) >= 1_100_000:
        _workers.clear()
    _workers[key] = worker
    return worker


def _decode_node(d: Any, path: str) -> wire.NodeHeartbeat:
    try:
        if type(d) is not dict or not d.keys() <= _NODE_FIELDS:
            raise _Slow
        get = d.get
        run_id, host, node_rank, world = get("run_id"), get("host"), get("node_rank"), get("world_size")
        hang_timeout, on_hang, finished, launcher_pid = (get("hang_timeout"), get("on_hang", "abort"),
                                                         get("finished", False), get("launcher_pid", 0))
        version, workers = get("version", 1), get("workers", [])
        if (type(run_id) is not str or not run_id or not _ID(run_id)
                or type(host) is not str or not host.isprintable() or len(host) > 255 or host.strip() != host
                or type(node_rank) is not int or not 0 <= node_rank < _MAX_WORLD
                or type(world) is not int or not 0 <= world <= _MAX_WORLD
                or (hang_timeout is not None and (type(hang_timeout) not in (int, float)
                                                  or not 1e-3 <= hang_timeout <= _MAX_DURATION))
                or on_hang not in ("abort", "wait") or type(finished) is not bool
                or type(launcher_pid) is not int or not 0 <= launcher_pid <= wire.MAX_PID
                or type(version) is not int or not 0 <= version <= wire.WIRE_VERSION
                or type(workers) is not list or len(workers) > 4096):
            raise _Slow
        return wire.NodeHeartbeat(run_id=run_id, host=host, node_rank=node_rank, world_size=world,
                                  sent_at=_time(get("sent_at")),
                                  hang_timeout=None if hang_timeout is None else float(hang_timeout),
                                  on_hang=on_hang, workers=[_worker(w, world) for w in workers],
                                  finished=finished, launcher_pid=launcher_pid, version=version)
    except _Slow:
        return _decode_node_slow(d, path)


# -- The typed road: a whole node report of the common shape in one pass ---------------
#
# msgspec decodes the report straight into typed structs whose constraints
# (ranges, patterns, lengths) are checked in C while the JSON is read: no
# Python dict per message and no Python check per value. The constraints are
# those of the checks above (at least as strict as wire's rules); whatever
# they refuse (a NaN loss sent as a string, an unknown field, a value out of
# range) is decoded again by the road above, which gives wire's answer. What
# the structs cannot say (rank < world size, a host name's rules, printable
# parameter names) is checked in Python, once per identity or per list.

if _msgspec is not None:
    from typing import Annotated, Literal

    _Meta = _msgspec.Meta
    _Count = Annotated[int, _Meta(ge=0, le=_MAX_COUNT)]
    _Time = Annotated[float, _Meta(ge=0.0, le=_MAX_TIME)]
    _Bytes = Annotated[int, _Meta(ge=0, le=_MAX_INT)]
    _Rank = Annotated[int, _Meta(ge=0, lt=_MAX_WORLD)]
    _Token = Annotated[str, _Meta(pattern=wire._TOKEN.pattern)]
    _Seqs = Annotated[dict[Annotated[str, _Meta(max_length=64, pattern=wire._TOKEN.pattern)],
                           Annotated[int, _Meta(ge=-1, le=_MAX_INT)]], _Meta(max_length=64)]
    _Row = tuple[
        _Count, _Time, _Time, _Count,  # step, started_at, ended_at, forwards
        Optional[Annotated[float, _Meta(ge=0.0, le=_MAX_DURATION)]],  # compute_s
        Optional[Annotated[float, _Meta(ge=0.0, le=_MAX_DURATION)]],  # data_s
        Optional[Annotated[float, _Meta(ge=-1e308, le=1e308)]],  # loss (non-finite ones: the road above)
        Optional[Annotated[float, _Meta(ge=-1e308, le=1e308)]],  # grad_norm
        _Count, _Count,  # nonfinite_grads, grad_check_stride
        Optional[_Bytes], Optional[_Bytes], Optional[_Bytes], Optional[_Bytes],  # rss, device a/r/p
        Optional[_Count], Optional[_Count],  # batch_fp, optim_fp
        Optional[Annotated[float, _Meta(ge=0.0, le=1e12)]],  # lr
    ]
    assert len(_Row.__args__) == len(_STEP_COLUMNS)
    _List = _Meta(max_length=wire.MAX_LIST_ITEMS)

    class _TypedIdentity(_msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
        run_id: Annotated[str, _Meta(min_length=1, pattern=wire.ID_PATTERN.pattern)]
        rank: _Rank
        local_rank: _Rank
        world_size: Annotated[int, _Meta(ge=1, le=_MAX_WORLD)]
        node_rank: _Rank = 0
        host: Annotated[str, _Meta(max_length=255)] = ""
        pid: Annotated[int, _Meta(ge=0, le=wire.MAX_PID)] = 0
        attempt: _Count = 0

    class _TypedMark(_msgspec.Struct, forbid_unknown_fields=True, gc=False):
        step: _Count
        seqs: _Seqs = {}

    class _TypedEvent(_msgspec.Struct, forbid_unknown_fields=True, gc=False):
        kind: _Token
        at: _Time
        step: Optional[Annotated[int, _Meta(ge=-1, le=_MAX_COUNT)]] = None
        details: _msgspec.Raw = _msgspec.Raw(b"{}")  # checked by wire's decoder once per distinct text

    class _TypedBeat(_msgspec.Struct, forbid_unknown_fields=True, gc=False):
        # The identity and the step columns as their text: the same from a
        # rank's every beat, so each distinct text is checked once
        # (_typed_identity, _known_columns), not decoded per beat.
        identity: _msgspec.Raw
        sent_at: _Time
        version: Annotated[int, _Meta(ge=0, le=wire.WIRE_VERSION)] = 1
        seq: _Count = 0
        step: _Count = 0
        forwards: _Count = 0
        phase: _Token = "startup"
        phase_since: _Time = 0.0
        last_progress_at: _Time = 0.0
        collectives_enqueued: _Seqs = {}
        collectives_completed: _Seqs = {}
        step_columns: _msgspec.Raw = _msgspec.Raw(b"[]")
        step_rows: Annotated[list[_Row], _List] = []
        marks: Annotated[list[_TypedMark], _List] = []
        steps: Annotated[list[Any], _List] = []  # older agents: wire's decoder
        events: Annotated[list[_TypedEvent], _List] = []
        fingerprints: Annotated[list[Any], _List] = []  # checked by _fingerprints
        host_memory: Annotated[dict[_Token, _Bytes], _Meta(max_length=16)] = {}
        steps_skipped: _Count = 0
        busy_cpu_s: Optional[_Time] = None
        io_bytes: Optional[_Bytes] = None
        wakeups: Optional[_Bytes] = None

    class _TypedWorker(_msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
        local_rank: _Rank
        rank: _Rank
        pid: Annotated[int, _Meta(ge=1, le=wire.MAX_PID)]
        alive: bool = True
        exit_code: Optional[Annotated[int, _Meta(ge=-wire.MAX_EXIT_CODE, le=wire.MAX_EXIT_CODE)]] = None
        exited_at: Optional[_Time] = None

    class _TypedNode(_msgspec.Struct, forbid_unknown_fields=True, gc=False):
        run_id: Annotated[str, _Meta(min_length=1, pattern=wire.ID_PATTERN.pattern)]
        host: Annotated[str, _Meta(max_length=255)]
        node_rank: _Rank
        world_size: Annotated[int, _Meta(ge=0, le=_MAX_WORLD)]
        sent_at: _Time
        hang_timeout: Optional[Annotated[float, _Meta(ge=1e-3, le=_MAX_DURATION)]] = None
        on_hang: Literal["abort", "wait"] = "abort"
        workers: Annotated[list[_TypedWorker], _Meta(max_length=4096)] = []
        finished: bool = False
        launcher_pid: Annotated[int, _Meta(ge=0, le=wire.MAX_PID)] = 0
        version: Annotated[int, _Meta(ge=0, le=wire.WIRE_VERSION)] = 1

    class _TypedReport(_msgspec.Struct, gc=False):
        version: Annotated[int, _Meta(ge=0, le=wire.WIRE_VERSION)] = 1
        sent_at: _Time = 0.0
        node: Optional[_TypedNode] = None
        heartbeats: Annotated[list[_TypedBeat], _List] = []

    _typed_report_decode = _msgspec.json.Decoder(_TypedReport).decode
    _typed_identity_decode = _msgspec.json.Decoder(_TypedIdentity).decode
    _columns_decode = _msgspec.json.Decoder(list[str]).decode
    _typed_errors = (_msgspec.DecodeError, RecursionError, UnicodeDecodeError)
    _typed_identities: dict[Any, wire.RankIdentity] = {}


def _typed_decode(decode, raw: bytes):
    """`decode(raw)` on the typed road: anything it refuses goes to the road
    that checks field by field and names the error (raises _Slow)."""
    try:
        return decode(raw)
    except _typed_errors:  # DecodeError covers msgspec's ValidationError
        raise _Slow from None


def _typed_identity(raw) -> wire.RankIdentity:
    text = bytes(raw)
    cached = _typed_identities.get(text)
    if cached is not None:
        return cached
    d = _typed_decode(_typed_identity_decode, text)
    if d.rank >= d.world_size or d.local_rank >= d.world_size or d.node_rank >= d.world_size:
        raise _Slow
    host = d.host
    if host:
        if not host.isprintable():
            raise _Slow
        try:
            _HOST_RULE(host, "RankIdentity.host")
        except wire.WireError:
            raise _Slow from None
    identity = _RankIdentity(d.run_id, d.rank, d.local_rank, d.world_size, d.node_rank, host, d.pid, d.attempt)
    if len(_typed_identities) >= 1_100_000:
        _typed_identities.clear()
    _typed_identities[text] = identity
    return identity


_known_columns: dict[bytes, bool] = {}  # step_columns text -> whether it is this reader's STEP_COLUMNS


def _columns_match(raw) -> bool:
    text = bytes(raw)
    known = _known_columns.get(text)
    if known is None:
        known = _typed_decode(_columns_decode, text) == _STEP_COLUMNS
        if len(_known_columns) >= 1_000:
            _known_columns.clear()
        _known_columns[text] = known
    return known


_event_details: dict[tuple[str, bytes], dict] = {}
_decode_event = wire._decoder(wire.Event)


def _typed_events(events) -> list[wire.Event]:
    """Events with their details decoded by wire's own decoder once per
    distinct (kind, details text): every rank of a job sends the same start-up
    facts (train_config), ~130 strings each, and wire's generic checks of them
    were most of a node's first report. Events of one text share its details
    object, which nobody changes (the collector's redaction makes a new one)."""
    out = []
    for e in events:
        key = (e.kind, bytes(e.details))
        details = _event_details.get(key)
        if details is None:
            try:
                data = _msgspec_decode(key[1])
                details = _decode_event({"kind": e.kind, "at": e.at, "details": data}, "Heartbeat.events[]").details
            except (wire.WireError, _msgspec.DecodeError, RecursionError, UnicodeDecodeError):
                raise _Slow from None  # the road above names the error
            if len(_event_details) >= 10_000:
                _event_details.clear()
            _event_details[key] = details
        out.append(wire.Event(e.kind, e.at, e.step, details))
    return out


def _typed_beat(b) -> wire.Heartbeat:
    steps: list = []
    if b.step_rows:
        if not _columns_match(b.step_columns):
            raise _Slow
        steps = [_StepRecord(*row) for row in b.step_rows]
    if b.steps:
        steps = _SLOW_LISTS["steps"](b.steps, "Heartbeat.steps") + steps
    return _Heartbeat(
        identity=_typed_identity(b.identity),
        sent_at=b.sent_at, seq=b.seq, step=b.step, forwards=b.forwards, phase=b.phase,
        phase_since=b.phase_since, last_progress_at=b.last_progress_at,
        collectives_enqueued=b.collectives_enqueued, collectives_completed=b.collectives_completed,
        steps=steps,
        marks=[_CollectiveMark(m.step, m.seqs) for m in b.marks] if b.marks else [],
        events=_typed_events(b.events) if b.events else [],
        fingerprints=_fingerprints(b.fingerprints) if b.fingerprints else [],
        host_memory=b.host_memory, version=b.version, steps_skipped=b.steps_skipped,
        busy_cpu_s=b.busy_cpu_s, io_bytes=b.io_bytes, wakeups=b.wakeups,
    )


def _typed_node(n) -> wire.NodeHeartbeat:
    host, world = n.host, n.world_size
    if not host.isprintable() or host.strip() != host:
        raise _Slow
    workers = []
    for w in n.workers:
        key = (world, w)
        worker = _workers.get(key)
        if worker is None:
            if world and w.rank >= world:
                raise _Slow
            worker = wire.WorkerStatus(w.local_rank, w.rank, w.pid, w.alive, w.exit_code, w.exited_at)
            if len(_workers) >= 1_100_000:
                _workers.clear()
            _workers[key] = worker
        workers.append(worker)
    return wire.NodeHeartbeat(run_id=n.run_id, host=host, node_rank=n.node_rank, world_size=world,
                              sent_at=n.sent_at, hang_timeout=n.hang_timeout, on_hang=n.on_hang, workers=workers,
                              finished=n.finished, launcher_pid=n.launcher_pid, version=n.version)


def _typed_node_report(raw: bytes) -> wire.NodeReport:
    """The typed road; raises _Slow when the report is not of the common shape."""
    report = _typed_decode(_typed_report_decode, raw)
    node = report.node
    return wire.NodeReport(
        node=None if node is None else _typed_node(node),
        heartbeats=[_typed_beat(b) for b in report.heartbeats],
        version=report.version,
        sent_at=report.sent_at,
    )


def loads_node_report(raw: bytes, limit: int) -> wire.NodeReport:
    if len(raw) > limit:
        raise wire.WireError(f"NodeReport: {len(raw)} bytes exceed the {limit}-byte limit")
    if _msgspec is not None and not _near_bounds(raw):
        try:
            return _typed_node_report(raw)
        except _Slow:
            pass
    data = parse(raw, "NodeReport", limit)
    if type(data) is not dict:
        raise wire.WireError("NodeReport: expected an object")
    version = data.get("version", 1)
    if type(version) is not int or not 0 <= version <= wire.WIRE_VERSION:
        raise wire.WireError(f"NodeReport: unsupported version {version!r:.40} (this reader knows "
                             f"{wire.WIRE_VERSION})")
    beats = data.get("heartbeats", [])
    if type(beats) is not list or len(beats) > wire.MAX_LIST_ITEMS:
        raise wire.WireError("NodeReport.heartbeats: expected a list of at most "
                             f"{wire.MAX_LIST_ITEMS} heartbeats")
    node = data.get("node")
    sent_at = data.get("sent_at", 0.0)
    if type(sent_at) not in (int, float) or not 0.0 <= sent_at <= _MAX_TIME:
        raise wire.WireError("NodeReport.sent_at: expected a time")
    return wire.NodeReport(
        node=None if node is None else _decode_node(node, "NodeReport.node"),
        heartbeats=[decode_heartbeat(b, f"NodeReport.heartbeats[{i}]") for i, b in enumerate(beats)],
        version=version,
        sent_at=float(sent_at),
    )
