"""The collector embedded in ``rankwatch run`` (single-node default): the same
service and routes as the standalone one, bound to loopback, storing into the
run dir.

Cheap by construction: the local agents keep one connection each to a small
threading server; the launcher's own supervisor calls the routes in process
(no socket, no thread per request), through the same validation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rankwatch.config import Config

from .server import CollectorServer, Routes
from .service import Collector


def start_embedded(config: Config, run_dir: Path, metrics_open: bool = False) -> tuple[Collector, CollectorServer]:
    """``config.token`` is required of every client (the launcher makes a
    random one per run when the user gave none)."""
    from .metrics import CollectorMetrics

    collector = Collector(config=config, data_dir=run_dir, run_dir_for=lambda _run_id: run_dir)
    metrics = CollectorMetrics(collector)
    # The node's one scrape endpoint: a fixed port when Prometheus must find it.
    server = CollectorServer(collector, host=config.bind, port=config.metrics_port or 0, token=config.token,
                             metrics_handler=metrics.render, metrics_open=metrics_open, max_connections=512)
    collector.start(tick=0.5)
    server.start()
    return collector, server


class InProcessClient:
    """``post(path, body, content_type)`` for the launcher's own parts (the
    supervisor), answered by the embedded collector's routes directly."""

    def __init__(self, routes: Routes, url: str = ""):
        self.routes = routes
        self.url = url

    def post(self, path: str, body: bytes, content_type: str = "application/json", timeout: float = 5.0) -> Any:
        status, payload, _, _ = self.routes.handle("POST", path, body, lambda _name: None)
        if not 200 <= status < 300:
            raise RuntimeError(f"HTTP {status}: {payload[:300].decode(errors='replace')}")
        return json.loads(payload) if payload else {}
