"""The container as users run it, against real containers: docker/Dockerfile built on the stand-in for NVIDIA's
base image (docker/base/build.sh), started with the tiny checkpoint mounted (every skill over gRPC, HTTP generate,
/metrics, the health check, a non-root user, `docker stop` with a stream in flight); the seed's way (the base with our
repository mounted and our wheel installed at start); and compose with the gateway, called by the official client.

The commands are README's, verbatim (a test checks that README gives them), so they use README's ports, 8000-8002
and 2020 on 127.0.0.1; the module runs in one xdist group. Needs a Docker engine (ci/docker.sh starts one): without
one the module skips, and fails where CI=true."""

import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "md2-tiny"
IMAGE = (TINY / "images" / "small.png").read_bytes()
GRPC, HTTP, METRICS, GATEWAY = "127.0.0.1:8001", "http://127.0.0.1:8000", "http://127.0.0.1:8002/metrics", \
    "http://127.0.0.1:2020/v1"

# README's container section, verbatim
WHEELHOUSE = "bash docker/wheelhouse.sh"
BUILD = ('docker build -f docker/Dockerfile -t kestrel-triton --build-arg BASE_IMAGE="$(bash docker/base/build.sh)" '
         "--build-arg TORCH=torch==2.13.0 --build-arg EXTRAS=client,gateway --build-arg PIP_NO_INDEX=1 .")
PORTS = "-p 127.0.0.1:8000:8000 -p 127.0.0.1:8001:8001 -p 127.0.0.1:8002:8002"
RUN = (f"docker run -d --name kestrel --shm-size 1g {PORTS} -v ./tests/fixtures/md2-tiny:/checkpoint:ro "
       "-e KESTREL_MODEL_PATH=/checkpoint kestrel-triton")
SEED = (f"docker run -d --name kestrel-seed --shm-size 1g {PORTS} -v ./model_repository:/models:ro -v ./dist:/wheels:ro "
        "-v ./tests/fixtures/md2-tiny:/checkpoint:ro -e KESTREL_MODEL_PATH=/checkpoint -e PIP_NO_INDEX=1 "
        '-e PIP_FIND_LINKS=/wheels "$(bash docker/base/build.sh)" '
        'bash -c "pip install /wheels/kestrel_triton-*.whl && tritonserver --model-repository=/models"')
COMPOSE = ('KESTREL_BASE_IMAGE="$(bash docker/base/build.sh)" KESTREL_TORCH=torch==2.13.0 KESTREL_PIP_NO_INDEX=1 '
           "docker-compose -f docker/docker-compose-cpu.yml -f tests/fixtures/compose/tiny.yml up -d --build")
COMPOSE_DOWN = "docker-compose -f docker/docker-compose-cpu.yml -f tests/fixtures/compose/tiny.yml down"

# the image's build is a test's set-up: on a machine without the base image or pip's cache it takes minutes
pytestmark = [pytest.mark.xdist_group("docker"), pytest.mark.timeout(1200)]


