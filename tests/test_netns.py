"""A multi-host run made real with Linux network namespaces, started exactly as the Helm chart
renders it.

Three "pods" in three network namespaces joined by veth pairs to a bridge (in a fourth namespace,
so nothing touches the host's network): the collector, started with the command and environment
of the chart's StatefulSet container, and two training nodes, started with the command and
environment of the chart's Indexed Job container. What a cluster would add is added the way the
cluster adds it:
- the Secret's token for ``secretKeyRef``, the Job's UID label and the pod name for ``fieldRef``,
  ``$(VAR)`` expansion as the kubelet does it, ``JOB_COMPLETION_INDEX``;
- the pod hostname ``<job>-<index>`` (a UTS namespace) and name resolution: per-namespace
  ``/etc/netns/<ns>/hosts`` (``ip netns exec`` mounts it on /etc/hosts) with what the kubelet's
  hosts file and the cluster DNS would answer (pod FQDNs, ``<job>-0.<job>``, the collector
  Service); the host's own /etc/hosts is untouched;
- an emptyDir per pod for the run dir (a bind mount in the pod's own mount namespace).
The only values this test sets are the script (a wrapper that prints each rank's host, then runs
examples/train.py), its arguments, and host paths for the run dir and the collector's data dir.

Heavy (real training processes): run under the shared lock, e.g.
    flock /tmp/rankwatch-heavy.lock python -m pytest -q tests/test_netns.py --basetemp=/tmp/pt-netns
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed")

from conftest import TRAIN, worker_env  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "rankwatch"
VALUES = CHART / "ci" / "netns-values.yaml"
RELEASE, NAMESPACE = "rw", "ml"
SUBNET = "10.231.7"
HANG_DEADLINE = 150.0  # seconds for a hung job to be diagnosed and ended on both nodes

WRAPPER = """\
import os, runpy, socket, sys
# The user's script: say where each rank runs (an account independent of rankwatch), then train.
print(f"rankwatch-netns: rank {os.environ['RANK']} on {socket.gethostname()}", flush=True)
sys.argv = [%(train)r, *sys.argv[1:]]
runpy.run_path(%(train)r, run_name="__main__")
"""


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, timeout=30)


def _skip_reason() -> str | None:
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    for tool in ("ip", "unshare", "mount", "hostname"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: iproute2, util-linux)"
    probe = f"rwprobe{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    try:
        inside = _run("ip", "netns", "exec", probe, "unshare", "--uts", "--", "sh", "-c", "hostname x && hostname",
                      check=False)
        if inside.returncode != 0 or inside.stdout.strip() != "x":
            return f"cannot enter a network + UTS namespace here: {inside.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


# -- what the chart renders, resolved as a cluster would ------------------------------------------

@dataclass
class Rendered:
    collector: dict  # the StatefulSet's container
    job: dict  # the Job
    trainer: dict  # the Job's container
    secret: dict
    collector_service: str
    headless_service: str

    @property
    def token(self) -> str:
        return base64.b64decode(self.secret["data"]["token"]).decode()


def render(values: dict) -> Rendered:
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    objects = [d for path, text in out.items() if not path.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d]
    by_kind: dict[str, list[dict]] = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], []).append(obj)
    (sts,), (job,), (secret,) = by_kind["StatefulSet"], by_kind["Job"], by_kind["Secret"]
    services = {("headless" if s["spec"].get("clusterIP") == "None" else "collector"): s["metadata"]["name"]
                for s in by_kind["Service"]}
    return Rendered(collector=sts["spec"]["template"]["spec"]["containers"][0], job=job,
                    trainer=job["spec"]["template"]["spec"]["containers"][0], secret=secret,
                    collector_service=services["collector"], headless_service=services["headless"])


def kubelet_env(container: dict, rendered: Rendered, fields: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: secretKeyRef, fieldRef, and $(VAR)
    expanded from the variables defined before it (an undefined reference stays as it is)."""
    env = {k: v for k, v in worker_env().items() if not k.startswith(("RANKWATCH_", "PET_", "TORCHELASTIC_"))}
    defined: dict[str, str] = dict(extra)
    for item in container["env"]:
        if "value" in item:
            value = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: defined.get(m.group(1), m.group(0)),
                           item["value"])
        elif "secretKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["secretKeyRef"]
            assert ref["name"] == rendered.secret["metadata"]["name"], ref
            value = base64.b64decode(rendered.secret["data"][ref["key"]]).decode()
        else:
            value = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        defined[item["name"]] = value
    env.update(defined)
    return env


