"""The collector's pages for people: a run's page (`/runs/<id>`, live while the
job runs), the index of runs (`/`), and how a browser gets in.

    GET  /                              the runs, with their status
    GET  /runs/<id>                     the run's page (report.html, live)
    GET  /runs/<id>/page.json           what the live page polls (its content and charts)
    GET  /runs/<id>/bundles/<inc>/<f>   a bundle archive of the run
    GET  /v1/runs/<id>/page             the page's data (`rankwatch analyze URL --html`)
    POST /v1/login-links                a one-time link for a browser (bearer token)
    GET  /login/<code>                  the one-time link: sets the session cookie

A browser cannot send the bearer token, and a token in a URL would land in
shell history, browser history and proxy logs. So `rankwatch run` and
`rankwatch collector serve` (or `rankwatch collector link`) print a one-time
link instead: a random code, valid LINK_TTL_S seconds, used once. Opening it
sets an HttpOnly, SameSite=Strict session cookie and moves on to the clean URL
(a same-origin step, so the strict cookie goes with it). The cookie opens the
pages only (GET of `/`, `/runs/...`), never the API; sessions live in memory
(a restart logs browsers out) and expire after SESSION_TTL_S.

The pages are made from the collector's state with `rankwatch.outputs.html`,
the same renderer as the report.html a run writes; a run's page data is cached
for a refresh interval so that many viewers of a big job cost one build.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from rankwatch import wire
from rankwatch.cadence import node_report_interval

log = logging.getLogger("rankwatch.collector")

LINK_TTL_S = 600.0  # a one-time link is good for 10 minutes
SESSION_TTL_S = 12 * 3600.0
MAX_LINKS = 1000  # outstanding links / live sessions kept (the oldest go first)
MAX_SESSIONS = 1000
MAX_MODEL_BYTES = 32 * 1024 * 1024  # the page data of a 100,000-rank run is ~0.5 MB
MAX_INDEX_RUNS = 500

_RUN = r"([A-Za-z0-9_-][A-Za-z0-9_.-]{0,127})"
_PAGE = re.compile(rf"^/runs/{_RUN}/?$")
_PAGE_JSON = re.compile(rf"^/runs/{_RUN}/page\.json$")
_BUNDLE = re.compile(rf"^/runs/{_RUN}/bundles/([A-Za-z0-9_-][A-Za-z0-9_.-]{{0,127}})/"
                     r"(rank-\d{1,7}(?:\.supervisor)?\.tar\.gz)$")
_MODEL = re.compile(rf"^/v1/runs/{_RUN}/page$")
_LOGIN = re.compile(r"^/login/([A-Za-z0-9_-]{20,100})$")

Response = tuple[int, bytes, str, dict[str, str]]

SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
                    "Cache-Control": "no-store"}


def is_page(method: str, path: str) -> bool:
    """The routes a session cookie opens (GET of the pages, nothing else)."""
    return method == "GET" and (path in ("/", "/runs", "/runs/") or path.startswith("/runs/"))


def is_login(method: str, path: str) -> bool:
    return method == "GET" and bool(_LOGIN.match(path))


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "replace")).digest()


class Sessions:
    """One-time links and the browser sessions they open (in memory)."""

    def __init__(self, link_ttl: float = LINK_TTL_S, session_ttl: float = SESSION_TTL_S,
                 clock: Callable[[], float] = time.time):
        self.link_ttl, self.session_ttl, self.clock = link_ttl, session_ttl, clock
        # A cookie name of this collector's own: two collectors on one host
        # (cookies ignore ports) do not log each other's browsers out.
        self.cookie_name = f"rankwatch_{secrets.token_hex(4)}"
        self._links: dict[bytes, tuple[float, str]] = {}
        self._sessions: dict[bytes, float] = {}
        self._lock = threading.Lock()

    def mint(self, target: str = "/") -> tuple[str, float]:
        """A one-time link's code for ``target`` (a page path) and its lifetime."""
        if not (target == "/" or _PAGE.match(target)):
            raise ValueError(f"not a page: {target!r}")
        code = secrets.token_urlsafe(32)
        now = self.clock()
        with self._lock:
            self._expire(now)
            while len(self._links) >= MAX_LINKS:
                self._links.pop(next(iter(self._links)))
            self._links[_digest(code)] = (now + self.link_ttl, target)
        return code, self.link_ttl

    def redeem(self, code: str) -> Optional[tuple[str, str]]:
        """(session id, target) for a valid, unused, unexpired code; the code
        is spent either way."""
        now = self.clock()
        with self._lock:
            entry = self._links.pop(_digest(code), None)
            if entry is None or entry[0] < now:
                return None
            self._expire(now)
            while len(self._sessions) >= MAX_SESSIONS:
                self._sessions.pop(next(iter(self._sessions)))
            session = secrets.token_urlsafe(32)
            self._sessions[_digest(session)] = now + self.session_ttl
            return session, entry[1]

    def valid(self, cookie_header: Optional[str]) -> bool:
        if not cookie_header or len(cookie_header) > 8192:
            return False
        # By hand, not http.cookies: one malformed cookie of another app on
        # this host must not hide ours.
        values = [part.split("=", 1)[1].strip() for part in cookie_header.split(";")
                  if "=" in part and part.split("=", 1)[0].strip() == self.cookie_name]
        now = self.clock()
        with self._lock:
            for value in values[:4]:
                expires = self._sessions.get(_digest(value))
                if expires is None:
                    continue
                if expires < now:
                    self._sessions.pop(_digest(value), None)
                    continue
                return True
        return False

    def cookie(self, session: str) -> str:
        return (f"{self.cookie_name}={session}; Path=/; Max-Age={int(self.session_ttl)}; HttpOnly; "
                f"SameSite=Strict")

    def _expire(self, now: float) -> None:
        for table in (self._links,):
            for key in [k for k, (at, _) in table.items() if at < now]:
                table.pop(key, None)
        for key in [k for k, at in self._sessions.items() if at < now]:
            self._sessions.pop(key, None)


