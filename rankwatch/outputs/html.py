"""``report.html``: one self-contained page per run.

    rankwatch run ...                       # writes <run-dir>/report.html next to report.json
    rankwatch analyze PATH --html FILE      # any run dir, bundle folder, bundle or collector URL
    http://COLLECTOR/runs/<run-id>          # the same page, live, on the collector

The page is the report and the run's state arranged for a person
(`pagedata`): a card per verdict; for a hang, the ranks' stacks grouped and
the collective sequence numbers side by side; timelines and a heat map of
the ranks' steps; the bundles, versions, command line and environment.

How it is made, and why:

- The HTML is rendered here, on the server side, with the standard library
  (`html.escape` on every value, `string.Template` for the shell): no
  template engine joins the dependencies of `rankwatch run`, which every
  training image installs.
- Charts are drawn in the browser by uPlot (vendored, MIT, ~50 KB: a
  time-series library made for many series on a canvas, with cursor values
  and zoom) from a JSON data island; the heat map is a plain canvas. No
  framework.
- Everything is inline (CSS, scripts, data): it opens from ``file://`` with
  no network, and a Content-Security-Policy that allows only this page's own
  scripts and styles (by hash) and no connection (the live page: its own
  origin) makes any markup that slipped through inert as well.
- Values come from untrusted ranks (stacks, exception texts, environment)
  and, for a page built from a collector's data, from the network: every
  string is escaped, every number checked, links keep to relative paths,
  ``file:`` and the collector's own routes.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import html as html_lib
import json
import math
import os
import re
import string
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Optional

from rankwatch import wire

from . import pagedata

KIND_COLOURS = {"hang": "#d62728", "collective_mismatch": "#9467bd", "crash": "#8c564b", "nonfinite": "#e377c2",
                "grad_spike": "#ff7f0e", "weight_divergence": "#17becf", "straggler": "#1f77b4",
                "oom": "#7f7f7f", "memory_growth": "#bcbd22", "config_divergence": "#2ca02c",
                "duplicate_data": "#8c6d31", "broken_update": "#637939",
                "train_config": "#2f4f4f"}
KIND_TEXT = {
    "hang": "no progress past the hang timeout",
    "collective_mismatch": "ranks issued different collectives at one sequence number",
    "crash": "a rank died",
    "nonfinite": "NaN/Inf in local loss or gradients, before the allreduce",
    "grad_spike": "a rank's local gradient norm is an outlier",
    "weight_divergence": "replicas hold different weights",
    "straggler": "a rank's own compute time is persistently slower",
    "oom": "out of memory",
    "memory_growth": "memory grows step after step",
    "config_divergence": "ranks that must train the same way do not",
    "duplicate_data": "ranks train on identical batches",
    "broken_update": "the optimizer step does not update what training needs",
}
SHOWN_ELSEWHERE = {"consequences", "culprit_stack"}
FIRST_COLUMNS = ("host", "bundles")  # per-rank evidence columns shown right after the rank  # evidence keys with a section of their own


# -- the document -----------------------------------------------------------------------------

def page(report: wire.Report, run: Any = None, **kwargs: Any) -> str:
    """The whole page for ``report`` (and the run's state, when known)."""
    return document(pagedata.build(report, run, **kwargs))


def write(report: wire.Report, path: Path, run: Any = None, **kwargs: Any) -> Path:
    """Write the page atomically (a full disk leaves no half page behind)."""
    path = Path(path)
    kwargs.setdefault("page_dir", path.parent)
    return _write_text(page(report, run, **kwargs), path)


def write_model(model: dict[str, Any], path: Path) -> Path:
    """Write the page of ready page data (a collector's: checked as it is rendered)."""
    model = dict(_d(model))
    model["live"] = False
    bundles = _d(model.get("bundles"))
    if bundles:  # the collector's download routes mean nothing in a file
        items = [dict(i) for i in _l(bundles.get("items"), pagedata.MAX_BUNDLES) if isinstance(i, dict)]
        for item in items:
            if isinstance(item.get("href"), str) and item["href"].startswith("/"):
                item["href"] = None
        model["bundles"] = {**bundles, "items": items}
    return _write_text(document(model), Path(path))


def _write_text(text: str, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return path


def document(model: dict[str, Any], poll_url: Optional[str] = None) -> str:
    """The page: shell, inline assets, the data island. ``poll_url``: the live
    page's JSON endpoint (same origin), polled every ``refresh_s``."""
    assets = _assets()
    data = {"charts": charts(model), "live": None}
    if poll_url and model.get("live") and not model.get("finished"):
        data["live"] = {"url": poll_url, "refresh_s": _refresh(model)}
    scripts = [assets["uplot.js"], assets["page.js"]]
    styles = [assets["uplot.css"], assets["page.css"]]
    csp = content_security_policy(scripts, styles, live=bool(data["live"]))
    return string.Template(assets["page.html"]).substitute(
        csp=esc(csp),
        title=esc(f"rankwatch: {_s(model.get('run_id'))} ({shown_status(model)})"),
        styles="".join(f"<style>{s}</style>" for s in styles),
        root=root(model),
        data=json_island(data),
        scripts="".join(f"<script>{s}</script>" for s in scripts),
    )


def fragment(model: dict[str, Any]) -> dict[str, Any]:
    """What the live page polls: the page's content and its charts' data."""
    return {"html": root(model), "charts": charts(model), "finished": bool(model.get("finished")),
            "refresh_s": _refresh(model)}


def _refresh(model: dict[str, Any]) -> float:
    value = _n(model.get("refresh_s"))
    return max(1.0, min(60.0, value)) if value is not None else 2.0


def content_security_policy(scripts: list[str], styles: list[str], live: bool = False) -> str:
    """Only this page's own inline scripts and styles run (by hash); no
    network at all from a file, only its own origin for the live page."""
    def sources(items: list[str]) -> str:
        return " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(i.encode()).digest()).decode()}'"
                        for i in items) or "'none'"

    connect = "'self'" if live else "'none'"
    return (f"default-src 'none'; script-src {sources(scripts)}; style-src {sources(styles)}; img-src data:; "
            f"connect-src {connect}; base-uri 'none'; form-action 'none'")


def json_island(data: Any) -> str:
    """JSON inside <script type="application/json">: nothing in it can end the
    element or start markup (<, >, & and the JS line separators escaped)."""
    text = json.dumps(wire.json_safe(data), separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    for raw, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                         ("\u2029", "\\u2029")):
        text = text.replace(raw, escaped)
    return f'<script type="application/json" id="rw-data">{text}</script>'


@functools.lru_cache(maxsize=1)
def _assets() -> dict[str, str]:
    here = resources.files(__package__)
    read = lambda *parts: here.joinpath(*parts).read_text(encoding="utf-8")  # noqa: E731
    return {"page.html": read("templates", "page.html"), "page.css": read("templates", "page.css"),
            "page.js": read("templates", "page.js"), "uplot.js": read("vendor", "uplot", "uPlot.iife.min.js"),
            "uplot.css": read("vendor", "uplot", "uPlot.min.css")}


# -- escaping and checked access (the model may come from the network) -----------------------

def esc(value: Any) -> str:
    return html_lib.escape(str(value), quote=True)


def _s(value: Any, limit: int = pagedata.MAX_TEXT) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and not math.isfinite(value):
        return wire.json_safe(value)
    text = value if isinstance(value, str) else json.dumps(value, default=str) if isinstance(value, (dict, list)) \
        else str(value)
    return text if len(text) <= limit else text[:limit] + " ..."


def _n(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _i(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _l(value: Any, limit: int = 10_000) -> list:
    return list(value[:limit]) if isinstance(value, list) else []


def _d(value: Any) -> dict:
    return value if isinstance(value, dict) else {}


_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def safe_href(value: Any) -> Optional[str]:
    """Relative paths, file: URIs and the collector's own /runs/ routes only
    (never javascript:, data: or another host)."""
    if not isinstance(value, str) or not value or len(value) > 4096 or any(c in value for c in "\x00\n\r\t\\"):
        return None
    if value.startswith("//"):
        return None
    if _SCHEME.match(value):
        return value if value.lower().startswith("file:///") else None
    if value.startswith("/") and not value.startswith("/runs/"):
        return None
    return value


def _kind_class(kind: Any) -> str:
    return "kind-" + re.sub(r"[^a-z0-9_]", "", str(kind).lower())[:40]


def ranks_label(ranks: Any, total: Any = None) -> str:
    items = [r for r in _l(ranks) if _i(r) is not None]
    count = _i(total) or len(items)
    if not items:
        return "no rank"
    text = pagedata.rank_ranges(items)
    if count > len(items):  # a group of a big job: its size first, then the ranks it starts with
        return f"{count:,} ranks ({text}, ...)"
    return f"{'rank' if count == 1 else 'ranks'} {text}"


def _tag(tag: str, text: Any = "", cls: Optional[str] = None) -> str:
    attr = f' class="{esc(cls)}"' if cls else ""
    return f"<{tag}{attr}>{esc(_s(text))}</{tag}>"


def _when(iso: Any) -> str:
    text = _s(iso, 64)
    return text.replace("T", " ").replace("Z", " UTC") if text else "-"


def _duration(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    if abs(seconds) < 120:
        return f"{seconds:.1f} s"
    if abs(seconds) < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _section(model_part: Any, render, title: str) -> str:
    """A section whose data cannot be shown says so, instead of breaking the page."""
    try:
        return render(model_part)
    except Exception as exc:  # a model from an older or hostile source
        return f'<p class="broken">{esc(title)} could not be shown ({esc(type(exc).__name__)}).</p>'


# -- the content ------------------------------------------------------------------------------

def root(model: dict[str, Any]) -> str:
    model = _d(model)
    parts = [header(model), '<main id="rw-main">', _toc(model)]
    parts.append(_section(model, verdicts_section, "The verdicts"))
    if model.get("timelines") is not None:
        parts.append(_section(_d(model.get("timelines")), timelines_section, "The timelines"))
    if model.get("heatmap") is not None:
        parts.append(_section(_d(model.get("heatmap")), heatmap_section, "The heat map"))
    if model.get("bundles") is not None:
        parts.append(_section(_d(model.get("bundles")), bundles_section, "The bundles"))
    parts.append(_section(_d(model.get("run")), run_section, "The run"))
    parts.append(f'<footer>Made by {esc(_s(model.get("generator"), 64))} from report.json and the run\'s '
                 f'evidence at {esc(_when(model.get("generated_at")))}. Self-contained: opens without network.'
                 f'</footer></main>')
    return "".join(parts)


def header(model: dict[str, Any]) -> str:
    status = shown_status(model)
    live = ""
    if model.get("live"):
        live = ('<span class="live" id="rw-live">live: updates every '
                f'{esc(f"{_refresh(model):g}")} s</span>' if not model.get("finished")
                else '<span class="live done" id="rw-live">finished</span>')
    world = _i(model.get("world_size")) or 0
    progress = _d(model.get("progress"))
    steps = ""
    if _i(progress.get("max_step")) is not None:
        steps = f" · steps reached {esc(progress.get('min_step'))}\u2013{esc(progress.get('max_step'))}"
    return (f'<header class="top"><div class="brand">rankwatch</div>'
            f'<h1>run <code>{esc(_s(model.get("run_id"), 200))}</code></h1>'
            f'<span class="status {status if status in ("faulty", "running") else "healthy"}" id="rw-status">'
            f'{esc(status.upper() or "UNKNOWN")}</span>'
            f'<span class="meta">{esc(world)} rank{"s" if world != 1 else ""}{steps} · generated '
            f'{esc(_when(model.get("generated_at")))}</span>{live}</header>')


def shown_status(model: dict[str, Any]) -> str:
    """The run's status as the page says it: a live run that is still going
    and has no verdict yet is "running" (nothing is known to be healthy
    before it ends); a finished run, or one with a verdict, says its
    report's status."""
    status = _s(model.get("status"), 16)
    if status == "healthy" and model.get("live") and not model.get("finished"):
        return "running"
    return status


def _toc(model: dict[str, Any]) -> str:
    links = [("verdicts", "Verdicts")]
    for key, anchor, title in (("timelines", "timelines", "Timelines"), ("heatmap", "heatmap", "Heat map"),
                               ("bundles", "bundles", "Bundles")):
        if model.get(key) is not None:
            links.append((anchor, title))
    links.append(("run", "Run"))
    return '<nav class="toc">' + "".join(f'<a href="#{a}">{esc(t)}</a>' for a, t in links) + "</nav>"


def verdicts_section(model: dict[str, Any]) -> str:
    verdicts = [v for v in _l(model.get("verdicts"), 200) if isinstance(v, dict)]
    out = ['<section id="verdicts">']
    for note in _l(model.get("notes"), 50):
        out.append(_tag("p", f"note: {_s(note)}", "note"))
    if not verdicts:
        progress = _d(model.get("progress"))
        ranks = _i(model.get("world_size")) or 0
        steps = _i(progress.get("max_step"))
        running = shown_status(model) == "running"
        out.append('<article class="verdict healthy-card"><header><span class="kind">'
                   + ("running" if running else "healthy") + '</span></header>'
                   f'<p class="summary">No faults found{" so far" if running else ""}: '
                   f'{esc(ranks)} rank{"s" if ranks != 1 else ""}'
                   + (f", {esc(steps + 1)} steps watched" if steps is not None else "") + ".</p></article>")
    for i, v in enumerate(verdicts):
        out.append(_section(v, lambda v, i=i: verdict_card(v, i), "A verdict"))
    out.append("</section>")
    return "".join(out)


def verdict_card(v: dict[str, Any], index: int) -> str:
    kind = _s(v.get("kind"), 64)
    ranks = [r for r in _l(v.get("ranks")) if _i(r) is not None]
    hosts = _d(v.get("hosts"))
    host_names = sorted({_s(h, 255) for h in hosts.values() if h})
    colour = KIND_COLOURS.get(kind, "#555")
    out = [f'<article class="verdict {esc(_kind_class(kind))}" id="verdict-{index}" data-kind="{esc(kind)}">',
           f'<header><span class="kind kind-{esc(re.sub(r"[^a-z0-9_]", "", kind))}" '
           f'data-colour="{esc(colour)}">{esc(kind)}</span>',
           f'<span class="culprits">{esc(ranks_label(ranks))}</span>']
    if host_names:
        out.append(f'<span class="hosts">on {esc(", ".join(host_names[:8]))}'
                   f'{" ..." if len(host_names) > 8 else ""}</span>')
    if kind in KIND_TEXT:
        out.append(f'<span class="kind-text">{esc(KIND_TEXT[kind])}</span>')
    out.append("</header>")
    step = _i(v.get("step"))
    out.append('<dl class="facts">'
               f'<dt>step</dt><dd class="step">{esc(step if step is not None else "-")}</dd>'
               f'<dt>first seen</dt><dd>{esc(_when(v.get("first_seen_at")))}</dd>'
               f'<dt>verdict</dt><dd>{esc(_when(v.get("detected_at")))}</dd>'
               f'<dt>time to verdict</dt><dd>{esc(_duration(_n(v.get("time_to_verdict_s"))))}</dd></dl>')
    out.append(_tag("p", v.get("summary"), "summary"))
    consequences = [c for c in _l(v.get("consequences"), 200) if isinstance(c, dict)]
    if consequences:
        out.append('<div class="consequences"><h3>Consequences (explained by this verdict)</h3><ul>')
        for c in consequences:
            out.append(f'<li><span class="kind-chip">{esc(_s(c.get("kind"), 64))}</span> '
                       f'{esc(ranks_label(c.get("ranks")))}'
                       + (f" at step {esc(_i(c.get('step')))}" if _i(c.get("step")) is not None else "")
                       + (f": {esc(_s(c.get('summary'), 600))}" if c.get("summary") else "") + "</li>")
        out.append("</ul></div>")
    silence = _d(v.get("silence"))
    out.append('<details class="silence"><summary>Not a fault here? Silence this check</summary><p>'
               f'In the config file (<code>--config FILE</code>): <code>{esc(_s(silence.get("config"), 100))}</code>; '
               f'or in the environment: <code>{esc(_s(silence.get("env"), 100))}</code>. '
               'The same setting applies to <code>rankwatch analyze</code>.</p></details>')
    if v.get("stacks") is not None:
        out.append(_section(_d(v.get("stacks")), lambda s: stacks_block(s), "The stacks"))
    if v.get("alignment") is not None:
        out.append(_section(_l(v.get("alignment"), 16), lambda a: alignment_block(a), "The collective alignment"))
    if v.get("exceptions"):
        out.append(_section(_l(v.get("exceptions"), 16), exceptions_block, "The exceptions"))
    out.append(_section(_d(v.get("evidence")), lambda e: evidence_block(e, set(ranks)), "The evidence"))
    out.append("</article>")
    return "".join(out)


# -- a hang's stacks ---------------------------------------------------------------------------

def _frame_html(f: dict[str, Any], cls: str, marker: str = "") -> str:
    f = _d(f)
    file = _s(f.get("file"), 1000)
    line = _i(f.get("line"))
    short = os.path.basename(file) if file else "?"
    loc = f"{short}:{line}" if line is not None else short
    code = _s(f.get("code"), 2000)
    return (f'<li class="frame {cls}"><span class="loc" title="{esc(file)}">{esc(loc)}</span> in '
            f'<span class="fn">{esc(_s(f.get("name"), 200))}</span>'
            + (f'<span class="marker">{esc(marker)}</span>' if marker else "")
            + (f'<pre class="code">{esc(code)}</pre>' if code else "") + "</li>")


def stacks_block(stacks: dict[str, Any]) -> str:
    groups = [g for g in _l(stacks.get("groups"), pagedata.MAX_STACK_GROUPS) if isinstance(g, dict)]
    if not groups:
        return ""
    total = _i(stacks.get("ranks_with_stack")) or 0
    out = ['<div class="stacks"><h3>Where each rank is</h3>',
           f'<p class="hint">Main-thread stacks of {esc(total)} rank{"s" if total != 1 else ""}, grouped by '
           'identity (outermost call first). The culprit\'s frames after the point where it leaves the '
           'stack the others share are marked.</p>']
    common = next((g for g in groups if g.get("common")), None)
    for g in groups:
        frames = [f for f in _l(g.get("frames"), pagedata.MAX_FRAMES) if isinstance(f, dict)]
        culprit = bool(g.get("culprit"))
        shared = max(0, min(_i(g.get("shared_frames")) or 0, len(frames)))
        here = _i(g.get("user_frame"))
        cls = "stack-group" + (" culprit" if culprit else "") + (" common" if g.get("common") else "")
        label = ranks_label(g.get("ranks"), g.get("ranks_total"))
        out.append(f'<div class="{cls}"><div class="stack-head"><span class="ranks">{esc(label)}</span>')
        if culprit:
            out.append('<span class="tag culprit-tag">culprit</span>')
        if g.get("common"):
            out.append('<span class="tag">the common stack</span>')
        where_text = g.get("where")
        if here is not None and 0 <= here < len(frames):
            f = frames[here]
            out.append(f'<span class="at">at <span class="stuck-line">'
                       f'{esc(os.path.basename(_s(f.get("file"), 1000)))}:{esc(_i(f.get("line")))}</span> in '
                       f'{esc(_s(f.get("name"), 200))}</span>')
        elif where_text:
            out.append(f'<span class="at">at <span class="stuck-line">{esc(_s(where_text, 600))}</span></span>')
        out.append("</div>")
        if here is not None and 0 <= here < len(frames) and frames[here].get("code"):
            out.append(f'<pre class="source-line">{esc(_s(frames[here].get("code"), 2000))}</pre>')
        if frames:
            if culprit and common is not None and shared:
                out.append(f'<details class="shared"><summary>{esc(shared)} outer frame{"s" if shared != 1 else ""} '
                           f'shared with {esc(ranks_label(common.get("ranks"), common.get("ranks_total")))}'
                           '</summary><ol class="frames">')
                out.extend(_frame_html(f, "same") for f in frames[:shared])
                out.append("</ol></details>")
                out.append(f'<ol class="frames" start="{shared + 1}">')
                for i, f in enumerate(frames[shared:], start=shared):
                    out.append(_frame_html(f, "differs" + (" here" if i == here else ""),
                                           "\u25c0 stuck here" if i == here else ""))
                out.append("</ol>")
            else:
                keep = 6 if len(frames) > 8 else len(frames)
                cut = len(frames) - keep
                if cut:
                    out.append(f'<details class="shared"><summary>{esc(cut)} outer frames</summary><ol class="frames">')
                    out.extend(_frame_html(f, "same") for f in frames[:cut])
                    out.append("</ol></details>")
                out.append(f'<ol class="frames" start="{cut + 1}">')
                for i, f in enumerate(frames[cut:], start=cut):
                    mark = ("\u25c0 stuck here" if culprit else "\u25c0 its code") if i == here else ""
                    out.append(_frame_html(f, ("differs " if culprit else "") + ("here" if i == here else ""), mark))
                out.append("</ol>")
        out.append("</div>")
    more = (_i(stacks.get("groups_total")) or 0) - len(groups)
    if more > 0:
        out.append(f'<p class="hint">{esc(more)} more distinct stack{"s" if more != 1 else ""} not shown.</p>')
    silent = _l(stacks.get("without_stack"), 64)
    if silent:
        out.append(f'<p class="hint">No main-thread stack from {esc(ranks_label(silent))}.</p>')
    out.append("</div>")
    return "".join(out)


# -- collective alignment ------------------------------------------------------------------------

def alignment_block(groups: list) -> str:
    groups = [g for g in groups if isinstance(g, dict)]
    if not groups:
        return ""
    out = ['<div class="alignment"><h3>Collective alignment</h3><p class="hint">Each rank\'s last enqueued and '
           'completed collective per process group (Flight Recorder, from the bundles; the heartbeats\' numbers '
           'where a rank sent none). The first sequence number where the ranks part is highlighted.</p>']
    for g in groups:
        parting = _i(g.get("parting_seq"))
        out.append(f'<div class="pg"><h4>Process group {esc(_s(g.get("pg"), 64))}: '
                   f'{esc(_i(g.get("ranks")) or 0)} ranks')
        if parting is not None:
            out.append(f'; ranks part at <span class="parting-seq">#{esc(parting)}</span> '
                       f'<span class="why">({esc(_s(g.get("parting_why"), 200))})</span>')
        else:
            out.append("; every rank at the same collective")
        out.append("</h4>")
        out.append('<table class="align"><thead><tr><th>ranks</th><th>last enqueued</th><th>op</th>'
                   '<th>last completed</th><th>op</th><th>from</th></tr></thead><tbody>')
        for row in [r for r in _l(g.get("rows"), 4 * pagedata.TABLE_ROWS) if isinstance(r, dict)]:
            cls = " ".join(c for c, on in (("culprit", row.get("culprit")), ("behind", row.get("behind"))) if on)
            enq, comp = _i(row.get("enqueued")), _i(row.get("completed"))
            out.append(f'<tr class="{cls}"><td>{esc(ranks_label(row.get("ranks"), row.get("ranks_total")))}</td>'
                       f'<td class="seq{" parted" if parting is not None and enq is not None and enq >= parting else ""}">'
                       f'{esc("#" + str(enq) if enq is not None else "-")}</td>'
                       f'<td class="op">{esc(_s(row.get("enqueued_op"), 300) or "-")}</td>'
                       f'<td class="seq">{esc("#" + str(comp) if comp is not None else "-")}</td>'
                       f'<td class="op">{esc(_s(row.get("completed_op"), 300) or "-")}</td>'
                       f'<td class="src">{esc(_s(row.get("source"), 20))}</td></tr>')
        out.append("</tbody></table>")
        columns = _d(g.get("columns"))
        seqs = [s for s in _l(columns.get("seqs"), 64) if _i(s) is not None]
        rows = [r for r in _l(columns.get("rows"), pagedata.TABLE_ROWS) if isinstance(r, dict)]
        if seqs and rows:
            out.append('<table class="seqgrid"><thead><tr><th>ranks \\ collective</th>')
            for s in seqs:
                out.append(f'<th class="{"parting" if s == parting else ""}">#{esc(s)}</th>')
            out.append("</tr></thead><tbody>")
            for row in rows:
                out.append(f'<tr><td>{esc(ranks_label(row.get("ranks"), row.get("ranks_total")))}</td>')
                cells = [c for c in _l(row.get("cells"), 64)]
                for s, cell in zip(seqs, cells):
                    cell = _d(cell)
                    state = re.sub(r"[^a-z]", "", _s(cell.get("state"), 16))
                    text = _s(cell.get("op"), 60) or {"absent": "\u2013", "done": "\u2713"}.get(state, "\u2026")
                    out.append(f'<td class="cell {esc(state)}{" parting" if s == parting else ""}" '
                               f'title="{esc(_s(cell.get("shape"), 300) or state)}">{esc(text)}</td>')
                out.append("</tr>")
            out.append('</tbody></table><p class="legend-line"><span class="cell done">done</span> '
                       '<span class="cell pending">enqueued, not completed</span> '
                       '<span class="cell enqueued">enqueued</span> <span class="cell absent">never enqueued</span></p>')
        out.append("</div>")
    out.append("</div>")
    return "".join(out)


def exceptions_block(items: list) -> str:
    out = ['<div class="exceptions"><h3>Exceptions</h3>']
    for e in [e for e in items if isinstance(e, dict)]:
        out.append(f'<div class="exception"><p><span class="ranks">rank {esc(_i(e.get("rank")))}</span>: '
                   f'<code>{esc(_s(e.get("type"), 200))}</code>: {esc(_s(e.get("message"), 2000))}</p>')
        if e.get("traceback"):
            out.append(f'<details><summary>traceback</summary><pre class="traceback">'
                       f'{esc(_s(e.get("traceback"), pagedata.MAX_TRACEBACK))}</pre></details>')
        out.append("</div>")
    out.append("</div>")
    return "".join(out)


# -- evidence, for any kind ------------------------------------------------------------------------

_RANKISH = re.compile(r"rank|host|^bundles$|^calls$|^peers$|^others$|per_rank|by_rank|^scores$")


def _rank_map(key: str, value: Any) -> bool:
    """A map keyed by rank ("2": {...}): shown as rows of one per-rank table."""
    if not isinstance(value, dict) or not value:
        return False
    keys = [k for k in value if k != "..."]
    if not keys or not all(pagedata._intlike(k) for k in keys):
        return False
    return bool(_RANKISH.search(key)) or all(isinstance(value[k], dict) for k in keys)


def evidence_block(evidence: dict[str, Any], culprits: set) -> str:
    """The evidence of any kind (kinds added later included): every map keyed
    by rank becomes columns of one table of per-rank values, culprits first
    and marked; the rest a table of keys and values."""
    per_rank: dict[int, dict[str, Any]] = {}
    columns: list[str] = []
    others: dict[str, Any] = {}
    more: dict[str, str] = {}
    for key, value in evidence.items():
        key = _s(key, 200)
        if key in SHOWN_ELSEWHERE:
            continue
        if _rank_map(key, value):
            for rk, item in value.items():
                if rk == "...":
                    more[key] = _s(item, 100)
                    continue
                row = per_rank.setdefault(int(rk), {})
                if isinstance(item, dict) and key == "ranks":
                    for k2, v2 in item.items():
                        col = _s(k2, 200)
                        row[col] = v2
                        if col not in columns:
                            columns.append(col)
                elif isinstance(item, dict):
                    for k2, v2 in item.items():
                        col = f"{key}.{_s(k2, 200)}"
                        row[col] = v2
                        if col not in columns:
                            columns.append(col)
                else:
                    col = "host" if key == "hosts" else key
                    row[col] = item
                    if col not in columns:
                        columns.append(col)
        else:
            others[key] = value
    out = ['<div class="evidence"><h3>Evidence</h3>']
    if per_rank:
        # Who and where first (host, bundle): a wide table scrolls, and these are what one looks for.
        columns = sorted(columns, key=lambda c: (c not in FIRST_COLUMNS, FIRST_COLUMNS.index(c) if c in FIRST_COLUMNS
                                                 else 0))[:40]
        ordered = sorted(per_rank, key=lambda r: (r not in culprits, r))
        out.append('<div class="scroll"><table class="per-rank"><thead><tr><th>rank</th>')
        out.extend(f"<th>{esc(c)}</th>" for c in columns)
        out.append("</tr></thead><tbody>")
        shown = ordered[:4 * pagedata.TABLE_ROWS]
        first = [r for r in shown if r in culprits] or shown[:1]
        first = first + [r for r in shown if r not in first][:max(0, 16 - len(first))]
        rest = [r for r in shown if r not in set(first)]

        def rows(ranks: list[int]) -> str:
            body = []
            for r in ranks:
                row = per_rank[r]
                body.append(f'<tr class="{"culprit" if r in culprits else ""}"><td class="rank">{esc(r)}</td>')
                body.extend(f"<td>{_value_html(row.get(c), 1, c)}</td>" for c in columns)
                body.append("</tr>")
            return "".join(body)

        out.append(rows(first) + "</tbody></table></div>")
        if rest:  # a long table stays folded: the culprits and the first ranks are what one reads
            out.append(f'<details class="more-ranks"><summary>{esc(len(rest))} more rank'
                       f'{"s" if len(rest) != 1 else ""}</summary><div class="scroll"><table class="per-rank">'
                       f'<thead><tr><th>rank</th>' + "".join(f"<th>{esc(c)}</th>" for c in columns)
                       + "</tr></thead><tbody>" + rows(rest) + "</tbody></table></div></details>")
        for key, text in more.items():
            out.append(f'<p class="hint">{esc(key)}: {esc(text)} rank{"s" if text != "1 more" else ""} not listed.</p>')
    if others:
        out.append(_kv_table(others, 0))
    out.append("</div>")
    return "".join(out)


def _kv_table(items: dict[str, Any], depth: int) -> str:
    out = ['<table class="kv"><tbody>']
    for key, value in list(items.items())[:200]:
        out.append(f"<tr><th>{esc(_s(key, 200))}</th><td>{_value_html(value, depth + 1, _s(key, 200))}</td></tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _value_html(value: Any, depth: int, key: str = "") -> str:
    if value is None:
        return '<span class="null">-</span>'
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        if (key == "at" or key.endswith(("_at", ".at"))) and 1e9 <= value <= wire.MAX_TIME:  # a unix time, in UTC
            return esc(_when(pagedata._iso(float(value))))
        return esc(_fmt_number(value))
    if isinstance(value, str):
        text = _s(value)
        if key == "bundles" and ("/" in text or "\\" in text):  # a bundle's path: its name, the path on hover
            return f'<span class="path" title="{esc(text)}">{esc(os.path.basename(text.rstrip("/")) or text)}</span>'
        if "\n" in text:
            return f"<pre>{esc(text)}</pre>"
        return esc(text)
    if isinstance(value, list):
        if all(not isinstance(x, (dict, list)) for x in value):
            return esc(", ".join(_fmt_number(x) if isinstance(x, (int, float)) and not isinstance(x, bool)
                                 else _s(x, 500) for x in value[:200]))
        if depth < 4 and all(isinstance(x, dict) for x in value):
            return _list_table(value[:200], depth)
        return f"<pre>{esc(_s(value))}</pre>"
    if isinstance(value, dict):
        if 0 < len(value) <= 6 and all(v is None or isinstance(v, (str, int, float)) for v in value.values()) \
                and all(len(_s(v, 100)) < 40 for v in value.values()):  # {"0": 25}: one line, "0: 25"
            return esc(", ".join(f"{_s(k, 100)}: {_fmt_number(v) if isinstance(v, (int, float)) else _s(v, 100)}"
                                 for k, v in value.items()))
        if depth < 4 and len(value) <= 200:
            return _kv_table(value, depth)
        return f"<pre>{esc(_s(value))}</pre>"
    return esc(_s(value))


def _list_table(items: list, depth: int) -> str:
    cols: list[str] = []
    for item in items:
        for k in item:
            if _s(k, 200) not in cols:
                cols.append(_s(k, 200))
    cols = cols[:30]
    out = ['<table class="list"><thead><tr>']
    out.extend(f"<th>{esc(c)}</th>" for c in cols)
    out.append("</tr></thead><tbody>")
    for item in items:
        out.append("<tr>" + "".join(f"<td>{_value_html(item.get(c), depth + 1, c)}</td>" for c in cols) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _fmt_number(x: Any) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if not math.isfinite(x):
            return wire.json_safe(x)
        if x != 0 and (abs(x) >= 1e6 or abs(x) < 1e-3):
            return f"{x:.4g}"
        return f"{x:.4f}".rstrip("0").rstrip(".")
    return _s(x, 200)


# -- timelines and heat map (drawn by page.js from the data island) ----------------------------------

def timelines_section(t: dict[str, Any]) -> str:
    metrics = [m for m in _l(t.get("metrics"), 16) if isinstance(m, dict)]
    if not metrics:
        return ('<section id="timelines"><h2>Timelines</h2><p class="hint">No step was recorded.</p></section>')
    shown = _l(t.get("ranks"), 64)
    binned = bool(t.get("binned"))
    hint = ("One line per rank; culprits in red, thicker. Vertical dashed lines mark verdicts at their step, "
            "dotted ones a rank's training-config change (train/eval mode, clipping, ...). "
            "Drag to zoom, double-click to reset.")
    if binned:
        hint = (f"{esc(_i(t.get('ranks_total')) or 0)} ranks: the band is the lowest to highest value of all "
                f"ranks at each step, the dotted line their median; the culprits, their neighbours and rank 0 "
                f"({esc(ranks_label(shown))}) have lines of their own. " + hint)
    out = ['<section id="timelines"><h2>Timelines</h2>', f'<p class="hint">{hint}</p><div class="charts">']
    for m in metrics:
        key = re.sub(r"[^a-z_]", "", _s(m.get("key"), 40))
        sampled = _d(m.get("sampled"))
        note = ""
        if _i(sampled.get("steps_with_value")) is not None and _i(sampled.get("steps")) is not None:
            note = (f'<span class="sampled"> · sampled: a value at {esc(sampled["steps_with_value"])} of '
                    f'{esc(sampled["steps"])} steps, drawn as points</span>')
        out.append(f'<figure class="chart" data-metric="{esc(key)}"><figcaption>{esc(_s(m.get("title"), 200))}'
                   f'{note}</figcaption><div class="plot"></div></figure>')
    out.append('</div>' + config_changes(t) +
               '<noscript><p class="hint">The charts need JavaScript.</p></noscript></section>')
    return "".join(out)


def config_label(marker: dict[str, Any]) -> str:
    """'rank 2: mode → eval (train.py:42)': a training-fact change, as text (escaped where it is markup)."""
    sites = {_s(k, 60): _s(v, 200) for k, v in (p for p in _l(marker.get("sites"), 16)
                                                 if isinstance(p, list) and len(p) == 2)}
    parts = []
    for pair in _l(marker.get("changed"), pagedata.MAX_CONFIG_FACTS):
        if isinstance(pair, list) and len(pair) == 2:
            key, value = _s(pair[0], 60), _s(pair[1], 120)
            parts.append(f"{key} → {value}" + (f" ({sites[key]})" if sites.get(key) else ""))
    return f"{ranks_label(marker.get('ranks'))}: {', '.join(parts) or 'training facts changed'}"


def config_changes(t: dict[str, Any]) -> str:
    """The timelines' training-fact marks as a list (readable without the charts)."""
    marks = [m for m in _l(t.get("markers"), 100 + pagedata.INDIVIDUAL_RANKS * pagedata.MAX_CONFIG_MARKS)
             if isinstance(m, dict) and m.get("kind") == "train_config" and _i(m.get("step")) is not None]
    if not marks:
        return ""
    items = []
    for m in marks:
        head, _, rest = config_label(m).partition(": ")
        items.append(f"<li>{esc(head)} at step {esc(m['step'])}: {esc(rest)}</li>")
    return (f'<details class="config-changes"><summary>Training-config changes ({len(marks)}; dotted lines on '
            f'the charts): train/eval mode, clipping, autocast, ...</summary><ul>{"".join(items)}</ul></details>')


def heatmap_section(h: dict[str, Any]) -> str:
    metrics = [m for m in _l(h.get("metrics"), 16) if isinstance(m, dict)]
    rows = _l(h.get("rows"), 100_000)
    if not metrics or not rows:
        return ""
    hint = ("Ranks \u00d7 steps: the rank that stands out is a row of another colour; culprits are labelled "
            "in red, non-finite values are magenta.")
    if h.get("binned"):
        hint += (f" {esc(_i(h.get('ranks_total')) or 0)} ranks in rows of neighbouring ranks, each showing the "
                 "largest value of its ranks; culprits and their neighbours have rows of their own.")
    options = "".join(f'<option value="{i}">{esc(_s(m.get("title"), 200))}</option>' for i, m in enumerate(metrics))
    return ('<section id="heatmap"><h2>Heat map</h2>'
            f'<p class="hint">{hint}</p><label>metric <select id="rw-hm-metric">{options}</select></label>'
            '<div class="hm-wrap"><canvas id="rw-hm" width="900" height="200"></canvas>'
            '<div class="hm-tip" id="rw-hm-tip"></div></div></section>')


def charts(model: dict[str, Any]) -> dict[str, Any]:
    """The numbers page.js draws (checked: numbers, nulls and the non-finite
    strings; labels are made by the script, never taken as markup)."""
    model = _d(model)
    t = _d(model.get("timelines"))
    h = _d(model.get("heatmap"))
    culprits = [r for r in _l(model.get("culprits"), 1000) if _i(r) is not None]

    def numbers(values: Any, limit: int = pagedata.MAX_STEPS) -> list:
        out = []
        for v in _l(values, limit):
            if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
                out.append(v)
            elif v in ("NaN", "Infinity", "-Infinity"):
                out.append(v)
            else:
                out.append(None)
        return out

    timeline = {"steps": numbers(t.get("steps")), "metrics": [], "markers": [], "culprits": culprits}
    for m in [m for m in _l(t.get("metrics"), 16) if isinstance(m, dict)]:
        series = {str(_i(int(k)) if pagedata._intlike(k) else None): numbers(v)
                  for k, v in list(_d(m.get("series")).items())[:64] if pagedata._intlike(k)}
        bands = _d(m.get("bands"))
        timeline["metrics"].append({
            "key": re.sub(r"[^a-z_]", "", _s(m.get("key"), 40)), "unit": re.sub(r"[^a-z]", "", _s(m.get("unit"), 10)),
            "series": series, "sampled": bool(_d(m.get("sampled"))),
            "bands": {k: numbers(bands.get(k)) for k in ("min", "median", "max")} if bands else None})
    limit = 100 + pagedata.INDIVIDUAL_RANKS * pagedata.MAX_CONFIG_MARKS
    for marker in [m for m in _l(t.get("markers"), limit) if isinstance(m, dict)]:
        if _i(marker.get("step")) is not None:
            kind = _s(marker.get("kind"), 40)
            drawn = {"step": marker["step"], "kind": re.sub(r"[^a-z_]", "", kind),
                     "colour": KIND_COLOURS.get(kind, "#555")}
            if kind == "train_config":  # a rank's training-fact change: its ranks and a label made here, as text
                drawn["ranks"] = [r for r in _l(marker.get("ranks"), 64) if _i(r) is not None]
                drawn["label"] = config_label(marker)
            timeline["markers"].append(drawn)
    heat = {"steps": numbers(h.get("steps")), "rows": [], "metrics": []}
    for row in [r for r in _l(h.get("rows"), 4 * pagedata.HEATMAP_ROWS) if isinstance(r, dict)]:
        span = [x for x in _l(row.get("ranks"), 2) if _i(x) is not None] or [0, 0]
        heat["rows"].append({"ranks": [span[0], span[-1]], "size": _i(row.get("size")) or 1,
                             "culprit": bool(row.get("culprit"))})
    for m in [m for m in _l(h.get("metrics"), 16) if isinstance(m, dict)]:
        heat["metrics"].append({"key": re.sub(r"[^a-z_]", "", _s(m.get("key"), 40)),
                                "unit": re.sub(r"[^a-z]", "", _s(m.get("unit"), 10)),
                                "values": [numbers(r) for r in _l(m.get("values"), len(heat["rows"]))]})
    return {"timelines": timeline, "heatmap": heat}


# -- bundles and the run -------------------------------------------------------------------------

def bundles_section(b: dict[str, Any]) -> str:
    items = [i for i in _l(b.get("items"), pagedata.MAX_BUNDLES) if isinstance(i, dict)]
    out = ['<section id="bundles"><h2>Bundles</h2>']
    if not items:
        out.append('<p class="hint">No diagnostic bundle (bundles are taken when a verdict asks for evidence).</p>')
        return "".join(out) + "</section>"
    out.append('<p class="hint">The diagnostic bundles the evidence comes from (one per rank per incident; '
               '<code>rankwatch analyze BUNDLE</code> reads one). Archives are gzip\'d tar files.</p>'
               '<div class="scroll"><table class="bundles"><thead><tr><th>incident</th><th>rank</th><th>from</th>'
               '<th>host</th><th>bundle</th><th>members</th></tr></thead><tbody>')
    for item in items:
        href = safe_href(item.get("href"))
        path = _s(item.get("path"), 2000)
        name = os.path.basename(path) or "-"
        link = f'<a href="{esc(href)}" title="{esc(path)}">{esc(name)}</a>' if href else \
            f'<span title="{esc(path)}">{esc(name)}</span>'
        members = []
        for m in [m for m in _l(item.get("members"), 64) if isinstance(m, dict)]:
            mhref = safe_href(m.get("href"))
            mname = _s(m.get("name"), 200)
            members.append(f'<a href="{esc(mhref)}">{esc(mname)}</a>' if mhref else f"<code>{esc(mname)}</code>")
        notes = "".join(f'<div class="note">{esc(_s(n, 500))}</div>' for n in _l(item.get("notes"), 8))
        out.append(f'<tr><td>{esc(_s(item.get("incident"), 200))}</td><td>{esc(_i(item.get("rank")))}</td>'
                   f'<td>{esc(_s(item.get("source"), 40))}</td><td>{esc(_s(item.get("host"), 255))}</td>'
                   f'<td>{link}</td><td class="members">{" ".join(members)}{notes}</td></tr>')
    out.append("</tbody></table></div>")
    total = _i(b.get("total")) or 0
    if total > len(items):
        out.append(f'<p class="hint">{esc(total - len(items))} more bundles not listed.</p>')
    return "".join(out) + "</section>"


def run_section(info: dict[str, Any]) -> str:
    out = ['<section id="run"><h2>Run</h2>']
    versions = _d(info.get("versions"))
    if versions:
        out.append('<table class="kv versions"><tbody>' + "".join(
            f"<tr><th>{esc(_s(k, 64))}</th><td>{esc(_s(v, 200))}</td></tr>" for k, v in list(versions.items())[:20])
            + "</tbody></table>")
    out.append(f'<p class="hint">From {esc(_s(info.get("source"), 300))}.</p>')
    argv = _l(info.get("argv"), 200)
    if argv:
        src = _s(info.get("argv_source"), 100)
        out.append(f'<h3>Command line{" (" + esc(src) + ")" if src else ""}</h3>'
                   f'<pre class="argv">{esc(" ".join(_shell_quote(_s(a, 2000)) for a in argv))}</pre>')
        if info.get("executable"):
            out.append(f'<p class="hint">Python: <code>{esc(_s(info.get("executable"), 2000))}</code></p>')
    env = _d(info.get("env"))
    if env:
        src = _s(info.get("env_source"), 100)
        out.append(f'<details class="env"><summary>Environment ({esc(len(env))} variables, secrets redacted'
                   f'{"; " + esc(src) if src else ""})</summary><div class="scroll"><table class="kv env"><tbody>')
        for k, v in list(env.items())[:pagedata.MAX_ENV_VARS]:
            out.append(f"<tr><th>{esc(_s(k, 300))}</th><td>{esc(_s(v, 2000))}</td></tr>")
        out.append("</tbody></table></div></details>")
    return "".join(out) + "</section>"


def _shell_quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


# -- the collector's index page ------------------------------------------------------------------

def index_document(runs: Iterable[dict[str, Any]]) -> str:
    """The collector's list of runs with their status (`/`)."""
    assets = _assets()
    styles = [assets["page.css"]]
    rows = []
    for run in runs:
        run = _d(run)
        rid = _s(run.get("run_id"), 200)
        if not wire.valid_id(rid):
            continue
        status = _s(run.get("status"), 20)
        kinds = ", ".join(_s(k, 40) for k in _l(run.get("kinds"), 20))
        rows.append(f'<tr class="{esc(re.sub(r"[^a-z]", "", status))}"><td><a href="/runs/{esc(rid)}">{esc(rid)}</a></td>'
                    f'<td>{esc(status)}</td><td>{esc(_i(run.get("world_size")) or 0)}</td>'
                    f'<td>{esc(_i(run.get("verdicts")) or 0)}</td><td>{esc(kinds)}</td>'
                    f'<td>{esc(_when(run.get("started_at")))}</td></tr>')
    body = ('<header class="top"><div class="brand">rankwatch</div><h1>runs on this collector</h1></header>'
            '<main id="rw-main"><section><table class="runs"><thead><tr><th>run</th><th>status</th><th>ranks</th>'
            '<th>verdicts</th><th>kinds</th><th>started</th></tr></thead><tbody>'
            + ("".join(rows) or '<tr><td colspan="6">no run yet</td></tr>') + "</tbody></table></section></main>")
    csp = content_security_policy([], styles)
    return ('<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{esc(csp)}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            '<meta name="referrer" content="no-referrer"><title>rankwatch runs</title>'
            + "".join(f"<style>{s}</style>" for s in styles) + f"</head><body>{body}</body></html>")


def message_document(title: str, text: str, refresh_to: Optional[str] = None) -> str:
    """A small page: the collector's answer to a browser without the credential,
    or the step after a one-time link (``refresh_to``: a same-origin path)."""
    styles = [_assets()["page.css"]]
    csp = content_security_policy([], styles)
    meta = ""
    link = ""
    if refresh_to and safe_href(refresh_to) and refresh_to.startswith("/"):
        meta = f'<meta http-equiv="refresh" content="0;url={esc(refresh_to)}">'
        link = f'<p><a href="{esc(refresh_to)}">continue</a></p>'
    return ('<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{esc(csp)}">{meta}'
            f'<meta name="referrer" content="no-referrer"><title>{esc(title)}</title>'
            + "".join(f"<style>{s}</style>" for s in styles)
            + f'</head><body><main id="rw-main" class="message"><h1>{esc(title)}</h1><p>{esc(text)}</p>{link}'
            '</main></body></html>')
