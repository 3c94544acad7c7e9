"""The command line a user types: help text, torchrun's options unchanged, config names."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rankwatch import config as config_mod
from rankwatch.node.launcher import build_parser


def test_help_lists_every_command_with_one_line_and_no_markup():
    out = subprocess.run([sys.executable, "-m", "rankwatch.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for command in ("run", "analyze", "collector", "grafana"):
        line = next(l for l in out.stdout.splitlines() if l.strip().startswith(command + " "))
        assert len(line.split(None, 1)[1]) > 10, line
    assert "``" not in out.stdout and ":class:" not in out.stdout


@pytest.mark.parametrize("argv, expected", [
    # torchrun's own prefixes keep their meaning next to our flags.
    (["--run-p", "t.py"], {"run_path": True}),
    (["--log-d", "L", "t.py"], {"log_dir": "L"}),
    # our flags, exactly, with a space or '='.
    (["--run-dir", "d", "--nproc-per-node", "2", "t.py"], {"run_dir": "d", "nproc_per_node": "2"}),
    (["--run-dir=d", "--collector=http://c:1", "t.py"], {"run_dir": "d", "collector": "http://c:1"}),
    # a script's own flags after the script are the script's.
    (["t.py", "--co", "1", "--run-dir", "x"], {"training_script_args": ["--co", "1", "--run-dir", "x"]}),
])
def test_torchrun_command_lines_parse_as_torchrun_parses_them(argv, expected):
    args = build_parser().parse_args(argv)
    assert args.training_script == "t.py"
    for key, value in expected.items():
        assert getattr(args, key) == value, key


@pytest.mark.parametrize("prefix", ["--co", "--run-d", "--hang", "--on-h", "--conf"])
def test_our_flags_are_never_matched_by_prefix(prefix, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([prefix, "x", "t.py"])
    assert exc.value.code == 2


def test_every_config_key_reads_its_own_env_name():
    env = {"RANKWATCH_COLLECTOR": "http://collector:8765", "RANKWATCH_TOKEN": "t0k",
           "RANKWATCH_HANG_TIMEOUT": "12", "RANKWATCH_ON_HANG": "wait"}
    cfg = config_mod.load(env=env)
    assert (cfg.collector, cfg.token, cfg.hang_timeout, cfg.on_hang) == ("http://collector:8765", "t0k", 12.0, "wait")
    for key in config_mod.Config.keys():
        assert "RANKWATCH_" + key.upper() in config_mod.to_env(config_mod.Config(**{key: getattr(cfg, key)})) \
            or getattr(cfg, key) is None


def test_on_kind_ignore_silences_that_kind_only():
    cfg = config_mod.load(env={"RANKWATCH_ON_STRAGGLER": "ignore"})
    assert config_mod.ignored_kinds(cfg) == {"straggler"}
    with pytest.raises(config_mod.ConfigError):
        config_mod.load(env={"RANKWATCH_ON_STRAGGLER": "silence"})


def test_analyze_reads_a_run_from_a_collector_over_http(tmp_path):
    import time as _time

    from rankwatch import wire
    from rankwatch.collector import Collector, CollectorServer
    from rankwatch.config import Config

    collector = Collector(config=Config(), data_dir=tmp_path)
    server = CollectorServer(collector, host="127.0.0.1", port=0, token="s3cret-token").start()
    try:
        hb = wire.Heartbeat(identity=wire.RankIdentity(run_id="job-7", rank=0, local_rank=0, world_size=1),
                            sent_at=_time.time(), step=3)
        collector.ingest_heartbeat(hb)
        cli = [sys.executable, "-m", "rankwatch.cli", "analyze", "--json"]
        env = {k: v for k, v in __import__("os").environ.items() if k != "RANKWATCH_TOKEN"}
        ok = subprocess.run(cli + [f"{server.url}/runs/job-7"], capture_output=True, text=True,
                            env={**env, "RANKWATCH_TOKEN": "s3cret-token"})
        assert ok.returncode == 0, ok.stderr
        report = __import__("json").loads(ok.stdout)
        assert report["run_id"] == "job-7" and report["status"] == "healthy"
        denied = subprocess.run(cli + [f"{server.url}/runs/job-7"], capture_output=True, text=True, env=env)
        assert denied.returncode == 2 and "401" in denied.stderr and "RANKWATCH_TOKEN" in denied.stderr
        bad = subprocess.run(cli + [f"{server.url}/runs/..%2f"], capture_output=True, text=True, env=env)
        assert bad.returncode == 2 and "expected http://HOST:PORT/runs/RUN_ID" in bad.stderr
    finally:
        server.stop()
        collector.stop()


def test_standalone_collector_keeps_each_runs_report_and_analyze_picks_a_run(tmp_path):
    """Reports out of the cluster: every run's report.json lands in the data
    dir (on finish, and on shutdown for runs still going), and `rankwatch
    analyze DATA_DIR --run ID` reads any run of the index."""
    import json as _json
    import time as _time

    from rankwatch import wire
    from rankwatch.collector import Collector
    from rankwatch.config import Config

    collector = Collector(config=Config(), data_dir=tmp_path)
    for run_id in ("job-a", "job-b", "job-c"):
        collector.ingest_heartbeat(wire.Heartbeat(
            identity=wire.RankIdentity(run_id=run_id, rank=0, local_rank=0, world_size=1),
            sent_at=_time.time(), step=2))
    collector.finish("job-a")
    collector.finish("job-b")
    assert _json.loads((tmp_path / "runs" / "job-a" / "report.json").read_text())["run_id"] == "job-a"
    collector.stop()  # job-c is still going: its report as it stands
    assert _json.loads((tmp_path / "runs" / "job-c" / "report.json").read_text())["status"] == "healthy"

    cli = [sys.executable, "-m", "rankwatch.cli", "analyze", str(tmp_path), "--json"]
    picked = subprocess.run(cli + ["--run", "job-a"], capture_output=True, text=True)
    assert picked.returncode == 0, picked.stderr
    assert _json.loads(picked.stdout)["run_id"] == "job-a"
    newest = subprocess.run(cli, capture_output=True, text=True)
    assert newest.returncode == 0 and "--run RUN_ID" in newest.stderr
    missing = subprocess.run(cli + ["--run", "job-z"], capture_output=True, text=True)
    assert missing.returncode == 2 and "no run 'job-z'" in missing.stderr
