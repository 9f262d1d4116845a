"""Deployment files: the Helm chart renders and validates (and a broken copy fails), Dockerfile and
compose files agree with pyproject and the engine's configuration."""

import json
import re
import shutil
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "ci"))
import chart_check  # noqa: E402

from kestrel_backend.engine_config import RuntimeConfig  # noqa: E402

KNOWN_ENV = set(RuntimeConfig.ENV.values()) | {"HF_HOME", "HF_TOKEN"}


def test_chart_renders_and_every_object_validates():
    assert chart_check.check() == []


@pytest.fixture
def chart_copy(tmp_path):
    dst = tmp_path / "kestrel-triton"
    shutil.copytree(chart_check.CHART, dst)
    return dst


def test_broken_template_fails(chart_copy):
    svc = chart_copy / "templates" / "service.yaml"
    svc.write_text(svc.read_text().replace("{{ .Values.service.type }}", "{{ .Values.service.type "))
    problems = chart_check.check(chart_copy)
    assert any("render failed" in p or "lint" in p for p in problems), problems


def test_invalid_object_fails(chart_copy):
    dep = chart_copy / "templates" / "deployment.yaml"
    dep.write_text(dep.read_text().replace("containerPort: 8001", 'containerPort: "grpc-port"'))
    problems = chart_check.check(chart_copy)
    assert any("Deployment" in p and "ValidationError" in p for p in problems), problems


def test_unknown_field_fails(chart_copy):
    svc = chart_copy / "templates" / "service.yaml"
    svc.write_text(svc.read_text().replace("  selector:", "  selektor: {}\n  selector:", 1))
    problems = chart_check.check(chart_copy)
    assert any("Service" in p for p in problems), problems


def test_chart_env_names_are_engine_settings():
    text = (chart_check.CHART / "templates" / "deployment.yaml").read_text()
    names = set(re.findall(r"name: (KESTREL_\w+|HF_\w+)", text))
    assert names and names <= KNOWN_ENV, names - KNOWN_ENV


def test_dockerfile_defaults_are_what_pyproject_declares():
    """The NGC build's defaults, which the container test (built on the stand-in base) overrides."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    docker = (ROOT / "docker" / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-py3$", docker, re.M)
    extras = re.search(r"^ARG EXTRAS=([\w,]+)$", docker, re.M).group(1).split(",")
    assert set(extras) <= set(project["optional-dependencies"])
    torch_req = next(Requirement(r) for r in project["dependencies"] if r.startswith("torch"))
    docker_torch = Requirement(re.search(r'^ARG TORCH="(torch[^"]*)"$', docker, re.M).group(1))
    lower = re.search(r">=\s*([\d.]+)", str(docker_torch.specifier)).group(1)
    assert torch_req.specifier.contains(lower), (torch_req, docker_torch)


def test_image_chart_and_compose_agree_on_user_ports_and_health():
    docker = (ROOT / "docker" / "Dockerfile").read_text()
    assert re.search(r"^USER 1000$", docker, re.M)
    assert re.search(r"^EXPOSE 8000 8001 8002 2020$", docker, re.M) and "/v2/health/ready" in docker
    values = yaml.safe_load((chart_check.CHART / "values.yaml").read_text())
    assert values["image"]["repository"] == "kestrel-triton"
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((chart_check.CHART / "Chart.yaml").read_text())
    assert values["image"]["tag"] == chart["appVersion"] == version
    assert values["podSecurityContext"]["runAsUser"] == 1000
    assert [values["service"][k] for k in ("httpPort", "grpcPort", "metricsPort")] == [8000, 8001, 8002]
    assert values["gateway"]["port"] == 2020
    container = _deployment()["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose-cpu.yml"])
def test_compose_files(name):
    compose = yaml.safe_load((ROOT / "docker" / name).read_text())
    svc = compose["services"]["kestrel"]
    assert svc["network_mode"] == "host" and svc["command"] == ["tritonserver", "--model-repository=/models"]
    assert set(svc["environment"]) <= KNOWN_ENV
    assert svc["environment"]["KESTREL_DEVICE"] == ("cpu" if "cpu" in name else "cuda")
    assert (ROOT / "docker" / svc["build"]["context"] / svc["build"]["dockerfile"]).exists()
    gateway = compose["services"]["gateway"]
    assert gateway["image"] == svc["image"] and gateway["network_mode"] == "host"
    assert gateway["command"][:3] == ["python3", "-m", "kestrel_backend.gateway"]
    assert "127.0.0.1:8001" in gateway["command"]


def _objects(values_file=None) -> list[dict]:
    values = yaml.safe_load(values_file.read_text()) if values_file else None
    return [d for path, text in chart_check.render(values=values).items() if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def _deployment(values_file=None) -> dict:
    return next(d for d in _objects(values_file) if d["kind"] == "Deployment" and "gateway" not in d["metadata"]["name"])


def test_the_gateway_as_a_sidecar_or_as_a_deployment_routing_over_the_pods():
    """Sidecar (all-on values): a gateway container beside tritonserver, talking to it on localhost, with its port on
    the Service and its keys from a Secret. Deployment (the HPA values): gateways of their own that find the
    tritonserver pods through a headless Service, whose labels the tritonserver selectors do not match."""
    pod = _deployment(chart_check.ALL_ON)["spec"]["template"]["spec"]
    sidecar = next(c for c in pod["containers"] if c["name"] == "gateway")
    assert "--triton=localhost:8001" in sidecar["args"] and "--fetch-image-urls" in sidecar["args"]
    assert sidecar["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "gateway-keys"
    service = next(d for d in _objects(chart_check.ALL_ON) if d["kind"] == "Service")
    assert {"name": "gateway", "port": 2020, "targetPort": "gateway", "protocol": "TCP"} in service["spec"]["ports"]

    objects = _objects(chart_check.HPA)
    triton = next(d for d in objects if d["kind"] == "Deployment" and "gateway" not in d["metadata"]["name"])
    assert [c["name"] for c in triton["spec"]["template"]["spec"]["containers"]] == ["tritonserver"]
    gateway = next(d for d in objects if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-gateway"))
    args = gateway["spec"]["template"]["spec"]["containers"][0]["args"]
    headless = next(d for d in objects if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None")
    assert f"--triton-dns={headless['metadata']['name']}.inference.svc.cluster.local:8001" in args
    assert "--model-name=moondream2" in args
    triton_labels = triton["spec"]["selector"]["matchLabels"]
    gateway_labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"] == triton_labels and not triton_labels.items() <= gateway_labels.items()


def test_gpus_per_pod_runs_one_engine_per_gpu():
    """gpusPerPod 1: the default config (one KIND_CPU instance); 2: the model's KIND_GPU config on two GPUs."""
    one, two = _deployment(), _deployment(chart_check.ALL_ON)
    for deployment, gpus in ((one, 1), (two, 2)):
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
        assert ("--model-config-name=multi_gpu" in container["args"]) == (gpus > 1)


