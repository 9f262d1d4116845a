"""Deployment files: the Helm chart renders and validates (and a broken copy fails), Dockerfile and
compose files agree with pyproject and the engine's configuration."""

import re
import shutil
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "ci"))
import chart_check  # noqa: E402

from kestrel_backend.config import RuntimeConfig  # noqa: E402

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


def test_dockerfile_installs_what_pyproject_declares():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    docker = (ROOT / "docker" / "Dockerfile").read_text()
    assert re.search(r"^FROM nvcr\.io/nvidia/tritonserver:\$\{TRITON_VERSION\}-py3$", docker, re.M)
    assert re.search(r"^ARG TRITON_VERSION=\d\d\.\d\d$", docker, re.M)
    # the package is installed from its own pyproject, with extras that exist there
    m = re.search(r'pip install "\.\[([\w,]+)\]"', docker)
    assert m, "Dockerfile must pip install the package itself"
    assert set(m.group(1).split(",")) <= set(project["optional-dependencies"])
    # its torch pin is one pyproject accepts
    torch_req = next(Requirement(r) for r in project["dependencies"] if r.startswith("torch"))
    docker_torch = Requirement(re.search(r'pip install "(torch[^"]*)"', docker).group(1))
    lower = re.search(r">=\s*([\d.]+)", str(docker_torch.specifier)).group(1)
    assert torch_req.specifier.contains(lower), (torch_req, docker_torch)
    for src in re.findall(r"^COPY (\S+)", docker, re.M):
        assert (ROOT / src).exists(), src
    assert re.search(r"^USER 1000$", docker, re.M)
    assert "/v2/health/ready" in docker and re.search(r"^EXPOSE 8000 8001 8002$", docker, re.M)


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose-cpu.yml"])
def test_compose_files(name):
    compose = yaml.safe_load((ROOT / "docker" / name).read_text())
    svc = compose["services"]["kestrel"]
    assert svc["ports"] == ["8000:8000", "8001:8001", "8002:8002"]
    assert set(svc["environment"]) <= KNOWN_ENV
    assert svc["environment"]["KESTREL_DEVICE"] == ("cpu" if "cpu" in name else "cuda")
    assert (ROOT / "docker" / svc["build"]["context"] / svc["build"]["dockerfile"]).exists()
