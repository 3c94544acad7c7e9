"""What a run's page shows, as plain JSON-able data (`rankwatch.page/v1`).

Built from the report and, when there is one, the run's state (`RunState`:
the heartbeats' numbers, each rank's recent step records, the bundles'
evidence). Nothing here is analysis: the verdicts, their culprits and
summaries are the report's. This module only arranges what the report and the
state already hold so that a person can look at it: stacks grouped by
identity, sequence numbers side by side, series per rank, ranks binned.

Everything is bounded whatever the job's size: at most INDIVIDUAL_RANKS
ranks get their own line in a timeline (culprits and their neighbours first;
the others become per-step bands), at most HEATMAP_ROWS heat map rows (bins
of neighbouring ranks beyond, culprits and neighbours always on a row of their
own), at most TABLE_ROWS rows in a table of ranks.

`rankwatch.outputs.html` turns this into the page. The collector also serves
it as JSON (the live page and `rankwatch analyze URL --html`), so the renderer
treats it as untrusted: every value is escaped and checked there.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional

from rankwatch import __version__, wire

SCHEMA = "rankwatch.page/v1"
INDIVIDUAL_RANKS = 16  # timelines: every rank its own line up to this many
HEATMAP_ROWS = 256  # heat map: one row per rank up to this many, then bins
MAX_STEPS = 256  # steps shown (the newest): the state keeps at most 256 per rank anyway
NEIGHBOURS = 1  # ranks either side of a culprit always shown on their own
MAX_CULPRITS_EXPANDED = 8  # culprits given their own line / row (a 50,000-rank verdict is binned)
TABLE_ROWS = 64  # rows of a table of ranks, beyond culprits and neighbours
MAX_STACK_GROUPS = 12
MAX_FRAMES = 64
ALIGN_COLUMNS = 10  # sequence numbers shown around the one where ranks part
MAX_BUNDLES = 400
MAX_ENV_VARS = 500
MAX_TEXT = 4000  # characters of one value on the page
MAX_TRACEBACK = 16000
MAX_CONFIG_MARKS = 24  # a rank's training-fact changes marked on its timelines (first of each, then thinned)
MAX_CONFIG_FACTS = 8  # facts named in one mark

# (key, title, unit): per-rank step series, in the order the page shows them.
METRICS = (
    ("step_s", "Step time (waiting for peers included)", "s"),
    ("compute_s", "Own compute time (data + forward + backward, waiting excluded)", "s"),
    ("loss", "Loss", ""),
    ("grad_norm", "Local gradient norm (before the allreduce)", ""),
    ("rss_bytes", "Host memory (RSS)", "bytes"),
    ("device_allocated_bytes", "Device memory allocated", "bytes"),
)
HEATMAP_METRICS = ("compute_s", "step_s", "loss", "grad_norm", "rss_bytes", "device_allocated_bytes")


def build(report: wire.Report, run: Any = None, *, page_dir: Optional[Path] = None,
          bundle_href: Optional[Any] = None, argv: Optional[list[str]] = None,
          env: Optional[dict[str, str]] = None, live: bool = False, refresh_s: Optional[float] = None,
          finished: bool = True) -> dict[str, Any]:
    """The page's data for ``report`` (and ``run``, a RunState, when known).

    ``page_dir``: where the page will be written (bundle links are relative to
    it). ``bundle_href(path) -> str|None``: how the live page links a bundle.
    ``argv``/``env``: the launcher's command line and environment, shown when
    no bundle carries the workers' own."""
    culprits = sorted({r for v in report.verdicts for r in v.ranks})
    ranks = sorted(list(run.ranks)) if run is not None else []
    world = report.world_size or (ranks[-1] + 1 if ranks else 0)
    expanded = _expanded(culprits, world)
    model: dict[str, Any] = {
        "schema": SCHEMA,
        "run_id": report.run_id,
        "world_size": world,
        "ranks_seen": len(ranks),
        "status": report.status,
        "notes": list(report.notes),
        "generated_at": _iso(time.time()),
        "generator": f"rankwatch {__version__}",
        "live": live,
        "finished": finished,
        "refresh_s": refresh_s,
        "culprits": culprits,
        "verdicts": [],
    }
    for v in report.verdicts:
        model["verdicts"].append(_verdict(v, run))
    if run is not None:
        steps = _steps(run, ranks)
        model["progress"] = _progress(run, ranks)
        model["timelines"] = timelines(run, ranks, steps, expanded, report)
        model["heatmap"] = heatmap(run, ranks, steps, culprits, world)
        model["bundles"] = bundles(run, page_dir, bundle_href)
    model["run"] = run_info(run, culprits, argv, env)
    # Defence in depth: everything rankwatch stores was redacted already; the
    # page is redacted again as a whole (the series are numbers only).
    from rankwatch.redact import redact_obj

    return {k: (v if k in ("timelines", "heatmap") else redact_obj(v)) for k, v in model.items()}