class Pages:
    """The page routes (answers for `Routes`)."""

    def __init__(self, collector: Any, sessions: Optional[Sessions] = None):
        self.collector = collector
        self.sessions = sessions or Sessions()
        self._cache: dict[str, tuple[float, dict[str, Any]]] = {}
        self._cache_lock = threading.Lock()
        self._build_locks: dict[str, threading.Lock] = {}

    # -- routing ----------------------------------------------------------------------------
    def get(self, path: str) -> Optional[Response]:
        """The answer to a GET of a page route (already authorised), or None."""
        if path in ("/", "/runs", "/runs/"):
            return self._html(200, self.index())
        match = _PAGE.match(path)
        if match:
            return self.run_page(match.group(1))
        match = _PAGE_JSON.match(path)
        if match:
            from rankwatch.outputs import html

            model = self.model(match.group(1))
            if model is None:
                return _json(404, {"error": f"unknown run {match.group(1)!r}"})
            return _json(200, html.fragment(model), SECURITY_HEADERS)
        match = _MODEL.match(path)
        if match:
            model = self.model(match.group(1), live=False)
            if model is None:
                return _json(404, {"error": f"unknown run {match.group(1)!r}"})
            return _json(200, model)
        match = _BUNDLE.match(path)
        if match:
            return self.bundle(*match.groups())
        return None

    def login(self, path: str) -> Response:
        from rankwatch.outputs import html

        match = _LOGIN.match(path)
        found = self.sessions.redeem(match.group(1)) if match else None
        if found is None:
            return self._html(403, html.message_document(
                "This link has expired or was used already",
                "A rankwatch link opens the pages once, for 10 minutes. Ask for a new one: "
                "rankwatch collector link --url URL (with RANKWATCH_TOKEN set), or see the link rankwatch run prints."))
        session, target = found
        # 200 and a same-origin step to the clean URL (not a redirect from a
        # cross-site click, which would not carry the SameSite=Strict cookie).
        return self._html(200, html.message_document("Opening the rankwatch page", "Signed in.", refresh_to=target),
                          {"Set-Cookie": self.sessions.cookie(session)})

    def refused(self) -> Response:
        from rankwatch.outputs import html

        return self._html(401, html.message_document(
            "This page needs a rankwatch link",
            "Open the one-time link that rankwatch run or rankwatch collector serve printed, or make a new one: "
            "rankwatch collector link --url URL (with RANKWATCH_TOKEN set)."), {"WWW-Authenticate": "Bearer"})

    def mint_link(self, body: bytes) -> Response:
        """POST /v1/login-links {"run_id": optional}: a one-time link (path)."""
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            return _json(400, {"error": "body is not JSON"})
        run_id = request.get("run_id") if isinstance(request, dict) else None
        if run_id is not None and not wire.valid_id(run_id):
            return _json(400, {"error": "run_id: not a run id"})
        code, ttl = self.sessions.mint(f"/runs/{run_id}" if run_id else "/")
        return _json(200, {"path": f"/login/{code}", "expires_in_s": ttl})

    # -- pages -----------------------------------------------------------------------------------
    def index(self) -> str:
        from rankwatch.outputs import html

        return html.index_document(self.runs())

    def runs(self) -> list[dict[str, Any]]:
        collector = self.collector
        out: dict[str, dict[str, Any]] = {}
        status = collector.status()
        for rid, info in status.get("runs", {}).items():
            verdicts = info.get("verdicts") or []
            state = "faulty" if verdicts else ("healthy" if info.get("finished") else "running")
            run = collector.runs.get(rid)
            out[rid] = {"run_id": rid, "status": state, "world_size": info.get("world_size"),
                        "verdicts": len(verdicts), "kinds": sorted({v.get("kind") for v in verdicts}),
                        "started_at": _iso(run.started_at) if run is not None else None}
        try:
            known = collector.store.run_ids()[-MAX_INDEX_RUNS:]
        except Exception:
            known = []
        for rid in known:
            if rid in out:
                continue
            try:
                verdicts = collector.store.verdicts(rid)
            except Exception:
                verdicts = []
            out[rid] = {"run_id": rid, "status": "faulty" if verdicts else "finished", "world_size": None,
                        "verdicts": len(verdicts), "kinds": sorted({v.kind for v in verdicts}), "started_at": None}
        return sorted(out.values(), key=lambda r: r["started_at"] or "", reverse=True)  # newest first

    def run_page(self, run_id: str) -> Response:
        from rankwatch.outputs import html

        model = self.model(run_id)
        if model is None:
            return self._html(404, html.message_document("No such run", f"The collector knows no run {run_id}."))
        return self._html(200, html.document(model, poll_url=f"/runs/{run_id}/page.json"))

    def model(self, run_id: str, live: bool = True) -> Optional[dict[str, Any]]:
        """The run's page data, rebuilt at most once a refresh interval."""
        from rankwatch.collector.service import RequestError

        now = time.time()
        with self._cache_lock:
            cached = self._cache.get(run_id)
            lock = self._build_locks.setdefault(run_id, threading.Lock())
        if cached is not None and now - cached[0] < cached[1].get("refresh_s", 1.0) and cached[1].get("live") == live:
            return cached[1]
        with lock:  # one build per run at a time; the others take its result
            with self._cache_lock:
                cached = self._cache.get(run_id)
            if cached is not None and time.time() - cached[0] < cached[1].get("refresh_s", 1.0) \
                    and cached[1].get("live") == live:
                return cached[1]
            try:
                report = self.collector.report(run_id)
            except RequestError:
                return None
            started = time.perf_counter()
            model = self._build(run_id, report, live)
            took = time.perf_counter() - started
            # A big job's page takes a while to make: not more than a fifth of the time.
            model["refresh_s"] = max(model.get("refresh_s") or 1.0, 5 * took)
            with self._cache_lock:
                self._cache[run_id] = (time.time(), model)
                while len(self._cache) > 16:
                    self._cache.pop(next(iter(self._cache)))
            return model

    def _build(self, run_id: str, report: wire.Report, live: bool) -> dict[str, Any]:
        from rankwatch.outputs import pagedata

        collector = self.collector
        run = collector.runs.get(run_id)
        if run is not None and run.finished and not run.all_evidence() and collector.store.bundle_paths(run_id):
            run = self._with_bundles(run_id)  # reloaded from the index: its bundles' evidence
        finished = bool(run.finished) if run is not None else True
        interval = collector.config.heartbeat_interval
        if run is not None:
            interval = max(interval, node_report_interval(run.world_size) or 0.0)
        run_dir = None
        try:
            run_dir = collector.run_dir(run_id)
        except Exception:
            pass
        return pagedata.build(report, run, bundle_href=lambda p: _bundle_href(run_id, run_dir, p),
                              live=live, refresh_s=interval, finished=finished)

    def _with_bundles(self, run_id: str):
        """A finished run out of memory: its state from the index and its
        bundles (read-only, bounded) for the stacks and sequence numbers."""
        from rankwatch.bundles import BundleError, read_path
        from rankwatch.collector.service import merge_bundle

        collector = self.collector
        run = collector.store.load_run(run_id)
        for path in collector.store.bundle_paths(run_id)[:2000]:
            try:
                merge_bundle(run, read_path(Path(path)))
            except (BundleError, wire.WireError, OSError, ValueError):
                continue
        run.finished = True
        return run

    def bundle(self, run_id: str, incident: str, name: str) -> Response:
        try:
            base = (self.collector.run_dir(run_id) / "bundles").resolve()
        except Exception:
            return _json(404, {"error": "no bundles"})
        path = base / incident / name
        try:
            if path.is_symlink() or not path.is_file() or path.resolve().parent.parent != base:
                return _json(404, {"error": "no such bundle"})
            if path.stat().st_size > wire.MAX_BUNDLE_BYTES:
                return _json(413, {"error": "bundle too big to serve"})
            data = path.read_bytes()
        except OSError:
            return _json(404, {"error": "no such bundle"})
        return 200, data, "application/gzip", {**SECURITY_HEADERS,
                                               "Content-Disposition": f'attachment; filename="{name}"'}

    @staticmethod
    def _html(status: int, text: str, headers: Optional[dict[str, str]] = None) -> Response:
        csp = _csp_of(text)
        out = {**SECURITY_HEADERS, **(headers or {})}
        if csp:
            out["Content-Security-Policy"] = csp + "; frame-ancestors 'none'"
        return status, text.encode("utf-8"), "text/html; charset=utf-8", out


_CSP_META = re.compile(r'<meta http-equiv="Content-Security-Policy" content="([^"]*)">')


def _csp_of(text: str) -> Optional[str]:
    """The page's own policy (in its <meta>), sent as a header too."""
    import html as html_lib

    match = _CSP_META.search(text[:4096])
    return html_lib.unescape(match.group(1)) if match else None


def _bundle_href(run_id: str, run_dir: Optional[Path], path: str) -> Optional[str]:
    """The page link of a bundle stored under the run's dir."""
    if run_dir is None or not path:
        return None
    try:
        rel = Path(path).resolve().relative_to((Path(run_dir) / "bundles").resolve())
    except (ValueError, OSError):
        return None
    parts = rel.parts
    if len(parts) != 2:
        return None
    href = f"/runs/{run_id}/bundles/{parts[0]}/{parts[1]}"
    return href if _BUNDLE.match(href) else None


def _json(status: int, payload: Any, headers: Optional[dict[str, str]] = None) -> Response:
    return status, wire.json_text(payload, compact=True).encode(), "application/json", dict(headers or {})


def _iso(t: Optional[float]) -> Optional[str]:
    if not t:
        return None
    from rankwatch.collector.analyses.common import iso

    return iso(t)
