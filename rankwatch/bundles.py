"""The diagnostic bundle archive: written by agents and supervisors, read by
the collector and by ``rankwatch analyze``.

A bundle is a gzip'd tar (or an unpacked folder) holding one rank's evidence
for one incident:

    manifest.json          BundleManifest (rank, host, pid, step, reason, versions)
    stacks.json            every thread's Python stack
    exception.json         the uncaught exception, if any
    collectives.json       Python-API collective call sites, pg_status
    flight_recorder.json   torch Flight Recorder dump (JSON; NCCL's and gloo's recorders merged)
    fr_timeout_dump.pickle the dump torch's NCCL watchdog wrote on a collective timeout
                           (opaque, for torch's fr_trace; never unpickled; .json if torch wrote JSON)
    metrics.json           recent per-step records and collective marks
    env.json               environment, secrets redacted
    memory.json            host RSS, device memory stats and summary
    native_stacks.txt      py-spy dump (supervisor, from outside)
    worker_stacks.json     the rank's DataLoader worker processes' stacks (supervisor, py-spy)
    faulthandler.txt       faulthandler output (supervisor, from outside)
    memory_snapshot.pickle CUDA memory snapshot for pytorch.org/memory_viz (opaque:
                           never unpickled by rankwatch, see memory_snapshot.json)

Reading is bounded in work, not only in bytes: the archive is untrusted.

- The tar stream is parsed here, 512-byte header by header, from a gzip
  stream inflated in chunks. Only plain ustar regular files with plain known
  names are accepted: GNU long-name/long-link and PAX headers (which
  ``tarfile`` would read whole into memory), links, devices, directories and
  paths are refused before any of their content is read. Member count,
  member size and the total inflated size are capped (a gzip bomb stops at
  the cap).
- JSON members are checked for depth, object and value counts before they
  are parsed (one budget per bundle), then through a typed schema per member:
  a wrong shape drops that member with a note saying why, never a traceback.
- Every string is redacted again (``redact``): a bundle from an older or
  foreign agent is not trusted to be clean. ``*.pickle`` members are never loaded.

Writing (``pack``) produces plain ustar members only, strict JSON (non-finite
numbers as strings, see ``wire.json_text``) and redacted text.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from . import wire
from .redact import redact_obj, redact_text

_MEMBER_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}\.(json|txt|pickle|gz|json\.gz)$")
OPAQUE_SUFFIXES = (".pickle", ".gz")

# Work bounds of one bundle (SECURITY.md lists them).
MAX_MEMBERS = 64
MAX_MANIFEST_BYTES = 1024 * 1024
MAX_INFLATED_BYTES = 4 * wire.MAX_BUNDLE_BYTES  # all members, opaque ones included
MAX_LOADED_BYTES = wire.MAX_BUNDLE_BYTES  # JSON and text members held in memory
MAX_JSON_CONTAINERS = 400_000  # per bundle (a CUDA snapshot of 20,000 blocks needs ~250,000)
MAX_JSON_VALUES = 1_500_000  # per bundle
_BLOCK = 512
_CHUNK = 1024 * 1024


class BundleError(ValueError):
    """A bundle that cannot be read; the text says why."""


@dataclass
class Bundle:
    manifest: wire.BundleManifest
    json_members: dict[str, Any] = field(default_factory=dict)
    text_members: dict[str, str] = field(default_factory=dict)
    opaque_members: dict[str, int] = field(default_factory=dict)  # name -> size, content not loaded
    source_path: Optional[str] = None

    def get(self, name: str, default: Any = None) -> Any:
        return self.json_members.get(name, default)


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------


def _encode(content: Any) -> bytes:
    """A member's bytes: opaque bytes as they are, text and JSON redacted
    (strict JSON: non-finite numbers as strings)."""
    if isinstance(content, bytes):
        return content
    if isinstance(content, str):
        return redact_text(content).encode("utf-8", "replace")
    return wire.json_text(redact_obj(content)).encode("utf-8", "replace")


def pack(manifest: wire.BundleManifest, members: dict[str, Any]) -> bytes:
    """Build the archive. ``members`` maps file name to bytes, str or JSON-able
    data. Text and JSON are redacted here: this is the one way rankwatch
    writes a bundle (agent, supervisor, collector), so none leaves unredacted."""
    blobs: dict[str, bytes] = {}
    for name, content in members.items():
        if content is None:
            continue
        if not _MEMBER_NAME.match(name) or name == "manifest.json":
            raise BundleError(f"bad member name {name!r}")
        blobs[name] = _encode(content)
    manifest.members = sorted(blobs)
    return _write(manifest, blobs, None, {})


def _write(manifest: wire.BundleManifest, blobs: dict[str, bytes], original: Optional[bytes],
           opaque: dict[str, int]) -> bytes:
    buffer = io.BytesIO()
    now = int(time.time())
    head = _encode(wire.to_dict(manifest))
    # USTAR: never a PAX or GNU header (names are short ASCII, sizes < 8 GiB).
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6, format=tarfile.USTAR_FORMAT) as tar:
        for name, blob in [("manifest.json", head)] + sorted(blobs.items()):
            info = tarfile.TarInfo(name)
            info.mtime, info.mode, info.size = now, 0o644, len(blob)
            tar.addfile(info, io.BytesIO(blob))
        if original is not None and opaque:
            _copy_opaque(original, opaque, tar, now)
    return buffer.getvalue()


class _MemberReader(io.RawIOBase):
    """One member's bytes, read from the inflating stream (for tarfile.addfile)."""

    def __init__(self, stream: "_Inflater", size: int):
        self.stream, self.left = stream, size

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        n = self.left if n is None or n < 0 else min(n, self.left)
        data = self.stream.read(n)
        self.left -= len(data)
        return data


