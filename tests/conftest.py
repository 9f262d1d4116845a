import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest

TINY = Path(__file__).parent / "fixtures" / "md2-tiny"
SHARED_TINY = Path(__file__).parents[2] / "shared" / "fixtures" / "md2-tiny"


FIXTURES = Path(__file__).parent / "fixtures"


def pytest_configure(config):
    """Under pytest-xdist each worker computes with one thread: two workers on CI's two CPUs, not four threads."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def fixture_dirs() -> list[Path]:
    """Every golden fixture folder: md2-tiny (with adapters and spatial refs), md2-tiny-4bit, md05-tiny."""
    return sorted(p.parent for p in FIXTURES.glob("*/cases.json")) + \
        [p for p in (SHARED_TINY,) if (p / "cases.json").exists()]


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return TINY


@pytest.fixture(scope="session")
def tiny_model():
    import torch

    from kestrel_backend.model.moondream import Moondream

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return Moondream.from_checkpoint(TINY, dtype=torch.float32)


def wait_until(condition, what: str, timeout: float = 120.0, poll: float = 0.05) -> None:
    """Poll condition() until it is true; an AssertionError naming `what` after `timeout` seconds (a synchronisation
    with a server, never a speed bound: a wait that never ends would hold CI to its own limit)."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {timeout:g} s"
        time.sleep(poll)


def on_engine_loop(engine, fn):
    """fn() run on the engine's loop, where no step runs while it does (it has no await): a test that changes the
    scheduler's queues there races no step, which from the test's own thread could start in between."""
    import asyncio

    async def call():
        return fn()
    return asyncio.run_coroutine_threadsafe(call(), engine.loop).result(timeout=60)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(server, what: str, url: str, timeout: float) -> None:
    """Until `url` answers 200; the end of server.log in the error if server.proc exits or the timeout passes."""
    import time
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {server.log.read_text()[-3000:]}")
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"{what} was not ready: {server.log.read_text()[-3000:]}")


class TritonProcess:
    """A real tritonserver (nvidia-pytriton wheel) on free ports with our repository, tiny checkpoint, CPU."""

    def __init__(self, work, ports: tuple[int, int, int] | None = None, log_verbose: int | None = None, **env):
        """ports: (http, grpc, metrics), to start a server again where one stopped; free ones by default.
        log_verbose: tritonserver's verbose log level (TRITON_LOG_VERBOSE by default, else 0)."""
        import os
        import subprocess

        from kestrel_backend.server.local_server import server_command

        http, grpc, metrics = self.ports = ports or (_free_port(), _free_port(), _free_port())
        if log_verbose is None:
            log_verbose = int(os.environ.get("TRITON_LOG_VERBOSE", "0"))
        cmd, full_env = server_command(http, grpc, metrics, work=work, log_verbose=log_verbose)
        full_env.update({"KESTREL_DEVICE": "cpu", **env})
        self.log = work / "server.log"
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        self.grpc, self.http = f"127.0.0.1:{grpc}", f"http://127.0.0.1:{http}"
        self.metrics = f"http://127.0.0.1:{metrics}/metrics"
        _wait_ready(self, "tritonserver", self.http + "/v2/health/ready", 180)
        # (tritonserver starts its metrics service just after the HTTP one: a scrape at once was refused)
        _wait_ready(self, "tritonserver's metrics", self.metrics, 30)

    def __getitem__(self, key):  # tests read server["grpc"], server["metrics"], ...
        return getattr(self, key)

    def rss_bytes(self) -> int:
        """Resident memory of the server and its Python-backend stub (the engine lives in the stub)."""
        import subprocess

        pids = [str(self.proc.pid)] + subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                                                     text=True).stdout.split()
        total = 0
        for pid in pids:
            try:
                for line in open(f"/proc/{pid}/status"):
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except FileNotFoundError:
                pass
        return total

    def stop(self):
        import subprocess

        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory):
    """One server per test run for the functional tests."""
    server = TritonProcess(tmp_path_factory.mktemp("triton"), KESTREL_MAX_QUEUE="64",
                           HF_TOKEN="hf_secret_token_must_not_be_logged", KESTREL_ADAPTER_DIR=str(TINY / "adapters"))
    yield server
    server.stop()


class GatewayProcess:
    """The gateway (python -m kestrel_backend.gateway) on a free port in front of the given tritonservers."""

    def __init__(self, work, tritons: list[str], *args: str, env: dict | None = None):
        import os
        import subprocess
        import sys

        port = _free_port()
        cmd = [sys.executable, "-m", "kestrel_backend.gateway", "--port", str(port), "--host", "127.0.0.1",
               "--refresh-s", "0.5", *[a for t in tritons for a in ("--triton", t)], *args]
        self.log = work / f"gateway-{port}.log"
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        _wait_ready(self, "the gateway", self.url + "/readyz", 60)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


GATEWAY_KEY = "test-key-1"


@pytest.fixture(scope="session")
def gateway(triton_server, tmp_path_factory):
    """The gateway in front of the session's tritonserver, with an API key, serving the name `moondream2`."""
    g = GatewayProcess(tmp_path_factory.mktemp("gateway"), [triton_server["grpc"]], "--model-name", "moondream2",
                       env={"KESTREL_GATEWAY_API_KEYS": f"{GATEWAY_KEY}, other-key"})
    yield g
    g.stop()


def http_request(url: str, path: str, body=None, headers=None, method=None, raw: bytes | None = None):
    """(status, parsed JSON or None, headers) of one HTTP request."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    r = urllib.request.Request(url + path, data=data, method=method,
                               headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(r, timeout=120) as response:
            text = response.read()
            status, head = response.status, response.headers
    except urllib.error.HTTPError as e:
        text, status, head = e.read(), e.code, e.headers
    try:
        return status, json.loads(text), head
    except ValueError:
        return status, None, head
