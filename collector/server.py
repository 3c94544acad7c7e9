"""HTTP front of the collector (standard library only).

    POST /v1/heartbeat           agent heartbeat           -> Reply (commands)
    POST /v1/nodes               node supervisor report    -> Reply (commands)
    POST /v1/bundles             gzip'd tar bundle         -> {"stored": path}
    POST /v1/runs/<id>/finish    launcher is done          -> report
    GET  /v1/runs/<id>/report    current report
    GET  /v1/status              runs, incidents, verdicts
    GET  /metrics                Prometheus exposition (when enabled)
    GET  /healthz

Every request body is untrusted: its size is bounded before it is read, JSON is
validated field by field, bundles are never unpickled.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

from rankwatch import wire

from .service import Collector, RequestError

log = logging.getLogger("rankwatch.collector")

_RUN_PATH = re.compile(r"^/v1/runs/([A-Za-z0-9_.-]{1,128})/(report|finish)$")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256


class CollectorServer:
    def __init__(self, collector: Collector, host: str = "127.0.0.1", port: int = 0,
                 token: Optional[str] = None, metrics_handler=None):
        self.collector = collector
        self.token = token
        self.metrics_handler = metrics_handler
        handler = _make_handler(self)
        self.httpd = _Server((host, port), handler)
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


def _make_handler(server: CollectorServer):
    collector = server.collector

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "rankwatch-collector"

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet; errors are logged below
            log.debug("%s " + fmt, self.address_string(), *args)

        # -- helpers ----------------------------------------------------------
        def _send(self, status: int, payload: Any, content_type: str = "application/json") -> None:
            body = payload if isinstance(payload, bytes) else json.dumps(payload, default=str).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self, limit: int) -> bytes:
            length = self.headers.get("Content-Length")
            if length is None:
                raise RequestError("Content-Length required", 411)
            try:
                size = int(length)
            except ValueError:
                raise RequestError("bad Content-Length") from None
            if size < 0 or size > limit:
                raise RequestError(f"body of {size} bytes exceeds the {limit}-byte limit", 413)
            data = self.rfile.read(size)
            if len(data) != size:
                raise RequestError("truncated body")
            return data

        def _authorised(self) -> bool:
            if not server.token:
                return True
            given = self.headers.get("Authorization", "")
            return hmac.compare_digest(given, f"Bearer {server.token}")

        def _guard(self, fn) -> None:
            try:
                fn()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away (a rank that died mid-request)
            except RequestError as exc:
                self._send(exc.status, {"error": str(exc)})
            except wire.WireError as exc:
                self._send(400, {"error": str(exc)})
            except Exception as exc:
                log.exception("request %s failed", self.path)
                self._send(500, {"error": f"internal error: {type(exc).__name__}"})

        # -- routes ---------------------------------------------------------------
        def do_GET(self) -> None:
            self._guard(self._get)

        def do_POST(self) -> None:
            if not self._authorised():
                self._send(401, {"error": "missing or wrong bearer token"})
                return
            self._guard(self._post)

        def _get(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._send(200, {"ok": True})
            elif path == "/v1/status":
                self._send(200, collector.status())
            elif path == "/metrics" and server.metrics_handler is not None:
                body, content_type = server.metrics_handler()
                self._send(200, body, content_type)
            else:
                match = _RUN_PATH.match(path)
                if match and match.group(2) == "report":
                    self._send(200, wire.to_dict(collector.report(match.group(1))))
                else:
                    self._send(404, {"error": f"no route {path}"})

        def _post(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/v1/heartbeat":
                hb = wire.loads(wire.Heartbeat, self._body(wire.MAX_MESSAGE_BYTES))
                self._send(200, wire.to_dict(collector.ingest_heartbeat(hb)))
            elif path == "/v1/nodes":
                node = wire.loads(wire.NodeHeartbeat, self._body(wire.MAX_MESSAGE_BYTES))
                self._send(200, wire.to_dict(collector.ingest_node(node)))
            elif path == "/v1/bundles":
                data = self._body(wire.MAX_BUNDLE_BYTES)
                run_hint = self.headers.get("X-Rankwatch-Run", "")
                self._send(200, collector.ingest_bundle(data, run_hint=run_hint))
            else:
                match = _RUN_PATH.match(path)
                if match and match.group(2) == "finish":
                    request = wire.loads(wire.FinishRequest, self._body(wire.MAX_MESSAGE_BYTES))
                    exits = {int(r): (e.exit_code, e.exited_at) for r, e in request.exits.items()}
                    report = collector.finish(match.group(1), interrupted=request.interrupted, exits=exits)
                    self._send(200, wire.to_dict(report))
                else:
                    self._send(404, {"error": f"no route {path}"})

    return Handler