# -- verdicts -----------------------------------------------------------------------------

def _verdict(v: wire.Verdict, run: Any) -> dict[str, Any]:
    evidence = v.evidence if isinstance(v.evidence, dict) else {}
    hosts = evidence.get("hosts") if isinstance(evidence.get("hosts"), dict) else {}
    if run is not None:
        hosts = {**{str(r): run.ranks[r].host for r in v.ranks[:TABLE_ROWS] if r in run.ranks and run.ranks[r].host},
                 **hosts}
    out: dict[str, Any] = {
        "kind": v.kind,
        "ranks": list(v.ranks),
        "hosts": {str(k): str(h) for k, h in list(hosts.items())[:TABLE_ROWS]},
        "step": v.step,
        "first_seen_at": v.first_seen_at,
        "detected_at": v.detected_at,
        "time_to_verdict_s": _seconds_between(v.first_seen_at, v.detected_at),
        "summary": v.summary,
        "consequences": [c for c in evidence.get("consequences") or [] if isinstance(c, dict)][:TABLE_ROWS],
        "silence": {"config": f"on_{v.kind}: ignore", "env": f"RANKWATCH_ON_{v.kind.upper()}=ignore"},
        "evidence": bounded(evidence, set(v.ranks)),
    }
    incident = evidence.get("incident") if isinstance(evidence.get("incident"), str) else None
    if v.kind == "hang":
        out["stacks"] = stack_groups(run, incident, list(v.ranks), evidence)
    if v.kind in ("hang", "collective_mismatch"):
        out["alignment"] = alignment(run, incident, list(v.ranks), evidence)
    if v.kind == "crash" and run is not None:
        out["exceptions"] = exceptions(run, list(v.ranks))
    return out


def _seconds_between(a: str, b: str) -> Optional[float]:
    try:
        start = dt.datetime.fromisoformat(str(a).replace("Z", "+00:00"))
        end = dt.datetime.fromisoformat(str(b).replace("Z", "+00:00"))
    except ValueError:
        return None
    return round((end - start).total_seconds(), 3)


def bounded(value: Any, culprits: set[int], depth: int = 0) -> Any:
    """A verdict's evidence, cut to what a page can show: lists and maps of at
    most TABLE_ROWS items (a map keyed by rank keeps its culprits and their
    neighbours first), strings of at most MAX_TEXT characters, depth 8."""
    if depth > 8:
        return "..."
    if isinstance(value, str):
        return value if len(value) <= MAX_TEXT else value[:MAX_TEXT] + " ..."
    if isinstance(value, float):
        return value if math.isfinite(value) else wire.json_safe(value)
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, dict):
        keys = list(value)
        if len(keys) > TABLE_ROWS and all(_intlike(k) for k in keys):
            near = {r + d for r in sorted(culprits)[:MAX_CULPRITS_EXPANDED] for d in range(-NEIGHBOURS, NEIGHBOURS + 1)}
            first = [k for k in keys if int(k) in near]
            keys = first + [k for k in keys if int(k) not in near][:TABLE_ROWS]
            out = {str(k): bounded(value[k], culprits, depth + 1) for k in sorted(keys, key=lambda k: int(k))}
            out["..."] = f"{len(value) - len(keys)} more"
            return out
        out = {str(k): bounded(value[k], culprits, depth + 1) for k in keys[:4 * TABLE_ROWS]}
        if len(keys) > 4 * TABLE_ROWS:
            out["..."] = f"{len(keys) - 4 * TABLE_ROWS} more"
        return out
    if isinstance(value, (list, tuple)):
        out = [bounded(item, culprits, depth + 1) for item in list(value)[:TABLE_ROWS]]
        if len(value) > TABLE_ROWS:
            out.append(f"... {len(value) - TABLE_ROWS} more")
        return out
    return str(value)[:MAX_TEXT]


def _intlike(key: Any) -> bool:
    return isinstance(key, int) or (isinstance(key, str) and key.isdigit() and len(key) < 10)


# -- a hang: where each rank is ---------------------------------------------------------------

