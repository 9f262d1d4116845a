"""The Moondream API and OpenAI chat completions through the gateway, in front of the session's real tritonserver,
called by the official clients from PyPI (moondream 2.6.1, openai): the answers equal what the gRPC client gets."""

import base64
import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import moondream
import openai
import pytest
from conftest import GATEWAY_KEY, http_request, wait_until
from moondream.types import Base64EncodedImage
from test_triton_server import idle_metrics

from client import MoondreamClient
from client.metrics import metric_sum, scrape

GREEDY = {"temperature": 0, "max_tokens": 10}
# what the gateway sends for GREEDY: the API's max_tokens bounds reasoning and answer together
AS_THE_API = {**GREEDY, "max_total_tokens": GREEDY["max_tokens"]}
PNG_URL = "data:image/png;base64," + base64.b64encode(
    (Path(__file__).parent / "fixtures" / "md2-tiny" / "images" / "small.png").read_bytes()).decode()


@pytest.fixture(scope="module")
def png(tiny_dir):
    return (tiny_dir / "images" / "small.png").read_bytes()


@pytest.fixture(scope="module")
def image(png):
    """The image as the official client sends an already encoded one: unchanged, as a data URL."""
    return Base64EncodedImage(image_url="data:image/png;base64," + base64.b64encode(png).decode())


@pytest.fixture(scope="module")
def md(gateway):
    return moondream.vl(api_key=GATEWAY_KEY, endpoint=gateway.url + "/v1")


@pytest.fixture(scope="module")
def grpc(triton_server):
    return MoondreamClient(triton_server["grpc"], timeout=120)


def post(gateway, path: str, body, key: str | None = GATEWAY_KEY, raw: bytes | None = None):
    """(status, JSON body, headers) of a POST with the key."""
    return http_request(gateway.url, path, body, {"X-Moondream-Auth": key} if key else None, raw=raw)


def test_every_moondream_method_of_the_official_client_equals_grpc(md, image, png, grpc):
    assert md.query(image, "What is this?", settings=GREEDY)["answer"] == \
        grpc.query("What is this?", png, settings=GREEDY)["answer"]
    streamed = "".join(md.query(image, "What is this?", stream=True, settings=GREEDY)["answer"])
    assert streamed == grpc.query("What is this?", png, settings=GREEDY)["answer"]
    reasoned, direct = md.query(image, "Why?", reasoning=True, settings=GREEDY), \
        grpc.query("Why?", png, reasoning=True, settings=AS_THE_API)
    assert reasoned == {"answer": direct["answer"], "reasoning": direct["reasoning"]}
    refs = [[0.1, 0.2, 0.5, 0.6]]
    assert md.query(image, "This?", spatial_refs=refs, settings=GREEDY)["answer"] == \
        grpc.query("This?", png, settings=GREEDY, spatial_refs=refs)["answer"]
    assert md.query(question="Text only?", settings=GREEDY)["answer"] == \
        grpc.query("Text only?", settings=GREEDY)["answer"]
    for length in ("short", "normal"):
        caption = grpc.caption(png, length, settings=GREEDY)["caption"]
        assert md.caption(image, length, settings=GREEDY)["caption"] == caption
        assert "".join(md.caption(image, length, stream=True, settings=GREEDY)["caption"]) == caption
    few = {"max_objects": 3}
    assert md.point(image, "cat", settings=few)["points"] == grpc.point(png, "cat", settings=few)["points"]
    assert md.detect(image, "cat", settings=few)["objects"] == grpc.detect(png, "cat", settings=few)["objects"]


def test_official_chat_and_the_openai_sdk_equal_grpc_chat(gateway, image, png, grpc):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image.image_url}},
                                             {"type": "text", "text": "What is it?"}]},
                {"role": "assistant", "content": "A picture."}, {"role": "user", "content": "Of what?"}]
    over_grpc = [{**m, "content": [{"type": "image", "index": 0}, m["content"][1]]} if i == 1 else m
                 for i, m in enumerate(messages)]
    expected = grpc.chat(over_grpc, png, settings=AS_THE_API)
    assert expected["message"]["reasoning"]  # (on by default)
    assert expected["metrics"]["output_tokens"] <= GREEDY["max_tokens"]  # (reasoning included)
    md = moondream.vl(api_key=GATEWAY_KEY, endpoint=gateway.url + "/v1", model="moondream2")
    answer = md.chat(messages, settings=GREEDY)
    assert answer == {"message": expected["message"], "finish_reason": expected["finish_reason"]}
    assert "".join(md.chat(messages, stream=True, settings=GREEDY)["message"]) == expected["message"]["content"]
    assert md.chat(messages, reasoning=False, settings=GREEDY)["message"]["content"] == \
        grpc.chat(over_grpc, png, reasoning=False, settings=GREEDY)["message"]["content"]

    sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key=GATEWAY_KEY)
    done = sdk.chat.completions.create(model="moondream2", messages=messages, temperature=0, max_tokens=10)
    assert done.choices[0].message.content == expected["message"]["content"]
    assert done.choices[0].message.reasoning == expected["message"]["reasoning"]
    assert done.usage.prompt_tokens == expected["metrics"]["input_tokens"]
    assert done.usage.completion_tokens <= 10
    assert done.usage.prompt_tokens_details.cached_tokens >= 720  # (its image prefix, cached by the requests above)
    events = list(sdk.chat.completions.create(model="moondream2", messages=messages, temperature=0,
                                              max_completion_tokens=10, stream=True,
                                              stream_options={"include_usage": True}))
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == expected["message"]["content"]
    assert events[-2].choices[0].finish_reason == expected["finish_reason"] and events[-1].usage.total_tokens > 0