def _copy_opaque(original: bytes, opaque: dict[str, int], tar: tarfile.TarFile, mtime: int) -> None:
    """Opaque members copied from the (already validated) original archive in
    chunks: never whole in memory."""
    stream = _Inflater(original, MAX_INFLATED_BYTES)
    for index in range(MAX_MEMBERS + 1):
        block = stream.read(_BLOCK)
        parsed = _header(block, index) if len(block) == _BLOCK else None
        if parsed is None:
            return
        name, size, _ = parsed
        padded = -(-size // _BLOCK) * _BLOCK
        if opaque.get(name) == size:
            info = tarfile.TarInfo(name)
            info.mtime, info.mode, info.size = mtime, 0o644, size
            tar.addfile(info, _MemberReader(stream, size))
            stream.skip(padded - size)
        else:
            stream.skip(padded)


def repack(bundle: Bundle, original: Optional[bytes] = None) -> bytes:
    """The archive of what was read and validated (redacted text, checked
    JSON, opaque members copied from ``original``): what the collector
    stores, never the bytes it was sent. Without ``original`` the opaque
    members are left out (and a note says so)."""
    blobs = {name: _encode(content) for name, content in {**bundle.json_members, **bundle.text_members}.items()}
    manifest = wire.decode(wire.BundleManifest, wire.to_dict(bundle.manifest))
    opaque = bundle.opaque_members if original is not None else {}
    if bundle.opaque_members and original is None:
        manifest.notes.append(f"opaque members not kept: {', '.join(sorted(bundle.opaque_members))}")
    manifest.members = sorted(set(blobs) | set(opaque))
    return _write(manifest, blobs, original, opaque)


# --------------------------------------------------------------------------
# Reading: a bounded tar stream
# --------------------------------------------------------------------------


class _Inflater:
    """Bytes of the tar stream, inflated in chunks when gzip'd; refuses to
    produce more than ``limit`` bytes in all."""

    def __init__(self, data: bytes, limit: int):
        self._data = data
        self._gzip = data[:2] == b"\x1f\x8b"
        self._inflate = zlib.decompressobj(wbits=31) if self._gzip else None
        self._pos = 0
        self._buf = bytearray()
        self._limit = limit
        self.total = 0

    def _more(self) -> bool:
        if not self._gzip:
            if self._pos >= len(self._data):
                return False
            chunk = self._data[self._pos:self._pos + _CHUNK]
            self._pos += len(chunk)
        else:
            d = self._inflate
            if d.unconsumed_tail:
                chunk = d.decompress(d.unconsumed_tail, _CHUNK)
            elif d.eof or self._pos >= len(self._data):
                return False
            else:
                block = self._data[self._pos:self._pos + _CHUNK]
                self._pos += len(block)
                chunk = d.decompress(block, _CHUNK)
        self.total += len(chunk)
        if self.total > self._limit:
            raise BundleError(f"bundle inflates beyond {self._limit} bytes (a compression bomb?)")
        self._buf += chunk
        return True

    def read(self, n: int) -> bytes:
        while len(self._buf) < n:
            if not self._more():
                break
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def skip(self, n: int) -> int:
        skipped = 0
        while skipped < n:
            got = len(self.read(min(_CHUNK, n - skipped)))
            if not got:
                break
            skipped += got
        return skipped


_TYPE_NAMES = {b"L": "a GNU long-name header", b"K": "a GNU long-link header", b"x": "a PAX header",
               b"g": "a PAX global header", b"1": "a hard link", b"2": "a symbolic link",
               b"3": "a character device", b"4": "a block device", b"5": "a directory", b"6": "a FIFO",
               b"7": "a contiguous file"}


def _octal(field_bytes: bytes, what: str) -> int:
    if field_bytes[:1] and field_bytes[0] & 0x80:
        raise BundleError(f"{what} in base-256 form refused (larger than any bundle)")
    text = field_bytes.split(b"\0", 1)[0].strip()
    try:
        return int(text or b"0", 8)
    except ValueError:
        raise BundleError(f"bad tar header: {what} is not a number") from None


def _header(block: bytes, index: int) -> Optional[tuple[str, int, bool]]:
    """(name, size, regular) of one 512-byte ustar header; None at the end marker."""
    if block == b"\0" * _BLOCK:
        return None
    stored = _octal(block[148:156], "checksum")
    actual = sum(block[:148]) + 8 * 32 + sum(block[156:])
    if stored != actual:
        raise BundleError(f"member {index}: bad tar header checksum (not a tar archive, or corrupt)")
    typeflag = block[156:157]
    raw_name = block[:100].split(b"\0", 1)[0]
    prefix = block[345:500].split(b"\0", 1)[0] if block[257:262] == b"ustar" else b""
    try:
        name = raw_name.decode("ascii")
    except UnicodeDecodeError:
        name = raw_name.decode("ascii", "replace")
    if typeflag not in (b"0", b"\0"):
        kind = _TYPE_NAMES.get(typeflag, f"type {typeflag!r}")
        raise BundleError(f"member {name!r:.80} is {kind}, not a regular file: refused (bundles hold plain "
                          f"ustar regular files only; no links, paths, long names or PAX headers)")
    if prefix or not _MEMBER_NAME.match(name):
        full = (prefix.decode("ascii", "replace") + "/" if prefix else "") + name
        raise BundleError(f"member name {full!r:.120} refused (only plain file names, no paths)")
    return name, _octal(block[124:136], f"size of {name}"), True


def unpack(data: bytes, source: Optional[str] = None, keep_opaque: bool = False) -> Bundle:
    """Read and validate a bundle archive (gzip'd or plain tar). Opaque members
    are skipped in chunks, never held (``repack`` copies them the same way);
    ``keep_opaque`` is accepted for older callers and changes nothing."""
    if len(data) > wire.MAX_BUNDLE_BYTES:
        raise BundleError(f"bundle of {len(data)} bytes exceeds the {wire.MAX_BUNDLE_BYTES}-byte limit")
    stream = _Inflater(data, MAX_INFLATED_BYTES)
    members: dict[str, bytes] = {}
    opaque: dict[str, int] = {}
    loaded = 0
    try:
        for index in range(MAX_MEMBERS + 1):
            block = stream.read(_BLOCK)
            if len(block) < _BLOCK:
                if index == 0 and not block:
                    raise BundleError("unreadable bundle archive: empty")
                raise BundleError("unreadable or truncated bundle archive: header cut short")
            parsed = _header(block, index)
            if parsed is None:
                break
            if index == MAX_MEMBERS:
                raise BundleError(f"bundle holds more than {MAX_MEMBERS} members")
            name, size, _ = parsed
            if name in members or name in opaque:
                raise BundleError(f"member {name!r} appears twice")
            limit = MAX_MANIFEST_BYTES if name == "manifest.json" else wire.MAX_BUNDLE_MEMBER_BYTES
            if size > limit:
                raise BundleError(f"member {name!r} of {size} bytes exceeds the {limit}-byte limit")
            padded = -(-size // _BLOCK) * _BLOCK
            if name.endswith(OPAQUE_SUFFIXES):
                opaque[name] = size
                if stream.skip(padded) < padded:
                    raise BundleError(f"truncated bundle archive: member {name!r} cut short")
                continue
            loaded += size
            if loaded > MAX_LOADED_BYTES:
                raise BundleError(f"JSON and text members exceed {MAX_LOADED_BYTES} bytes")
            blob = stream.read(size)
            if len(blob) < size:
                raise BundleError(f"truncated bundle archive: member {name!r} cut short")
            stream.skip(padded - size)
            members[name] = blob
        else:
            raise BundleError(f"bundle holds more than {MAX_MEMBERS} members")
    except zlib.error as exc:
        raise BundleError(f"unreadable or truncated bundle archive: gzip: {exc}") from None
    return _build(members, opaque, source)


def read_folder(path: Path) -> Bundle:
    members: dict[str, bytes] = {}
    opaque: dict[str, int] = {}
    loaded = 0
    children = []
    for i, child in enumerate(path.iterdir()):
        if i >= 4 * MAX_MEMBERS:
            raise BundleError(f"{path}: more than {4 * MAX_MEMBERS} entries: not a bundle folder")
        children.append(child)
    for child in sorted(children):
        if child.is_symlink() or not child.is_file() or not _MEMBER_NAME.match(child.name):
            continue
        size = child.stat().st_size
        limit = MAX_MANIFEST_BYTES if child.name == "manifest.json" else wire.MAX_BUNDLE_MEMBER_BYTES
        if size > limit:
            raise BundleError(f"{child}: {size} bytes exceeds the {limit}-byte member limit")
        if child.name.endswith(OPAQUE_SUFFIXES):
            opaque[child.name] = size
            continue
        loaded += size
        if loaded > MAX_LOADED_BYTES or len(members) >= MAX_MEMBERS:
            raise BundleError(f"{path}: JSON and text members exceed the bundle limits")
        with open(child, "rb") as f:
            members[child.name] = f.read(limit + 1)
    return _build(members, opaque, str(path))


def read_path(path: Path) -> Bundle:
    path = Path(path)
    if path.is_dir():
        return read_folder(path)
    size = path.stat().st_size
    if size > wire.MAX_BUNDLE_BYTES:
        raise BundleError(f"{path}: {size} bytes exceeds the bundle limit")
    with open(path, "rb") as f:
        return unpack(f.read(wire.MAX_BUNDLE_BYTES + 1), str(path))


# --------------------------------------------------------------------------
# Members: bounded JSON, typed shapes, redaction
# --------------------------------------------------------------------------


class _Budget:
    """JSON objects and values one bundle may create, shared by its members."""

    def __init__(self) -> None:
        self.containers = MAX_JSON_CONTAINERS
        self.values = MAX_JSON_VALUES

    def parse(self, name: str, blob: bytes) -> Any:
        containers, values = wire.check_json_text(blob, name, wire.MAX_JSON_DEPTH, self.containers, self.values)
        self.containers -= containers
        self.values -= values
        try:
            data = json.loads(blob)
        except RecursionError:
            raise wire.WireError(f"{name}: JSON nested too deeply") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise wire.WireError(f"{name}: not valid JSON ({str(exc)[:200]})") from None
        return wire.decode_json(data, name, max_items=MAX_JSON_CONTAINERS)


def _build(members: dict[str, bytes], opaque: dict[str, int], source: Optional[str]) -> Bundle:
    raw_manifest = members.pop("manifest.json", None)
    if raw_manifest is None:
        raise BundleError("bundle has no manifest.json")
    try:
        manifest = wire.loads(wire.BundleManifest, raw_manifest, limit=MAX_MANIFEST_BYTES)
    except wire.WireError as exc:
        raise BundleError(f"bad manifest: {exc}") from None
    manifest.notes = [redact_text(n) for n in manifest.notes]
    bundle = Bundle(manifest=manifest, opaque_members=opaque, source_path=source)
    budget = _Budget()
    for name, blob in sorted(members.items()):
        if name.endswith(".json"):
            try:
                data = budget.parse(name, blob)
            except wire.WireError as exc:
                manifest.notes.append(f"{name}: dropped: {exc}")
                continue
            try:
                data = SCHEMAS[name](data, name) if name in SCHEMAS else data
            except (wire.WireError, ShapeError) as exc:
                manifest.notes.append(f"{name}: dropped, wrong shape: {exc}")
                continue
            bundle.json_members[name] = redact_obj(data)
        else:
            bundle.text_members[name] = redact_text(blob.decode("utf-8", errors="replace"))
    return bundle


class ShapeError(ValueError):
    """A JSON member whose shape is not what its readers expect."""


# A tiny typed-schema language for the members the collector reads. Each
# schema is a function (value, path) -> value that raises ShapeError; objects
# check the fields they name (when present) and keep the others as they are.

Schema = Callable[[Any, str], Any]


def _fail(path: str, expected: str, value: Any) -> None:
    raise ShapeError(f"{path}: expected {expected}, got {type(value).__name__} {str(value)[:40]!r}")


def INT(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(path, "an integer", value)
    return value


_DECIMAL = re.compile(r"^-?[0-9]{1,18}$")


def INTLIKE(value: Any, path: str) -> Any:
    """An integer, or one written as a decimal string (Flight Recorder writes
    its pg_status counters as strings); kept as it is, readers convert."""
    if isinstance(value, str) and _DECIMAL.match(value):
        return value
    return INT(value, path)


def NUM(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(path, "a finite number", value)
    return value


def STR(value: Any, path: str) -> str:
    if not isinstance(value, str):
        _fail(path, "a string", value)
    return value


def BOOL(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        _fail(path, "true/false", value)
    return value


def SCALAR(value: Any, path: str) -> Any:
    if isinstance(value, (dict, list)):
        _fail(path, "a plain value", value)
    return value


def ANY(value: Any, path: str) -> Any:
    return value


def opt(schema: Schema) -> Schema:
    return lambda value, path: None if value is None else schema(value, path)


def either(*schemas: Schema) -> Schema:
    def check(value, path):
        errors = []
        for schema in schemas:
            try:
                return schema(value, path)
            except ShapeError as exc:
                errors.append(str(exc))
        raise ShapeError(" or ".join(errors))
    return check


def lst(item: Schema) -> Schema:
    def check(value, path):
        if not isinstance(value, list):
            _fail(path, "a list", value)
        return [item(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return check


def dict_of(item: Schema) -> Schema:
    def check(value, path):
        if not isinstance(value, dict):
            _fail(path, "an object", value)
        return {k: item(v, f"{path}.{k}") for k, v in value.items()}
    return check


def obj(**fields: Schema) -> Schema:
    def check(value, path):
        if not isinstance(value, dict):
            _fail(path, "an object", value)
        out = dict(value)
        for name, schema in fields.items():
            if name in value:
                out[name] = schema(value[name], f"{path}.{name}")
        return out
    return check


def wire_record(cls: type) -> Schema:
    """A record of the wire format (a StepRecord, an Event): the same checks
    as on the network; kept as its strict-JSON dict."""
    def check(value, path):
        try:
            return wire.json_safe(wire.to_dict(wire.decode(cls, value, path)))
        except wire.WireError as exc:
            raise ShapeError(str(exc)) from None
    return check


_FRAME = obj(file=STR, line=opt(INT), name=STR, code=opt(STR), filename=STR)
_FRAMES = lst(_FRAME)
_THREADS = lst(obj(thread_id=opt(either(INT, STR)), name=opt(STR), main=BOOL, daemon=opt(BOOL), current=opt(BOOL),
                   frames=_FRAMES, owns_gil=opt(BOOL), active=opt(BOOL)))
_IN_FLIGHT = obj(op=STR, numel=opt(INT), entered_at=opt(NUM), callsite=opt(STR))
_PROGRESS = obj(step=opt(INT), forwards=opt(INT), phase=opt(STR), phase_since=opt(NUM), last_progress_at=opt(NUM),
                started_at=opt(NUM), pid=opt(INT), collective=opt(_IN_FLIGHT))
_MARK = obj(step=INT, seqs=dict_of(INT))
# Flight Recorder's own format: torch 2.13 writes pg_status sequence numbers as
# strings ("12"). As lenient as its readers in collector/evidence.py are (they
# convert with int()), strict where they are not.
_SEQ = INTLIKE
_PG_STATUS = dict_of(obj(enqueued=opt(INTLIKE), completed=opt(INTLIKE), last_enqueued_collective=opt(_SEQ),
                         last_completed_collective=opt(_SEQ), last_started_collective=opt(_SEQ)))
_FR_ENTRY = obj(process_group=opt(lst(SCALAR)), pg_id=opt(SCALAR), profiling_name=opt(SCALAR),
                collective_seq_id=opt(INTLIKE), input_sizes=opt(lst(either(lst(SCALAR), SCALAR))),
                input_dtypes=opt(lst(SCALAR)), time_created_ns=opt(INTLIKE), retired=opt(SCALAR),
                thread_id=opt(SCALAR), is_p2p=opt(SCALAR))
_PY_CALL = obj(started_ns=opt(INTLIKE), ended_ns=opt(INTLIKE), thread=opt(SCALAR), callsite=opt(SCALAR),
               op=opt(SCALAR))
_SNAPSHOT_BLOCK = obj(size=opt(INT), state=opt(STR), frames=opt(lst(obj(filename=opt(STR), line=opt(INT),
                                                                        name=opt(STR)))))
_SNAPSHOT = obj(segments=opt(lst(obj(total_size=opt(INT), blocks=opt(lst(_SNAPSHOT_BLOCK))))),
                device_traces=opt(lst(lst(ANY))))
_OPERATION = obj(name=STR, self_ms=opt(NUM), total_ms=opt(NUM), calls=opt(INT))

SCHEMAS: dict[str, Schema] = {
    "stacks.json": _THREADS,
    "worker_stacks.json": lst(obj(pid=INT, threads=_THREADS)),
    "exception.json": obj(type=opt(STR), message=opt(STR), traceback=opt(STR), frames=opt(_FRAMES),
                          unused_parameters=opt(lst(STR))),
    "metrics.json": obj(progress=opt(_PROGRESS), steps=opt(lst(wire_record(wire.StepRecord))), marks=opt(lst(_MARK)),
                        events=opt(lst(wire_record(wire.Event)))),
    "collectives.json": obj(python_calls=opt(lst(_PY_CALL)), pg_status=opt(_PG_STATUS)),
    "flight_recorder.json": obj(entries=opt(lst(_FR_ENTRY)), pg_status=opt(_PG_STATUS)),
    "fr_timeout_dump.json": obj(entries=opt(lst(_FR_ENTRY)), pg_status=opt(_PG_STATUS)),
    "memory.json": obj(rss_bytes=opt(INT), host_available_bytes=opt(INT),
                       cuda=opt(obj(device=opt(INT), allocated_bytes=opt(INT), reserved_bytes=opt(INT),
                                    peak_allocated_bytes=opt(INT), summary=opt(STR)))),
    "memory_snapshot.json": obj(snapshot=opt(_SNAPSHOT), summary=opt(ANY)),
    "profile_summary.json": obj(operations=opt(lst(_OPERATION))),
    "env.json": dict_of(STR),
}
