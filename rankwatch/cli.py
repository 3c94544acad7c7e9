"""The ``rankwatch`` command: one sub-command per job rankwatch does."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

from . import __version__, wire
from . import config as config_mod

COMMANDS = (
    ("run", "launch a job with torchrun (same options), watched; writes report.json"),
    ("exec", "watch one task of a Slurm step that runs Python directly (srun rankwatch exec -- python train.py)"),
    ("analyze", "rebuild and print the report of a run dir, a folder of bundles or one bundle (--html: its page)"),
    ("collector", "the standalone collector service for multi-node jobs (collector serve, collector link)"),
    ("grafana", "push the dashboards to Grafana and annotate verdicts (grafana push)"),
)


def usage() -> str:
    width = max(len(name) for name, _ in COMMANDS)
    lines = [f"rankwatch {__version__}: names the culprit rank and the cause when distributed PyTorch training misbehaves.",
             "",
             "usage: rankwatch COMMAND [OPTIONS]",
             "",
             "commands:"]
    lines += [f"  {name.ljust(width)}  {text}" for name, text in COMMANDS]
    lines += ["",
              "examples:",
              "  rankwatch run --nproc-per-node 4 train.py --epochs 3",
              "  rankwatch analyze rankwatch-runs/<run-id>",
              "  rankwatch collector serve --host 0.0.0.0 --port 8765 --token $TOKEN",
              "",
              "'rankwatch COMMAND --help' shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(f"rankwatch {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    from .extras import MissingExtra

    try:
        return _dispatch(command, rest)
    except MissingExtra as exc:
        print(f"rankwatch {command}: {exc}", file=sys.stderr)
        return 2


def _dispatch(command: str, rest: list[str]) -> int:
    if command in ("run", "exec"):
        from . import slurm

        slurm.note_warnings_early(os.environ)
    if command == "run":
        from .node.launcher import run

        return run(rest)
    if command == "exec":
        from .node.slurm_exec import run as exec_run

        return exec_run(rest)
    if command == "analyze":
        return analyze(rest)
    if command == "collector":
        return collector(rest)
    if command == "grafana":
        from .outputs.grafana import main as grafana_main

        return grafana_main(rest)
    print(f"rankwatch: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
    return 2


def analyze(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rankwatch analyze",
                                     description="Rebuild the report of a run from its run dir or bundles.")
    parser.add_argument("path", help="a run dir, a folder of bundles, one bundle archive, or a run on a "
                                     "collector: http://HOST:PORT/runs/RUN_ID (token from RANKWATCH_TOKEN)")
    parser.add_argument("--json", action="store_true", help="print report.json instead of text")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the run's per-rank picture (matplotlib)")
    parser.add_argument("--tensorboard", metavar="DIR", help="write per-rank series and verdicts for TensorBoard")
    parser.add_argument("--html", metavar="FILE.html",
                        help="write the run's page (report.html: self-contained, opens without network)")
    parser.add_argument("--config", default=None, help="YAML settings; on_<kind>: ignore silences a kind, as in the run")
    parser.add_argument("--run", dest="run_id", default=None,
                        help="which run of a collector's data dir (default: the newest)")
    args = parser.parse_args(argv)
    from rankwatch.outputs import report as report_mod
    from rankwatch.collector.offline import AnalyzeError, analyze_path

    try:
        if args.path.startswith(("http://", "https://")):
            if args.plot or args.tensorboard:
                raise AnalyzeError("--plot and --tensorboard need the run dir (kubectl cp it, then analyze it)")
            report = fetch_report(args.path, os.environ.get("RANKWATCH_TOKEN"))
        else:
            report = analyze_path(Path(args.path), args.run_id)
    except AnalyzeError as exc:
        print(f"rankwatch analyze: {exc}", file=sys.stderr)
        return 2
    try:
        ignored = config_mod.ignored_kinds(config_mod.load(env=os.environ, file=args.config))
    except config_mod.ConfigError as exc:
        print(f"rankwatch analyze: {exc}", file=sys.stderr)
        return 2
    if ignored:
        report.verdicts = [v for v in report.verdicts if v.kind not in ignored]
        report.status = "faulty" if report.verdicts else "healthy"
    if args.plot or args.tensorboard:
        from rankwatch.collector.offline import load

        from .outputs import plot as plot_mod
        from .outputs import tensorboard as tensorboard_mod
        from .extras import require

        if args.plot:
            require("matplotlib", "matplotlib", "plot", "--plot")
        run, _ = load(Path(args.path), args.run_id)
        if args.plot:
            print(f"plot: {plot_mod.plot(run, report, Path(args.plot))}", file=sys.stderr)
        if args.tensorboard:
            try:
                print(f"tensorboard: {tensorboard_mod.export(run, report, Path(args.tensorboard))}", file=sys.stderr)
            except RuntimeError as exc:
                print(f"rankwatch analyze: {exc}", file=sys.stderr)
                return 2
    if args.html:
        try:
            page = write_page(args.path, args.run_id, report, Path(args.html))
        except AnalyzeError as exc:
            print(f"rankwatch analyze: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"rankwatch analyze: {args.html}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"page: {page}", file=sys.stderr)
    if args.json:
        print(wire.json_text(wire.to_dict(report), indent=2))  # strict JSON
    else:
        print(report_mod.text(report))
    return 0


def write_page(path: str, run_id: str | None, report: wire.Report, target: Path) -> Path:
    """``analyze --html``: the page of a run dir / bundle(s) (from the same
    state the report was made from) or of a run on a collector (its page
    data, checked as it is rendered)."""
    from rankwatch.outputs import html

    if path.startswith(("http://", "https://")):
        model = fetch_page_model(path, os.environ.get("RANKWATCH_TOKEN"))
        if model is None:
            return html.write(report, target)  # an older collector: the report alone
        model["verdicts"] = [v for v in model.get("verdicts") or []
                             if isinstance(v, dict) and v.get("kind") in {x.kind for x in report.verdicts}]
        model["status"] = report.status
        return html.write_model(model, target)
    from rankwatch.collector.offline import load

    run, _ = load(Path(path), run_id)
    return html.write(report, target, run)


def _collector_get(url: str, suffix: str, token: str | None, timeout: float, limit: int) -> tuple[str, bytes]:
    """GET ``suffix`` of the run a collector URL names (no redirects: the
    token goes to one address only)."""
    import re
    import urllib.error
    import urllib.parse
    import urllib.request

    from rankwatch.collector.offline import AnalyzeError

    parts = urllib.parse.urlsplit(url)
    match = re.fullmatch(r"/*(?:v1/)?runs/([^/]+)(?:/report|/page)?/*", parts.path)
    if not match or not wire.ID_PATTERN.match(match.group(1)):
        raise AnalyzeError(f"{url}: expected http://HOST:PORT/runs/RUN_ID")
    endpoint = urllib.parse.urlunsplit((parts.scheme, parts.netloc, f"/v1/runs/{match.group(1)}/{suffix}", "", ""))

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    request = urllib.request.Request(endpoint)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.build_opener(NoRedirect).open(request, timeout=timeout) as response:
            raw = response.read(limit + 1)
    except urllib.error.HTTPError as exc:
        hint = " (set RANKWATCH_TOKEN)" if exc.code in (401, 403) else ""
        raise AnalyzeError(f"{endpoint}: HTTP {exc.code}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise AnalyzeError(f"{endpoint}: {getattr(exc, 'reason', exc)}") from None
    if len(raw) > limit:
        raise AnalyzeError(f"{endpoint}: answer larger than {limit} bytes")
    return endpoint, raw


def fetch_page_model(url: str, token: str | None, timeout: float = 60.0) -> dict | None:
    """A run's page data from a collector (None from a collector without pages)."""
    from rankwatch.collector.offline import AnalyzeError

    try:
        endpoint, raw = _collector_get(url, "page", token, timeout, 64 * 1024 * 1024)
    except AnalyzeError as exc:
        if "HTTP 404" in str(exc):
            return None
        raise
    try:
        model = wire.parse_json(raw, "page data", limit=64 * 1024 * 1024)
    except wire.WireError as exc:
        raise AnalyzeError(f"{endpoint}: not rankwatch page data ({exc})") from None
    if not isinstance(model, dict) or model.get("schema") != "rankwatch.page/v1":
        raise AnalyzeError(f"{endpoint}: not rankwatch page data")
    return model