def stack_groups(run: Any, incident: Optional[str], culprits: list[int], evidence: dict[str, Any]) -> dict[str, Any]:
    """Ranks grouped by their main thread's stack ("3 ranks: this stack; rank
    2: that one"); the culprits' frames are marked where they leave the stack
    most ranks share (the common one). Without bundles, the report's own
    `where` of each rank and the culprit's stack stand in."""
    stacks: dict[int, list[dict[str, Any]]] = {}
    silent: list[int] = []
    if run is not None and incident:
        from rankwatch.collector.analyses.hang import outside_frames
        from rankwatch.collector.evidence import fill_source

        donors = run.all_evidence()
        for rank, ev in sorted(run.evidence_for(incident).items()):
            if rank in culprits and (ev.native_stacks or ev.faulthandler or ev.source != "agent"):
                frames = outside_frames(ev)  # the view the verdict takes of a frozen rank
            else:
                frames = ev.main_stack
            if frames:
                stacks[rank] = fill_source([f for f in frames if isinstance(f, dict)], donors)[-MAX_FRAMES:]
            else:
                silent.append(rank)
    if not stacks:
        return _stack_groups_from_report(culprits, evidence)
    groups: dict[tuple, list[int]] = {}
    for rank, frames in stacks.items():
        key = tuple((str(f.get("file")), f.get("line"), str(f.get("name"))) for f in frames)
        groups.setdefault(key, []).append(rank)
    culprit_set = set(culprits)
    # The common stack: the biggest group without a culprit (where the others wait).
    innocent = [(k, members) for k, members in groups.items() if not culprit_set & set(members)]
    common_key = max(innocent, key=lambda kv: (len(kv[1]), -kv[1][0]))[0] if innocent else None
    common = list(common_key) if common_key is not None else []
    out_groups = []
    # The culprits' groups first, then the biggest.
    ordered = sorted(groups.items(), key=lambda kv: (not culprit_set & set(kv[1]), -len(kv[1]), kv[1][0]))
    for key, members in ordered[:MAX_STACK_GROUPS]:
        frames = stacks[members[0]]
        shared = len(key) if key == common_key else _common_prefix(list(key), common)
        out_groups.append({
            "ranks": members[:TABLE_ROWS],
            "ranks_total": len(members),
            "culprit": bool(culprit_set & set(members)),
            "common": key == common_key,
            "shared_frames": shared,
            "user_frame": _user_frame_index(frames),
            "frames": [_frame(f) for f in frames],
        })
    return {"groups": out_groups, "groups_total": len(groups), "without_stack": silent[:TABLE_ROWS],
            "ranks_with_stack": len(stacks)}


def _stack_groups_from_report(culprits: list[int], evidence: dict[str, Any]) -> dict[str, Any]:
    per_rank = evidence.get("ranks") if isinstance(evidence.get("ranks"), dict) else {}
    groups: dict[str, list[int]] = {}
    for key, info in per_rank.items():
        if _intlike(key) and isinstance(info, dict) and isinstance(info.get("where"), str):
            groups.setdefault(info["where"], []).append(int(key))
    culprit_set = set(culprits)
    frames = evidence.get("culprit_stack") if isinstance(evidence.get("culprit_stack"), list) else []
    out = []
    for where_text, members in sorted(groups.items(), key=lambda kv: (not culprit_set & set(kv[1]), -len(kv[1]))):
        is_culprit = bool(culprit_set & set(members))
        group: dict[str, Any] = {"ranks": sorted(members)[:TABLE_ROWS], "ranks_total": len(members),
                                 "culprit": is_culprit, "common": False, "where": where_text, "shared_frames": 0,
                                 "frames": []}
        if is_culprit and frames:
            clean = [f for f in frames if isinstance(f, dict)][-MAX_FRAMES:]
            group["frames"] = [_frame(f) for f in clean]
            group["user_frame"] = _user_frame_index(clean)
        out.append(group)
    if not out and frames:
        clean = [f for f in frames if isinstance(f, dict)][-MAX_FRAMES:]
        out.append({"ranks": culprits[:TABLE_ROWS], "ranks_total": len(culprits), "culprit": True, "common": False,
                    "shared_frames": 0, "frames": [_frame(f) for f in clean], "user_frame": _user_frame_index(clean)})
    return {"groups": out[:MAX_STACK_GROUPS], "groups_total": len(out), "without_stack": [],
            "ranks_with_stack": sum(len(g) for g in groups.values()), "from_report": True}


def _frame(f: dict[str, Any]) -> dict[str, Any]:
    line = f.get("line")
    return {"file": str(f.get("file") or "")[:MAX_TEXT], "line": line if isinstance(line, int) else None,
            "name": str(f.get("name") or "")[:200], "code": str(f.get("code") or "").strip()[:MAX_TEXT]}


def _common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _user_frame_index(frames: list[dict[str, Any]]) -> Optional[int]:
    """The innermost frame of the user's own code: the line the rank is at."""
    from rankwatch.collector.analyses.common import is_machinery

    for i in range(len(frames) - 1, -1, -1):
        if not is_machinery(str(frames[i].get("file", ""))):
            return i
    return None


# -- collective alignment -------------------------------------------------------------------

