import os
from pathlib import Path

import pytest

TINY = Path(__file__).parent / "fixtures" / "md2-tiny"
SHARED_TINY = Path(__file__).parents[2] / "shared" / "fixtures" / "md2-tiny"


def fixture_dirs() -> list[Path]:
    return [p for p in (TINY, SHARED_TINY) if (p / "cases.json").exists()]


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return TINY


@pytest.fixture(scope="session")
def tiny_model():
    import torch

    from kestrel_backend.model.moondream import Moondream

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    return Moondream.from_checkpoint(TINY, dtype=torch.float32)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory):
    """One real tritonserver (nvidia-pytriton wheel) per test run, on free ports, tiny checkpoint, CPU."""
    import subprocess
    import time
    import urllib.request

    from kestrel_backend.triton.local_server import server_command

    http, grpc, metrics = _free_port(), _free_port(), _free_port()
    work = tmp_path_factory.mktemp("triton")
    cmd, env = server_command(http, grpc, metrics, work=work)
    env.update(KESTREL_DEVICE="cpu", KESTREL_MAX_QUEUE="64")
    log = open(work / "server.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    ready = f"http://127.0.0.1:{http}/v2/health/ready"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited: {(work / 'server.log').read_text()[-3000:]}")
        try:
            if urllib.request.urlopen(ready, timeout=2).status == 200:
                break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError(f"tritonserver not ready: {(work / 'server.log').read_text()[-3000:]}")
    yield {"grpc": f"127.0.0.1:{grpc}", "http": f"http://127.0.0.1:{http}",
           "metrics": f"http://127.0.0.1:{metrics}/metrics", "log": work / "server.log", "proc": proc}
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