def test_drain_deadline_exit_timeout_and_grace_period_come_in_order(chart_copy):
    """A stopped pod: the engine's drain deadline ends what still runs before tritonserver's exit timeout would cut
    it, and the pod is killed only after that timeout, plus a margin. A drain deadline past the exit timeout does
    not render."""
    spec = _deployment()["spec"]["template"]["spec"]
    container = spec["containers"][0]
    timeout = next(int(a.split("=")[1]) for a in container["args"] if a.startswith("--exit-timeout-secs="))
    drain = next(int(e["value"]) for e in container["env"] if e["name"] == "KESTREL_DRAIN_TIMEOUT_S")
    assert 60 <= drain < timeout < spec["terminationGracePeriodSeconds"]
    values = chart_copy / "values.yaml"
    values.write_text(values.read_text().replace("drainTimeoutSeconds: 105", "drainTimeoutSeconds: 120"))
    assert any("drainTimeoutSeconds must be below" in p for p in chart_check.check(chart_copy)), "rendered"


def test_multi_gpu_config_differs_from_the_default_only_in_its_instance_group():
    model = ROOT / "model_repository" / "moondream"

    def without_instances(text):
        lines = [line for line in text.splitlines() if not line.startswith("#")]
        return [line for line in lines if not line.startswith("instance_group")]

    default, multi = (model / "config.pbtxt").read_text(), (model / "configs" / "multi_gpu.pbtxt").read_text()
    assert without_instances(default) == without_instances(multi)
    assert "kind: KIND_CPU" in default and "kind: KIND_GPU" in multi


def test_a_kind_gpu_instance_runs_its_engine_on_its_own_gpu():
    env = {"KESTREL_MAX_BATCH_SIZE": "4"}
    assert RuntimeConfig.from_sources(env, {}, ("GPU", 1)).device == "cuda:1"
    assert RuntimeConfig.from_sources({"KESTREL_DEVICE": "cuda:3"}, {}, ("GPU", 3)).device == "cuda:3"
    assert RuntimeConfig.from_sources({"KESTREL_DEVICE": "cpu"}, {}, ("CPU", 0)).device == "cpu"
    assert RuntimeConfig.from_sources({}, {}, ("CPU", 0)).device == ""
    with pytest.raises(ValueError, match="KESTREL_DEVICE=cpu contradicts this instance's instance_group: KIND_GPU on GPU 2"):
        RuntimeConfig.from_sources({"KESTREL_DEVICE": "cpu"}, {}, ("GPU", 2))


def test_the_image_pool_counts_the_cpus_a_container_may_use(tmp_path, monkeypatch):
    """A pod's CPU limit (a cgroup CPU quota) bounds the CPUs counted, not only its cpuset: a decode pool sized
    from the node's CPUs would take the engine thread's."""
    from kestrel_backend import engine_config as config

    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir(), (v1 / "cpu").mkdir(parents=True)
    assert config.usable_cpus(tmp_path / "none") == 64
    (v2 / "cpu.max").write_text("max 100000\n")
    assert config.usable_cpus(v2) == 64
    (v2 / "cpu.max").write_text("250000 100000\n")  # a limit of 2.5 CPUs
    assert config.usable_cpus(v2) == 3
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert config.usable_cpus(v1) == 64
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("1200000\n")  # 12 CPUs
    assert config.usable_cpus(v1) == 12
    monkeypatch.setattr(config, "usable_cpus", lambda: 12)
    assert RuntimeConfig().image_worker_count() == 4 and RuntimeConfig(image_workers=7).image_worker_count() == 7