def alignment(run: Any, incident: Optional[str], culprits: list[int], evidence: dict[str, Any]) -> list[dict[str, Any]]:
    """Per process group, each rank's last enqueued and completed collective
    (sequence number and op), with the first sequence number where ranks part
    (the report's `waiting_at` when it says, else the first one not every
    rank enqueued, or whose op differs between ranks)."""
    per_rank: dict[int, dict[str, Any]] = {}  # rank -> {"enq": {pg: n}, "comp": {pg: n}, "ops": {pg: {seq: op}}}
    if run is not None:
        from_evidence = run.evidence_for(incident) if incident else {}
        for rank in sorted(run.ranks):
            state = run.ranks[rank]
            ev = from_evidence.get(rank)
            enq = dict(ev.pg_enqueued) if ev is not None and ev.pg_enqueued else dict(state.enqueued)
            comp = dict(ev.pg_completed) if ev is not None and ev.pg_completed else dict(state.completed)
            ops: dict[str, dict[int, dict[str, Any]]] = {}
            if ev is not None:
                for entry in ev.collectives[-4 * ALIGN_COLUMNS * 4:]:
                    ops.setdefault(entry.pg, {})[entry.seq] = {"op": entry.op, "shape": entry.shape_text,
                                                              "signature": "|".join(map(str, entry.signature)),
                                                              "origin": entry.origin}
            if enq or comp:
                per_rank[rank] = {"enq": enq, "comp": comp, "ops": ops, "source": "bundle" if ev else "heartbeat"}
    if not per_rank:
        listed = evidence.get("ranks") if isinstance(evidence.get("ranks"), dict) else {}
        for key, info in listed.items():
            if _intlike(key) and isinstance(info, dict) and isinstance(info.get("collective_seq"), dict):
                seqs = {str(pg): n for pg, n in info["collective_seq"].items() if isinstance(n, int)}
                per_rank[int(key)] = {"enq": seqs, "comp": {}, "ops": {}, "source": "report"}
    waiting_at = evidence.get("waiting_at") if isinstance(evidence.get("waiting_at"), dict) else {}
    mismatch_seq = evidence.get("sequence") if isinstance(evidence.get("sequence"), int) else None
    mismatch_pg = str(evidence.get("process_group", ""))
    pgs = sorted({pg for info in per_rank.values() for pg in list(info["enq"]) + list(info["comp"])},
                 key=lambda p: (len(p), p))
    out = []
    for pg in pgs[:16]:
        members = {r: info for r, info in per_rank.items() if pg in info["enq"] or pg in info["comp"]}
        if not members:
            continue
        enq = {r: info["enq"].get(pg, -1) for r, info in members.items()}
        comp = {r: info["comp"].get(pg) for r, info in members.items()}
        top = max(enq.values())
        parting = waiting_at.get(pg) if isinstance(waiting_at.get(pg), int) else None
        why = "the collective the others wait in" if parting is not None else ""
        if parting is None and mismatch_seq is not None and mismatch_pg in ("", pg):
            parting, why = mismatch_seq, "ranks issued different collectives here"
        if parting is None and min(enq.values()) < top:
            parting, why = min(enq.values()) + 1, "the first collective not every rank enqueued"
        if parting is None:
            parting, why = _first_differing_op(members, pg), "ranks issued different collectives here"
        if parting is None:
            known = [c for c in comp.values() if c is not None]
            if known and min(known) < max(known):
                parting, why = min(known) + 1, "the first collective not every rank completed"
        rows = _alignment_rows(members, pg, enq, comp, parting, culprits)
        out.append({"pg": pg, "parting_seq": parting, "parting_why": why, "top_enqueued": top,
                    "ranks": len(members), "rows": rows, "columns": _columns(members, pg, parting, top)})
    return out


def _first_differing_op(members: dict[int, dict[str, Any]], pg: str) -> Optional[int]:
    seqs = sorted({s for info in members.values() for s in info["ops"].get(pg, {})})
    for seq in seqs:
        signatures = {info["ops"][pg][seq]["signature"] for info in members.values() if seq in info["ops"].get(pg, {})}
        if len(signatures) > 1:
            return seq
    return None


def _op_at(info: dict[str, Any], pg: str, seq: Optional[int]) -> Optional[str]:
    if seq is None:
        return None
    entry = info["ops"].get(pg, {}).get(seq)
    return entry["shape"] if entry else None