def console_script(command: list[str]) -> list[str]:
    """The image's `rankwatch` entry point is this environment's."""
    beside = Path(sys.executable).parent / command[0]
    return [str(beside) if beside.exists() else shutil.which(command[0]) or command[0], *command[1:]]


# -- the network --------------------------------------------------------------------------------------

@dataclass
class Network:
    tag: str
    pods: dict[str, str] = field(default_factory=dict)  # namespace -> IP
    processes: list[subprocess.Popen] = field(default_factory=list)

    def ns(self, pod: str) -> str:
        return f"rwt{self.tag}-{pod}"

    def build(self, pods: list[str], hosts: str) -> None:
        switch = self.ns("switch")
        _run("ip", "netns", "add", switch)
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        for i, pod in enumerate(pods):
            ns, ip = self.ns(pod), f"{SUBNET}.{10 + i}"
            _run("ip", "netns", "add", ns)
            inner, outer = f"rw{self.tag}{i}a", f"rw{self.tag}{i}b"
            _run("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "link", "set", outer, "netns", switch)
            _run("ip", "-n", ns, "link", "set", inner, "name", "eth0")
            _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", switch, "link", "set", outer, "master", "br0")
            _run("ip", "-n", switch, "link", "set", outer, "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            # No cluster DNS beyond the hosts file: unknown names fail at once (nothing listens on 53).
            (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
            self.pods[ns] = ip

    def ip(self, pod: str) -> str:
        return self.pods[self.ns(pod)]

    def start(self, pod: str, command: list[str], env: dict[str, str], hostname: str | None = None,
              binds: tuple[tuple[Path, Path], ...] = (), log: Path | None = None) -> subprocess.Popen:
        script = ['set -e'] + ([f'hostname "{hostname}"'] if hostname else [])
        script += [f'mount --bind "{src}" "{dst}"' for src, dst in binds] + ['exec "$@"']
        argv = ["ip", "netns", "exec", self.ns(pod), "unshare", "--uts", "--", "sh", "-c", "\n".join(script), "sh",
                *command]
        out = open(log, "w") if log else subprocess.DEVNULL
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes.append(proc)
        return proc

    def python_in(self, pod: str, code: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns(pod), sys.executable, "-c", code], env=env,
                              capture_output=True, text=True, timeout=timeout)

    def teardown(self) -> None:
        for proc in self.processes:  # only the process groups this test started
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        for ns in [*self.pods, self.ns("switch")]:
            _run("ip", "netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


@dataclass
class Cluster:
    net: Network
    values: dict
    rendered: Rendered
    tmp: Path
    collector: subprocess.Popen
    collector_url: str
    run_dir_mount: Path

    def get(self, path: str, token: str | None) -> tuple[int, dict]:
        """GET on the collector from a training node's namespace, over the veth network."""
        code = ("import json, sys, urllib.request, urllib.error\n"
                f"r = urllib.request.Request({self.collector_url + path!r})\n"
                + (f"r.add_header('Authorization', 'Bearer ' + {token!r})\n" if token else "")
                + "try:\n    resp = urllib.request.urlopen(r, timeout=10); print(resp.status); print(resp.read().decode())\n"
                "except urllib.error.HTTPError as e:\n    print(e.code); print(e.read().decode())\n")
        done = self.net.python_in("node0", code, worker_env())
        assert done.returncode == 0, done.stderr
        status, _, body = done.stdout.partition("\n")
        return int(status), json.loads(body or "{}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("netns")
    wrapper = tmp / "train_k8s.py"
    wrapper.write_text(WRAPPER % {"train": str(TRAIN)})
    run_dir_mount = tmp / "pod-run-dir"  # the pod's emptyDir mount point
    run_dir_mount.mkdir()
    values = yaml.safe_load(VALUES.read_text())
    values["collector"]["dataDir"] = str(tmp / "collector-pvc")
    values["job"].update(script=str(wrapper), runDir=str(run_dir_mount))
    rendered = render(dict(values, job=dict(values["job"], args=[])))

    job_name = rendered.job["metadata"]["name"]
    headless = rendered.headless_service
    pods = ["collector", "node0", "node1"]
    url = {e["name"]: e.get("value") for e in rendered.trainer["env"]}["RANKWATCH_COLLECTOR"]
    service_host = urlparse(url).hostname
    assert service_host.startswith(rendered.collector_service + "."), url
    fqdn = "svc.cluster.local"
    hosts = ["127.0.0.1 localhost",
             f"{SUBNET}.10 {service_host} {rendered.collector_service}.{NAMESPACE}.{fqdn}"]
    for index in range(2):  # what the kubelet writes for the pod and the cluster DNS answers for the others
        pod_host = f"{job_name}-{index}"
        hosts.append(f"{SUBNET}.{11 + index} {pod_host}.{headless}.{NAMESPACE}.{fqdn} {pod_host}.{headless} {pod_host}")
    net = Network(tag=f"{os.getpid() % 100000:05d}")
    try:
        net.build(pods, "\n".join(hosts) + "\n")
        (tmp / "collector-pvc").mkdir()
        env = kubelet_env(rendered.collector, rendered, {}, {})
        collector = net.start("collector", console_script(rendered.collector["command"]), env,
                              hostname=f"{rendered.collector_service}-0", log=tmp / "collector.log")
        port = rendered.collector["ports"][0]["containerPort"]
        collector_url = f"http://{service_host}:{port}"
        assert urlparse(url).port == port
        # Ready when /healthz answers over the veth network from a training node (the readiness probe's path).
        poll = ("import time, urllib.request\n"
                "deadline = time.time() + 40\n"
                "while True:\n"
                "    try:\n"
                f"        urllib.request.urlopen({collector_url + '/healthz'!r}, timeout=1); break\n"
                "    except OSError:\n"
                "        if time.time() > deadline: raise\n"
                "        time.sleep(0.1)\n")
        ready = net.python_in("node0", poll, worker_env())
        assert ready.returncode == 0, (ready.stderr, (tmp / "collector.log").read_text())
        yield Cluster(net=net, values=values, rendered=rendered, tmp=tmp, collector=collector,
                      collector_url=collector_url, run_dir_mount=run_dir_mount)
    finally:
        net.teardown()


@dataclass
class Node:
    index: int
    host: str
    proc: subprocess.Popen
    run_dir: Path
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def report(self) -> dict:
        path = self.run_dir / "report.json"
        assert path.is_file(), f"node {self.index}: no report.json\n{self.output()[-4000:]}"
        return json.loads(path.read_text())


def start_job(cluster: Cluster, name: str, args: list[str]) -> tuple[str, list[Node]]:
    """The chart's Indexed Job pods for ``args``: one launcher per node namespace."""
    values = dict(cluster.values, job=dict(cluster.values["job"], args=args))
    rendered = render(values)
    # The token the collector was started with (a re-render generates a new one, as a new release would).
    rendered.secret = cluster.rendered.secret
    job_name = rendered.job["metadata"]["name"]
    uid = str(uuid.uuid4())  # the Job's UID: one Job, two pods
    nodes = []
    for index in range(rendered.job["spec"]["completions"]):
        host = f"{job_name}-{index}"
        run_dir = cluster.tmp / name / f"pod-{index}"
        run_dir.mkdir(parents=True)
        fields = {"metadata.labels['batch.kubernetes.io/controller-uid']": uid,
                  "metadata.name": f"{host}-{uuid.uuid4().hex[:5]}"}
        env = kubelet_env(rendered.trainer, rendered, fields,
                          {"JOB_COMPLETION_INDEX": str(index), "HOSTNAME": host})
        log = cluster.tmp / name / f"pod-{index}.log"
        proc = cluster.net.start(f"node{index}", console_script(rendered.trainer["command"]), env, hostname=host,
                                 binds=((run_dir, cluster.run_dir_mount),), log=log)
        nodes.append(Node(index, host, proc, run_dir, log))
    run_id = f"{job_name}-{uid}"
    return run_id, nodes


def wait_all(nodes: list[Node], timeout: float) -> float:
    started = time.time()
    for node in nodes:
        try:
            node.proc.wait(timeout=max(1.0, started + timeout - time.time()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"node {node.index} still running after {timeout}s:\n{node.output()[-4000:]}")
    return time.time() - started


def ranks_by_host(nodes: list[Node]) -> dict[int, str]:
    found = {}
    for node in nodes:
        for rank, host in re.findall(r"rankwatch-netns: rank (\d+) on (\S+)", node.output()):
            found[int(rank)] = host
    return found


def test_rendered_pods_use_the_chart_token_and_the_rendered_names(cluster):
    """The collector refuses the training API without the chart's token, over the pod network."""
    status, _ = cluster.get("/healthz", None)
    assert status == 200
    status, _ = cluster.get("/v1/status", cluster.rendered.token)
    assert status == 200
    write = ("import urllib.request, urllib.error\n"
             f"r = urllib.request.Request({cluster.collector_url + '/v1/nodes'!r}, data=b'{{}}', method='POST')\n"
             "try:\n    urllib.request.urlopen(r, timeout=5); print(200)\n"
             "except urllib.error.HTTPError as e:\n    print(e.code)\n")
    done = cluster.net.python_in("node1", write, worker_env())
    assert done.stdout.strip() == "401", done.stdout + done.stderr


def test_healthy_multi_host_run_has_no_verdict(cluster):
    run_id, nodes = start_job(cluster, "healthy", ["--steps", "15"])
    wait_all(nodes, 120)
    for node in nodes:
        assert node.proc.returncode == 0, node.output()[-4000:]
        report = node.report()
        assert report["status"] == "healthy" and report["verdicts"] == [], json.dumps(report)[:2000]
        assert report["world_size"] == 2 and report["run_id"] == run_id
    assert set(ranks_by_host(nodes).values()) == {n.host for n in nodes}, "one rank per pod"
    status, report = cluster.get(f"/v1/runs/{run_id}/report", cluster.rendered.token)
    assert status == 200 and report["status"] == "healthy" and report["verdicts"] == [], report


def test_hang_on_one_rank_is_named_with_its_global_rank_and_host(cluster):
    started = time.time()
    run_id, nodes = start_job(cluster, "hang", ["--steps", "60", "--fault", "hang", "--fault-rank", "1",
                                                "--fault-step", "5"])
    elapsed = wait_all(nodes, HANG_DEADLINE)
    hosts = ranks_by_host(nodes)
    assert sorted(hosts) == [0, 1], [n.output()[-2000:] for n in nodes]
    culprit_host = hosts[1]
    for node in nodes:
        assert node.proc.returncode != 0, f"node {node.index}: the hung job was not ended\n{node.output()[-3000:]}"
        report = node.report()
        hangs = [v for v in report["verdicts"] if v["kind"] == "hang"]
        assert len(hangs) == 1, json.dumps(report)[:3000]
        assert [v["kind"] for v in report["verdicts"]] == ["hang"], "one fault, one verdict"
        assert hangs[0]["ranks"] == [1]
        assert hangs[0]["evidence"]["hosts"]["1"] == culprit_host
        assert culprit_host in hangs[0]["summary"]
        assert report["run_id"] == run_id and report["world_size"] == 2
    status, report = cluster.get(f"/v1/runs/{run_id}/report", cluster.rendered.token)
    assert status == 200, report
    assert [(v["kind"], v["ranks"]) for v in report["verdicts"]] == [("hang", [1])]
    # Bundles crossed the pod network into the collector's data dir (its PVC).
    run_files = Path(cluster.values["collector"]["dataDir"]) / "runs" / run_id
    bundles = list((run_files / "bundles").rglob("rank-*"))
    assert bundles, sorted(p.name for p in Path(cluster.values["collector"]["dataDir"]).rglob("*"))
    # The documented way out of the cluster: `kubectl cp <collector-0>:<dataDir>/runs/<run-id> .`, then analyze.
    offline = subprocess.run([*console_script(["rankwatch"]), "analyze", "--json", str(run_files)],
                             capture_output=True, text=True, timeout=120)
    assert offline.returncode == 0, offline.stderr
    assert [(v["kind"], v["ranks"]) for v in json.loads(offline.stdout)["verdicts"]] == [("hang", [1])], offline.stdout
    print(f"\nnetns hang: verdict on rank 1 ({culprit_host}); both pods ended {elapsed:.1f}s after start "
          f"({time.time() - started:.1f}s with setup); hang timeout {cluster.values['job']['hangTimeout']} s")


def test_collector_stops_within_its_grace_period_and_keeps_every_run(cluster):
    """Kubernetes sends SIGTERM and waits terminationGracePeriodSeconds: the collector must be gone
    by then, its index committed on the volume with every run it had."""
    status, before = cluster.get("/v1/status", cluster.rendered.token)
    assert status == 200
    runs = set(before["runs"])
    with helm.Chart.load(str(CHART)) as chart:
        sts_grace = chart.merge_values(cluster.values)["collector"]["terminationGracePeriodSeconds"]
    started = time.time()
    cluster.collector.send_signal(signal.SIGTERM)
    code = cluster.collector.wait(timeout=sts_grace)
    took = time.time() - started
    assert code == 0, (cluster.tmp / "collector.log").read_text()[-3000:]
    from rankwatch.collector.store import Store

    store = Store(Path(cluster.values["collector"]["dataDir"]) / "collector.sqlite")
    try:
        assert runs <= set(store.run_ids()), (runs, store.run_ids())
    finally:
        store.close()
    print(f"\ncollector: SIGTERM to exit {took:.2f}s (grace {sts_grace}s), {len(runs)} run(s) kept")
