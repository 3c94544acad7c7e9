"""report.html without a browser (light: no training, no subprocess): what the
page says for a hang, any verdict kind (kinds added later too), big jobs
binned, everything escaped, nothing fetched from the network; where the
launcher writes it when it cannot write the run dir; the collector's page
routes and the one-time links that let a browser in without the token ever
being in a URL (stdlib and aiohttp servers).

tests/test_page_browser.py opens real jobs' pages in Chromium."""

from __future__ import annotations

from html.parser import HTMLParser
import json
import logging
import os
import re
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rankwatch import wire
from rankwatch.outputs import html, pagedata

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import page_load  # noqa: E402  (the synthetic run states of bench/page_load.py)

HOSTILE = '<script>window.__pwned=1</script><img src=x onerror="window.__pwned=2">"\'&'


class _Elements(HTMLParser):
    """Every element and attribute of a page, as a browser's parser sees them."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict]] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"
        if tag == "script":
            self.scripts.append("")

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts[-1] += data


def _parse(text: str) -> _Elements:
    parser = _Elements()
    parser.feed(text)
    return parser


def _text(page: str) -> str:
    body = page[page.index('<div id="rw-root">'):page.index('<script type="application/json"')]
    return html_unescape(re.sub(r"<[^>]+>", " ", body))


def html_unescape(text: str) -> str:
    import html as std

    return std.unescape(text)


# -- what the page says -------------------------------------------------------------------------

def test_a_hangs_page_names_the_culprit_its_line_and_where_the_ranks_part():
    run, report = page_load.synthetic(8, culprit=5)
    page = html.page(report, run)
    text = _text(page)
    assert "rank 5" in text and "FAULTY" in text
    assert "train.py:94" in text and "time.sleep(3600)" in text and "stuck here" in text
    assert "ranks part at  #2001" in text
    assert "ranks 0\u20134, 6\u20137" in text  # the common stack's group
    assert "on_hang: ignore" in text and "RANKWATCH_ON_HANG=ignore" in text
    model = pagedata.build(report, run)
    stacks = model["verdicts"][0]["stacks"]["groups"]
    assert stacks[0]["ranks"] == [5] and stacks[0]["culprit"] and stacks[0]["shared_frames"] == 2
    assert stacks[1]["ranks"] == [0, 1, 2, 3, 4, 6, 7] and stacks[1]["common"]
    align = model["verdicts"][0]["alignment"][0]
    assert align["parting_seq"] == 2001
    behind = [row for row in align["rows"] if row["behind"]]
    assert [row["ranks"] for row in behind] == [[5]] and behind[0]["culprit"]


def test_the_page_is_self_contained_and_only_its_own_scripts_can_run():
    run, report = page_load.synthetic(8)
    page = html.page(report, run)
    parsed = _parse(page)
    for tag, attrs in parsed.tags:
        assert tag not in ("link", "iframe", "object", "embed", "base", "form"), tag
        assert "src" not in attrs, (tag, attrs)
        href = attrs.get("href")
        assert href is None or href.startswith("#") or not re.match(r"^[a-z]+:", href) or href.startswith("file:")
    csp = next(a["content"] for t, a in parsed.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy")
    assert "connect-src 'none'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
    runnable = [s for (t, a), s in zip([x for x in parsed.tags if x[0] == "script"], parsed.scripts)
                if a.get("type") != "application/json"]
    assert len(runnable) == 2  # uPlot and the page's own
    import base64
    import hashlib

    for script in runnable:
        digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
        assert f"'sha256-{digest}'" in csp


def test_hostile_text_from_a_rank_is_inert():
    """Stacks, exception texts, environment values and verdict texts come from
    untrusted ranks: none of it becomes markup."""
    run, report = page_load.synthetic(8, culprit=3)
    culprit = run.ranks[3]
    ev = culprit.evidence["hang-1"]
    ev.stacks[0]["frames"] = [dict(f) for f in ev.stacks[0]["frames"]]
    ev.stacks[0]["frames"][-1]["code"] = HOSTILE
    ev.stacks[0]["frames"][-1]["name"] = HOSTILE
    ev.stacks[0]["frames"][-1]["file"] = "/x/" + HOSTILE + ".py"
    culprit.host = HOSTILE[:200]
    culprit.events.append(wire.Event(kind="exception", at=time.time(), step=3,
                                     details={"type": HOSTILE, "message": HOSTILE, "traceback": HOSTILE}))
    v = report.verdicts[0]
    v.summary = HOSTILE
    v.kind = "hang"
    v.evidence["reason"] = HOSTILE
    v.evidence["consequences"] = [{"kind": HOSTILE, "ranks": [1], "summary": HOSTILE}]
    v.evidence[HOSTILE] = {HOSTILE: HOSTILE}
    crash = wire.Verdict(kind="crash", ranks=[3], step=3, first_seen_at=v.first_seen_at, detected_at=v.detected_at,
                         summary=HOSTILE, evidence={"exception": {"message": HOSTILE}})
    report.verdicts.append(crash)
    page = html.page(report, run, argv=[HOSTILE], env={"X": HOSTILE})
    parsed = _parse(page)
    assert len(parsed.scripts) == 3  # the data island, uPlot, the page's own: nothing injected
    assert not any(t in ("img",) for t, _ in parsed.tags)
    assert not any(k.startswith("on") for _, attrs in parsed.tags for k in attrs)
    assert HOSTILE not in page and "<script>window.__pwned" not in page
    assert "&lt;script&gt;window.__pwned=1&lt;/script&gt;" in page  # shown, as text


def test_any_verdict_kind_renders_its_evidence_as_a_table_of_per_rank_values():
    """Kinds added later (config_divergence, duplicate_data, broken_update)
    need nothing from the page: maps keyed by rank become one table."""
    run, _ = page_load.synthetic(4, culprit=2)
    evidence = {
        "ranks": {"0": {"lr": 0.1, "train_mode": True}, "1": {"lr": 0.1, "train_mode": True},
                  "2": {"lr": 1.0, "train_mode": False}, "3": {"lr": 0.1, "train_mode": True}},
        "hosts": {"2": "node-b"},
        "setting": "optimizer.param_groups[0].lr",
        "majority": {"lr": 0.1},
        "consequences": [{"kind": "weight_divergence", "ranks": [2], "step": 9, "summary": "follows"}],
    }
    report = wire.Report(run_id=run.run_id, world_size=4, status="faulty", verdicts=[wire.Verdict(
        kind="config_divergence", ranks=[2], step=0, first_seen_at="2026-11-24T10:00:00.000Z",
        detected_at="2026-11-24T10:00:03.500Z", summary="Rank 2 trains with lr 1.0, the others 0.1.",
        evidence=evidence)])
    page = html.page(report, run)
    text = _text(page)
    assert "config_divergence" in text and "rank 2" in text and "3.5 s" in text
    table = page[page.index('<table class="per-rank">'):]
    table = table[:table.index("</table>")]
    header = re.findall(r"<th>([^<]*)</th>", table)
    assert header[:4] == ["rank", "host", "lr", "train_mode"]  # who and where first (issue 26)
    first = re.search(r"<tr class=\"culprit\">(.*?)</tr>", table).group(1)
    assert re.findall(r"<td[^>]*>([^<]*)</td>", first)[:4] == ["2", "node-b", "1", "no"]
    assert "weight_divergence" in text and "on_config_divergence: ignore" in text


def test_a_healthy_page_says_so():
    run, report = page_load.synthetic(4)
    report.verdicts, report.status = [], "healthy"
    text = _text(html.page(report, run))
    assert "HEALTHY" in text and "No faults found: 4 ranks" in text


def test_a_big_job_is_binned_with_culprits_and_neighbours_expanded():
    run, report = page_load.synthetic(2000, culprit=1234)
    model = pagedata.build(report, run)
    heat = model["heatmap"]
    assert heat["binned"] and len(heat["rows"]) <= pagedata.HEATMAP_ROWS + 8
    alone = [row["ranks"][0] for row in heat["rows"] if row["size"] == 1]
    assert {1233, 1234, 1235} <= set(alone)
    assert sum(row["size"] for row in heat["rows"]) == 2000
    t = model["timelines"]
    assert t["binned"] and t["ranks"] == ["0", "1233", "1234", "1235"]
    assert all(m["bands"] and len(m["bands"]["max"]) == len(t["steps"]) for m in t["metrics"])
    align = model["verdicts"][0]["alignment"][0]
    assert len(align["rows"]) < 20 and any(row["ranks"] == [1234] and row["behind"] for row in align["rows"])
    page = html.document(model)
    assert len(page) < 3_000_000


def test_a_model_from_the_network_cannot_break_or_inject_into_the_page():
    """`rankwatch analyze URL --html` renders a collector's page data: wrong
    types, hostile links and markup render as text or not at all."""
    run, report = page_load.synthetic(8)
    model = json.loads(json.dumps(wire.json_safe(pagedata.build(report, run))))
    model["verdicts"][0]["stacks"] = {"groups": [{"frames": "not a list", "ranks": {"a": 1}}, 5, None]}
    model["verdicts"][0]["alignment"] = [{"rows": [{"ranks": "x", "enqueued": "<b>"}], "columns": 7}]
    model["verdicts"][0]["ranks"] = ["<i>", 3]
    model["bundles"]["items"][0]["href"] = "javascript:alert(1)"
    model["bundles"]["items"][1]["href"] = "//evil.example/x"
    model["bundles"]["items"][2]["members"] = [{"name": HOSTILE, "href": "data:text/html,x"}]
    model["timelines"]["metrics"][0]["series"] = {"0": ["<script>", 1, {"x": 1}], "</script>": [1]}
    model["heatmap"]["rows"] = [{"ranks": ["a", None]}]
    model["run"] = {"env": {HOSTILE: HOSTILE}, "argv": HOSTILE}
    page = html.document(model)
    parsed = _parse(page)
    assert len(parsed.scripts) == 3 and HOSTILE not in page
    hrefs = [a.get("href") for t, a in parsed.tags if t == "a"]
    assert not any(h and (h.startswith(("javascript:", "data:", "//"))) for h in hrefs)
    island = json.loads(parsed.scripts[0])
    assert island["charts"]["timelines"]["metrics"][0]["series"] == {"0": [None, 1, None]}


def test_safe_links():
    assert html.safe_href("bundles/hang-1/rank-00002.tar.gz") == "bundles/hang-1/rank-00002.tar.gz"
    assert html.safe_href("file:///tmp/x.tar.gz") == "file:///tmp/x.tar.gz"
    assert html.safe_href("/runs/r1/bundles/hang-1/rank-00001.tar.gz")
    for bad in ("javascript:alert(1)", "JavaScript:x", "data:text/html,x", "//evil", "http://evil/x", "/v1/status",
                "a\nb", None, 5):
        assert html.safe_href(bad) is None, bad


def test_the_page_of_an_analyzed_run_dir_links_its_bundle_folders(tmp_path):
    """Bundle links that work from file://, relative inside the run dir."""
    from rankwatch.bundles import pack

    run_dir = tmp_path / "run"
    target = run_dir / "bundles" / "hang-1"
    target.mkdir(parents=True)
    manifest = wire.BundleManifest(run_id="r1", rank=0, local_rank=0, world_size=2, host="h", pid=1, step=3,
                                   created_at=time.time(), reason="hang", incident="hang-1",
                                   torch_version="2.13.0", rankwatch_version="0.1.0", python_version="3.11.7 x")
    (target / "rank-00000.tar.gz").write_bytes(pack(manifest, {
        "stacks.json": [{"name": "MainThread", "main": True, "frames": [{"file": "t.py", "line": 1, "name": "f"}]}],
        "env.json": {"HOME": "/root", "HF_TOKEN": "hf_abcdefghijklmnopqrstuvwx"},
        "runtime.json": {"argv": ["train.py", "--lr", "0.1"]}}))
    from rankwatch.collector.offline import analyze_path, load

    report = analyze_path(run_dir)
    run, _ = load(run_dir)
    out = html.write(report, tmp_path / "out" / "page.html", run)
    page = out.read_text()
    assert f'href="{(run_dir / "bundles/hang-1/rank-00000.tar.gz").as_uri()}"' in page  # outside the page's folder
    inside = html.write(report, run_dir / "report.html", run).read_text()
    assert 'href="bundles/hang-1/rank-00000.tar.gz"' in inside  # the run dir's own page: relative
    text = _text(page)
    assert "2.13.0" in text and "train.py --lr 0.1" in text and "hf_abcdefghijkl" not in page