def _alignment_rows(members: dict[int, dict[str, Any]], pg: str, enq: dict[int, int],
                    comp: dict[int, Optional[int]], parting: Optional[int], culprits: list[int]) -> list[dict[str, Any]]:
    """One row per rank up to TABLE_ROWS ranks; beyond, ranks with the same
    numbers and ops share a row, culprits and their neighbours keep their own."""
    keep_apart = _near(culprits, max(members) + 1) if len(members) > TABLE_ROWS else set(members)
    rows: dict[tuple, dict[str, Any]] = {}
    culprit_set = set(culprits)
    for rank in sorted(members):
        info = members[rank]
        e, c = enq[rank], comp[rank]
        cells = {"enqueued": e if e >= 0 else None, "completed": c,
                 "enqueued_op": _op_at(info, pg, e), "completed_op": _op_at(info, pg, c),
                 "behind": parting is not None and e >= 0 and e < parting,
                 "source": info["source"]}
        key = (rank,) if rank in keep_apart else tuple(sorted((k, str(v)) for k, v in cells.items()))
        row = rows.get(key)
        if row is None:
            row = rows[key] = {**cells, "ranks": [], "ranks_total": 0, "culprit": False}
        if len(row["ranks"]) < TABLE_ROWS:
            row["ranks"].append(rank)
        row["ranks_total"] += 1
        row["culprit"] = row["culprit"] or rank in culprit_set
    ordered = sorted(rows.values(), key=lambda r: r["ranks"][0])
    return ordered[:2 * TABLE_ROWS]


