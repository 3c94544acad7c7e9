"""HTTP front of the collector.

    POST /v1/heartbeat           agent heartbeat                 -> Reply (commands)
    POST /v1/nodes               node supervisor report          -> Reply (commands)
    POST /v1/node-report         a node relay's batch            -> NodeReply (node's and ranks' commands)
    POST /v1/bundles             gzip'd tar bundle               -> {"stored": path}
    POST /v1/runs/<id>/finish    launcher is done                -> report
    GET  /v1/runs/<id>/report    current report
    GET  /v1/status              runs, incidents, verdicts
    GET  /metrics                Prometheus exposition (when enabled)
    GET  /healthz                health probe (never needs the token)
    GET  /, /runs/<id>, ...      the pages for people (collector/pages.py): the token, or
                                 the session cookie a one-time link (POST /v1/login-links,
                                 GET /login/<code>) gives a browser

Two servers share one set of routes (`Routes`):

- `CollectorServer`: the standard library's threading server. The embedded
  collector of `rankwatch run` (a handful of local, kept-alive connections)
  and tests.
- `AsyncCollectorServer`: aiohttp on one event loop, for the standalone
  service: 12,500 nodes keep 12,500 connections open, which a thread per
  connection cannot hold.

Every request is untrusted: with a token, every endpoint but /healthz (and
/metrics when opened by flag) requires ``Authorization: Bearer <token>``
(constant-time compare), checked before the body is read; the body's size is
bounded before it is read; a request must arrive whole within
REQUEST_TIMEOUT (headers trickled byte by byte are cut off); connections
beyond MAX_CONNECTIONS are refused; JSON is validated field by field.

Ingest is admitted before its body is read (`admission.py`): a collector
that is behind answers 503 with `Retry-After` and the cadence at once,
instead of letting a backlog time every request out.
"""

from __future__ import annotations

import asyncio
import hmac
import io
import json
import logging
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

from rankwatch import wire

from . import codec
from .admission import INGEST_PATHS, Admission, AdmissionConfig, collector_cadence
from .service import Collector, MustWait, RequestError, without_waiting

log = logging.getLogger("rankwatch.collector")

_LOGIN_CODE = re.compile(r"/login/[A-Za-z0-9_-]+")
_RUN_PATH = re.compile(r"^/v1/runs/([A-Za-z0-9_.-]{1,128})/(report|finish)$")

REQUEST_TIMEOUT = 10.0  # seconds for a whole request (line, headers, body) once it started
IDLE_TIMEOUT = 120.0  # a kept-alive connection with no request
SHED_BODY_GRACE_S = 0.5  # a shed request's body still arriving is waited for this long, then its connection closed
MAX_CONNECTIONS = 20_000  # standalone; the embedded server takes fewer (see CollectorServer)
MAX_NODE_REPORT_BYTES = 16 * 1024 * 1024  # 8+ ranks' beats in one request
INLINE_MAX_BYTES = 64 * 1024  # reports taken in on the aiohttp loop at most this big (a steady 8-rank one: ~7 KB)

Response = tuple[int, bytes, str, dict[str, str]]


def _json(status: int, payload: Any, headers: Optional[dict[str, str]] = None) -> Response:
    body = payload if isinstance(payload, bytes) else wire.json_text(payload, compact=True).encode() \
        if hasattr(wire, "json_text") else json.dumps(payload, default=str).encode()
    return status, body, "application/json", headers or {}


_EMPTY_REPLY = {"commands": [], "version": wire.WIRE_VERSION}


_EMPTY_BYTES: dict[Any, bytes] = {}


def _timed(handle: Callable[..., Response], *args: Any) -> tuple[Response, float]:
    started = time.perf_counter()
    result = handle(*args)
    return result, time.perf_counter() - started