# -- the launcher ---------------------------------------------------------------------------------

def _report():
    return wire.Report(run_id="run-x", world_size=2, status="healthy", verdicts=[])


def test_the_launcher_writes_the_page_next_to_report_json(tmp_path, capsys):
    from rankwatch.node import launcher

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    written = launcher._write_report(_report(), run_dir)
    page = launcher._write_page(_report(), run_dir, written, None)
    assert page == run_dir / "report.html" and "HEALTHY" in page.read_text()
    assert f"page: {page}" in capsys.readouterr().err


def test_an_unwritable_run_dir_gets_its_page_in_the_temp_dir(tmp_path, capsys, monkeypatch):
    import tempfile

    from rankwatch.node import launcher

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    run_dir = blocked / "run"  # every write below it fails (NotADirectoryError)
    written = launcher._write_report(_report(), run_dir)
    page = launcher._write_page(_report(), run_dir, written, None)
    err = capsys.readouterr().err
    assert page == tmp_path / "tmp" / "rankwatch-run-x-report.html" and page.is_file()
    assert written == tmp_path / "tmp" / "rankwatch-run-x-report.json"
    assert "Traceback" not in err and f"page: {page}" in err


def test_a_page_that_cannot_be_made_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    from rankwatch.node import launcher

    def broken(*args, **kwargs):
        raise TypeError("something unexpected")

    monkeypatch.setattr(html, "write", broken)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert launcher._write_page(_report(), run_dir, run_dir / "report.json", None) is None
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if "report.html" in l]
    assert lines == ["[rankwatch] report.html not written (TypeError: something unexpected)"]
    assert "Traceback" not in err