def test_a_conversation_of_two_images_through_both_sdks_equals_grpc_chat(gateway, image, png, tiny_dir, grpc):
    """An image in each of two user turns: two image_url parts through the official client and the OpenAI SDK, two
    IMAGE elements over gRPC."""
    other = (tiny_dir / "images" / "medium.png").read_bytes()
    other_url = "data:image/png;base64," + base64.b64encode(other).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image.image_url}},
                                             {"type": "text", "text": "What is it?"}]},
                {"role": "assistant", "content": "A picture."},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": other_url}},
                                             {"type": "text", "text": "And this?"}]}]
    over_grpc = [{**m, "content": [{"type": "image", "index": i // 2}, m["content"][1]]} if m["role"] == "user" else m
                 for i, m in enumerate(messages)]
    expected = grpc.chat(over_grpc, [png, other], reasoning=False, settings=GREEDY)
    assert expected["metrics"]["input_tokens"] > 1459  # (both images' rows: 730 and 729)
    md = moondream.vl(api_key=GATEWAY_KEY, endpoint=gateway.url + "/v1", model="moondream2")
    assert md.chat(messages, reasoning=False, settings=GREEDY)["message"] == expected["message"]
    sdk = openai.OpenAI(base_url=gateway.url + "/v1", api_key=GATEWAY_KEY)
    done = sdk.chat.completions.create(model="moondream2", messages=messages, temperature=0, max_tokens=10,
                                       extra_body={"reasoning": False})
    assert done.choices[0].message.content == expected["message"]["content"]
    assert done.usage.prompt_tokens == expected["metrics"]["input_tokens"]


def test_an_adapter_is_chosen_by_the_model_name(gateway, png, grpc):
    body = {"image_url": "data:image/png;base64," + base64.b64encode(png).decode(), "question": "What?",
            "settings": GREEDY, "model": "moondream2/r4"}
    status, answer, _ = post(gateway, "/v1/query", body)
    assert status == 200
    assert answer["answer"] == grpc.query("What?", png, settings={**GREEDY, "adapter": "r4"})["answer"]
    status, error, _ = post(gateway, "/v1/query", {**body, "model": "moondream2/no-such-adapter"})
    assert status == 404 and "no-such-adapter" in error["error"]["message"]


@pytest.mark.parametrize("path, body, raw, key, status, words", [
    ("/v1/query", None, b"{not json", GATEWAY_KEY, 400, "not valid JSON"),
    ("/v1/query", [1, 2], None, GATEWAY_KEY, 400, "must be a JSON object"),
    ("/v1/query", {"question": 7}, None, GATEWAY_KEY, 400, "question is required"),
    ("/v1/caption", {"image_url": "data:image/png;base64,@@@"}, None, GATEWAY_KEY, 400, "not valid base64"),
    ("/v1/caption", {"image_url": "file:///etc/passwd"}, None, GATEWAY_KEY, 400, "only data URLs"),
    ("/v1/caption", {"image_url": "http://example.com/cat.jpg"}, None, GATEWAY_KEY, 400, "not fetched"),
    ("/v1/caption", {"image_url": "aGVsbG8="}, None, GATEWAY_KEY, 400, "neither image bytes"),
    ("/v1/caption", {"image_url": base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"x" * 40).decode()}, None, GATEWAY_KEY, 400,
     "not a decodable"),
    ("/v1/detect", {"image_url": "aGVsbG8=", "object": "x", "settings": "hot"}, None, GATEWAY_KEY, 400,
     "settings must be a JSON object"),
    ("/v1/segment", {"image_url": PNG_URL, "object": "x"}, None, GATEWAY_KEY, 400, "segment needs Moondream 3"),
    ("/v1/query", {"question": "hi", "settings": {"max_tokens": -1}}, None, GATEWAY_KEY, 400, "max_tokens"),
    ("/v1/query", {"question": "hi", "model": "gpt-4"}, None, GATEWAY_KEY, 404, "served: moondream2"),
    ("/v1/query", {"question": "hi"}, None, "wrong-key", 401, "API key"),
    ("/v1/query", {"question": "hi"}, None, None, 401, "API key"),
    ("/v1/query", None, b"[" * 100000, GATEWAY_KEY, 400, "nested too deeply"),
    ("/v1/chat/completions", {"model": "moondream2", "messages": [{"role": "user", "content": "hi"},
                                                                   {"role": "user", "content": "again"}] * 2 +
                              [{"role": "assistant", "content": "x"}]}, None, GATEWAY_KEY, 400, "last message"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [  # (counted before any is decoded)
        {"type": "image_url", "image_url": {"url": "aGVsbG8="}}] * 17}]}, None, GATEWAY_KEY, 400, "at most 16"),
])
def test_bad_requests_get_a_clear_http_error_and_the_gateway_keeps_serving(gateway, path, body, raw, key, status,
                                                                            words):
    got, error, _ = post(gateway, path, body, key, raw)
    assert got == status and words in error["error"]["message"], error
    assert error["error"]["type"] and error["error"]["code"]
    assert post(gateway, "/v1/query", {"question": "still there?", "settings": {"max_tokens": 2}})[0] == 200


