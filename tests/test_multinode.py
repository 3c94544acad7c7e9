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
        run_ids = {json.loads((tmp_path / f"node{n}" / "report.json").read_text())["run_id"] for n in range(2)}
        assert len(run_ids) == 1 and run_ids.pop().startswith("mn-job-")  # one run: the nodes agreed its id
        with urllib.request.urlopen(f"{url}/v1/runs/{report['run_id']}/report", timeout=5) as r:
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


def test_readme_multinode_example_run_twice_the_rerun_is_a_new_run(tmp_path, train_script):
    """Issue 26: the README's multi-node example (a standalone collector,
    two launchers, ``--rdzv-id job42``) run twice under the same id, faulty
    then healthy: the second launch is a new run and reports healthy (it
    printed FAULTY with the first run's NaN verdict when the run id was the
    rendezvous id)."""
    port = free_port()
    collector = subprocess.Popen([sys.executable, "-m", "rankwatch.cli", "collector", "serve", "--port", str(port),
                                  "--data-dir", str(tmp_path / "collector")], env=worker_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _healthy(url), 30, what="collector")

        def launch(name: str, fault: list[str]) -> list[tuple[int, dict, str]]:
            rdzv = f"127.0.0.1:{free_port()}"
            nodes = []
            for node in range(2):
                cmd = [sys.executable, "-m", "rankwatch.cli", "run", "--collector", url,
                       "--run-dir", str(tmp_path / name / f"node{node}"), "--nnodes", "2", "--nproc-per-node", "1",
                       "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv, "--rdzv-id", "job42",
                       str(train_script), "--steps", "12", *fault]
                nodes.append(subprocess.Popen(cmd, cwd=tmp_path, env=worker_env({"RANKWATCH_HOST": f"node{node}"}),
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            outputs = [p.communicate(timeout=150)[0] for p in nodes]
            return [(p.returncode, json.loads((tmp_path / name / f"node{n}" / "report.json").read_text()), out)
                    for n, (p, out) in enumerate(zip(nodes, outputs))]

        faulty = launch("first", ["--fault", "nan", "--fault-rank", "1", "--fault-step", "3"])
        for _code, report, output in faulty:
            assert report["status"] == "faulty" and any(v["kind"] == "nonfinite" for v in report["verdicts"]), \
                output[-3000:]
        healthy = launch("second", [])
        for code, report, output in healthy:
            assert code == 0, output[-3000:]
            assert report["status"] == "healthy" and report["verdicts"] == [], output[-3000:]
            assert "FAULTY" not in output
        first_ids = {r["run_id"] for _c, r, _o in faulty}
        second_ids = {r["run_id"] for _c, r, _o in healthy}
        assert len(first_ids) == 1 and len(second_ids) == 1 and first_ids != second_ids
        assert all(i.startswith("job42-") for i in first_ids | second_ids)
    finally:
        collector.terminate()
        collector.wait(timeout=10)