def test_dockerfile_passes_hadolint():
    """Every rule on."""
    run = subprocess.run(["hadolint", str(ROOT / "docker" / "Dockerfile")], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_readme_gives_these_commands():
    readme = re.sub(r"\\\n\s+", "", (ROOT / "README.md").read_text())
    for command in (WHEELHOUSE, BUILD, RUN, SEED, COMPOSE):
        assert command in readme, command


def sh(command: str, timeout: float = 900) -> str:
    run = subprocess.run(["bash", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, f"{command}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run.stdout


@pytest.fixture(scope="session")
def docker():
    """The docker CLI and an engine that answers, else a skip (a failure where CI=true)."""
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0:
        return
    why = "no Docker engine answers (bash ci/docker.sh as root starts one)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="session")
def image(docker):
    sh(WHEELHOUSE)
    sh(BUILD)
    return "kestrel-triton"


def wait_ready(container: str, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(HTTP + "/v2/health/ready", timeout=2).status == 200:
                return
        except OSError:
            pass
        if sh(f"docker inspect -f '{{{{.State.Running}}}}' {container}").strip() != "true":
            break
        time.sleep(1)
    raise AssertionError(f"{container} never became ready:\n" + sh(f"docker logs {container} 2>&1 | tail -40"))


def remove(container: str) -> None:
    subprocess.run(["docker", "rm", "-f", container], capture_output=True)


def every_skill_answers(grpc: str) -> None:
    from client import MoondreamClient

    client = MoondreamClient(grpc, timeout=120)
    greedy = {"temperature": 0, "max_tokens": 6}
    assert client.query("What is this?", IMAGE, settings=greedy)["finish_reason"] in ("stop", "length")
    assert client.caption(IMAGE, "short", settings=greedy)["caption"]
    assert len(client.point(IMAGE, "cat", settings={"max_objects": 2})["points"]) <= 2
    assert len(client.detect(IMAGE, "cat", settings={"max_objects": 2})["objects"]) <= 2
    chat = client.chat([{"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": "Hi?"}]}],
                       IMAGE, reasoning=False, settings=greedy)
    assert chat["message"]["role"] == "assistant" and chat["message"]["content"]
    bodies = list(client.stream("query", image=IMAGE, question="What is this?", settings=greedy))
    assert bodies[-1]["completed"] and "".join(b["chunk"] for b in bodies) == bodies[-1]["answer"]


def clean() -> None:
    """No container of an earlier test (or run) holds the names or ports (tests of one xdist group may be run
    between other modules' tests, so a module-scoped container could be set up twice)."""
    sh("docker rm -f kestrel kestrel-seed >/dev/null 2>&1; " + COMPOSE_DOWN + " >/dev/null 2>&1; true")


def test_the_image_serves_turns_healthy_runs_as_a_user_and_stops_cleanly(image):
    clean()
    sh(RUN)
    try:
        wait_ready("kestrel")
        serves_every_skill_over_grpc_and_http_with_metrics()
        turns_healthy_and_runs_as_a_user_not_root("kestrel")
        docker_stop_lets_a_stream_in_flight_finish_and_exits_0("kestrel")
    finally:
        remove("kestrel")


def serves_every_skill_over_grpc_and_http_with_metrics():
    from client.metrics import metric_sum, scrape

    every_skill_answers(GRPC)
    body = json.dumps({"SKILL": "caption", "LENGTH": "short", "SETTINGS": '{"max_tokens": 4}',
                       "IMAGE": "data:image/png;base64," + __import__("base64").b64encode(IMAGE).decode()}).encode()
    answer = json.load(urllib.request.urlopen(HTTP + "/v2/models/moondream/generate", body, timeout=60))
    assert json.loads(answer["TEXT_OUTPUT"])["caption"]
    text = scrape(METRICS)
    assert metric_sum(text, "kestrel_requests_total", outcome="success") >= 7
    assert metric_sum(text, "kestrel_engine_state", state="kv_pages_total") > 0


def turns_healthy_and_runs_as_a_user_not_root(server: str):
    deadline = time.time() + 60
    while (health := sh(f"docker inspect -f '{{{{.State.Health.Status}}}}' {server}").strip()) != "healthy":
        assert health == "starting" and time.time() < deadline, health
        time.sleep(1)
    assert sh(f"docker exec {server} id -u").strip() == "1000"
    # the server process itself, as the engine sees it
    assert sh(f"docker top {server} -o pid,uid,comm | grep tritonserver").split()[1] in ("1000", "triton-server")


def docker_stop_lets_a_stream_in_flight_finish_and_exits_0(server: str):
    from client import MoondreamClient

    bodies, errors = [], []

    def stream():
        try:  # a long caption: about 200 tokens after the stop
            for b in MoondreamClient(GRPC, timeout=120).stream("caption", image=IMAGE, length="long",
                                                               settings={"max_tokens": 400, "temperature": 0}):
                bodies.append(b)
        except Exception as e:  # noqa: BLE001 - the assertion below shows it
            errors.append(e)

    thread = threading.Thread(target=stream)
    thread.start()
    while len(bodies) < 3 and not errors:
        time.sleep(0.05)
    started, at_stop = time.time(), len(bodies)
    sh(f"docker stop -t 60 {server}", timeout=90)
    stopped_in = time.time() - started
    thread.join(60)
    assert not errors and bodies[-1]["completed"] and len(bodies) > at_stop + 10, (errors, at_stop, len(bodies))
    assert sh(f"docker inspect -f '{{{{.State.ExitCode}}}}' {server}").strip() == "0"
    assert stopped_in < 35, stopped_in  # tritonserver's exit timeout is 30 s: it did not run out


def test_the_seeds_way_base_image_with_the_repository_mounted_and_the_wheel_installed_at_start(image):
    clean()
    sh(SEED)
    try:
        wait_ready("kestrel-seed", timeout=600)
        every_skill_answers(GRPC)
    finally:
        remove("kestrel-seed")


def test_compose_brings_up_tritonserver_and_the_gateway_for_the_official_client(image):
    import moondream as md
    from PIL import Image

    clean()
    sh(COMPOSE)
    try:
        wait_ready("docker_kestrel_1")
        deadline = time.time() + 60
        while True:
            try:
                if urllib.request.urlopen(GATEWAY.removesuffix("/v1") + "/readyz", timeout=2).status == 200:
                    break
            except OSError:
                assert time.time() < deadline, sh("docker logs docker_gateway_1 2>&1 | tail -40")
                time.sleep(0.5)
        model = md.vl(endpoint=GATEWAY, model="moondream2")
        picture = Image.open(TINY / "images" / "small.png")
        assert isinstance(model.query(picture, "What is this?", settings={"max_tokens": 4})["answer"], str)
        assert isinstance(model.caption(picture, length="short", settings={"max_tokens": 4})["caption"], str)
        assert len(model.point(picture, "cat", settings={"max_objects": 2})["points"]) <= 2
        assert len(model.detect(picture, "cat", settings={"max_objects": 2})["objects"]) <= 2
    finally:
        sh(COMPOSE_DOWN)