def test_a_body_over_the_limit_is_refused_from_its_declared_length(gateway):
    host, port = gateway.url.rsplit("/", 1)[-1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST /v1/query HTTP/1.1\r\nHost: {host}\r\nX-Moondream-Auth: {GATEWAY_KEY}\r\n"
                  f"Content-Length: {40 * 2**20}\r\n\r\n".encode())
        answer = b""
        while b"byte limit" not in answer and (chunk := s.recv(4096)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and b"byte limit" in answer


def test_models_health_and_metrics(gateway):
    with urllib.request.urlopen(urllib.request.Request(gateway.url + "/v1/models", headers={
            "Authorization": f"Bearer {GATEWAY_KEY}"})) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == ["moondream2"]
    assert urllib.request.urlopen(gateway.url + "/readyz").status == 200
    with pytest.raises(urllib.error.HTTPError, match="401"):  # keys are set: scraping needs one too
        scrape(gateway.url + "/metrics")
    before = metric_sum(scrape(gateway.url + "/metrics", api_key=GATEWAY_KEY), "kestrel_gateway_requests_total",
                        endpoint="query", status="200")  # (other tests of the module may run in another worker)
    assert post(gateway, "/v1/query", {"question": "hi", "settings": {"max_tokens": 2}})[0] == 200
    text = scrape(gateway.url + "/metrics", api_key=GATEWAY_KEY)
    assert metric_sum(text, "kestrel_gateway_requests_total", endpoint="query", status="200") == before + 1
    assert metric_sum(text, "kestrel_gateway_request_duration_seconds_count", endpoint="query") >= 1


def _send_and_hang_up(gateway, path: str, body: dict, until: bytes) -> bytes:
    """Send a request over a raw socket, read its answer until `until` (b"": nothing), and close the connection."""
    data = json.dumps(body).encode()
    host, port = gateway.url.rsplit("/", 1)[-1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nX-Moondream-Auth: "
                  f"{GATEWAY_KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        got = b""
        while until and until not in got and (chunk := s.recv(4096)):
            got += chunk
        if not until:
            time.sleep(1.0)  # (in the engine by now)
    return got


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_request(gateway, triton_server, png, stream):
    before = metric_sum(scrape(triton_server["metrics"]), "kestrel_requests_total", outcome="cancelled")
    body = {"image_url": "data:image/png;base64," + base64.b64encode(png).decode(), "length": "long",
            "stream": stream, "settings": {"max_tokens": 1000, "temperature": 0}}  # (greedy: 1,000 tokens, no EOS)
    got = _send_and_hang_up(gateway, "/v1/caption", body, b"data: " if stream else b"")
    assert not stream or b"data: " in got
    wait_until(lambda: metric_sum(scrape(triton_server["metrics"]), "kestrel_requests_total", outcome="cancelled")
               != before, "the request counted as cancelled", 30, poll=0.2)
    text = idle_metrics(triton_server)
    assert metric_sum(text, "kestrel_engine_state", state="kv_pages_used") == 0
    assert metric_sum(text, "kestrel_requests_total", outcome="cancelled") == before + 1


def test_requests_waiting_for_a_ready_replica_share_one_round_of_probes():
    """With no replica ready (a rolling restart's worst moment), the requests waiting for one ask each replica once a
    round between them, not once each, and all go on to the replica that turns ready."""
    import asyncio

    from kestrel_backend.gateway.upstream import Replica, Upstream

    class Readiness:  # (a replica's model-ready answers: no for three probes, then yes)
        asked = 0

        async def is_model_ready(self, model):
            self.asked += 1
            await asyncio.sleep(0.05)
            return self.asked > 3

    async def wait_together():
        upstream = Upstream("moondream")
        clients = [Readiness(), Readiness()]
        for i, client in enumerate(clients):
            upstream.replicas[f"10.0.0.{i}:8001"] = Replica(f"10.0.0.{i}:8001", client)
        chosen = await asyncio.gather(*[upstream._choices_when_ready(None) for _ in range(20)])
        return clients, chosen

    clients, chosen = asyncio.run(wait_together())
    assert all(len(replicas) == 2 for replicas in chosen)
    assert all(client.asked <= 5 for client in clients), [client.asked for client in clients]
