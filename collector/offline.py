"""``rankwatch analyze PATH``: the same analyses, offline, from files only.

PATH may be a run dir (index + bundles), a folder of bundles, or one bundle
archive. Needs neither the network nor torch.distributed.

Everything is opened read-only: the index through SQLite's read-only /
immutable URI (``collector.sqlite`` stays byte-identical, nothing is created
next to it), bundles through the bounded reader. A corrupt or foreign index,
or a bad bundle, is a warning naming the file and the analysis goes on with
what is readable; nothing readable at all is an AnalyzeError (exit 2).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import sqlite3

from rankwatch import wire
from rankwatch.bundles import BundleError, read_path

from . import analyses, report as report_mod
from .state import Incident, RunState
from .store import Store


class AnalyzeError(ValueError):
    pass


MAX_BUNDLES = 20_000  # per analysis: a run dir of 10,000 ranks x 2 incidents


def _bundle_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    found = []
    for path in sorted(root.rglob("*")):
        if len(found) >= MAX_BUNDLES:
            break
        if path.is_symlink():
            continue
        if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
            found.append(path)
        elif path.is_dir() and (path / "manifest.json").is_file():
            found.append(path)
    return found


def load(path: Path, run_id: Optional[str] = None) -> tuple[RunState, list[str]]:
    """Rebuild a RunState from PATH; returns it with the problems met on the way.

    A standalone collector's data dir holds many runs: ``run_id`` picks one
    (default: the newest in its index)."""
    path = Path(path)
    if not path.exists():
        raise AnalyzeError(f"{path} does not exist")
    problems: list[str] = []
    run: Optional[RunState] = None
    index = path / "collector.sqlite" if path.is_dir() else None
    if index is not None and index.is_file():
        run = _load_index(index, problems, run_id)
    elif run_id is not None and (path / "runs" / run_id).is_dir():
        path = path / "runs" / run_id
    bundles = []
    for file in _bundle_files(path):
        try:
            bundle = read_path(file)
        except (BundleError, wire.WireError, OSError) as exc:
            problems.append(f"{file}: {exc}")
            continue
        bundles.append(bundle)
        problems.extend(f"{file}: {note}" for note in bundle.manifest.notes if ": dropped" in note)
    if run is None:
        if not bundles:
            raise AnalyzeError(f"{path}: no rankwatch index and no readable bundle found"
                               + (f" ({'; '.join(problems)})" if problems else ""))
        first = bundles[0].manifest
        run = RunState(run_id=first.run_id, world_size=max(b.manifest.world_size for b in bundles),
                       started_at=min(b.manifest.created_at for b in bundles))
    from .service import merge_bundle

    seen_incidents = {i.id for i in run.incidents}
    for bundle in bundles:
        m = bundle.manifest
        if m.run_id != run.run_id:
            problems.append(f"{bundle.source_path}: belongs to run {m.run_id}, not {run.run_id}; skipped")
            continue
        try:
            merge_bundle(run, bundle)
        except Exception as exc:  # validated already: a defect, reported, not fatal
            problems.append(f"{bundle.source_path}: evidence not merged ({type(exc).__name__}: {exc})")
            continue
        if m.reason == "hang" and m.incident and m.incident not in seen_incidents:
            seen_incidents.add(m.incident)
            run.incidents.append(_hang_incident_from_bundles(run, m.incident, bundles))
    run.termination = run.termination or _termination(path, problems)
    run.finished = True
    return run, problems


TERMINATION_FILE = "termination.json"  # the launcher's record of an outside ending (a scheduler, a signal)


def _termination(path: Path, problems: list[str]) -> Optional[wire.Termination]:
    """How something outside ended the run, when its launcher wrote it down
    (untrusted like any file here: bounded, validated)."""
    file = path / TERMINATION_FILE if path.is_dir() else None
    if file is None or not file.is_file():
        return None
    try:
        if file.stat().st_size > 64 * 1024:
            raise ValueError("larger than 64 KiB")
        return wire.decode(wire.Termination, wire.parse_json(file.read_bytes(), TERMINATION_FILE))
    except (ValueError, OSError) as exc:
        problems.append(f"{file}: not read ({exc})")
        return None


def _load_index(index: Path, problems: list[str], run_id: Optional[str] = None) -> Optional[RunState]:
    """One run of a collector index (``run_id``, default the newest), read-only;
    None (with a problem said) when the file is not a readable rankwatch index."""
    store = None
    try:
        store = Store(index, readonly=True)
        ids = store.run_ids()
        if run_id is not None:
            if run_id not in ids:
                raise AnalyzeError(f"{index}: no run {run_id!r}; it holds {', '.join(ids[-20:]) or 'none'}")
            return store.load_run(run_id)
        if len(ids) > 1:
            problems.append(f"{index} holds {len(ids)} runs; analysing the newest, {ids[-1]} "
                            f"(--run RUN_ID picks another: {', '.join(ids[-6:-1])})")
        return store.load_run(ids[-1]) if ids else None
    except AnalyzeError:
        raise
    except (sqlite3.Error, ValueError, TypeError, KeyError, IndexError) as exc:
        problems.append(f"{index}: not a readable rankwatch index ({type(exc).__name__}: {exc}); "
                        f"analysing the bundles only")
        return None
    finally:
        if store is not None:
            try:
                store.close()
            except Exception:
                pass


def _hang_incident_from_bundles(run: RunState, incident: str, bundles) -> Incident:
    mine = [b for b in bundles if b.manifest.incident == incident]
    created = min(b.manifest.created_at for b in mine)
    progress = [float(b.get("metrics.json", {}).get("progress", {}).get("last_progress_at") or 0) for b in mine]
    last = max([p for p in progress if p] or [created])
    return Incident(id=incident, kind="hang", opened_at=created, last_progress_at=last, ready=True,
                    requested_ranks=sorted({b.manifest.rank for b in mine}), details={"diagnosed_at": created})


def analyze_path(path: Path, run_id: Optional[str] = None) -> wire.Report:
    run, problems = load(Path(path), run_id)
    verdicts = analyses.run_all(run, time.time(), final=True)
    previous = _detected_at(Path(path))
    for v in verdicts:
        key = (v.kind, ",".join(map(str, v.ranks)))
        if key in previous:
            v.detected_at = previous[key]
    report = report_mod.build(run, verdicts)
    for problem in problems:
        import sys

        print(f"[rankwatch] warning: {problem}", file=sys.stderr)
    return report


def _detected_at(path: Path) -> dict[tuple[str, str], str]:
    """Keep the live detection times when the run dir has them."""
    report_file = path / "report.json" if path.is_dir() else None
    if report_file is None or not report_file.is_file():
        return {}
    try:
        if report_file.stat().st_size > wire.MAX_MESSAGE_BYTES:
            return {}
        data = wire.parse_json(report_file.read_bytes(), "report.json")
        return {(str(v["kind"]), ",".join(map(str, v["ranks"]))): str(v["detected_at"])
                for v in data.get("verdicts", [])}
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        return {}
