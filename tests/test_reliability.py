"""Load through a real tritonserver with a deliberately small queue: concurrent streams, random
cancellations, an overfilled queue. Every accepted request finishes or gets a clear overload error,
memory stays flat, and every KV page is free at the end."""

import asyncio
import random
import time
import urllib.request

import pytest

from client import AsyncMoondreamClient, MoondreamError
from client.metrics import metric_sum
from conftest import TritonProcess
from test_triton_server import idle_metrics


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    server = TritonProcess(tmp_path_factory.mktemp("triton-small"), KESTREL_MAX_QUEUE="6", KESTREL_MAX_BATCH_SIZE="4")
    yield server
    server.stop()


async def _round(client, image, n, rng):
    async def one(i):
        cancel_after = rng.choice([None, None, None, 1, 3])
        bodies = []
        try:
            skill = "caption" if i % 3 else "query"
            async for body in client.stream(skill, image=image if skill == "caption" or i % 2 else None,
                                            question=f"load {i}", settings={"temperature": 0.8, "max_tokens": 32, "seed": i}):
                bodies.append(body)
                if cancel_after and len(bodies) >= cancel_after:
                    return "cancelled"
            assert bodies[-1]["completed"] is True
            return "done"
        except MoondreamError as e:
            assert "overloaded" in str(e), str(e)
            return "overloaded"

    return await asyncio.gather(*[one(i) for i in range(n)])


def test_load_with_cancellations_and_overflow(small_server, tiny_dir):
    client = AsyncMoondreamClient(small_server["grpc"], timeout=120)
    image = (tiny_dir / "images" / "small.png").read_bytes()
    rng = random.Random(0)
    outcomes, rss = [], []
    deadline = time.time() + 90  # bounded in time as well as in count
    for _ in range(5):
        if time.time() > deadline:
            break
        outcomes += asyncio.run(_round(client, image, 24, rng))
        rss.append(small_server.rss_bytes())
    print("outcomes", {k: outcomes.count(k) for k in set(outcomes)}, "rss MiB", [r >> 20 for r in rss])
    assert len(rss) >= 3
    assert "overloaded" in outcomes and "done" in outcomes and "cancelled" in outcomes
    # memory: after the first round (allocator warm-up) RSS stays within 64 MiB
    assert max(rss[1:]) - rss[1] < 64 << 20, [r >> 20 for r in rss]
    text = idle_metrics(small_server)
    assert metric_sum(text, "kestrel_engine_state", state="kv_pages_used") == 0
    assert metric_sum(text, "kestrel_requests_total", outcome="overloaded") >= 1
    assert urllib.request.urlopen(small_server["http"] + "/v2/health/ready").status == 200


def test_unusable_device_turns_readiness_false_and_the_server_exits(tmp_path):
    """Every step after the 4th fails (chaos knob): requests get errors, then the server shuts down."""
    server = TritonProcess(tmp_path, KESTREL_CHAOS_FAIL_AFTER_STEPS="4")
    try:
        from client import MoondreamClient

        client = MoondreamClient(server["grpc"], timeout=60)
        assert client.query("fine", settings={"max_tokens": 2})["finish_reason"] in ("stop", "length")
        errors = []
        for _ in range(3):
            try:
                client.query("fail", settings={"max_tokens": 20})
            except MoondreamError as e:
                errors.append(str(e))
        assert errors and all("inference step failed" in e for e in errors), errors
        deadline = time.time() + 60
        ready = True
        while time.time() < deadline and server.proc.poll() is None:
            try:
                ready = urllib.request.urlopen(server["http"] + "/v2/health/ready", timeout=2).status == 200
            except OSError:
                ready = False
            time.sleep(0.2)
        assert not ready
        assert server.proc.wait(60) is not None  # the process is gone: the container/pod restarts
        assert "engine unhealthy" in server.log.read_text()
    finally:
        server.stop()
