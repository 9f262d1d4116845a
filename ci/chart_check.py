"""Render the Helm chart with Helm's own engine (helm-python-sdk), lint it, and validate every object.

    python ci/chart_check.py [CHART_DIR]

Renders the default values and deploy/helm/values-all-on.yaml; every rendered object is checked
against the Kubernetes JSON schemas shipped by kubernetes-validate (strict: unknown fields fail).
ServiceMonitor and PrometheusRule (Prometheus Operator) and ScaledObject (KEDA) are CRDs with no shipped schema: their required
fields are checked by hand. deploy/helm/values-hpa.yaml renders the plain-HPA autoscaling. Prints one line per object and exits non-zero on any problem.
"""

from __future__ import annotations

import sys
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "kestrel-triton"
ALL_ON = ROOT / "deploy" / "helm" / "values-all-on.yaml"
HPA = ROOT / "deploy" / "helm" / "values-hpa.yaml"
KUBE_VERSION = "1.30.0"


def _check_service_monitor(obj: dict) -> None:
    spec = obj.get("spec") or {}
    if not spec.get("selector", {}).get("matchLabels"):
        raise ValueError("ServiceMonitor spec.selector.matchLabels is empty")
    if not spec.get("endpoints") or not all(e.get("port") for e in spec["endpoints"]):
        raise ValueError("ServiceMonitor spec.endpoints need a port")


def render(chart_dir: Path = CHART, values: dict | None = None) -> dict[str, str]:
    """The chart's rendered templates (path -> text), with Helm's own engine."""
    return helm.Chart.load(str(chart_dir)).render(values, name="kestrel", namespace="inference", is_install=True)


def _check_scaled_object(obj: dict) -> None:
    """KEDA's ScaledObject (keda.sh/v1alpha1): what KEDA needs of it, by hand (no shipped schema)."""
    spec = obj.get("spec") or {}
    if not spec.get("scaleTargetRef", {}).get("name"):
        raise ValueError("ScaledObject spec.scaleTargetRef.name is empty")
    if not 0 < int(spec.get("minReplicaCount", 0)) <= int(spec.get("maxReplicaCount", 0)):
        raise ValueError("ScaledObject needs 0 < minReplicaCount <= maxReplicaCount")
    for trigger in spec.get("triggers") or [None]:
        meta = (trigger or {}).get("metadata", {})
        if (trigger or {}).get("type") != "prometheus" or not all(meta.get(k) for k in ("serverAddress", "query",
                                                                                          "threshold")):
            raise ValueError("ScaledObject needs a prometheus trigger with serverAddress, query and threshold")
        float(meta["threshold"])


def _check_prometheus_rule(obj: dict) -> None:
    """The Prometheus Operator's PrometheusRule: groups of named rules, each an alert (or a record) with an expr."""
    groups = (obj.get("spec") or {}).get("groups") or []
    if not groups or not all(g.get("name") and g.get("rules") for g in groups):
        raise ValueError("PrometheusRule needs groups, each with a name and rules")
    if not all((r.get("alert") or r.get("record")) and r.get("expr") for g in groups for r in g["rules"]):
        raise ValueError("PrometheusRule rules need an alert or record name and an expr")


CUSTOM_RESOURCES = {"ServiceMonitor": _check_service_monitor, "ScaledObject": _check_scaled_object,
                    "PrometheusRule": _check_prometheus_rule}


def check(chart_dir: Path = CHART, values_files=(None, ALL_ON, HPA)) -> list[str]:
    """Returns the problems found (empty: all good)."""
    problems: list[str] = []
    for values_file in values_files:
        label = values_file.name if values_file else "default values"
        values = yaml.safe_load(values_file.read_text()) if values_file else None
        report = helm.lint(str(chart_dir), values, strict=True, kube_version=f"v{KUBE_VERSION}")
        for msg in report.get("messages", []):
            if msg.get("severity", 0) >= 2:
                problems.append(f"{label}: lint: {msg.get('path')}: {msg.get('error')}")
        problems += [f"{label}: lint: {e}" for e in report.get("errors", [])]
        try:
            rendered = render(chart_dir, values)
        except helm.HelmError as e:
            problems.append(f"{label}: render failed: {e}")
            continue
        kinds = []
        for path, text in sorted(rendered.items()):
            if not path.endswith((".yaml", ".yml")):
                continue
            try:
                docs = [d for d in yaml.safe_load_all(text) if d]
            except yaml.YAMLError as e:
                problems.append(f"{label}: {path}: not YAML: {e}")
                continue
            for obj in docs:
                kind = obj.get("kind", "?")
                try:
                    if kind in CUSTOM_RESOURCES:
                        CUSTOM_RESOURCES[kind](obj)
                    else:
                        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
                    kinds.append(kind)
                    print(f"ok   {label}: {path}: {kind}")
                except Exception as e:
                    problems.append(f"{label}: {path}: {kind}: {type(e).__name__}: {e}")
        if "Deployment" not in kinds or "Service" not in kinds:
            problems.append(f"{label}: rendered no Deployment/Service (got {kinds})")
    return problems


def main(argv: list[str]) -> int:
    problems = check(Path(argv[0]) if argv else CHART)
    for p in problems:
        print("FAIL", p)
    print("chart check:", "passed" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
