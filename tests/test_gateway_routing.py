"""Several real tritonservers (tiny checkpoint, CPU) behind one gateway: requests follow their image, a replica
that joins takes load, one that dies or restarts loses no request it had not admitted."""

import base64
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import pyvips
from conftest import GatewayProcess, TritonProcess

from client import MoondreamClient
from client.metrics import metric_sum, scrape

# one worker runs these in order (pytest-xdist's loadgroup): each test leaves the replicas as the next expects them
pytestmark = [pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning"),
              pytest.mark.xdist_group("routing")]
SHORT = {"temperature": 0, "max_tokens": 3}


def fresh_png(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return pyvips.Image.new_from_array(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)).resize(
        4, kernel="linear").pngsave_buffer()


def ask(gateway, png: bytes, question: str = "What is this?", settings=SHORT) -> tuple[int, dict]:
    body = {"image_url": "data:image/png;base64," + base64.b64encode(png).decode(), "question": question,
            "settings": settings}
    request = urllib.request.Request(gateway.url + "/v1/query", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def prefix_hits(servers) -> float:
    return sum(metric_sum(scrape(s.metrics), "kestrel_prefix_cache_hits_total") for s in servers)


def served_by(gateway) -> dict[str, float]:
    text = scrape(gateway.url + "/metrics")
    return {line.split('replica="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("kestrel_gateway_upstream_requests_total{") and 'outcome="served"' in line}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    work = tmp_path_factory.mktemp("replicas")
    for i in range(3):
        (work / f"r{i}").mkdir()
    with ThreadPoolExecutor(3) as pool:
        servers = list(pool.map(lambda i: TritonProcess(work / f"r{i}", KESTREL_MAX_QUEUE="64",
                                                        KESTREL_DRAIN_TIMEOUT_S="20"), range(3)))
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def listing(tmp_path_factory, replicas):
    path = tmp_path_factory.mktemp("listing") / "replicas.txt"
    path.write_text("\n".join(s.grpc for s in replicas[:2]) + "\n")  # the third joins in the first test
    return path


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, replicas, listing):
    g = GatewayProcess(tmp_path_factory.mktemp("routing"), [], "--triton-file", str(listing))
    yield g
    g.stop()


def test_a_replica_added_to_the_list_takes_load(gateway, replicas, listing):
    for i in range(6):
        assert ask(gateway, fresh_png(1000 + i))[0] == 200
    assert replicas[2].grpc not in served_by(gateway)
    listing.write_text("\n".join(s.grpc for s in replicas) + "\n")
    time.sleep(1.5)  # (the gateway reads the list every 0.5 s)
    for i in range(12):
        assert ask(gateway, fresh_png(2000 + i))[0] == 200
    assert served_by(gateway).get(replicas[2].grpc, 0) >= 1


def test_questions_on_one_image_reach_the_replica_that_cached_it(gateway, replicas, triton_server):
    """Prefix-cache hits through three replicas, against one server given the same stream of requests (other
    fresh images, the same order): at least 95% of them."""
    questions = [f"Question {q}?" for q in range(3)]

    def stream(first_seed: int):
        order = [(first_seed + i, q) for q in questions for i in range(8)]  # each image's questions apart
        return [(fresh_png(seed), q) for seed, q in order]

    single = MoondreamClient(triton_server["grpc"], timeout=120)
    before = prefix_hits([triton_server])
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda item: single.query(item[1], item[0], settings=SHORT), stream(3000)))
    time.sleep(1.5)
    alone = prefix_hits([triton_server]) - before

    before = prefix_hits(replicas)
    with ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda item: ask(gateway, item[0], item[1])[0], stream(4000)))
    time.sleep(1.5)
    routed = prefix_hits(replicas) - before
    assert statuses == [200] * len(statuses)
    assert alone >= 8 and routed >= 0.95 * alone, (routed, alone)


def _load(gateway, n: int, seed: int, workers: int = 6, settings=None):
    """n queries (two a fresh image) from `workers` threads, in the background: -> (thread, results list)."""
    results = []

    def run():
        with ThreadPoolExecutor(workers) as pool:
            results.extend(pool.map(lambda i: ask(gateway, fresh_png(seed + i // 2), settings=settings or
                                                  {"temperature": 0, "max_tokens": 40}), range(n)))
    thread = threading.Thread(target=run)
    thread.start()
    return thread, results


def test_a_rolling_restart_through_the_drain_fails_no_request(gateway, replicas, tmp_path_factory):
    thread, results = _load(gateway, 90, 5000)
    for i, server in enumerate(replicas):
        time.sleep(1.0)
        server.stop()  # SIGTERM, as Kubernetes sends it: the engine drains, the gateway sends new requests on
        replicas[i] = TritonProcess(server.log.parent, ports=server.ports, KESTREL_MAX_QUEUE="64",
                                    KESTREL_DRAIN_TIMEOUT_S="20")
    thread.join()
    failed = [r for r in results if r[0] != 200]
    assert len(results) == 90 and not failed, failed[:3]


def test_a_replica_killed_under_load_fails_only_what_it_had_admitted(gateway, replicas):
    time.sleep(1.5)  # (every replica ready again in the gateway's eyes)
    thread, results = _load(gateway, 60, 6000)
    time.sleep(2.0)
    victim = replicas[1]
    children = subprocess.run(["pgrep", "-P", str(victim.proc.pid)], capture_output=True, text=True).stdout.split()
    victim.proc.kill()
    for pid in children:  # (its Python-backend stub)
        os.kill(int(pid), signal.SIGKILL)
    thread.join()
    failed = [r for r in results if r[0] != 200]
    assert len(results) == 60
    assert all(r[0] == 502 and victim.grpc in r[1]["error"]["message"] for r in failed), failed[:3]
    assert len(failed) <= 6  # at most what was in flight on it (six client threads)
    replicas[1] = TritonProcess(victim.log.parent, ports=victim.ports, KESTREL_MAX_QUEUE="64")
