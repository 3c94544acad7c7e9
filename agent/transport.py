"""HTTP to the collector from inside a rank: short timeouts, backoff, never blocks training.

Uses only the standard library (the agent lives in every training process).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any, Optional

from .safety import log


class CollectorUnreachable(Exception):
    pass


class Transport:
    def __init__(self, url: Optional[str], token: Optional[str] = None, timeout: float = 2.0):
        self.url = url.rstrip("/") if url else None
        self.token = token
        self.timeout = timeout
        self._failures = 0
        self._next_try = 0.0
        self._warned = False

    @property
    def configured(self) -> bool:
        return bool(self.url)

    def available(self) -> bool:
        return self.configured and time.monotonic() >= self._next_try

    def post(self, path: str, body: bytes, content_type: str = "application/json",
             headers: Optional[dict[str, str]] = None, timeout: Optional[float] = None) -> Any:
        if not self.url:
            raise CollectorUnreachable("no collector configured")
        request = urllib.request.Request(self.url + path, data=body, method="POST")
        request.add_header("Content-Type", content_type)
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        for key, value in (headers or {}).items():
            request.add_header(key, value)
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                payload = response.read(4 * 1024 * 1024)
        except urllib.error.HTTPError as exc:
            detail = exc.read(2000).decode(errors="replace")
            self._failed(f"HTTP {exc.code} from {path}: {detail}")
            raise CollectorUnreachable(f"HTTP {exc.code}: {detail}") from None
        except (OSError, ValueError) as exc:
            self._failed(f"{type(exc).__name__}: {exc}")
            raise CollectorUnreachable(str(exc)) from None
        if self._failures and self._warned:
            log(f"collector at {self.url} reachable again")
        self._failures = 0
        self._next_try = 0.0
        try:
            return json.loads(payload) if payload else {}
        except ValueError:
            return {}

    def _failed(self, why: str) -> None:
        self._failures += 1
        # Back off (1, 2, 4 ... 10 s) so a dead collector costs nothing.
        self._next_try = time.monotonic() + min(10.0, 2 ** (self._failures - 1))
        if not self._warned:
            self._warned = True
            log(f"collector at {self.url} unreachable ({why}); training continues, evidence is kept locally")