def fetch_report(url: str, token: str | None, timeout: float = 30.0) -> wire.Report:
    """The current report of a run from a collector's HTTP API.

    ``http://HOST:PORT/runs/RUN_ID`` (or ``.../v1/runs/RUN_ID[/report]``). The
    answer is untrusted: decoded and checked by the wire layer. Redirects are
    not followed, so the token never goes to another address.
    """
    import re
    import urllib.error
    import urllib.parse
    import urllib.request

    from rankwatch.collector.offline import AnalyzeError

    parts = urllib.parse.urlsplit(url)
    match = re.fullmatch(r"/*(?:v1/)?runs/([^/]+)(?:/report)?/*", parts.path)
    if not match or not wire.ID_PATTERN.match(match.group(1)):
        raise AnalyzeError(f"{url}: expected http://HOST:PORT/runs/RUN_ID")
    endpoint = urllib.parse.urlunsplit((parts.scheme, parts.netloc, f"/v1/runs/{match.group(1)}/report", "", ""))

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    request = urllib.request.Request(endpoint)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.build_opener(NoRedirect).open(request, timeout=timeout) as response:
            raw = response.read(wire.MAX_MESSAGE_BYTES + 1)
    except urllib.error.HTTPError as exc:
        hint = " (set RANKWATCH_TOKEN)" if exc.code in (401, 403) else ""
        raise AnalyzeError(f"{endpoint}: HTTP {exc.code}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise AnalyzeError(f"{endpoint}: {getattr(exc, 'reason', exc)}") from None
    try:
        return wire.loads(wire.Report, raw)
    except wire.WireError as exc:
        raise AnalyzeError(f"{endpoint}: not a rankwatch report ({exc})") from None


def collector(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rankwatch collector")
    sub = parser.add_subparsers(dest="action", required=True)
    serve = sub.add_parser("serve", help="run the standalone collector service")
    serve.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8765)
    serve.add_argument("--data-dir", default="./rankwatch-collector", help="index and bundles")
    serve.add_argument("--config", default=None, help="YAML file with rankwatch settings")
    serve.add_argument("--hang-timeout", dest="hang_timeout", default=None)
    serve.add_argument("--on-hang", dest="on_hang", choices=("abort", "wait"), default=None)
    serve.add_argument("--token", default=None,
                       help="bearer token required on every endpoint but /healthz (or RANKWATCH_TOKEN)")
    serve.add_argument("--metrics-open", dest="metrics_open", action="store_true", default=None,
                       help="serve /metrics without the token (or RANKWATCH_METRICS_OPEN=1)")
    serve.add_argument("--server", choices=("auto", "aiohttp", "stdlib"), default="auto",
                       help="HTTP server: aiohttp (for many nodes; pip install 'rankwatch[collector]') or the "
                            "standard library's; auto (default) takes aiohttp when it is installed")
    link = sub.add_parser("link", help="print a one-time link that opens the collector's pages in a browser")
    link.add_argument("--url", default=os.environ.get("RANKWATCH_COLLECTOR"),
                      help="the collector (or RANKWATCH_COLLECTOR); the token comes from RANKWATCH_TOKEN")
    link.add_argument("--run", dest="run_id", default=None, help="open this run's page (default: the list of runs)")
    args = parser.parse_args(argv)
    if args.action == "link":
        return collector_link(args.url, args.run_id, os.environ.get("RANKWATCH_TOKEN"))
    from rankwatch.collector import Collector, CollectorServer

    cfg = config_mod.load(flags={"hang_timeout": args.hang_timeout, "on_hang": args.on_hang,
                                 "bind": args.host, "token": args.token, "metrics_open": args.metrics_open},
                          file=args.config)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rankwatch.collector.metrics import CollectorMetrics
    from rankwatch.redact import install_log_redaction, register_secret

    register_secret(cfg.token)  # the token is redacted wherever it would appear (given by flag, not env)
    install_log_redaction()

    # The ingest (HTTP thread) and the analyses (tick thread) share one
    # interpreter: a shorter switch interval hands it to a waiting request
    # sooner while an analysis pass runs (request latency at scale).
    sys.setswitchinterval(0.001)
    service = Collector(config=cfg, data_dir=Path(args.data_dir))
    metrics = CollectorMetrics(service)
    from .extras import available, require

    choice = args.server
    if choice == "auto":
        choice = "aiohttp" if available("aiohttp") else "stdlib"
        if choice == "stdlib":
            print("rankwatch collector: aiohttp is not installed, serving with the standard library's server "
                  "(fine for jobs of up to ~1,000 ranks; pip install 'rankwatch[collector]' for more)",
                  file=sys.stderr, flush=True)
    if choice == "aiohttp":
        require("aiohttp", "aiohttp", "collector", "--server aiohttp")
        from rankwatch.collector.server import AsyncCollectorServer as server_class
    else:
        server_class = CollectorServer
    from rankwatch.collector.admission import AdmissionConfig

    # Behind, the standalone collector sheds reports before reading them (503, Retry-After).
    server = server_class(service, host=cfg.bind, port=args.port, token=cfg.token, metrics_handler=metrics.render,
                          metrics_open=cfg.metrics_open, admission=AdmissionConfig())
    service.start()
    server.start()
    print(f"rankwatch collector listening on {server.url} (data in {args.data_dir})", flush=True)
    if not cfg.token:
        print(f"pages: {server.url}/", flush=True)
    elif sys.stdout.isatty() or cfg.bind.startswith("127.") or cfg.bind == "localhost":
        # A one-time link is a credential for 10 minutes: printed to a person
        # or for this machine only, never into the logs of a reachable service.
        code, ttl = server.routes.pages.sessions.mint("/")
        print(f"pages: {server.url}/login/{code} (one-time link, valid {int(ttl // 60)} min; "
              f"a new one: rankwatch collector link --url {server.url})", flush=True)
    else:
        print(f"pages: {server.url}/ (a browser gets in with a one-time link: rankwatch collector link "
              f"--url {server.url}, RANKWATCH_TOKEN set)", flush=True)
    stopping = []

    def stop(signum, frame):
        stopping.append(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while not stopping:
        signal.pause() if hasattr(signal, "pause") else None
    server.stop()
    service.stop()
    return 0


def collector_link(url: str | None, run_id: str | None, token: str | None) -> int:
    """``rankwatch collector link``: ask the collector for a one-time link to
    its pages (the token stays in the environment, never in a URL)."""
    import urllib.error
    import urllib.request

    if not url:
        print("rankwatch collector link: --url (or RANKWATCH_COLLECTOR) is required", file=sys.stderr)
        return 2
    if run_id is not None and not wire.ID_PATTERN.match(run_id):
        print(f"rankwatch collector link: {run_id!r} is not a run id", file=sys.stderr)
        return 2
    base = url.rstrip("/")

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    body = json.dumps({"run_id": run_id} if run_id else {}).encode()
    request = urllib.request.Request(base + "/v1/login-links", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.build_opener(NoRedirect).open(request, timeout=10) as response:
            answer = json.loads(response.read(65536))
    except urllib.error.HTTPError as exc:
        hint = " (set RANKWATCH_TOKEN)" if exc.code in (401, 403) else ""
        print(f"rankwatch collector link: {base}: HTTP {exc.code}{hint}", file=sys.stderr)
        return 2
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"rankwatch collector link: {base}: {getattr(exc, 'reason', exc)}", file=sys.stderr)
        return 2
    path = answer.get("path") if isinstance(answer, dict) else None
    if not isinstance(path, str) or not path.startswith("/login/"):
        print(f"rankwatch collector link: {base} did not answer with a link", file=sys.stderr)
        return 2
    minutes = int(float(answer.get("expires_in_s") or 600) // 60)
    print(f"{base}{path}")
    print(f"(one-time link, valid {minutes} min)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
