"""`rankwatch.agent.attach()` in a script launched without `rankwatch run`
(plain torchrun here; Ray and srun alike): the agent reads RANKWATCH_COLLECTOR
(and RANKWATCH_TOKEN) and reports to that collector. Heavy: a 2-rank torchrun
job against a real collector served over HTTP in the test process.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ddp_script, free_port, wait_until, worker_env
from rankwatch.agent.runtime import collector_url_from_env
from rankwatch.config import Config, load

_BODY = """
import rankwatch.agent as rw
rw.attach()  # before the model is wrapped
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(12):
    opt.zero_grad()
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
print("RESULT done", dist.get_rank(), flush=True)
"""


def test_collector_url_env_names():
    assert collector_url_from_env(load(env={"RANKWATCH_COLLECTOR": "http://a:1"}), env={}) == "http://a:1"
    assert collector_url_from_env(load(env={}), env={"RANKWATCH_COLLECTOR_URL": "http://b:2"}) == "http://b:2"
    both = {"RANKWATCH_COLLECTOR": "http://a:1", "RANKWATCH_COLLECTOR_URL": "http://b:2"}
    assert collector_url_from_env(load(env=both), env=both) == "http://a:1"
    assert collector_url_from_env(Config(), env={}) is None


@pytest.fixture
def collector(tmp_path):
    from rankwatch.collector.embedded import start_embedded

    config = Config(token="s3cret-token", run_dir=str(tmp_path / "collector"))
    (tmp_path / "collector").mkdir()
    service, server = start_embedded(config, tmp_path / "collector")
    yield service, server
    server.stop()
    stop = getattr(service, "stop", None)
    if stop is not None:
        stop()


def _torchrun(script, cwd, env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()), str(script)]
    return subprocess.run(cmd, cwd=cwd, env=worker_env(env), capture_output=True, text=True, timeout=180)


def test_attach_under_plain_torchrun_reports_to_the_collector(tmp_path, collector):
    service, server = collector
    script = ddp_script(tmp_path, "train.py", _BODY)
    proc = _torchrun(script, tmp_path, {"RANKWATCH_COLLECTOR": server.url, "RANKWATCH_TOKEN": "s3cret-token",
                                        "RANKWATCH_RUN_ID": "attached"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("RESULT done") == 2
    assert "[rankwatch]" not in proc.stderr, proc.stderr[-3000:]

    def both_ranks_done():
        run = service.runs.get("attached")
        return run is not None and len(run.ranks) == 2 and all(
            state.step == 12 and state.phase == "exited" for state in run.ranks.values())

    wait_until(both_ranks_done, timeout=20, what="both ranks' final heartbeats")


def test_wrong_token_never_hurts_the_job(tmp_path, collector):
    service, server = collector
    script = ddp_script(tmp_path, "train.py", _BODY)
    proc = _torchrun(script, tmp_path, {"RANKWATCH_COLLECTOR": server.url, "RANKWATCH_TOKEN": "wrong",
                                        "RANKWATCH_RUN_ID": "refused"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("RESULT done") == 2
    assert "refused" not in service.runs
    assert proc.stderr.count("[rankwatch] collector at") <= 2, proc.stderr[-3000:]  # said once per rank
