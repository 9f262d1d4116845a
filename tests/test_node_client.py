"""The official Moondream Node client (npm moondream 0.2.0, its newest) as a real caller of the gateway: every skill
it has, streaming included, and its top-level `variant` selecting the adapter (the server counts the adapter's
requests). Its server has a short context (KESTREL_MAX_CONTEXT=800) because the client sends no settings: the default
768 tokens would take the tiny model seconds a request on a CPU."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import GATEWAY_KEY, TINY, GatewayProcess, TritonProcess

from client.metrics import metric_sum, scrape

NODE = Path(__file__).parent / "node"


@pytest.fixture(scope="module")
def node_client():
    if not (shutil.which("node") and shutil.which("npm")):
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("node and npm are needed for the Node client's test")
        pytest.skip("node and npm are not installed")
    subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE, check=True, capture_output=True, timeout=300)
    return NODE / "every_skill.js"


@pytest.fixture(scope="module")
def short_context_gateway(tmp_path_factory):
    work = tmp_path_factory.mktemp("node")
    server = TritonProcess(work, KESTREL_MAX_CONTEXT="800", KESTREL_ADAPTER_DIR=str(TINY / "adapters"))
    gateway = GatewayProcess(work, [server.grpc], "--model-name", "moondream2",
                             env={"KESTREL_GATEWAY_API_KEYS": GATEWAY_KEY})
    yield gateway, server
    gateway.stop()
    server.stop()


def test_the_official_node_client_calls_every_skill_and_selects_its_variant(node_client, short_context_gateway):
    gateway, server = short_context_gateway
    adapter = next(p.name for p in (TINY / "adapters").iterdir() if p.is_dir())
    before = metric_sum(scrape(server.metrics), "kestrel_adapter_requests_total", adapter=adapter)
    run = subprocess.run(["node", str(node_client), gateway.url + "/v1", GATEWAY_KEY,
                          str(TINY / "images" / "small.png"), adapter], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout)
    assert all(isinstance(got[k], str) for k in ("caption", "captionStream", "query", "queryStream", "variantQuery"))
    assert isinstance(got["detect"], list) and isinstance(got["point"], list)
    assert all(set(o) == {"x_min", "y_min", "x_max", "y_max"} for o in got["detect"])
    assert metric_sum(scrape(server.metrics), "kestrel_adapter_requests_total", adapter=adapter) == before + 1
