"""The operator's dashboard and alert rules (deploy/helm/kestrel-triton/files/) against a real Prometheus (Debian's)
scraping a real tritonserver and gateway on loopback: every panel's query returns data, every rule evaluates without
error and none fires on a healthy server, and promtool accepts the rules."""

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import GATEWAY_KEY, _free_port, http_request
from test_batch import b64, batch_gateway, client, png, submit

CHART_FILES = Path(__file__).parents[1] / "deploy" / "helm" / "kestrel-triton" / "files"
DASHBOARD = json.loads((CHART_FILES / "grafana-dashboard.json").read_text())
RULES = CHART_FILES / "alert-rules.yaml"
GPU_ONLY = "Needs a GPU"  # (a panel's description: Triton exports nv_gpu_* only where it sees one)
pytestmark = pytest.mark.xdist_group("dashboard")  # (one Prometheus and its servers for the module, on one worker)


def _binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed (README's set-up installs Debian's prometheus)")
        pytest.skip(f"{name} is not installed")
    return found


def _api(prometheus: str, path: str, **params) -> dict:
    url = f"{prometheus}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    with urllib.request.urlopen(url, timeout=10) as r:
        answer = json.loads(r.read())
    assert answer["status"] == "success", answer
    return answer["data"]


@pytest.fixture(scope="module")
def watched(triton_server, tmp_path_factory):
    """(Prometheus's URL, the gateway) once Prometheus scrapes both and requests of every kind have been served."""
    work = tmp_path_factory.mktemp("prometheus")
    gateway = batch_gateway(work, triton_server["grpc"])
    port = _free_port()
    config = {"global": {"scrape_interval": "500ms", "evaluation_interval": "500ms"}, "rule_files": [str(RULES)],
              "scrape_configs": [
                  {"job_name": "tritonserver", "static_configs": [{"targets": [triton_server.metrics.split("/")[2]]}]},
                  {"job_name": "gateway", "authorization": {"credentials": GATEWAY_KEY},
                   "static_configs": [{"targets": [gateway.url.split("/")[2]]}]}]}
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    server = subprocess.Popen([_binary("prometheus"), f"--config.file={work / 'prometheus.yml'}",
                               f"--storage.tsdb.path={work / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                              stdout=subprocess.DEVNULL, stderr=open(work / "prometheus.log", "w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if [t["health"] for t in _api(url, "targets")["activeTargets"]] == ["up", "up"]:
                    break
            except OSError:
                pass
            time.sleep(0.3)
        else:
            raise RuntimeError((work / "prometheus.log").read_text()[-2000:])
        _serve_a_bit_of_everything(gateway)
        time.sleep(2)  # (scrapes after the requests, so that every rate has two samples that differ)
        yield url, gateway
    finally:
        server.terminate()
        server.wait(30)
        gateway.stop()


def _serve_a_bit_of_everything(gateway) -> None:
    image, headers = b64(png(50)), {"X-Moondream-Auth": GATEWAY_KEY}
    settings = {"temperature": 0, "max_tokens": 4}
    for question in ("What is this?", "What colour is it?"):  # the second starts from the first's cached prefix
        status, _, _ = http_request(gateway.url, "/v1/query", {"image_url": image, "question": question,
                                                             "settings": settings}, headers)
        assert status == 200
    status, _, _ = http_request(gateway.url, "/v1/caption", {"image_url": image, "settings": {"temperature": 9}},
                                headers)
    assert status == 400  # (counted by the engine as invalid: the errors panel has data)
    c = client(gateway)
    batch_id = submit(c, [{"skill": "caption", "image": image, "settings": settings}, {"skill": "dance"}])
    c.wait(batch_id, poll_s=0.2, timeout_s=120)


def _panel_queries():
    for panel in DASHBOARD["panels"]:
        for target in panel["targets"]:
            # Grafana's $__rate_interval: at least four scrapes (this Prometheus scrapes twice a second)
            yield panel, target["expr"].replace("$__rate_interval", "1m")


def test_every_panel_query_returns_data(watched):
    prometheus, _ = watched
    empty = []
    for panel, expr in _panel_queries():
        result = _api(prometheus, "query", query=expr)["result"]
        if not result and GPU_ONLY not in panel["description"]:
            empty.append(f"{panel['title']}: {expr}")
    assert not empty, empty
    titles = {p["title"] for p in DASHBOARD["panels"]}
    assert {"Requests by skill and outcome", "Time to first token", "KV cache pages", "Prefix-cache hits",
            "GPU utilisation", "Gateway requests by endpoint and status"} <= titles
    assert sum(GPU_ONLY in p["description"] for p in DASHBOARD["panels"]) == 2  # (the rest must have data here)


def test_every_alert_rule_evaluates_and_none_fires_on_a_healthy_server(watched):
    prometheus, _ = watched
    rules = [r for group in _api(prometheus, "rules")["groups"] for r in group["rules"]]
    assert {r["name"] for r in rules} == {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"]
                                          for r in g["rules"]}
    for rule in rules:
        assert rule["health"] == "ok" and not rule.get("lastError"), rule
        assert rule["state"] == "inactive", rule
        assert _api(prometheus, "query", query=rule["query"])["result"] == []  # (its condition holds nowhere)
    # the no-ready-replica rule does see the engine: with a selector that matches nothing it holds
    expr = next(r["query"] for r in rules if r["name"] == "KestrelNoReadyReplica")
    assert _api(prometheus, "query", query=expr.replace('state="draining"', 'state="no such state"'))["result"]


def test_promtool_accepts_the_rules():
    out = subprocess.run([_binary("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0 and "SUCCESS: 5 rules found" in out.stdout, out.stdout + out.stderr
