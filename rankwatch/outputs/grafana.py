"""Grafana provisioning with grafana-client: dashboards, the Prometheus
datasource, and one annotation per verdict.

    rankwatch grafana push --url http://grafana:3000 --token $GRAFANA_TOKEN \\
        --prometheus-url http://prometheus:9090

The collector posts an annotation (tags: rankwatch, the kind, the run id)
for every new verdict when ``grafana_url`` is configured; the dashboards show
them on every time series.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Optional

from rankwatch import wire

log = logging.getLogger("rankwatch.outputs.grafana")

DASHBOARDS_DIR = Path(__file__).resolve().parents[2] / "dashboards"  # the source tree's dashboards/
DATASOURCE_NAME = "rankwatch-prometheus"


def _api(url: str, token: Optional[str]):
    from rankwatch.extras import require

    GrafanaApi = require("grafana_client", "grafana-client", "grafana", "rankwatch grafana").GrafanaApi

    return GrafanaApi.from_url(url=url, credential=token or None, timeout=5.0)


def push(url: str, token: Optional[str], prometheus_url: Optional[str],
         dashboards_dir: Path = DASHBOARDS_DIR, folder_uid: Optional[str] = None) -> list[str]:
    """Upload (overwrite) every dashboard, and create or update the datasource."""
    api = _api(url, token)  # first: names the extra when grafana-client is missing
    from grafana_client.client import GrafanaClientError

    done = []
    if prometheus_url:
        datasource = {"name": DATASOURCE_NAME, "type": "prometheus", "access": "proxy", "url": prometheus_url,
                      "jsonData": {"timeInterval": "5s"}}
        try:
            existing = api.datasource.get_datasource_by_name(DATASOURCE_NAME)
            api.datasource.update_datasource(existing["id"], {**existing, **datasource})
            done.append(f"datasource {DATASOURCE_NAME} updated")
        except GrafanaClientError:
            api.datasource.create_datasource(datasource)
            done.append(f"datasource {DATASOURCE_NAME} created")
    boards = sorted(Path(dashboards_dir).glob("*.json"))
    if not boards:
        raise FileNotFoundError(f"no dashboards (*.json) in {dashboards_dir}: pass --dashboards DIR "
                                f"(the dashboards/ folder of rankwatch's source tree)")
    for path in boards:
        board = json.loads(path.read_text())
        payload = {"dashboard": board, "overwrite": True, "message": "rankwatch grafana push"}
        if folder_uid:
            payload["folderUid"] = folder_uid
        api.dashboard.update_dashboard(payload)
        done.append(f"dashboard {board.get('uid')} uploaded")
    return done


class Annotator:
    """Posts a Grafana annotation for each verdict (collector side, best effort)."""

    def __init__(self, url: str, token: Optional[str]):
        self.url = url
        self.token = token
        self._threads: list = []

    def __call__(self, run_id: str, verdict: wire.Verdict) -> None:
        import threading

        # Off the collector's lock: a slow Grafana must not delay verdicts.
        thread = threading.Thread(target=self.post, args=(run_id, verdict), name="rankwatch-annotate", daemon=True)
        thread.start()
        self._threads.append(thread)

    def flush(self, timeout: float = 5.0) -> None:
        """Let the annotations in flight arrive before the process ends."""
        import time

        deadline = time.time() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.time()))

    def post(self, run_id: str, verdict: wire.Verdict) -> None:
        import datetime as dt

        try:
            when = dt.datetime.fromisoformat(verdict.first_seen_at.replace("Z", "+00:00")).timestamp()
            ranks = ",".join(map(str, verdict.ranks)) or "-"
            _api(self.url, self.token).annotations.add_annotation(
                time_from=int(when * 1000),
                tags=["rankwatch", verdict.kind, run_id],
                text=f"<b>{verdict.kind}</b> rank(s) {ranks}: {verdict.summary}")
        except Exception as exc:  # Grafana down must not disturb the collector
            log.warning("could not post the %s annotation to Grafana: %s", verdict.kind, exc)


def main(argv: list[str]) -> int:
    import argparse
    import os

    parser = argparse.ArgumentParser(prog="rankwatch grafana")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("push", help="upload the dashboards and the Prometheus datasource")
    p.add_argument("--url", default=os.environ.get("RANKWATCH_GRAFANA_URL"), required=False)
    p.add_argument("--token", default=os.environ.get("RANKWATCH_GRAFANA_TOKEN"))
    p.add_argument("--prometheus-url", default=None)
    p.add_argument("--folder-uid", default=None)
    p.add_argument("--dashboards", default=str(DASHBOARDS_DIR))
    args = parser.parse_args(argv)
    if not args.url:
        parser.error("--url (or RANKWATCH_GRAFANA_URL) is required")
    try:
        lines = push(args.url, args.token, args.prometheus_url, Path(args.dashboards), args.folder_uid)
    except FileNotFoundError as exc:
        print(f"rankwatch grafana: {exc}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0
