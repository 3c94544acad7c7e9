"""Two `rankwatch run` launchers (--nnodes 2, c10d rendezvous on 127.0.0.1)
report to one standalone collector, which names the culprit by global rank
and host."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

from conftest import free_port, wait_until, worker_env


def test_multinode_hang_named_by_the_standalone_collector(tmp_path, train_script):
    port = free_port()
    collector = subprocess.Popen([sys.executable, "-m", "rankwatch.cli", "collector", "serve", "--port", str(port),
                                  "--data-dir", str(tmp_path / "collector")], env=worker_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _healthy(url), 30, what="collector")
        rdzv = f"127.0.0.1:{free_port()}"
        nodes = []
        for node in range(2):
            cmd = [sys.executable, "-m", "rankwatch.cli", "run", "--collector", url, "--hang-timeout", "8",
                   "--run-dir", str(tmp_path / f"node{node}"), "--nnodes", "2", "--nproc-per-node", "2",
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", "mn-job",
                   str(train_script), "--steps", "40", "--fault", "hang", "--fault-rank", "3", "--fault-step", "5"]
            nodes.append(subprocess.Popen(cmd, cwd=tmp_path, env=worker_env({"RANKWATCH_HOST": f"node{node}"}),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=180)[0] for p in nodes]
        assert all(p.returncode != 0 for p in nodes), "the hung job was ended on both nodes"
        for node in range(2):
            report = json.loads((tmp_path / f"node{node}" / "report.json").read_text())
            hang = [v for v in report["verdicts"] if v["kind"] == "hang"]
            assert hang, outputs[node][-3000:]
            assert hang[0]["ranks"] == [3]
            assert report["world_size"] == 4
            host = hang[0]["evidence"]["hosts"]["3"]
            assert host in ("node0", "node1")
            assert host in hang[0]["summary"]
        with urllib.request.urlopen(f"{url}/v1/runs/mn-job/report", timeout=5) as r:
            assert json.loads(r.read())["verdicts"][0]["ranks"] == [3]
    finally:
        collector.terminate()
        collector.wait(timeout=10)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=1):
            return True
    except OSError:
        return False