def _reply_dict(reply: Any) -> Any:
    """Most replies carry no command: encoded once, not per request."""
    if not reply.commands and not getattr(reply, "ranks", None) and not getattr(reply, "verdicts", None):
        interval, stride = getattr(reply, "interval", None), getattr(reply, "step_stride", None)
        cached = _EMPTY_BYTES.get((interval, stride))
        if cached is None:
            out = dict(_EMPTY_REPLY)
            if interval is not None:
                out["interval"] = interval
            if stride is not None:
                out["step_stride"] = stride
            cached = _EMPTY_BYTES[(interval, stride)] = json.dumps(out, separators=(",", ":")).encode()
        return cached
    return wire.to_dict(reply)


class Routes:
    """The collector's endpoints, independent of the HTTP server."""

    def __init__(self, collector: Collector, token: Optional[str] = None,
                 metrics_handler: Optional[Callable[[], tuple[bytes, str]]] = None, metrics_open: bool = False):
        self.collector = collector
        self.token = token or None
        self.metrics_handler = metrics_handler
        self.metrics_open = metrics_open
        self._expected = f"Bearer {self.token}".encode() if self.token else b""
        from .pages import Pages

        self.pages = Pages(collector)

    # -- checks before the body is read ----------------------------------------------
    def needs_token(self, method: str, path: str) -> bool:
        if not self.token:
            return False
        if method == "GET" and (path == "/healthz" or (path == "/metrics" and self.metrics_open)):
            return False
        from .pages import is_login

        return not is_login(method, path)  # a one-time link is its own credential

    def authorised(self, header: Optional[str]) -> bool:
        given = (header or "").encode("utf-8", "replace")
        return hmac.compare_digest(given, self._expected)

    @staticmethod
    def body_limit(path: str) -> int:
        if path == "/v1/bundles":
            return wire.MAX_BUNDLE_BYTES
        if path == "/v1/node-report":
            return MAX_NODE_REPORT_BYTES
        return wire.MAX_MESSAGE_BYTES

    def precheck(self, method: str, path: str, authorization: Optional[str],
                 length: Optional[str], cookie: Optional[str] = None) -> Optional[Response]:
        """An answer before the body is read (auth, size), or None to go on.
        The pages also take a browser's session cookie (never the API)."""
        if self.needs_token(method, path) and not self.authorised(authorization):
            from .pages import is_page

            if not is_page(method, path):
                return _json(401, {"error": "missing or wrong bearer token"}, {"WWW-Authenticate": "Bearer"})
            if not self.pages.sessions.valid(cookie):
                return self.pages.refused()
        if method == "POST":
            if length is None:
                return _json(411, {"error": "Content-Length required"})
            try:
                size = int(length)
            except ValueError:
                return _json(400, {"error": "bad Content-Length"})
            limit = self.body_limit(path)
            if size < 0 or size > limit:
                return _json(413, {"error": f"body of {size} bytes exceeds the {limit}-byte limit"})
        return None

    # -- the endpoints ------------------------------------------------------------------
    def handle(self, method: str, path: str, body: bytes, header: Callable[[str], Optional[str]],
               arrived_at: Optional[float] = None) -> Response:
        """One request (`arrived_at`: wall clock when its first bytes came,
        so that a heartbeat's transit leaves out the wait for ingest)."""
        try:
            if method == "GET":
                return self._get(path)
            if method == "POST":
                return self._post(path, body, header, arrived_at)
            return _json(405, {"error": f"method {method} not allowed"})
        except MustWait:
            raise  # taken in elsewhere (AsyncCollectorServer.take_inline)
        except RequestError as exc:
            return _json(exc.status, {"error": str(exc)})
        except wire.WireError as exc:
            return _json(400, {"error": str(exc)})
        except Exception as exc:
            log.exception("request %s %s failed", method, path)
            return _json(500, {"error": f"internal error: {type(exc).__name__}"})

    def _get(self, path: str) -> Response:
        collector = self.collector
        if path == "/healthz":
            return _json(200, {"ok": True})
        if path == "/v1/status":
            return _json(200, collector.status())
        if path == "/metrics" and self.metrics_handler is not None:
            body, content_type = self.metrics_handler()
            return 200, body, content_type, {}
        match = _RUN_PATH.match(path)
        if match and match.group(2) == "report":
            return _json(200, wire.to_dict(collector.report(match.group(1))))
        from .pages import is_login

        if is_login("GET", path):
            return self.pages.login(path)
        page = self.pages.get(path)
        if page is not None:
            return page
        return _json(404, {"error": f"no route {path}"})

    def _post(self, path: str, body: bytes, header: Callable[[str], Optional[str]],
              arrived_at: Optional[float] = None) -> Response:
        collector = self.collector
        if path == "/v1/heartbeat":
            hb = codec.loads_heartbeat(body)
            return _json(200, _reply_dict(collector.ingest_heartbeat(hb, arrived_at=arrived_at)))
        if path == "/v1/node-report":
            report = codec.loads_node_report(body, limit=MAX_NODE_REPORT_BYTES)
            return _json(200, _reply_dict(collector.ingest_node_report(report, arrived_at=arrived_at)))
        if path == "/v1/nodes":
            node = wire.loads(wire.NodeHeartbeat, body)
            return _json(200, wire.to_dict(collector.ingest_node(node, arrived_at=arrived_at)))
        if path == "/v1/bundles":
            run_hint = header("X-Rankwatch-Run") or ""
            rank_hint = header("X-Rankwatch-Rank") or ""
            return _json(200, collector.ingest_bundle(body, run_hint=run_hint, rank_hint=rank_hint))
        if path == "/v1/login-links":
            return self.pages.mint_link(body)
        match = _RUN_PATH.match(path)
        if match and match.group(2) == "finish":
            request = wire.loads(wire.FinishRequest, body)
            exits = {int(r): (e.exit_code, e.exited_at) for r, e in request.exits.items()}
            report = collector.finish(match.group(1), interrupted=request.interrupted, exits=exits,
                                      termination=request.termination)
            return _json(200, wire.to_dict(report))
        return _json(404, {"error": f"no route {path}"})