def _columns(members: dict[int, dict[str, Any]], pg: str, parting: Optional[int], top: int) -> dict[str, Any]:
    """The sequence numbers around where ranks part, and what each rank had
    there: done (completed), pending (enqueued, not completed), absent (not
    enqueued). Ranks with the same cells share a row."""
    if top < 0:
        return {"seqs": [], "rows": []}
    centre = parting if parting is not None else top
    last = max(top, centre)
    first = max(0, min(centre - ALIGN_COLUMNS // 2, last - ALIGN_COLUMNS + 1))
    seqs = list(range(first, last + 1))[-ALIGN_COLUMNS:]
    rows: dict[tuple, dict[str, Any]] = {}
    for rank in sorted(members):
        info = members[rank]
        e = info["enq"].get(pg, -1)
        c = info["comp"].get(pg)
        cells = []
        for seq in seqs:
            state = "absent" if seq > e else ("done" if c is not None and seq <= c else
                                              "pending" if c is not None else "enqueued")
            op = info["ops"].get(pg, {}).get(seq)
            cells.append({"state": state, "op": op["op"] if op else None, "shape": op["shape"] if op else None})
        key = tuple((cell["state"], cell["shape"]) for cell in cells)
        row = rows.setdefault(key, {"ranks": [], "ranks_total": 0, "cells": cells})
        if len(row["ranks"]) < TABLE_ROWS:
            row["ranks"].append(rank)
        row["ranks_total"] += 1
    ordered = sorted(rows.values(), key=lambda r: r["ranks"][0])
    return {"seqs": seqs, "rows": ordered[:TABLE_ROWS]}


# -- a crash: the exception -----------------------------------------------------------------

def exceptions(run: Any, culprits: list[int]) -> list[dict[str, Any]]:
    out = []
    for rank in culprits[:MAX_CULPRITS_EXPANDED]:
        state = run.ranks.get(rank)
        event = state.exception_event() if state is not None else None
        if event is None:
            continue
        details = event.details if isinstance(event.details, dict) else {}
        out.append({"rank": rank, "type": str(details.get("type") or "")[:200],
                    "message": str(details.get("message") or "")[:MAX_TEXT],
                    "traceback": str(details.get("traceback") or "")[-MAX_TRACEBACK:], "step": event.step})
    return out


# -- series per rank ----------------------------------------------------------------------

def _near(culprits: Iterable[int], world: int) -> set[int]:
    out = set()
    for r in sorted(culprits)[:MAX_CULPRITS_EXPANDED]:
        for d in range(-NEIGHBOURS, NEIGHBOURS + 1):
            if 0 <= r + d < max(world, r + 1):
                out.add(r + d)
    return out


def _expanded(culprits: list[int], world: int) -> list[int]:
    """Ranks drawn one by one: every rank of a small job; of a big one the
    culprits, their neighbours and rank 0 (a reference)."""
    if world <= INDIVIDUAL_RANKS:
        return list(range(world))
    chosen = sorted(_near(culprits, world) | {0})
    return chosen[:INDIVIDUAL_RANKS]


def _sampled(rows: dict[str, list], steps: int) -> Optional[dict[str, int]]:
    """A series with values at fewer than half of the steps shown (the
    gradient checks' sampled steps) is sampled: drawn as points (lines would
    be fragments between gaps), and the page says how many steps have one."""
    with_value = sum(1 for j in range(steps) if any(j < len(row) and row[j] is not None for row in rows.values()))
    if steps == 0 or with_value == 0 or with_value * 2 >= steps:
        return None
    return {"steps_with_value": with_value, "steps": steps}


def _steps(run: Any, ranks: list[int]) -> list[int]:
    seen: set[int] = set()
    for r in ranks:
        seen.update(list(run.ranks[r].steps))  # one snapshot per rank: the live collector keeps ingesting
    return sorted(seen)[-MAX_STEPS:]


def _value(record: Any, key: str) -> Optional[float]:
    if key == "step_s":
        value = record.ended_at - record.started_at
    else:
        value = getattr(record, key, None)
    if value is None or isinstance(value, bool):
        return None
    return float(value)


def _num(value: Optional[float]) -> Any:
    """4 significant digits (the page's resolution, and a smaller page);
    non-finite values as the strings strict JSON uses."""
    if value is None:
        return None
    if not math.isfinite(value):
        return wire.json_safe(value)
    if value == 0:
        return 0
    return float(f"{value:.4g}")


def timelines(run: Any, ranks: list[int], steps: list[int], expanded: list[int],
              report: wire.Report) -> dict[str, Any]:
    """Per metric: one series per expanded rank, and for a job with more ranks
    than that, the per-step minimum, median and maximum of all ranks."""
    index = {s: i for i, s in enumerate(steps)}
    shown = [r for r in expanded if r in run.ranks]
    binned = len(ranks) > len(shown)
    series: dict[str, dict[str, list]] = {key: {} for key, _, _ in METRICS}
    for r in shown:
        records = list(run.ranks[r].steps.items())
        for key, _, _ in METRICS:
            row: list = [None] * len(steps)
            for step, record in records:
                i = index.get(step)
                if i is not None:
                    row[i] = _num(_value(record, key))
            series[key][str(r)] = row
    bands: dict[str, dict[str, list]] = {}
    if binned:
        columns: dict[str, list[list[float]]] = {key: [[] for _ in steps] for key, _, _ in METRICS}
        for r in ranks:
            for step, record in list(run.ranks[r].steps.items()):
                i = index.get(step)
                if i is None:
                    continue
                for key, _, _ in METRICS:
                    value = _value(record, key)
                    if value is not None and math.isfinite(value):
                        columns[key][i].append(value)
        for key, _, _ in METRICS:
            lo, mid, hi = [], [], []
            for values in columns[key]:
                if values:
                    values.sort()
                    lo.append(_num(values[0]))
                    mid.append(_num(values[len(values) // 2]))
                    hi.append(_num(values[-1]))
                else:
                    lo.append(None)
                    mid.append(None)
                    hi.append(None)
            bands[key] = {"min": lo, "median": mid, "max": hi}
    metrics = []
    for key, title, unit in METRICS:
        rows = series[key]
        has_data = any(v is not None for row in rows.values() for v in row) or (
            key in bands and any(v is not None for v in bands[key]["max"]))
        if not has_data:
            continue
        metric = {"key": key, "title": title, "unit": unit, "series": rows, "bands": bands.get(key)}
        sampled = _sampled(rows, len(steps))
        if sampled is not None:
            metric["sampled"] = sampled
        metrics.append(metric)
    markers = [{"step": v.step, "kind": v.kind, "ranks": v.ranks[:MAX_CULPRITS_EXPANDED]}
               for v in report.verdicts if isinstance(v.step, int)]
    markers += config_marks(run, shown, steps)
    return {"steps": steps, "ranks": [str(r) for r in shown], "binned": binned, "ranks_total": len(ranks),
            "metrics": metrics, "markers": markers}


def config_marks(run: Any, shown: list[int], steps: list[int]) -> list[dict[str, Any]]:
    """The shown ranks' training-fact changes (`train_config` events,
    agent/checks/train_config.py: train/eval mode, clipping, autocast, ...) as
    timeline markers: {"step", "kind": "train_config", "ranks", "changed":
    [[fact, value]], "sites": [[fact, "file:line"]]}. A rank's first facts
    are its baseline, not a change. Per rank at most MAX_CONFIG_MARKS: the
    first change of each fact to each value, then evenly thinned others. The
    same change at the same step on several ranks is one marker."""
    lo, hi = (steps[0], steps[-1]) if steps else (None, None)
    grouped: dict[tuple, dict[str, Any]] = {}
    for r in shown:
        events = sorted((e for e in run.ranks[r].events if e.kind == "train_config" and isinstance(e.step, int)),
                        key=lambda e: e.step)
        current: dict[str, str] = {}
        changes = []
        for n, event in enumerate(events):
            details = event.details if isinstance(event.details, dict) else {}
            sites = {str(k): str(v) for k, v in _pairs(details.get("sites"))}
            changed = []
            for key, value in _pairs(details.get("facts")):
                key, value = str(key)[:MAX_TEXT], str(value)[:MAX_TEXT]
                if current.get(key) != value:
                    if n > 0:
                        changed.append((key, value))
                    current[key] = value
            if changed:
                changes.append((event.step, changed, sites))
        if len(changes) > MAX_CONFIG_MARKS:
            seen: set = set()
            firsts = []
            for i, (_, changed, _) in enumerate(changes):
                if any(c not in seen for c in changed):
                    firsts.append(i)
                seen.update(changed)
            keep = set(firsts[:MAX_CONFIG_MARKS])
            rest = [i for i in range(len(changes)) if i not in keep]
            room = MAX_CONFIG_MARKS - len(keep)
            if room > 0 and rest:
                keep.update(rest[int(j * len(rest) / room)] for j in range(min(room, len(rest))))
            changes = [c for i, c in enumerate(changes) if i in keep]
        for step, changed, sites in changes:
            if lo is not None and not lo <= step <= hi:
                continue  # outside the steps shown
            facts = changed[:MAX_CONFIG_FACTS]
            where = tuple((k, sites[k]) for k, _ in facts if sites.get(k))
            mark = grouped.setdefault((step, tuple(facts), where), {
                "step": step, "kind": "train_config", "ranks": [], "changed": [list(c) for c in facts],
                "sites": [list(w) for w in where]})
            if len(mark["ranks"]) < MAX_CULPRITS_EXPANDED * 2:
                mark["ranks"].append(r)
    return sorted(grouped.values(), key=lambda m: (m["step"], m["ranks"]))


def _pairs(value: Any) -> list:
    return [p for p in value if isinstance(p, (list, tuple)) and len(p) == 2][:64] if isinstance(value, list) else []


def heatmap(run: Any, ranks: list[int], steps: list[int], culprits: list[int], world: int) -> dict[str, Any]:
    """Ranks x steps. One row per rank up to HEATMAP_ROWS ranks; beyond, rows
    are bins of neighbouring ranks holding the largest value of their ranks
    (an outlier lights its bin up; a NaN wins), and every culprit and its
    neighbours keep a row of their own."""
    if not ranks or not steps:
        return {"rows": [], "steps": steps, "metrics": []}
    index = {s: i for i, s in enumerate(steps)}
    culprit_set = set(culprits)
    if len(ranks) <= HEATMAP_ROWS:
        groups = [[r] for r in ranks]
    else:
        apart = _near(culprits, world) & set(ranks)
        size = math.ceil(len(ranks) / HEATMAP_ROWS)
        groups, current = [], []
        for r in ranks:
            if r in apart:
                if current:
                    groups.append(current)
                    current = []
                groups.append([r])
                continue
            current.append(r)
            if len(current) >= size:
                groups.append(current)
                current = []
        if current:
            groups.append(current)
    metrics = []
    available = {key for key in HEATMAP_METRICS}
    grids: dict[str, list[list]] = {key: [] for key in available}
    present: dict[str, bool] = {key: False for key in available}
    for group in groups:
        cells = {key: [None] * len(steps) for key in available}
        for r in group:
            for step, record in list(run.ranks[r].steps.items()):
                i = index.get(step)
                if i is None:
                    continue
                for key in available:
                    value = _value(record, key)
                    if value is None:
                        continue
                    current = cells[key][i]
                    if current is None or not math.isfinite(value) or (math.isfinite(current) and value > current):
                        cells[key][i] = value
        for key in available:
            row = [_num(v) for v in cells[key]]
            present[key] = present[key] or any(v is not None for v in row)
            grids[key].append(row)
    titles = {key: (title, unit) for key, title, unit in METRICS}
    for key in HEATMAP_METRICS:
        if present[key]:
            metrics.append({"key": key, "title": titles[key][0], "unit": titles[key][1], "values": grids[key]})
    rows = [{"ranks": [g[0], g[-1]], "size": len(g), "culprit": bool(culprit_set & set(g))} for g in groups]
    return {"rows": rows, "steps": steps, "metrics": metrics, "binned": len(ranks) > HEATMAP_ROWS,
            "ranks_total": len(ranks)}


def _progress(run: Any, ranks: list[int]) -> dict[str, Any]:
    """Where the job got to: the last step reached, lowest and highest."""
    if not ranks:
        return {}
    steps = [run.ranks[r].step for r in ranks]
    exited = sum(1 for r in list(run.notable) if r in run.ranks and run.ranks[r].exit_code is not None)
    return {"min_step": min(steps), "max_step": max(steps), "ranks": len(ranks), "exited": exited,
            "finished": bool(run.finished), "aborted": run.aborted}


# -- bundles, versions, environment ---------------------------------------------------------

def bundles(run: Any, page_dir: Optional[Path], bundle_href: Optional[Any]) -> dict[str, Any]:
    """Every bundle the run's evidence came from, with its members."""
    items = []
    total = 0
    for state in run.notable_ranks():
        for incident, ev in list(state.evidence.items()):
            total += 1
            if len(items) >= MAX_BUNDLES:
                continue
            path = ev.bundle_path
            items.append({"incident": incident, "rank": state.rank, "source": ev.source, "reason": ev.reason,
                          "host": ev.host or state.host, "path": path or "", "href": _href(path, page_dir, bundle_href),
                          "members": [{"name": m, "href": _member_href(path, m, page_dir, bundle_href)}
                                      for m in list(ev.members)[:64]],
                          "archive": bool(path and str(path).endswith((".tar.gz", ".tgz"))),
                          "notes": [str(n)[:500] for n in ev.notes[:8]]})
    return {"items": items, "total": total}


def _href(path: Optional[str], page_dir: Optional[Path], bundle_href: Optional[Any]) -> Optional[str]:
    if not path:
        return None
    if bundle_href is not None:
        return bundle_href(path)
    if page_dir is None:
        return None
    try:
        rel = os.path.relpath(Path(path).resolve(), Path(page_dir).resolve())
    except (OSError, ValueError):
        return None
    return Path(rel).as_posix() if not rel.startswith("..") else Path(path).resolve().as_uri()


def _member_href(path: Optional[str], member: str, page_dir: Optional[Path], bundle_href: Optional[Any]) -> Optional[str]:
    """A member file is linkable when the bundle is a folder on disk."""
    if not path or str(path).endswith((".tar.gz", ".tgz")) or bundle_href is not None:
        return None
    return _href(str(Path(path) / member), page_dir, None)


def run_info(run: Any, culprits: list[int], argv: Optional[list[str]], env: Optional[dict[str, str]]) -> dict[str, Any]:
    """Versions, the command line and the environment (redacted): the workers'
    own from a bundle when there is one (a culprit's first), else what the
    launcher passed."""
    from rankwatch.redact import redact_env, redact_obj

    info: dict[str, Any] = {"versions": {"rankwatch": __version__,
                                         "python": sys.version.split()[0]},
                            "argv": None, "env": None,
                            "source": "the process that made this page (no agent bundle carries the workers' own)"}
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__version__", None):
        info["versions"]["torch"] = str(torch.__version__)
    bundle = _first_bundle(run, culprits) if run is not None else None
    if bundle is not None:
        m = bundle.manifest
        info["versions"] = {k: v for k, v in (("torch", m.torch_version), ("rankwatch", m.rankwatch_version),
                                              ("python", m.python_version.split()[0] if m.python_version else ""))
                            if v}
        info["source"] = f"rank {m.rank}'s bundle ({m.host})"
        runtime = bundle.get("runtime.json")
        if isinstance(runtime, dict) and isinstance(runtime.get("argv"), list):
            info["argv"] = [str(a)[:MAX_TEXT] for a in redact_obj(runtime["argv"])[:200]]
            if isinstance(runtime.get("executable"), str):
                info["executable"] = redact_obj(runtime["executable"])[:MAX_TEXT]
        env_member = bundle.get("env.json")
        if isinstance(env_member, dict):
            info["env"] = _env(redact_env({str(k): str(v) for k, v in env_member.items()}))
    if info["argv"] is None and argv is not None:
        info["argv"] = [str(a)[:MAX_TEXT] for a in redact_obj(list(argv))[:200]]
        info["argv_source"] = "the launcher"
    if info["env"] is None and env is not None:
        info["env"] = _env(redact_env(dict(env)))
        info["env_source"] = "the launcher"
    return info


def _env(env: dict[str, str]) -> dict[str, str]:
    keys = sorted(env)[:MAX_ENV_VARS]
    return {k: env[k][:MAX_TEXT] for k in keys}


def _first_bundle(run: Any, culprits: list[int]):
    """One bundle to read versions and environment from: a culprit's agent
    bundle first (the workers' own view), else any agent bundle."""
    from rankwatch.bundles import BundleError, read_path

    candidates = []
    for state in run.notable_ranks():
        for ev in list(state.evidence.values()):
            if ev.bundle_path and ev.source == "agent":
                candidates.append((state.rank not in culprits, state.rank, ev.bundle_path))
    for _, _, path in sorted(candidates)[:3]:
        try:
            return read_path(Path(path))
        except (BundleError, wire.WireError, OSError, ValueError):
            continue
    return None


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def rank_ranges(ranks: Iterable[int], limit: int = 12) -> str:
    """'0-3, 5, 7-9': ranks as ranges."""
    ordered = sorted(set(int(r) for r in ranks))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}\u2013{ordered[j]}")
        i = j + 1
    if len(parts) > limit:
        return ", ".join(parts[:limit]) + f", ... ({len(ordered)} ranks)"
    return ", ".join(parts)
