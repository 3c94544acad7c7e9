"""The diagnostic bundle archive: written by agents and supervisors, read by
the collector and by ``rankwatch analyze``.

A bundle is a gzip'd tar (or an unpacked folder) holding one rank's evidence
for one incident:

    manifest.json          BundleManifest (rank, host, pid, step, reason, versions)
    stacks.json            every thread's Python stack
    exception.json         the uncaught exception, if any
    collectives.json       Python-API collective call sites, pg_status
    flight_recorder.json   torch Flight Recorder dump (JSON)
    metrics.json           recent per-step records and collective marks
    env.json               environment, secrets redacted
    memory.json            host RSS, device memory stats and summary
    native_stacks.txt      py-spy dump (supervisor, from outside)
    faulthandler.txt       faulthandler output (supervisor, from outside)
    memory_snapshot.pickle CUDA memory snapshot for pytorch.org/memory_viz (opaque:
                           never unpickled by rankwatch, see memory_snapshot.json)

Reading is defensive: the archive is untrusted. Sizes are bounded, member
names must be plain known file names (no paths, no links), JSON members are
parsed as JSON only, and ``*.pickle`` members are never loaded.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from . import wire
from .redact import redact_obj, redact_text

_MEMBER_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}\.(json|txt|pickle|gz|json\.gz)$")
OPAQUE_SUFFIXES = (".pickle", ".gz")


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


def pack(manifest: wire.BundleManifest, members: dict[str, Any]) -> bytes:
    """Build the archive. ``members`` maps file name to bytes, str or JSON-able data."""
    blobs: dict[str, bytes] = {}
    for name, content in members.items():
        if content is None:
            continue
        if not _MEMBER_NAME.match(name):
            raise BundleError(f"bad member name {name!r}")
        if isinstance(content, bytes):
            blobs[name] = content
        elif isinstance(content, str):
            blobs[name] = content.encode()
        else:
            blobs[name] = json.dumps(content, default=str).encode()
    manifest.members = sorted(blobs)
    blobs["manifest.json"] = json.dumps(wire.to_dict(manifest)).encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=6) as tar:
        for name in ["manifest.json"] + manifest.members:
            info = tarfile.TarInfo(name)
            info.size = len(blobs[name])
            info.mtime = int(time.time())
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(blobs[name]))
    return buffer.getvalue()


def unpack(data: bytes, source: Optional[str] = None) -> Bundle:
    if len(data) > wire.MAX_BUNDLE_BYTES:
        raise BundleError(f"bundle of {len(data)} bytes exceeds the {wire.MAX_BUNDLE_BYTES}-byte limit")
    members: dict[str, bytes] = {}
    opaque: dict[str, int] = {}
    total = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            for info in tar:
                name = info.name
                if not info.isfile():
                    raise BundleError(f"member {name!r} is not a regular file (links and devices are refused)")
                if not _MEMBER_NAME.match(name):
                    raise BundleError(f"member name {name!r} refused (only plain file names, no paths)")
                if info.size > wire.MAX_BUNDLE_MEMBER_BYTES:
                    raise BundleError(f"member {name!r} of {info.size} bytes exceeds the limit")
                total += info.size
                if total > 4 * wire.MAX_BUNDLE_BYTES:
                    raise BundleError("bundle expands beyond the size limit")
                if name.endswith(OPAQUE_SUFFIXES):
                    opaque[name] = info.size
                    continue
                handle = tar.extractfile(info)
                members[name] = handle.read(info.size + 1) if handle else b""
    except BundleError:
        raise
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        raise BundleError(f"unreadable or truncated bundle archive: {type(exc).__name__}: {exc}") from None
    return _build(members, opaque, source)


def read_folder(path: Path) -> Bundle:
    members: dict[str, bytes] = {}
    opaque: dict[str, int] = {}
    for child in sorted(path.iterdir()):
        if child.is_symlink() or not child.is_file() or not _MEMBER_NAME.match(child.name):
            continue
        size = child.stat().st_size
        if size > wire.MAX_BUNDLE_MEMBER_BYTES:
            raise BundleError(f"{child}: {size} bytes exceeds the member limit")
        if child.name.endswith(OPAQUE_SUFFIXES):
            opaque[child.name] = size
        else:
            members[child.name] = child.read_bytes()
    return _build(members, opaque, str(path))


def read_path(path: Path) -> Bundle:
    if path.is_dir():
        return read_folder(path)
    size = path.stat().st_size
    if size > wire.MAX_BUNDLE_BYTES:
        raise BundleError(f"{path}: {size} bytes exceeds the bundle limit")
    return unpack(path.read_bytes(), str(path))


def _build(members: dict[str, bytes], opaque: dict[str, int], source: Optional[str]) -> Bundle:
    raw_manifest = members.pop("manifest.json", None)
    if raw_manifest is None:
        raise BundleError("bundle has no manifest.json")
    try:
        manifest = wire.loads(wire.BundleManifest, raw_manifest)
    except wire.WireError as exc:
        raise BundleError(f"bad manifest: {exc}") from None
    bundle = Bundle(manifest=manifest, opaque_members=opaque, source_path=source)
    for name, blob in members.items():
        text = blob.decode("utf-8", errors="replace")
        if name.endswith(".json"):
            try:
                bundle.json_members[name] = redact_obj(json.loads(text))
            except ValueError as exc:
                bundle.text_members[name] = redact_text(text[:100_000])
                manifest.notes.append(f"{name}: not valid JSON ({exc}); kept as text")
        else:
            bundle.text_members[name] = redact_text(text)
    return bundle
