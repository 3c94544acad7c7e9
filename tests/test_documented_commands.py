"""Every command the README shows works after the README's install (base
dependencies only), or says in one line which extra it needs: never a
traceback.

"Without the extras" is made real for the child processes by a
``sitecustomize`` that makes importing the extras' packages fail exactly as
an absent package does (ModuleNotFoundError), so the same interpreter stands
in for a fresh `pip install -e .`.
"""

from __future__ import annotations

import json
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest

from conftest import ROOT, TRAIN, free_port, wait_until, worker_env

pytestmark = pytest.mark.slow

# Packages of rankwatch's extras (pyproject: collector, grafana, plot, tensorboard, ray, stacks)
# and of the dev tools: none is installed by `pip install -e .`.
EXTRAS_MODULES = ("aiohttp", "msgspec", "grafana_client", "grafana_foundation_sdk", "matplotlib", "tensorboard",
                  "ray", "lightning", "pytorch_lightning", "transformers", "accelerate")

# The rankwatch sub-commands the README shows; each has a case below.
COVERED = {"run", "analyze", "collector serve", "grafana push"}


@pytest.fixture(scope="module")
def bare_env(tmp_path_factory):
    site = tmp_path_factory.mktemp("no-extras")
    (site / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import sys

        class _NotInstalled:
            blocked = {EXTRAS_MODULES!r}

            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in self.blocked:
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, _NotInstalled())
    """))
    env = worker_env({"PYTHONPATH": str(site)})
    probe = subprocess.run([sys.executable, "-c", "import aiohttp"], env=env, capture_output=True, text=True)
    assert "No module named 'aiohttp'" in probe.stderr  # the stand-in works
    return env


def _rankwatch(args: list[str], env: dict, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rankwatch.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def _one_line_hint(done: subprocess.CompletedProcess, extra: str) -> None:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    hints = [line for line in done.stderr.splitlines() if f"rankwatch[{extra}]" in line]
    assert len(hints) == 1, done.stderr


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = line.strip().split()
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                words = words[1:]  # VAR=value rankwatch ...
            if words and words[0] == "rankwatch":
                commands.append(" ".join(words))
    return commands


def test_every_rankwatch_command_in_the_readme_has_a_case_here():
    shown = set()
    for command in readme_commands():
        words = command.split()
        shown.add(" ".join(words[1:3]) if words[1] in ("collector", "grafana") else words[1])
    assert shown, "no rankwatch command found in README.md"
    assert shown <= COVERED, f"README shows commands this test does not run: {sorted(shown - COVERED)}"


def test_collector_serve_as_the_readme_shows_it_runs_without_aiohttp(tmp_path, bare_env):
    port = free_port()
    token = "documented-command-token-0123456789"
    # The README's line, with a local address and a temporary data dir.
    line = next(c for c in readme_commands() if c.startswith("rankwatch collector serve --host"))
    args = shlex.split(line.replace('"$RANKWATCH_TOKEN"', token))[1:]
    values = {"--host": "127.0.0.1", "--port": str(port), "--data-dir": str(tmp_path / "data")}
    args = [values.get(args[i - 1], a) if i else a for i, a in enumerate(args)]
    server = subprocess.Popen([sys.executable, "-m", "rankwatch.cli", *args], env=bare_env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def answers():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                    return r.status == 200
            except OSError:
                return server.poll() is not None  # died: the assertion below says why

        wait_until(answers, 60, what="the collector to answer")
        assert server.poll() is None, server.communicate()[1]
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/status",
                                         headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=5) as r:
            assert r.status == 200 and isinstance(json.loads(r.read()), dict)
    finally:
        server.send_signal(signal.SIGTERM)
        out, err = server.communicate(timeout=30)
    assert server.returncode == 0, err
    assert "Traceback" not in err, err
    notes = [l for l in err.splitlines() if "aiohttp is not installed" in l]
    assert len(notes) == 1 and "rankwatch[collector]" in notes[0], err


def test_collector_serve_asked_for_aiohttp_without_it_names_the_extra(tmp_path, bare_env):
    done = _rankwatch(["collector", "serve", "--host", "127.0.0.1", "--port", str(free_port()), "--data-dir",
                       str(tmp_path / "d"), "--server", "aiohttp"], bare_env, tmp_path)
    _one_line_hint(done, "collector")


def test_grafana_push_without_grafana_client_names_the_extra(tmp_path, bare_env):
    line = next(c for c in readme_commands() if c.startswith("rankwatch grafana push"))
    args = shlex.split(line.replace("$TOKEN", "t"))[1:]
    done = _rankwatch(args, bare_env, tmp_path)
    _one_line_hint(done, "grafana")


def test_dashboards_build_without_the_sdk_names_the_extra(tmp_path, bare_env):
    done = subprocess.run([sys.executable, str(ROOT / "dashboards" / "build.py"), "--check"], env=bare_env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    _one_line_hint(done, "grafana")


def test_run_then_analyze_without_the_extras(tmp_path, bare_env):
    """`rankwatch run` (the demo's script) and every `rankwatch analyze` form
    the README shows, on the base install: the run's output is clean (no
    NumPy warning), --plot and --tensorboard name their extra."""
    run_dir = tmp_path / "run"
    done = _rankwatch(["run", "--nproc-per-node", "2", "--run-dir", str(run_dir), str(TRAIN), "--steps", "8"],
                      bare_env, tmp_path, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "Failed to initialize NumPy" not in done.stdout + done.stderr
    assert json.loads((run_dir / "report.json").read_text())["status"] == "healthy"
    assert "HEALTHY" in (run_dir / "report.html").read_text()  # the page needs no extra

    for args in ([str(run_dir)], [str(run_dir), "--json"], [str(run_dir), "--html", str(tmp_path / "p.html")]):
        done = _rankwatch(["analyze", *args], bare_env, tmp_path)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    _one_line_hint(_rankwatch(["analyze", str(run_dir), "--plot", str(tmp_path / "run.png")], bare_env, tmp_path),
                   "plot")
    assert not (tmp_path / "run.png").exists()
    _one_line_hint(_rankwatch(["analyze", str(run_dir), "--tensorboard", str(tmp_path / "tb")], bare_env,
                              tmp_path), "tensorboard")


def test_the_base_install_brings_numpy():
    """Without numpy every torch process prints "Failed to initialize NumPy"
    (torch's CPU wheel does not depend on it): the README's demo printed it
    once per process."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"numpy\b", d) for d in deps), deps
