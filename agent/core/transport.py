"""HTTP to the collector from inside a rank: short timeouts, backoff, never blocks training.

Uses only the standard library (the agent lives in every training process).
One kept-alive HTTP/1.1 connection per concurrent sender (the heartbeat
thread, a bundle upload): a heartbeat over an open connection costs a write
and a read, not a TCP handshake (p50 1.4 ms instead of 92 ms at 64 ranks).

Redirects are never followed: the bearer token must not reach another
address, so a 3xx is a failure like any other non-2xx answer.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.parse
from typing import Any, Optional

from .safety import log

MAX_REPLY_BYTES = 4 * 1024 * 1024
_IDLE_KEPT = 2  # connections kept open between requests (heartbeat + one upload)


MAX_BACKOFF_S = 10.0  # an agent's longest pause after failures (its own beats; a relay has its own)


class CollectorUnreachable(Exception):
    """No usable answer. ``status`` is the HTTP status when there was one;
    ``retry_after`` the seconds a busy collector asked for (429/503)."""

    def __init__(self, message: str, status: Optional[int] = None, retry_after: Optional[float] = None):
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


def retry_after_seconds(value: Optional[str]) -> Optional[float]:
    """`Retry-After` as delta-seconds (what the collector sends); a date or
    anything else is ignored. Bounded: a hostile answer cannot park a sender."""
    if not value or not value.strip().isdigit():
        return None
    return min(float(value.strip()), 300.0)


def backoff_delay(failures: int, base: float, cap: float, rng: Optional[random.Random] = None) -> float:
    """Exponential backoff with jitter: base * 2^(failures-1), capped, then a
    uniform draw in its upper half. Senders that failed together (a
    collector restart) come back spread over the window, not at one instant."""
    ceiling = min(cap, base * 2 ** max(0, failures - 1))
    return ceiling * (0.5 + 0.5 * (rng or random).random())


class Transport:
    def __init__(self, url: Optional[str], token: Optional[str] = None, timeout: float = 2.0):
        self.url = url.rstrip("/") if url else None
        self.token = token
        self.timeout = timeout
        self._failures = 0
        self._next_try = 0.0
        self._warned = False
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self.recovered = False  # set when the collector answers again after failures
        self._host = self._port = None
        self._https = False
        self._prefix = ""
        if self.url:
            parts = urllib.parse.urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                log(f"collector URL {self.url!r} is not http(s)://host[:port]; not sending")
                self.url = None
            else:
                self._https = parts.scheme == "https"
                self._host, self._port = parts.hostname, parts.port
                self._prefix = parts.path.rstrip("/")
        base = {"Connection": "keep-alive"}
        if token:
            base["Authorization"] = f"Bearer {token}"
        self._base_headers = base

    @property
    def configured(self) -> bool:
        return bool(self.url)

    def available(self) -> bool:
        return self.configured and time.monotonic() >= self._next_try

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = cls(self._host, self._port, timeout=timeout)
        elif conn.sock is not None:
            conn.sock.settimeout(timeout)
        conn.timeout = timeout
        return conn

    def _release(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < _IDLE_KEPT:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def post(self, path: str, body: bytes, content_type: str = "application/json",
             headers: Optional[dict[str, str]] = None, timeout: Optional[float] = None) -> Any:
        if not self.url:
            raise CollectorUnreachable("no collector configured")
        all_headers = dict(self._base_headers)
        all_headers["Content-Type"] = content_type
        if headers:
            all_headers.update(headers)
        # One retry on a fresh connection: the server may have closed an idle
        # kept-alive connection between two beats (not a collector failure).
        for attempt in (0, 1):
            conn = self._connection(timeout or self.timeout)
            reused = conn.sock is not None
            try:
                conn.request("POST", self._prefix + path, body=body, headers=all_headers)
                response = conn.getresponse()
                status = response.status
                retry_after = retry_after_seconds(response.getheader("Retry-After"))
                length = response.getheader("Content-Length")
                if length is not None and length.isdigit() and int(length) > MAX_REPLY_BYTES:
                    conn.close()
                    raise CollectorUnreachable(f"reply of {length} bytes exceeds the limit")
                payload = response.read(MAX_REPLY_BYTES + 1)
                if len(payload) > MAX_REPLY_BYTES or response.will_close:
                    conn.close()
                else:
                    self._release(conn)
                break
            except CollectorUnreachable as exc:
                self._failed(str(exc))
                raise
            except (OSError, http.client.HTTPException, ValueError) as exc:
                conn.close()
                if attempt == 0 and reused and isinstance(
                        exc, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)):
                    continue
                self._failed(f"{type(exc).__name__}: {exc}")
                raise CollectorUnreachable(str(exc) or type(exc).__name__) from None
        if not 200 <= status < 300:
            # 3xx included: never follow a redirect with the bearer token.
            detail = payload[:2000].decode(errors="replace")
            self._failed(f"HTTP {status} from {path}: {detail}", retry_after)
            raise CollectorUnreachable(f"HTTP {status}: {detail}", status=status, retry_after=retry_after)
        if self._failures:
            if self._warned:
                log(f"collector at {self.url} reachable again")
            self.recovered = True
        self._failures = 0
        self._next_try = 0.0
        try:
            return json.loads(payload) if payload else {}
        except ValueError:
            return {}

    def _failed(self, why: str, retry_after: Optional[float] = None) -> None:
        self._failures += 1
        # Back off (1, 2, 4 ... 10 s, jittered) so a dead collector costs nothing and
        # the ranks of a job do not come back in one burst; a busy collector's
        # Retry-After is a floor.
        delay = backoff_delay(self._failures, 1.0, MAX_BACKOFF_S)
        if retry_after is not None:
            delay = max(delay, retry_after * (1.0 + 0.5 * random.random()))
        self._next_try = time.monotonic() + delay
        if not self._warned:
            self._warned = True
            log(f"collector at {self.url} unreachable ({why}); training continues, evidence is kept locally")