# ----------------------------------------------------------------------------------------
# The standard library's server (embedded collector, tests)
# ----------------------------------------------------------------------------------------


class _DeadlineReader(io.RawIOBase):
    """The socket, read with one deadline for a whole request: a client that
    trickles its headers byte by byte is cut off when the deadline passes,
    however often it sends a byte."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.deadline: Optional[float] = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.deadline is not None:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise socket.timeout("request not received in time")
            self.sock.settimeout(remaining)
        return self.sock.recv_into(buffer)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256
    max_connections = 256

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._active = 0
        self._active_lock = threading.Lock()

    def process_request(self, request, client_address):
        with self._active_lock:
            full = self._active >= self.max_connections
            if not full:
                self._active += 1
        if full:
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n"
                                b"Connection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._active_lock:
                self._active -= 1


class CollectorServer:
    def __init__(self, collector: Collector, host: str = "127.0.0.1", port: int = 0,
                 token: Optional[str] = None, metrics_handler=None, metrics_open: bool = False,
                 max_connections: int = 256, routes: Optional[Any] = None,
                 admission: Optional[AdmissionConfig] = None):
        self.collector = collector
        self.token = token
        self.routes = routes or Routes(collector, token, metrics_handler, metrics_open)
        # Admission only when asked (`collector serve`): the embedded collector
        # serves one node's handful of agents, and a relay's server (no
        # collector) takes its node's beats on loopback; nothing to shed there.
        self.admission = Admission(admission, collector_cadence(collector), collector.note_refused) \
            if collector is not None and admission is not None else None
        self.httpd = _Server((host, port), _make_handler(self.routes, self.admission))
        self.httpd.max_connections = max_connections
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "CollectorServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="rankwatch-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _make_handler(routes: Routes, admission: Optional[Admission] = None):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "rankwatch-collector"

        def setup(self) -> None:
            super().setup()
            self._reader = _DeadlineReader(self.connection)
            self.rfile = io.BufferedReader(self._reader, 65536)

        def handle_one_request(self) -> None:
            # Idle between requests of a kept-alive connection, then the whole
            # request within REQUEST_TIMEOUT.
            self._reader.deadline = time.monotonic() + IDLE_TIMEOUT
            try:
                if not self.rfile.peek(1):
                    self.close_connection = True
                    return
            except (socket.timeout, OSError):
                self.close_connection = True
                return
            self._reader.deadline = time.monotonic() + REQUEST_TIMEOUT
            self.arrived_at = time.time()  # its first bytes are in (a heartbeat's transit ends here)
            try:
                super().handle_one_request()
            except socket.timeout:
                self.close_connection = True

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet; errors are logged by the routes
            # A one-time link's code never reaches a log, even spent.
            args = tuple(_LOGIN_CODE.sub("/login/<code>", a) if isinstance(a, str) else a for a in args)
            log.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, response: Response) -> None:
            status, body, content_type, headers = response
            self._reader.deadline = None  # the answer gets its own time, not what is left of the request's
            self.connection.settimeout(REQUEST_TIMEOUT)
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for key, value in headers.items():
                self.send_header(key, value)
            if status in (401, 411, 413) or self.close_connection:  # body unread: the connection cannot be reused
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(body)

        def _serve(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            try:
                early = routes.precheck(method, path, self.headers.get("Authorization"),
                                        self.headers.get("Content-Length"), self.headers.get("Cookie"))
                if early is not None:
                    self._send(early)
                    return
                ticket = None
                if admission is not None and method == "POST" and path in INGEST_PATHS:
                    ticket = admission.enter()
                    if ticket is None:  # behind: answered before the body is read, the connection closed
                        self.close_connection = True
                        self._send(admission.shed_response())
                        return
                cost = 0.0
                try:
                    body = b""
                    if method == "POST":
                        size = int(self.headers["Content-Length"])
                        body = self.rfile.read(size)
                        if len(body) != size:
                            self._send(_json(400, {"error": "truncated body"}))
                            self.close_connection = True
                            return
                    if ticket is not None:
                        admission.ready(ticket)
                    result, cost = _timed(routes.handle, method, path, body, self.headers.get, self.arrived_at)
                finally:
                    if ticket is not None:
                        admission.leave(ticket, cost)
                self._send(result)
            except (BrokenPipeError, ConnectionResetError, socket.timeout):
                self.close_connection = True  # the client went away or was too slow

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

    return Handler


# ----------------------------------------------------------------------------------------
# aiohttp (the standalone service)
# ----------------------------------------------------------------------------------------


class AsyncCollectorServer:
    """The standalone collector's server: aiohttp, one event loop in its own
    thread. Heartbeats, node reports and node views are admitted on the loop
    (`admission.py`) and taken in there while the collector is free, on one
    ingest thread while a tick (or a report there) holds it; bundles, finish,
    reports and /metrics run in a worker thread."""

    def __init__(self, collector: Collector, host: str = "127.0.0.1", port: int = 0,
                 token: Optional[str] = None, metrics_handler=None, metrics_open: bool = False,
                 max_connections: int = MAX_CONNECTIONS, request_timeout: float = REQUEST_TIMEOUT,
                 admission: Optional[AdmissionConfig] = None):
        self.collector = collector
        self.token = token
        self.routes = Routes(collector, token, metrics_handler, metrics_open)
        self.admission = Admission(admission, collector_cadence(collector), collector.note_refused)
        # A report that would wait for the collector (a tick holding its lock)
        # waits on one thread of its own, so the loop always answers: it never
        # stops the next report from being admitted or shed.
        from concurrent.futures import ThreadPoolExecutor

        self._ingest = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rankwatch-ingest")
        self.host, self.port = host, port
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        self._runner = None
        self._protocols: set = set()
        self.refused = 0  # connections over the cap
        self.cut_off = 0  # requests that did not arrive in time

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "AsyncCollectorServer":
        _raise_fd_limit(self.max_connections + 256)
        self._thread = threading.Thread(target=self._run, name="rankwatch-http", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._shutdown(), loop)
        try:
            future.result(timeout=10)
        except Exception:
            pass
        loop.call_soon_threadsafe(loop.stop)
        if self._thread:
            self._thread.join(timeout=10)

    # -- the loop -------------------------------------------------------------------------
    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._startup())
        except BaseException as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _startup(self) -> None:
        from aiohttp import web
        from aiohttp.web_protocol import RequestHandler

        server = self
        loop = asyncio.get_running_loop()

        class Protocol(RequestHandler):
            """aiohttp's connection, plus the cap on connections and the
            deadline of a request that has begun to arrive."""

            started: Optional[float] = None  # loop clock: when the request's first bytes came (its deadline)
            arrived_at: Optional[float] = None  # the same, wall clock (a heartbeat's transit ends there)

            def connection_made(self, transport) -> None:
                super().connection_made(transport)
                if len(server._protocols) >= server.max_connections:
                    server.refused += 1
                    transport.close()
                    return
                server._protocols.add(self)

            def connection_lost(self, exc) -> None:
                server._protocols.discard(self)
                super().connection_lost(exc)

            def data_received(self, data: bytes) -> None:
                if self.started is None:
                    self.started, self.arrived_at = loop.time(), time.time()
                super().data_received(data)

        class Server(web.Server):
            def __call__(self):
                return Protocol(self, loop=loop, **self._kwargs)

            def _make_request(self, message, payload, protocol, writer, task):
                # Bodies are bounded by the routes (Content-Length, before reading).
                return web.BaseRequest(message, payload, protocol, writer, task, loop,
                                       client_max_size=wire.MAX_BUNDLE_BYTES)

        async def handler(request: "web.BaseRequest") -> "web.StreamResponse":
            protocol = request.protocol
            method, path = request.method, request.path
            early = server.routes.precheck(method, path, request.headers.get("Authorization"),
                                           request.headers.get("Content-Length"), request.headers.get("Cookie"))
            if early is not None:
                response = _aio_response(web, early)
                response.force_close()
                return response
            ticket = None
            if method == "POST" and path in INGEST_PATHS:
                started = getattr(protocol, "started", None)  # the loop's clock: time.monotonic() less its offset
                arrived = None if started is None else time.monotonic() - (loop.time() - started)
                ticket = server.admission.enter(arrived)
                if ticket is None:  # behind: answered before the body is decoded
                    response = _aio_response(web, server.admission.shed_response())
                    if await body_arrived(request, protocol):
                        if isinstance(protocol, Protocol):
                            protocol.started = None  # so the next request on it gets its own deadline
                    else:
                        response.force_close()  # body unread: the connection cannot be reused
                    return response
            try:
                return await ingest_or_route(request, protocol, method, path, ticket)
            finally:
                if ticket is not None:
                    server.admission.leave(ticket, None)  # no-op once taken in; else the body never came

        async def body_arrived(request, protocol) -> bool:
            """Take a shed request's body (read, never decoded) if it is in or
            comes within SHED_BODY_GRACE_S, so its connection can be kept.
            http.client (the relays' transport) sends the headers and the body
            in two writes, so on a busy loop the handler often starts between
            them; closing then would make every shed relay reconnect."""
            try:
                if request.content.is_eof():
                    await request.read()
                else:
                    grace = min(SHED_BODY_GRACE_S, server._remaining(protocol))
                    await asyncio.wait_for(request.read(), max(0.0, grace))
                return True
            except (ConnectionError, OSError, asyncio.TimeoutError):
                return False

        async def ingest_or_route(request, protocol, method, path, ticket) -> "web.StreamResponse":
            body = b""
            if method == "POST":
                try:
                    if request.content.is_eof():  # the usual case: the whole body is in already
                        body = await request.read()
                    else:
                        body = await asyncio.wait_for(request.read(), max(0.1, server._remaining(protocol)))
                except (ConnectionError, OSError):  # the client went away mid-body
                    response = _aio_response(web, _json(400, {"error": "connection lost"}))
                    response.force_close()
                    return response
                except asyncio.TimeoutError:
                    server.cut_off += 1
                    response = _aio_response(web, _json(408, {"error": "request body not received in time"}))
                    response.force_close()
                    return response
            arrived_at = None
            if isinstance(protocol, Protocol):
                arrived_at = protocol.arrived_at
                protocol.started = None  # the request is in: the next one gets its own deadline
            headers = request.headers
            if ticket is not None:
                server.admission.ready(ticket)
                taken = server.take_inline(method, path, body, headers.get, arrived_at)
                if taken is None:  # waited for off the loop, which keeps answering
                    taken = await loop.run_in_executor(server._ingest, _timed, server.routes.handle, method, path,
                                                       body, headers.get, arrived_at)
                result, cost = taken
                server.admission.leave(ticket, cost)
            else:  # bundles, finish, reports, status, metrics: off the loop
                result = await loop.run_in_executor(None, server.routes.handle, method, path, body, headers.get)
            return _aio_response(web, result)

        self._web_server = Server(handler, loop=loop, keepalive_timeout=IDLE_TIMEOUT, access_log=None, max_line_size=8190, max_field_size=8190,
                                  max_headers=64)
        self._site_server = await loop.create_server(self._web_server, self.host, self.port, backlog=4096,
                                                     reuse_address=True)
        self.port = self._site_server.sockets[0].getsockname()[1]
        self._sweeper = loop.create_task(self._sweep())

    def take_inline(self, method: str, path: str, body: bytes, header: Callable[[str], Optional[str]],
                    arrived_at: Optional[float]) -> Optional[tuple[Response, float]]:
        """A report taken in on the loop, or None: hand it to the ingest thread.
        The hand-over there and back cost ~1/4 of the loop's own work a report,
        and that thread's turns at the interpreter delayed the loop's (100,000
        ranks: p50 133-411 -> 47-71 ms, 0.84-0.96 -> 0.76-0.77 core). Only when
        nothing can make the loop wait: the collector's lock is free, the body
        is small (a start-up report with history takes tens of ms to decode),
        and the report needs no read of the index (`without_waiting`: MustWait,
        nothing changed). A report taken here may pass one queued on the
        thread: a rank's state takes each beat by its own step and time
        (`ingest.heartbeat`), whatever the order. Sending every report to the
        thread while one waited there kept the whole cold start there (its
        big first reports): p99 0.75-1.6 s at 100,000 ranks."""
        if len(body) > INLINE_MAX_BYTES:
            return None
        lock = self.collector._lock
        if not lock.acquire(blocking=False):  # a tick, or a report on the thread, holds it
            return None
        try:
            with without_waiting():
                return _timed(self.routes.handle, method, path, body, header, arrived_at)
        except MustWait:
            return None
        finally:
            lock.release()

    def _remaining(self, protocol) -> float:
        started = getattr(protocol, "started", None)
        if started is None:
            return self.request_timeout
        return started + self.request_timeout - self._loop.time()

    async def _sweep(self) -> None:
        """Cut off connections whose request began arriving too long ago."""
        while True:
            await asyncio.sleep(1.0)
            now = self._loop.time()
            for protocol in list(self._protocols):
                started = protocol.started
                if started is not None and now - started > self.request_timeout and protocol.transport is not None:
                    self.cut_off += 1
                    protocol.transport.close()

    async def _shutdown(self) -> None:
        self._ingest.shutdown(wait=False)
        self._sweeper.cancel()
        self._site_server.close()
        for protocol in list(self._protocols):
            if protocol.transport is not None:
                protocol.transport.close()
        await self._web_server.shutdown(2.0)


def _raise_fd_limit(wanted: int) -> None:
    """One descriptor per kept-alive connection: the soft limit (often 1024)
    goes up to what the connection cap needs, within the hard limit."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):
        pass


def _aio_response(web, result: Response):
    status, body, content_type, headers = result
    return web.Response(status=status, body=body, headers={**headers, "Content-Type": content_type})