# -- the collector's pages and one-time links ---------------------------------------------------------

TOKEN = "page-test-token-0123456789abcdef"


def _collector(tmp_path, run=None, report=None):
    from rankwatch.collector import Collector
    from rankwatch.config import Config

    collector = Collector(config=Config(), data_dir=tmp_path / "data")
    if run is not None:
        collector.runs[run.run_id] = run
        collector._runtime(run.run_id).verdicts = list(report.verdicts)
    return collector


@pytest.fixture(params=["stdlib", "aiohttp"])
def served(request, tmp_path):
    """A collector holding a synthetic hung run, on either server, with a token."""
    from rankwatch.collector.server import AsyncCollectorServer, CollectorServer

    if request.param == "aiohttp":
        pytest.importorskip("aiohttp")
    run, report = page_load.synthetic(8, culprit=5)
    run.finished = False
    collector = _collector(tmp_path, run, report)
    cls = CollectorServer if request.param == "stdlib" else AsyncCollectorServer
    server = cls(collector, host="127.0.0.1", port=0, token=TOKEN).start()
    yield server, run.run_id
    server.stop()
    collector.stop()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def _get(url, headers=None):
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.build_opener(_NoRedirect).open(request, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def _mint(server, run_id=None):
    body = json.dumps({"run_id": run_id} if run_id else {}).encode()
    request = urllib.request.Request(server.url + "/v1/login-links", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())


def test_pages_refuse_a_browser_without_the_credential(served):
    server, run_id = served
    for path in ("/", f"/runs/{run_id}", f"/runs/{run_id}/page.json", f"/v1/runs/{run_id}/page"):
        status, headers, body = _get(server.url + path)
        assert status == 401, path
        assert b"synthetic" not in body and b"rank 5" not in body
    status, _, body = _get(server.url + f"/runs/{run_id}", {"Cookie": "rankwatch_x=forged"})
    assert status == 401 and b"needs a rankwatch link" in body


def test_a_one_time_link_opens_the_pages_once_and_the_cookie_opens_only_pages(served):
    server, run_id = served
    link = _mint(server, run_id)
    assert link["path"].startswith("/login/") and TOKEN not in link["path"]
    status, headers, body = _get(server.url + link["path"])
    assert status == 200
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie and TOKEN not in cookie
    assert f'url=/runs/{run_id}"'.encode() in body  # on to the clean URL, the code left behind
    session = cookie.split(";", 1)[0]
    status, headers, body = _get(server.url + f"/runs/{run_id}", {"Cookie": session})
    assert status == 200 and b"train.py:94" in body and b"rank 5" in body
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert headers["X-Frame-Options"] == "DENY"
    status, _, body = _get(server.url + f"/runs/{run_id}/page.json", {"Cookie": session})
    fragment = json.loads(body)
    assert status == 200 and "train.py:94" in fragment["html"] and fragment["finished"] is False
    status, _, body = _get(server.url + "/", {"Cookie": session})
    assert status == 200 and run_id.encode() in body and b"faulty" in body
    # The cookie is not the token: the API stays closed to it.
    assert _get(server.url + "/v1/status", {"Cookie": session})[0] == 401
    assert _get(server.url + f"/v1/runs/{run_id}/report", {"Cookie": session})[0] == 401
    # Used once: the same link again is refused and sets nothing.
    status, headers, _ = _get(server.url + link["path"])
    assert status == 403 and "Set-Cookie" not in headers


def test_a_wrong_or_expired_link_is_refused(served, monkeypatch):
    server, run_id = served
    sessions = server.routes.pages.sessions
    status, headers, _ = _get(server.url + "/login/" + "A" * 43)
    assert status == 403 and "Set-Cookie" not in headers
    link = _mint(server, run_id)
    now = time.time()
    monkeypatch.setattr(sessions, "clock", lambda: now + sessions.link_ttl + 1)
    status, headers, _ = _get(server.url + link["path"])
    assert status == 403 and "Set-Cookie" not in headers
    # A session expires too.
    monkeypatch.setattr(sessions, "clock", lambda: now)
    cookie = _get(server.url + _mint(server, run_id)["path"])[1]["Set-Cookie"].split(";", 1)[0]
    assert _get(server.url + f"/runs/{run_id}", {"Cookie": cookie})[0] == 200
    monkeypatch.setattr(sessions, "clock", lambda: now + sessions.session_ttl + 1)
    assert _get(server.url + f"/runs/{run_id}", {"Cookie": cookie})[0] == 401


def test_minting_a_link_needs_the_token(served):
    server, _ = served
    request = urllib.request.Request(server.url + "/v1/login-links", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 401
    request.add_header("Authorization", f"Bearer {TOKEN}")
    bad = urllib.request.Request(server.url + "/v1/login-links", data=b'{"run_id": "../x"}', method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(bad, timeout=10)
    assert err.value.code == 400


def test_neither_the_token_nor_a_links_code_reaches_the_logs(served, caplog):
    server, run_id = served
    caplog.set_level(logging.DEBUG)
    link = _mint(server, run_id)
    _get(server.url + link["path"])
    _get(server.url + link["path"])
    _get(server.url + f"/runs/{run_id}", {"Authorization": f"Bearer {TOKEN}"})
    code = link["path"].rsplit("/", 1)[1]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert TOKEN not in logged and code not in logged


def test_the_bearer_token_opens_the_page_data_for_analyze(served):
    server, run_id = served
    status, _, body = _get(server.url + f"/v1/runs/{run_id}/page", {"Authorization": f"Bearer {TOKEN}"})
    model = json.loads(body)
    assert status == 200 and model["schema"] == pagedata.SCHEMA and model["culprits"] == [5]
    assert _get(server.url + "/v1/runs/nope/page", {"Authorization": f"Bearer {TOKEN}"})[0] == 404


def test_a_bundle_is_served_from_the_run_dir_only(tmp_path):
    from rankwatch.collector.pages import Pages

    collector = _collector(tmp_path)
    try:
        pages = Pages(collector)
        bundles = collector.run_dir("r1") / "bundles" / "hang-1"
        bundles.mkdir(parents=True)
        (bundles / "rank-00001.tar.gz").write_bytes(b"\x1f\x8b data")
        (bundles / "rank-00002.tar.gz").symlink_to("/etc/passwd")
        status, body, kind, headers = pages.get("/runs/r1/bundles/hang-1/rank-00001.tar.gz")
        assert status == 200 and body == b"\x1f\x8b data" and kind == "application/gzip"
        assert pages.get("/runs/r1/bundles/hang-1/rank-00002.tar.gz")[0] == 404
        assert pages.get("/runs/r1/bundles/../../etc/rank-00001.tar.gz") is None
        assert pages.get("/runs/r1/bundles/hang-1/passwd") is None
    finally:
        collector.stop()


def test_another_apps_malformed_cookie_does_not_hide_the_session():
    from rankwatch.collector.pages import Sessions

    sessions = Sessions()
    code, _ = sessions.mint("/runs/r1")
    session, target = sessions.redeem(code)
    assert target == "/runs/r1" and sessions.redeem(code) is None
    assert sessions.valid(f'theme="dark; x=\\"1; {sessions.cookie_name}={session}; other=2')
    assert not sessions.valid(f"{sessions.cookie_name}=forged")
    assert not Sessions().valid(f"{sessions.cookie_name}={session}")  # another collector's session


def test_the_launcher_takes_a_collectors_page_data_only_when_it_says_what_the_report_says():
    from rankwatch.node import launcher

    run, report = page_load.synthetic(4, culprit=1)
    model = pagedata.build(report, run)

    class Remote:
        answer = b""

        def get(self, path, timeout=30):
            assert path == f"/v1/runs/{report.run_id}/page"
            return self.answer

    remote = Remote()
    remote.answer = wire.json_text(model).encode()
    assert launcher._collector_page_model(report, remote)["culprits"] == [1]
    lying = dict(model, verdicts=[])  # a collector that calls the run healthy
    remote.answer = wire.json_text(lying).encode()
    assert launcher._collector_page_model(report, remote) is None
    remote.answer = b"<html>not json</html>"
    assert launcher._collector_page_model(report, remote) is None


def test_analyze_url_html_renders_a_collectors_page_data(served, tmp_path, monkeypatch, capsys):
    """`rankwatch analyze http://collector/runs/ID --html FILE`: the bearer
    token from the environment, the page written locally, no collector route
    left in it (a file cannot follow them)."""
    from rankwatch import cli

    server, run_id = served
    monkeypatch.setenv("RANKWATCH_TOKEN", TOKEN)
    out = tmp_path / "page.html"
    assert cli.main(["analyze", f"{server.url}/runs/{run_id}", "--html", str(out)]) == 0
    page = out.read_text()
    assert "train.py:94" in page and 'class="culprits">rank 5<' in page
    assert 'href="/runs/' not in page and "connect-src &#x27;none&#x27;" in page
    monkeypatch.setenv("RANKWATCH_TOKEN", "wrong")
    assert cli.main(["analyze", f"{server.url}/runs/{run_id}", "--html", str(out)]) == 2
    assert "HTTP 401 (set RANKWATCH_TOKEN)" in capsys.readouterr().err


def test_analyze_html_of_one_bundle_archive(tmp_path):
    from rankwatch import cli
    from rankwatch.bundles import pack

    manifest = wire.BundleManifest(run_id="r2", rank=1, local_rank=1, world_size=2, host="h", pid=1, step=3,
                                   created_at=time.time(), reason="crash", incident="crash-1", torch_version="2.13.0")
    archive = tmp_path / "rank-00001.tar.gz"
    archive.write_bytes(pack(manifest, {"exception.json": {"type": "ValueError", "message": HOSTILE,
                                                           "traceback": "Traceback ...\nValueError: " + HOSTILE}}))
    out = tmp_path / "one.html"
    assert cli.main(["analyze", str(archive), "--html", str(out)]) == 0
    page = out.read_text()
    assert "crash" in page and "ValueError" in page and HOSTILE not in page


def test_a_link_for_a_reachable_collector_never_goes_to_a_log(capsys, monkeypatch):
    """`rankwatch run --collector http://collector:8765` with its output in a
    log (no terminal): the clean page URL and how to get a link, no link."""
    from rankwatch.node import launcher

    class Remote:
        def post(self, *args, **kwargs):
            raise AssertionError("no link is minted for a log")

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    launcher._announce_page("job-1", "http://collector.example:8765", None, None, Remote())
    err = capsys.readouterr().err
    assert "/login/" not in err
    assert ("page: http://collector.example:8765/runs/job-1 (open it in a browser with a one-time link: "
            "rankwatch collector link --url http://collector.example:8765 --run job-1)") in err


def test_the_printed_link_opens_the_runs_page_before_any_worker_has_started(tmp_path, capsys):
    """`rankwatch run` prints the link before torchrun starts the workers, and
    a person may open it at once: the page is the run's (live), not "No such
    run" (a page that would never update)."""
    import http.cookiejar

    from rankwatch.collector.embedded import InProcessClient, start_embedded
    from rankwatch.config import Config
    from rankwatch.node import launcher
    from rankwatch.node.supervisor import NodeSupervisor

    config = Config()
    config.token = "t" * 32
    embedded, server = start_embedded(config, tmp_path)
    try:
        remote = InProcessClient(server.routes, server.url)
        # Not started: no report of its loop, only the one before the link.
        supervisor = NodeSupervisor(run_id="job-1", run_dir=tmp_path, post=remote.post, node_rank=0, world_size=0,
                                    on_hang="abort", hang_timeout=60.0)
        launcher._announce_page("job-1", server.url, embedded, server, remote, make_known=supervisor.report_now)
        link = re.search(r"page: (http://\S+/login/\S+)", capsys.readouterr().err).group(1)
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
        with opener.open(link, timeout=10) as r:
            target = re.search(r'url=(/runs/[^"]+)"', r.read().decode()).group(1)
        with opener.open(server.url + target, timeout=10) as r:
            status, page = r.status, r.read().decode()
        assert status == 200
        assert 'id="rw-live"' in page and "job-1" in page
    finally:
        server.stop()
        embedded.stop()


def test_the_login_link_is_printed_once_and_on_demand(tmp_path, capsys):
    """Issue 26: a fresh one-time link was printed at start and again with
    every verdict, flooding job logs. It is printed once; SIGUSR1 to the
    launcher prints a fresh one."""
    import signal

    from rankwatch.collector.embedded import InProcessClient, start_embedded
    from rankwatch.config import Config
    from rankwatch.node import launcher

    config = Config()
    config.token = "t" * 32
    embedded, server = start_embedded(config, tmp_path)
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        remote = InProcessClient(server.routes, server.url)
        launcher._announce_page("job-1", server.url, embedded, server, remote)
        first = capsys.readouterr().err
        assert first.count("/login/") == 1 and f"kill -USR1 {os.getpid()}" in first
        verdict = wire.Verdict(kind="nonfinite", ranks=[1], step=3, first_seen_at="2026-11-25T00:00:00Z",
                               detected_at="2026-11-25T00:00:01Z", summary="NaN")
        for callback in embedded.on_verdict:  # what the collector calls with each new verdict
            callback("job-1", verdict)
        assert "/login/" not in capsys.readouterr().err
        os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs in this (main) thread before the next line
        fresh = re.findall(r"page: http://\S+/login/(\S+)", capsys.readouterr().err)
        assert len(fresh) == 1 and fresh[0] not in first
    finally:
        signal.signal(signal.SIGUSR1, previous)
        server.stop()
        embedded.stop()


def test_a_just_started_run_says_running_not_healthy():
    """Issue 26: a live run without a verdict yet was titled "(healthy)"."""
    run, report = page_load.synthetic(4)
    report.verdicts, report.status = [], "healthy"
    model = pagedata.build(report, run, live=True, finished=False)
    page = html.document(model, poll_url="/v1/runs/x/page")
    assert "<title>rankwatch: synthetic-4 (running)</title>" in page
    assert 'id="rw-status">RUNNING</span>' in html.fragment(model)["html"]  # what the live page polls
    text = _text(page)
    assert "RUNNING" in text and "No faults found so far" in text and "HEALTHY" not in text
    finished = pagedata.build(report, run, live=True, finished=True)
    assert "(healthy)" in html.document(finished)


def test_a_sampled_series_is_drawn_as_points_and_says_it_is_sampled():
    """Issue 26: the local gradient norm (sampled steps) was drawn as line
    fragments between gaps, a nearly empty chart."""
    run, report = page_load.synthetic(4)
    for state in run.ranks.values():
        for step, record in state.steps.items():
            record.grad_norm = 1.0 + step % 3 if step % 8 == 0 else None
    model = pagedata.build(report, run)
    grad = next(m for m in model["timelines"]["metrics"] if m["key"] == "grad_norm")
    loss = next(m for m in model["timelines"]["metrics"] if m["key"] == "loss")
    assert grad["sampled"]["steps_with_value"] * 8 == pytest.approx(grad["sampled"]["steps"], abs=8)
    assert "sampled" not in loss
    charts = html.charts(model)["timelines"]["metrics"]
    assert {m["key"]: m["sampled"] for m in charts if m["key"] in ("grad_norm", "loss")} == \
        {"grad_norm": True, "loss": False}
    text = _text(html.document(model))
    assert "sampled: a value at" in text and "drawn as points" in text


def test_the_evidence_tables_bundle_column_comes_right_after_the_rank():
    """Issue 26: the bundle column was the last of a wide table, behind a
    horizontal scroll; a bundle is shown by its name (the path on hover)."""
    run, _ = page_load.synthetic(4, culprit=2)
    path = "/very/long/run/dir/bundles/collective_mismatch-1/rank-00002.tar.gz"
    evidence = {"calls": {str(r): {"op": "all_reduce", "callsite": "train.py:40 in main", "numel": 1 << r}
                          for r in range(4)},
                "others": {str(r): {"phase": "backward", "step": 5} for r in (0, 1, 3)},
                "bundles": {"2": path}}
    report = wire.Report(run_id=run.run_id, world_size=4, status="faulty", verdicts=[wire.Verdict(
        kind="collective_mismatch", ranks=[2], step=5, first_seen_at="2026-11-24T10:00:00.000Z",
        detected_at="2026-11-24T10:00:03.500Z", summary="Rank 2 called all_reduce.", evidence=evidence)])
    page = html.page(report, run)
    table = page[page.index('<table class="per-rank">'):]
    table = table[:table.index("</table>")]
    assert re.findall(r"<th>([^<]*)</th>", table)[:2] == ["rank", "bundles"]
    assert 'title="' + path + '">rank-00002.tar.gz</span>' in table


def test_a_ranks_train_config_changes_are_marked_on_its_timelines_with_the_line_that_set_them():
    """Issue 26 item 5: a rank switching to eval (or changing another training
    fact) is a mark on its timelines, next to the verdicts' markers: which
    rank, at which step, what changed and the line that set it. The first
    facts a rank sends are its baseline, not a change; marks are bounded."""
    run, report = page_load.synthetic(4)
    steps = sorted(run.ranks[0].steps)
    first, switch = steps[0], steps[len(steps) // 2]

    def facts(rank, step, values, sites=None):
        details = {"facts": [[k, v] for k, v in values.items()]}
        if sites:
            details["sites"] = [[k, v] for k, v in sites.items()]
        run.ranks[rank].events.append(wire.Event(kind="train_config", at=1.0 + step, step=step, details=details))

    for r in range(4):
        facts(r, first, {"mode": "train", "clip": "none", "micro_batches": "1"})
    facts(2, switch, {"mode": "eval"}, {"mode": "train.py:" + HOSTILE})
    facts(2, switch + 1, {"mode": "train"})
    for i in range(200):  # a fact flapping every step: thinned, not 200 marks
        facts(3, first + 1 + i % 50, {"loss_scale": str(2.0 ** (i % 7))})
    model = pagedata.build(report, run)
    marks = [m for m in model["timelines"]["markers"] if m["kind"] == "train_config"]
    eval_marks = [m for m in marks if ["mode", "eval"] in m["changed"]]
    assert [(m["ranks"], m["step"]) for m in eval_marks] == [([2], switch)]
    assert eval_marks[0]["sites"] == [["mode", "train.py:" + HOSTILE]]
    assert any(m["ranks"] == [2] and m["step"] == switch + 1 and m["changed"] == [["mode", "train"]] for m in marks)
    assert not any(m["step"] == first for m in marks)  # the baseline is no change
    assert 0 < sum(1 for m in marks if 3 in m["ranks"]) <= pagedata.MAX_CONFIG_MARKS
    # The charts' data carries them, checked; the page lists them, escaped.
    drawn = [m for m in html.charts(model)["timelines"]["markers"] if m["kind"] == "train_config"]
    assert {"step": switch, "ranks": [2], "label": "rank 2: mode \u2192 eval (train.py:" + HOSTILE + ")"}.items() \
        <= next(m for m in drawn if m["step"] == switch).items()
    page = html.document(model)
    assert "<script>window.__pwned" not in page and "<img src=x" not in page
    text = _text(page)
    assert f"rank 2 at step {switch}: mode \u2192 eval (train.py:" + HOSTILE + ")" in text
