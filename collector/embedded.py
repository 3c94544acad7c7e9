"""The collector embedded in ``rankwatch run`` (single-node default): the same
service and HTTP front as the standalone one, bound to loopback, storing into
the run dir."""

from __future__ import annotations

from pathlib import Path

from rankwatch.config import Config

from .server import CollectorServer
from .service import Collector


def start_embedded(config: Config, run_dir: Path) -> tuple[Collector, CollectorServer]:
    from .metrics import CollectorMetrics

    collector = Collector(config=config, data_dir=run_dir, run_dir_for=lambda _run_id: run_dir)
    metrics = CollectorMetrics(collector)
    # The node's one scrape endpoint: a fixed port when Prometheus must find it.
    server = CollectorServer(collector, host=config.bind, port=config.metrics_port or 0, token=config.token,
                             metrics_handler=metrics.render)
    collector.start(tick=0.5)
    server.start()
    return collector, server