def test_tritonserver_takes_the_multi_gpu_config_by_name(tmp_path):
    """`--model-config-name=multi_gpu` makes the real tritonserver load configs/multi_gpu.pbtxt: on this machine,
    without a GPU, it then refuses the KIND_GPU instance group (on a GPU machine it starts one per GPU)."""
    import subprocess

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the KIND_GPU config would load")
    from conftest import _free_port
    from kestrel_backend.server.local_server import server_command

    cmd, env = server_command(_free_port(), _free_port(), _free_port(), work=tmp_path)
    run = subprocess.run(cmd + ["--model-config-name=multi_gpu"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "instance group moondream_0 of model moondream has kind KIND_GPU but no GPUs are available" in run.stderr + run.stdout


def _rendered_kinds(values_file) -> dict:
    rendered = chart_check.render(values=yaml.safe_load(values_file.read_text()))
    return {d["kind"]: d for path, text in rendered.items() if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d}


def test_autoscaling_by_keda_or_hpa_on_the_queue_depth():
    """provider keda: a ScaledObject whose Prometheus query reads this release's queue-depth gauge, no HPA of ours;
    provider hpa: the HPA on the adapter's pods metric, no ScaledObject."""
    keda = _rendered_kinds(chart_check.ALL_ON)
    assert "HorizontalPodAutoscaler" not in keda
    trigger = keda["ScaledObject"]["spec"]["triggers"][0]
    assert 'kestrel_engine_state{state="queue_depth", namespace="inference", pod=~"kestrel-kestrel-triton-.*"}' in \
        trigger["metadata"]["query"]
    assert keda["ScaledObject"]["spec"]["scaleTargetRef"]["name"] == keda["Deployment"]["metadata"]["name"]
    hpa = _rendered_kinds(chart_check.HPA)
    assert "ScaledObject" not in hpa and hpa["HorizontalPodAutoscaler"]["spec"]["maxReplicas"] == 8


def test_a_scaled_object_without_a_query_fails(chart_copy):
    tpl = chart_copy / "templates" / "scaledobject.yaml"
    tpl.write_text(tpl.read_text().replace("        query:", "        nquery:"))
    problems = chart_check.check(chart_copy)
    assert any("ScaledObject" in p and "query" in p for p in problems), problems


def test_the_batch_api_mounts_one_data_volume_in_every_gateway_and_needs_postgresql_for_several():
    """All-on values: every sidecar gateway mounts the Batch API's ReadWriteMany claim and reads its job store's URL
    from a Secret. Several gateways with no database: the chart refuses to render (SQLite is for one gateway)."""
    objects = _objects(chart_check.ALL_ON)
    pod = _deployment(chart_check.ALL_ON)["spec"]["template"]["spec"]
    sidecar = next(c for c in pod["containers"] if c["name"] == "gateway")
    assert "--batch-data=/var/lib/kestrel/batch" in sidecar["args"]
    assert {"name": "batch-data", "mountPath": "/var/lib/kestrel/batch"} in sidecar["volumeMounts"]
    db = next(e for e in sidecar["env"] if e["name"] == "KESTREL_BATCH_DB")
    assert db["valueFrom"]["secretKeyRef"] == {"name": "batch-db", "key": "DATABASE_URL"}
    claim = next(v for v in pod["volumes"] if v["name"] == "batch-data")["persistentVolumeClaim"]["claimName"]
    pvc = next(d for d in objects if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == claim)
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]

    values = yaml.safe_load(chart_check.HPA.read_text())
    values["gateway"]["batch"] = {"enabled": True}
    with pytest.raises(Exception, match="needs gateway.batch.database.existingSecret"):
        chart_check.render(values=values)
    values["gateway"]["replicaCount"] = 1  # one gateway: SQLite on the claim
    rendered = [d for path, text in chart_check.render(values=values).items() if path.endswith(".yaml")
                for d in yaml.safe_load_all(text) if d]
    gateway = next(d for d in rendered if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-gateway"))
    assert gateway["spec"]["template"]["spec"]["volumes"][0]["name"] == "batch-data"


def test_the_dashboard_and_the_alert_rules_ship_in_the_chart():
    """All-on values: Grafana's dashboard as a ConfigMap with the sidecar's label, the alert rules as a PrometheusRule,
    both the files under deploy/ that tests/test_dashboard.py runs against a real Prometheus. Default values: neither
    (no PrometheusRule API when rendered offline)."""
    files = chart_check.CHART / "files"
    objects = _objects(chart_check.ALL_ON)
    dashboard = next(d for d in objects if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard"))
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["kestrel-triton.json"]) == json.loads((files / "grafana-dashboard.json")
                                                                               .read_text())
    rule = next(d for d in objects if d["kind"] == "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((files / "alert-rules.yaml").read_text())
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    assert not [d for d in _objects() if d["kind"] in ("PrometheusRule", "ConfigMap")]
