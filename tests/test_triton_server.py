"""The product as users run it: a real tritonserver with our model repository, driven over gRPC."""

import asyncio
import json
import re
import threading
import time
import urllib.request

import numpy as np
import pytest
import pyvips
import tritonclient.grpc as grpcclient
from conftest import wait_until
from test_images import png_header_only

from client import AsyncMoondreamClient, MoondreamClient, MoondreamError
from client.metrics import metric_sum, scrape
from kestrel_backend.engine_config import RuntimeConfig
from kestrel_backend.engine import InferenceEngine

GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def client(triton_server):
    return MoondreamClient(triton_server["grpc"], timeout=120)


@pytest.fixture(scope="module")
def image(tiny_dir):
    return (tiny_dir / "images" / "small.png").read_bytes()


@pytest.fixture(scope="module")
def direct(tiny_dir):
    """The same engine in-process: the server must give exactly its answers."""
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                               adapter_dir=str(tiny_dir / "adapters")))
    yield lambda coro_fn: asyncio.run(coro_fn(eng))
    eng.shutdown()


def metrics_text(triton_server) -> str:
    return scrape(triton_server["metrics"])


def idle_metrics(server, timeout: float = 30.0) -> str:
    """The metrics once the engine gauges show no running sequence and no KV page in use (they are
    refreshed every 50 ms, so they may lag the last response), or the last text at the deadline."""
    deadline = time.time() + timeout
    while True:
        text = metrics_text(server)
        idle = metric_sum(text, "kestrel_engine_state", state="kv_pages_used") == 0 and \
            metric_sum(text, "kestrel_engine_state", state="running") == 0
        if idle or time.time() > deadline:
            return text
        time.sleep(0.2)


def test_health_ready(triton_server):
    assert urllib.request.urlopen(triton_server["http"] + "/v2/health/ready").status == 200
    assert urllib.request.urlopen(triton_server["http"] + "/v2/models/moondream/ready").status == 200


def _check_metrics(body, n_out):
    m = body["metrics"]
    assert set(m) == {"input_tokens", "output_tokens", "prefill_time_ms", "decode_time_ms", "ttft_ms", "cached_tokens"}
    assert m["output_tokens"] == n_out and m["input_tokens"] > 0


def test_query_and_caption_equal_the_engine(client, image, direct):
    q = client.query("What is in the picture?", image=image, settings=GREEDY)
    assert set(q) == {"request_id", "finish_reason", "answer", "metrics"}
    assert q["finish_reason"] in ("stop", "length")
    want = direct(lambda e: e.query(image, "What is in the picture?", settings=GREEDY))
    assert q["answer"] == want.output["answer"] and q["finish_reason"] == want.finish_reason
    _check_metrics(q, want.metrics["output_tokens"])

    c = client.caption(image, "short", settings=GREEDY)
    assert set(c) == {"request_id", "finish_reason", "caption", "metrics"}
    assert c["caption"] == direct(lambda e: e.caption(image, "short", settings=GREEDY)).output["caption"]

    t = client.query("Text only, please.", settings=GREEDY)
    assert t["answer"] == direct(lambda e: e.query(None, "Text only, please.", settings=GREEDY)).output["answer"]

    r = client.query("Think first.", image=image, reasoning=True, settings=GREEDY)
    assert set(r["reasoning"]) == {"text", "grounding"}
    assert r["answer"] == direct(lambda e: e.query(image, "Think first.", reasoning=True, settings=GREEDY)).output["answer"]


@pytest.mark.parametrize("skill", ["query", "caption"])
def test_streamed_chunks_join_to_the_final_text(client, image, skill):
    kw = {"question": "Describe it."} if skill == "query" else {"length": "long"}
    bodies = list(client.stream(skill, image=image, settings={"temperature": 0, "max_tokens": 24}, **kw))
    *chunks, final = bodies
    assert chunks and all(b["completed"] is False and set(b) == {"chunk", "completed", "token_index"} for b in chunks)
    assert final["completed"] is True
    key = "answer" if skill == "query" else "caption"
    assert "".join(b["chunk"] for b in chunks) + final["chunk"] == final[key]
    assert [b["token_index"] for b in chunks] == sorted(b["token_index"] for b in chunks)


def test_point_and_detect(client, image, direct):
    p = client.point(image, "dog", settings={"max_objects": 4})
    assert set(p) == {"request_id", "finish_reason", "points", "metrics"}
    assert p["points"] == direct(lambda e: e.point(image, "dog", settings={"max_objects": 4})).output["points"]
    d = client.detect(image, "dog", settings={"max_objects": 4})
    assert d["objects"] and all(set(o) == {"x_min", "y_min", "x_max", "y_max"} for o in d["objects"])
    assert all(0.0 <= v <= 1.0 for o in d["objects"] for v in o.values())
    assert d["objects"] == direct(lambda e: e.detect(image, "dog", settings={"max_objects": 4})).output["objects"]
    # STREAM on a region skill still gives one final response
    bodies = list(client.stream("point", image=image, object="dog", settings={"max_objects": 2}))
    assert len(bodies) == 1 and len(bodies[0]["points"]) <= 2


def _raw(url, inputs):
    """Send hand-made tensors; returns (bodies, error message)."""
    done = threading.Event()
    out = {"bodies": [], "error": None}

    def callback(result, error):
        if error is not None:
            out["error"] = str(error)
            done.set()
            return
        text = result.as_numpy("TEXT_OUTPUT")
        if text is not None:
            out["bodies"].append(text[0])
        final = result.get_response().parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            done.set()

    c = grpcclient.InferenceServerClient(url)
    c.start_stream(callback=callback)
    c.async_stream_infer("moondream", inputs, enable_empty_final_response=True)
    assert done.wait(60), "no final response"
    c.stop_stream()
    c.close()
    return out["bodies"], out["error"]


def _tensor(name, arr, dtype):
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def _animated_webp():
    frames = pyvips.Image.arrayjoin([pyvips.Image.black(16, 16, bands=3) + i * 40 for i in range(3)], across=1).cast("uchar")
    frames = frames.copy()
    frames.set_type(pyvips.GValue.gint_type, "page-height", 16)
    return frames.webpsave_buffer()


def _jpeg():
    pixels = np.random.default_rng(0).integers(0, 256, (120, 160, 3), dtype=np.uint8)
    return pyvips.Image.new_from_array(pixels).jpegsave_buffer()


def _bad_requests(image):
    b = lambda name, v: _tensor(name, np.array([v], dtype=np.object_), "BYTES")
    refs = lambda rows: _tensor("SPATIAL_REFS", np.array(rows, np.float32), "FP32")
    skill = lambda s: b("SKILL", s.encode())
    return {
        "unknown skill": ([skill("dance"), b("IMAGE", image)], r"SKILL must be one of"),
        "missing SKILL": ([b("QUESTION", b"hi")], r"SKILL"),
        "missing QUESTION": ([skill("query"), b("IMAGE", image)], r"QUESTION is required"),
        "missing IMAGE for caption": ([skill("caption")], r"IMAGE is required"),
        "missing OBJECT": ([skill("detect"), b("IMAGE", image)], r"OBJECT is required"),
        "empty QUESTION": ([skill("query"), b("QUESTION", b"  ")], r"QUESTION is required"),
        "non-UTF-8 QUESTION": ([skill("query"), b("QUESTION", b"\xff\xfe\xfa")], r"QUESTION is not valid UTF-8"),
        "random bytes IMAGE": ([skill("caption"), b("IMAGE", bytes(range(256)) * 4)], r"IMAGE is not a decodable"),
        "truncated PNG": ([skill("caption"), b("IMAGE", image[: len(image) // 2])], r"IMAGE is (truncated|not a decodable)"),
        "zero-byte IMAGE": ([skill("caption"), b("IMAGE", b"")], r"IMAGE is (empty|required)"),
        "SETTINGS not JSON": ([skill("query"), b("QUESTION", b"hi"), b("SETTINGS", b"{nope")], r"SETTINGS is not valid JSON"),
        "SETTINGS not an object": ([skill("query"), b("QUESTION", b"hi"), b("SETTINGS", b"[1]")], r"SETTINGS must be a JSON object"),
        "SETTINGS unknown key": ([skill("query"), b("QUESTION", b"hi"), b("SETTINGS", b'{"temp": 1}')], r"unknown key"),
        "temperature < 0": ([skill("query"), b("QUESTION", b"hi"), b("SETTINGS", b'{"temperature": -1}')], r"temperature"),
        "top_p > 1": ([skill("query"), b("QUESTION", b"hi"), b("SETTINGS", b'{"top_p": 1.5}')], r"top_p"),
        "negative max_tokens": ([skill("query"), b("QUESTION", b"hi"), b("SETTINGS", b'{"max_tokens": -5}')], r"max_tokens"),
        "NaN temperature": ([skill("query"), b("QUESTION", b"hi"), b("SETTINGS", b'{"temperature": NaN}')], r"temperature must be a finite"),
        "20000x20000 PNG bomb": ([skill("caption"), b("IMAGE", png_header_only(20000, 20000))], r"20000x20000 pixels, over the"),
        "animated WebP": ([skill("caption"), b("IMAGE", _animated_webp())], r"several frames"),
        "GIF": ([skill("caption"), b("IMAGE", pyvips.Image.new_from_array(np.zeros((8, 8), np.uint8)).gifsave_buffer())], r"not supported"),
        "truncated JPEG": ([skill("caption"), b("IMAGE", _jpeg()[:600])], r"IMAGE is (truncated|not a decodable)"),
        "missing IMAGE for point": ([skill("point"), b("OBJECT", b"cat")], r"IMAGE is required"),
        "10 MB of zeros as IMAGE": ([skill("caption"), b("IMAGE", bytes(10 << 20))], r"IMAGE is not a decodable"),
        "huge max_objects": ([skill("point"), b("IMAGE", image), b("OBJECT", b"x"), b("SETTINGS", b'{"max_objects": 100000}')], r"max_objects"),
        "invalid LENGTH": ([skill("caption"), b("IMAGE", image), b("LENGTH", b"epic")], r"LENGTH must be"),
        "question longer than the context": ([skill("query"), b("QUESTION", ("word " * 3000).encode())], r"QUESTION is too long"),
        "wrong type SKILL": ([_tensor("SKILL", np.array([1], dtype=np.int32), "INT32")], r"SKILL|data-type|datatype"),
        "wrong shape QUESTION": ([skill("query"), _tensor("QUESTION", np.array([b"a", b"b"], dtype=np.object_), "BYTES")], r"QUESTION|shape"),
        "SPATIAL_REFS rows of 3": ([skill("query"), b("IMAGE", image), b("QUESTION", b"hi"), refs([[0.1, 0.2, 0.3]])],
                                   r"SPATIAL_REFS must have shape \[N, 2\] \(points\) or \[N, 4\]"),
        "SPATIAL_REFS outside [0, 1]": ([skill("query"), b("IMAGE", image), b("QUESTION", b"hi"), refs([[0.5, 1.5]])],
                                        r"SPATIAL_REFS values must be finite and within \[0, 1\]"),
        "SPATIAL_REFS for caption": ([skill("caption"), b("IMAGE", image), refs([[0.5, 0.5]])], r"only taken by the query"),
        "SPATIAL_REFS without IMAGE": ([skill("query"), b("QUESTION", b"hi"), refs([[0.5, 0.5]])], r"need an IMAGE"),
        "TEMPERATURE and SETTINGS.temperature": ([skill("query"), b("QUESTION", b"hi"), b("SETTINGS", b'{"temperature": 0}'),
                                                  _tensor("TEMPERATURE", np.array([0.5], np.float32), "FP32")],
                                                 r"TEMPERATURE and SETTINGS.temperature both given"),
        "MAX_TOKENS out of range": ([skill("query"), b("QUESTION", b"hi"), _tensor("MAX_TOKENS", np.array([0], np.int32), "INT32")],
                                    r"max_tokens must be between 1"),
        "unknown adapter": ([skill("query"), b("QUESTION", b"hi"), b("SETTINGS", b'{"adapter": "nope@1"}')],
                            r"adapter 'nope@1' not found"),
        # echoed values are cut (to 64 characters and a count), deep nesting is refused in our words
        "100,000-character adapter id": ([skill("query"), b("QUESTION", b"hi"), b("SETTINGS", json.dumps(
            {"adapter": "a" * 100000}).encode())], r"got '.{0,70}\.\.\. \(100002 characters\)$"),
        "100,000-character LENGTH": ([skill("caption"), b("IMAGE", image), b("LENGTH", b"L" * 100000)],
                                     r"LENGTH must be .{0,60} got '.{0,70}\.\.\. \(100002 characters\)$"),
        "SETTINGS nested 100,000 deep": ([skill("query"), b("QUESTION", b"hi"), b("SETTINGS", b"[" * 100000)],
                                         r"SETTINGS is nested too deeply$"),
        "chat without MESSAGES": ([skill("chat")], r"MESSAGES is required"),
        "MESSAGES for query": ([skill("query"), b("QUESTION", b"hi"), b("MESSAGES", b"[]")], r"only taken by the chat"),
        "two IMAGE elements for query": ([skill("query"), b("QUESTION", b"hi"),
                                          _tensor("IMAGE", np.array([image, image], dtype=np.object_), "BYTES")],
                                         r"IMAGE holds 2 images; only the chat skill takes more than one"),
        "chat naming a third image of two": ([skill("chat"), _tensor("IMAGE", np.array([image, image], np.object_),
                                                                     "BYTES"), b("MESSAGES", json.dumps([
            {"role": "user", "content": [{"type": "image", "index": 2}]}]).encode())], r"one of the 2 images"),
    }


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(triton_server, client, image):
    bad = _bad_requests(image)
    assert len(bad) >= 25
    for kind, (inputs, pattern) in bad.items():
        bodies, error = _raw(triton_server["grpc"], inputs)
        assert error is not None and not bodies, kind
        assert re.search(pattern, error), (kind, error)
        ok = client.query("still there?", settings={"max_tokens": 2})
        assert ok["finish_reason"] in ("stop", "length"), kind
    text = idle_metrics(triton_server)
    assert metric_sum(text, "kestrel_requests_total", outcome="invalid") >= 20
    assert metric_sum(text, "kestrel_engine_state", state="kv_pages_used") == 0


def test_chat_streamed_and_not_and_a_second_turn_reads_the_first_from_the_prefix_cache(triton_server, client, image):
    settings = {"temperature": 0, "max_tokens": 6}
    turn_1 = [{"role": "user", "content": [{"type": "image", "index": 0}, {"type": "text", "text": "What is it?"}]}]
    first = client.chat(turn_1, image, reasoning=False, settings=settings)
    streamed = list(client.stream("chat", image=image, messages=turn_1, reasoning=False, settings=settings))
    assert "".join(b.get("chunk", "") for b in streamed) == first["message"]["content"] and streamed[-1]["completed"]
    before = metric_sum(idle_metrics(triton_server), "kestrel_cached_prompt_tokens_total", skill="chat")
    turn_2 = turn_1 + [{"role": "assistant", "content": first["message"]["content"]},
                       {"role": "user", "content": "And the colour?"}]
    second = client.chat(turn_2, image, reasoning=False, settings=settings)
    assert second["metrics"]["cached_tokens"] >= first["metrics"]["input_tokens"] // 16 * 16 > 730
    deadline = time.time() + 10
    while metric_sum(metrics_text(triton_server), "kestrel_cached_prompt_tokens_total", skill="chat") - before < \
            second["metrics"]["cached_tokens"] and time.time() < deadline:
        time.sleep(0.2)
    assert metric_sum(metrics_text(triton_server), "kestrel_cached_prompt_tokens_total", skill="chat") - before == \
        second["metrics"]["cached_tokens"]


def test_one_pixel_image_is_served(client):
    one = pyvips.Image.new_from_array(np.full((1, 1, 3), 200, np.uint8)).pngsave_buffer()
    assert client.caption(one, settings={"max_tokens": 3})["finish_reason"] in ("stop", "length")


def test_secrets_are_never_logged(triton_server, client):
    client.query("hello", settings={"max_tokens": 2})
    assert "hf_secret_token_must_not_be_logged" not in triton_server["log"].read_text()


def test_concurrent_streams_with_cancellations_and_metrics(triton_server, image):
    aclient = AsyncMoondreamClient(triton_server["grpc"], timeout=300)

    async def one(i):
        settings = {"temperature": 0.5, "max_tokens": 40, "seed": i}
        got = []
        async for body in aclient.stream("caption" if i % 2 else "query", image=image, question=f"q {i}", settings=settings):
            got.append(body)
            if i % 4 == 0 and len(got) == 2:  # every fourth client walks away midway
                return "cancelled", got
        return "done", got

    async def run():
        return await asyncio.gather(*[one(i) for i in range(32)])

    results = asyncio.run(run())
    for i, (state, bodies) in enumerate(results):
        if i % 4:
            assert state == "done" and bodies[-1]["completed"] is True, i
            key = "caption" if i % 2 else "answer"
            assert "".join(b["chunk"] for b in bodies) == bodies[-1][key]
    text = idle_metrics(triton_server)
    assert metric_sum(text, "kestrel_engine_state", state="kv_pages_used") == 0
    assert metric_sum(text, "kestrel_engine_state", state="kv_pages_total") > 0
    assert metric_sum(text, "kestrel_engine_state", state="kv_pages_cached") > 0  # the image's prefix, kept
    assert metric_sum(text, "kestrel_prefix_cache_hits_total") >= 1  # (32 requests on one image)
    assert metric_sum(text, "nv_inference_request_success", model="moondream") > 0
    assert metric_sum(text, "kestrel_requests_total", outcome="success") >= 24
    assert metric_sum(text, "kestrel_requests_total", outcome="cancelled") >= 1  # the server saw clients leave
    assert metric_sum(text, "kestrel_output_tokens_total") > 0
    assert metric_sum(text, "kestrel_time_to_first_token_seconds_count") > 0
    assert metric_sum(text, "kestrel_request_latency_seconds_count") > 0


def test_the_clients_timeout_ends_a_call_whose_server_stopped_answering(triton_server, image):
    """The server stops answering mid-stream (SIGSTOP): the call raises once the client's timeout passes, rather
    than waiting for a stream that will not end (it is cancelled); resumed, the server frees the abandoned request's
    pages and serves on. A caller that stops reading early cancels its request too."""
    import os
    import signal

    client = MoondreamClient(triton_server["grpc"], timeout=2)
    before = metric_sum(scrape(triton_server["metrics"]), "kestrel_requests_total", outcome="cancelled")
    failed = []

    def read_to_the_end(bodies):
        try:
            for _ in bodies:
                pass
        except MoondreamError as e:
            failed.append(str(e))

    long = {"length": "long", "settings": {"max_tokens": 1000, "temperature": 0}}  # (greedy: 1,000 tokens, no EOS)
    bodies = client.stream("caption", image=image, **long)
    next(bodies)
    os.kill(triton_server.proc.pid, signal.SIGSTOP)
    try:
        reader = threading.Thread(target=read_to_the_end, args=(bodies,), daemon=True)
        reader.start()
        reader.join(15)
    finally:
        os.kill(triton_server.proc.pid, signal.SIGCONT)
    assert not reader.is_alive() and failed == ["no response within 2 s"], failed
    bodies = client.stream("caption", image=image, **long)
    next(bodies)
    bodies.close()  # the caller leaves: cancelled (a graceful close would wait for all 1,000 tokens: a success)
    assert client.query("Still there?", image, settings=GREEDY)["answer"] is not None
    wait_until(lambda: metric_sum(scrape(triton_server["metrics"]), "kestrel_requests_total",
                                  outcome="cancelled") >= before + 2, "both requests counted as cancelled", 30)
    assert metric_sum(idle_metrics(triton_server), "kestrel_engine_state", state="kv_pages_used") == 0


def test_cli_and_seed_client(triton_server, tiny_dir):
    import subprocess
    import sys

    img = str(tiny_dir / "images" / "small.png")
    out = subprocess.run([sys.executable, "-m", "client", "detect", "--url", triton_server["grpc"], "--image", img,
                          "--object", "cat", "--settings", '{"max_objects": 2}'], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert '"objects"' in out.stdout
    seed = subprocess.run([sys.executable, "client/client.py", "--url", triton_server["grpc"], "--image", img],
                          capture_output=True, text=True, timeout=300)
    assert seed.returncode == 0, seed.stderr
    assert all(k in seed.stdout for k in ("query:", "caption:", "detect:", "point:"))
    bad = subprocess.run([sys.executable, "-m", "client", "caption", "--url", triton_server["grpc"], "--image", "README.md"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "IMAGE is not a decodable" in bad.stderr
    chat = subprocess.run([sys.executable, "-m", "client", "chat", "--url", triton_server["grpc"], "--image", img,
                           "--messages", '[{"role": "user", "content": "What is this?"}]', "--stream",
                           "--settings", '{"max_tokens": 4}'], capture_output=True, text=True, timeout=120)
    assert chat.returncode == 0 and '"completed": true' in chat.stdout, chat.stderr
    unstreamed = subprocess.run([sys.executable, "-m", "client", "point", "--url", triton_server["grpc"], "--stream",
                                 "--image", img, "--object", "cat"], capture_output=True, text=True, timeout=60)
    assert unstreamed.returncode == 2 and "point does not stream" in unstreamed.stderr


def _kestrel_inputs(skill, image, question=None, obj=None, temperature=None, top_p=None, max_tokens=None,
                    max_objects=None, spatial_refs=None, stream=False):
    """Exactly the tensors a client written for Kestrel's own Triton backend sends."""
    b = lambda name, v: _tensor(name, np.array([v], dtype=np.object_), "BYTES")
    inputs = [b("SKILL", skill.encode()), b("IMAGE", image), _tensor("STREAM", np.array([stream]), "BOOL")]
    if question is not None:
        inputs.append(b("QUESTION", question.encode()))
    if obj is not None:
        inputs.append(b("OBJECT", obj.encode()))
    for name, value, dtype in (("TEMPERATURE", temperature, np.float32), ("TOP_P", top_p, np.float32),
                               ("MAX_TOKENS", max_tokens, np.int32), ("MAX_OBJECTS", max_objects, np.int32)):
        if value is not None:
            inputs.append(_tensor(name, np.array([value], dtype), "FP32" if dtype == np.float32 else "INT32"))
    if spatial_refs is not None:
        inputs.append(_tensor("SPATIAL_REFS", np.array(spatial_refs, np.float32), "FP32"))
    return inputs


def _kestrel_call(url, inputs):
    bodies, error = _raw(url, inputs)
    return [json.loads(b) for b in bodies], error


def test_a_kestrel_client_gets_the_answers_settings_give(triton_server, client, image):
    """A client using Kestrel's tensor set (TEMPERATURE, TOP_P, MAX_TOKENS, MAX_OBJECTS, SPATIAL_REFS)
    gets the same answers as through SETTINGS and our client."""
    url = triton_server["grpc"]
    points = [[0.25, 0.5], [0.75, 0.125]]
    bodies, error = _kestrel_call(url, _kestrel_inputs("query", image, "What is this?", temperature=0.0, top_p=0.9, max_tokens=6,
                                              spatial_refs=points))
    assert error is None
    want = client.query("What is this?", image, settings={"temperature": 0, "top_p": 0.9, "max_tokens": 6},
                        spatial_refs=points)
    assert bodies[-1]["answer"] == want["answer"]
    bodies, error = _kestrel_call(url, _kestrel_inputs("query", image, "What is this?", temperature=0.0, max_tokens=6,
                                              stream=True))
    assert error is None and bodies[-1]["completed"]
    assert "".join(b["chunk"] for b in bodies) == bodies[-1]["answer"] == client.query(
        "What is this?", image, settings=GREEDY | {"max_tokens": 6})["answer"]
    bodies, error = _kestrel_call(url, _kestrel_inputs("detect", image, obj="cat", max_objects=2))
    assert error is None and bodies[-1]["objects"] == client.detect(image, "cat", settings={"max_objects": 2})["objects"]
    bodies, error = _kestrel_call(url, _kestrel_inputs("caption", image, temperature=0.0, max_tokens=5))
    assert error is None and bodies[-1]["caption"] == client.caption(image, settings=GREEDY | {"max_tokens": 5})["caption"]


def test_spatial_refs_equal_the_engine_and_change_the_answer(client, tiny_dir, direct):
    image = (tiny_dir / "images" / "medium.png").read_bytes()
    boxes = [[0.1, 0.2, 0.6, 0.9]]
    got = client.query("What is here?", image, settings=GREEDY, spatial_refs=boxes)
    want = direct(lambda e: e.query(image, "What is here?", settings=GREEDY, spatial_refs=boxes))
    assert got["answer"] == want.output["answer"]
    assert got["metrics"]["input_tokens"] == client.query("What is here?", image, settings=GREEDY)["metrics"]["input_tokens"] + 3
    assert got["answer"] != client.query("What is here?", image, settings=GREEDY)["answer"]


def test_two_adapters_and_none_in_flight_equal_each_alone(triton_server, image, direct):
    """Requests of adapters r8 and r4 and of none, every skill, all in flight at once (one batch), answer
    as each does alone in the engine; the metrics count requests per adapter; no adapter stays pinned."""
    before = metrics_text(triton_server)
    jobs = []
    for adapter in ("r8", "r4", None):
        extra = {"adapter": adapter} if adapter else {}
        jobs += [("query", dict(question="What is in the picture?", settings=GREEDY | extra)),
                 ("caption", dict(length="short", settings=GREEDY | extra)),
                 ("point", dict(object="cat", settings={"max_objects": 3} | extra)),
                 ("detect", dict(object="cat", settings={"max_objects": 3} | extra))]

    async def together():
        c = AsyncMoondreamClient(triton_server["grpc"], timeout=120)
        return await asyncio.gather(*[getattr(c, skill)(image=image, **kw) for skill, kw in jobs])

    results = asyncio.run(together())
    outputs = {"query": "answer", "caption": "caption", "point": "points", "detect": "objects"}
    for (skill, kw), got in zip(jobs, results):
        args = {"question": kw.get("question"), "length": kw.get("length"), "object": kw.get("object")}
        call = {"query": lambda e: e.query(image, args["question"], settings=kw["settings"]),
                "caption": lambda e: e.caption(image, args["length"], settings=kw["settings"]),
                "point": lambda e: e.point(image, args["object"], settings=kw["settings"]),
                "detect": lambda e: e.detect(image, args["object"], settings=kw["settings"])}[skill]
        assert got[outputs[skill]] == direct(call).output[outputs[skill]], (skill, kw["settings"])
    assert results[0]["answer"] != results[8]["answer"]  # (r8's answer is not the base model's)
    text = idle_metrics(triton_server)
    for adapter in ("r8", "r4"):
        grown = metric_sum(text, "kestrel_adapter_requests_total", adapter=adapter) - \
            metric_sum(before, "kestrel_adapter_requests_total", adapter=adapter)
        assert grown == 4, adapter


def _post(url: str, body: dict):
    return urllib.request.urlopen(urllib.request.Request(url, data=json.dumps(body).encode(),
                                                         headers={"Content-Type": "application/json"}), timeout=120)


def test_http_generate_and_generate_stream_take_base64_images(triton_server, client, image):
    """Triton's HTTP generate extension, every skill: IMAGE as base64 text or a data URL (JSON carries no raw
    bytes); the server-sent events of generate_stream join to the final text; bad base64 is a clear error."""
    import base64
    import urllib.error

    url = triton_server["http"] + "/v2/models/moondream/generate"
    b64 = base64.b64encode(image).decode()
    settings = json.dumps(GREEDY)
    calls = {"query": ({"QUESTION": "What is in the picture?"}, client.query("What is in the picture?", image, settings=GREEDY)),
             "caption": ({"LENGTH": "short"}, client.caption(image, "short", settings=GREEDY)),
             "point": ({"OBJECT": "cat"}, client.point(image, "cat", settings=GREEDY | {"max_objects": 3})),
             "detect": ({"OBJECT": "cat"}, client.detect(image, "cat", settings=GREEDY | {"max_objects": 3}))}
    for skill, (inputs, want) in calls.items():
        extra = {"SETTINGS": json.dumps({"max_objects": 3})} if skill in ("point", "detect") else {"SETTINGS": settings}
        with _post(url, {"SKILL": skill, "IMAGE": b64, **inputs, **extra}) as response:
            body = json.loads(json.loads(response.read())["TEXT_OUTPUT"])
        key = {"query": "answer", "caption": "caption", "point": "points", "detect": "objects"}[skill]
        assert body[key] == want[key], skill

    with _post(url + "_stream", {"SKILL": "caption", "IMAGE": "data:image/png;base64," + b64, "STREAM": True,
                                 "SETTINGS": json.dumps({"temperature": 0, "max_tokens": 20})}) as response:
        events = [json.loads(json.loads(line[len(b"data: "):])["TEXT_OUTPUT"])
                  for line in response.read().splitlines() if line.startswith(b"data: ")]
    assert len(events) > 1 and events[-1]["completed"] and not any(e["completed"] for e in events[:-1])
    assert "".join(e["chunk"] for e in events) == events[-1]["caption"] == \
        client.caption(image, settings={"temperature": 0, "max_tokens": 20})["caption"]

    for bad, message in (("data:image/png;base64,@@@@", "payload is not valid base64"),
                         ("data:image/png,plain", "must be data:image/<type>;base64"),
                         ("abc", "neither image bytes nor valid base64")):
        with pytest.raises(urllib.error.HTTPError) as error:
            _post(url, {"SKILL": "caption", "IMAGE": bad})
        assert message in error.value.read().decode()


def test_moondream3_served_for_every_skill_equals_the_engine(tmp_path_factory, tiny_dir):
    """A second real tritonserver serving the tiny Moondream 3 (found from its config.json, no flag): every skill,
    streamed and not, equals the in-process engine (segment with its refiner too); so do its adapters (a LoRA of
    every expert), named by id or as the official fine-tuning client names them (moondream3-preview/<id>)."""
    from conftest import TritonProcess

    folder = tiny_dir.parent / "md3-tiny"
    image = (folder / "images" / "medium.png").read_bytes()
    refiner = str(folder / "seg_refiner")
    adapters = str(folder / "adapters")
    server = TritonProcess(tmp_path_factory.mktemp("triton-md3"), KESTREL_MODEL_PATH=str(folder),
                           KESTREL_SEG_REFINER_PATH=refiner, KESTREL_ADAPTER_DIR=adapters)
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(folder), device="cpu", dtype="float32",
                                               seg_refiner_path=refiner, adapter_dir=adapters))
    try:
        client = MoondreamClient(server["grpc"], timeout=120)
        direct = lambda fn: asyncio.run(fn(eng)).output  # noqa: E731
        assert client.query("What is it?", image=image, settings=GREEDY)["answer"] == \
            direct(lambda e: e.query(image, "What is it?", settings=GREEDY))["answer"]
        r = client.query("Think first.", image=image, reasoning=True, settings=GREEDY)
        want = direct(lambda e: e.query(image, "Think first.", reasoning=True, settings=GREEDY))
        assert (r["answer"], r["reasoning"]) == (want["answer"], want["reasoning"])
        for length in ("short", "normal", "long"):
            *chunks, final = list(client.stream("caption", image=image, length=length, settings=GREEDY))
            assert "".join(c["chunk"] for c in chunks) + final["chunk"] == final["caption"] == \
                direct(lambda e: e.caption(image, length, settings=GREEDY))["caption"]
        assert client.point(image, "dog")["points"] == direct(lambda e: e.point(image, "dog"))["points"]
        assert client.detect(image, "dog")["objects"] == direct(lambda e: e.detect(image, "dog"))["objects"]
        few = {"max_tokens": 12}
        assert client.segment(image, "dog", settings=few)["segments"] == \
            direct(lambda e: e.segment(image, "dog", settings=few))["segments"]
        with pytest.raises(MoondreamError, match="OBJECT is required"):
            client.segment(image, " ")
        assert client.caption(image, "short", settings=GREEDY)["caption"]
        tuned = {**GREEDY, "adapter": "r8"}
        answer = direct(lambda e: e.query(image, "What is it?", settings=tuned))["answer"]
        assert answer != direct(lambda e: e.query(image, "What is it?", settings=GREEDY))["answer"]
        for name in ("r8", "moondream3-preview/r8"):
            assert client.query("What is it?", image=image, settings={**GREEDY, "adapter": name})["answer"] == answer
        assert client.detect(image, "dog", settings={"adapter": "experts"})["objects"] == \
            direct(lambda e: e.detect(image, "dog", settings={"adapter": "experts"}))["objects"]
        _official_client_on_moondream3(tmp_path_factory, server, client, image, few)
    finally:
        eng.shutdown()
        server.stop()


def _official_client_on_moondream3(tmp_path_factory, server, client, image, few):
    """The gateway in front of it, serving `moondream3-preview`, the name the official client's chat() sends by
    default: segment (its path and box, streamed as a box, path chunks and the result) and chat equal gRPC's."""
    import base64

    import moondream
    from conftest import GatewayProcess
    from moondream.types import Base64EncodedImage

    gateway = GatewayProcess(tmp_path_factory.mktemp("gateway-md3"), [server["grpc"]], "--model-name",
                             "moondream3-preview")
    try:
        md = moondream.vl(endpoint=gateway.url + "/v1")
        encoded = Base64EncodedImage(image_url="data:image/png;base64," + base64.b64encode(image).decode())
        want = client.segment(image, "dog", settings=few)["segments"][0]  # (random weights: a path that does
        box = {"bbox": want["bbox"]} if want.get("bbox") else {}  # not parse has no box)
        assert md.segment(encoded, "dog", settings=few) == {"path": want["svg_path"], **box}
        events = list(md.segment(encoded, "dog", stream=True, settings=few))
        assert events[-1] == {"path": want["svg_path"], "bbox": want.get("bbox"), "completed": True}
        assert events[0] == box if box else len(events) == 1 + bool(want["svg_path"])
        assert "".join(e.get("chunk", "") for e in events) == want["svg_path"]
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": encoded.image_url}},
                                                 {"type": "text", "text": "What is it?"}]}]
        grpc = client.chat([{"role": "user", "content": [{"type": "image", "index": 0}, messages[0]["content"][1]]}],
                           image, settings={**GREEDY, "max_total_tokens": GREEDY["max_tokens"]})  # (as the API counts)
        assert md.chat(messages, settings=GREEDY) == {"message": grpc["message"], "finish_reason": grpc["finish_reason"]}
    finally:
        gateway.stop()


def test_sigterm_under_load_drains_admitted_requests_and_refuses_later_ones(tmp_path_factory, tiny_dir):
    """A stopped server (SIGTERM, as Kubernetes stops a pod) under steady load: readiness goes false at once, every
    request admitted before the stop that can finish within the drain deadline (KESTREL_DRAIN_TIMEOUT_S) is answered
    whole, longer ones end at the deadline with an error that says so, requests after the stop are refused, and the
    process exits 0 soon after the deadline, well within tritonserver's exit timeout (30 s)."""
    import signal

    from conftest import TritonProcess

    server = TritonProcess(tmp_path_factory.mktemp("triton-stop"), KESTREL_DRAIN_TIMEOUT_S="3")
    image = (tiny_dir / "images" / "small.png").read_bytes()
    stop_at = [float("inf")]
    requests = []  # (sent at, first response at, outcome: "answered" or the error's message, max_tokens)

    def one(question: str, max_tokens: int) -> None:
        sent, first, outcome = time.time(), None, "ended without its final answer"
        try:
            for body in MoondreamClient(server["grpc"], timeout=60).stream(
                    "query", image=image, question=question, settings={"temperature": 0, "max_tokens": max_tokens}):
                first = first or time.time()
                if body["completed"] and body["metrics"]["output_tokens"] == max_tokens:
                    outcome = "answered"
        except MoondreamError as e:
            outcome = str(e)
        requests.append((sent, first, outcome, max_tokens))

    def steady(i: int) -> None:  # closed loop until a second after the stop
        n = 0
        while time.time() < stop_at[0] + 1.0:
            one(f"question {i} {n}", 6)
            n += 1

    longs = [threading.Thread(target=one, args=(f"long {i}", 1900)) for i in range(2)]
    load = [threading.Thread(target=steady, args=(i,)) for i in range(4)]
    for t in longs + load:
        t.start()
    time.sleep(2.0)
    stop_at[0] = time.time()
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:  # readiness false at once (the server is exiting: it answers "not ready" or refuses the call)
        ready = grpcclient.InferenceServerClient(server["grpc"]).is_model_ready("moondream", client_timeout=10)
    except Exception:
        ready = False
    assert not ready
    # by this answer the server had seen the stop; a request sent after the signal but before it may have come first
    not_ready_at = time.time()
    for t in longs + load:
        t.join(60)
    assert server.proc.wait(30) == 0
    exited_after = time.time() - stop_at[0]
    assert exited_after < 3 + 10, exited_after
    refusals = ("server draining", "has no available versions")
    admitted = [r for r in requests if r[1] is not None and r[1] < stop_at[0] and r[3] == 6]
    later = [r for r in requests if r[0] > not_ready_at]
    assert len(admitted) >= 10 and later, (len(admitted), len(later))
    for sent, first, outcome, max_tokens in requests:
        if max_tokens == 1900:
            assert "still running 3 s after the stop began" in outcome, outcome
        elif first is not None and first < stop_at[0]:
            assert outcome == "answered", outcome
        else:
            assert (outcome == "answered" and sent < not_ready_at) or any(m in outcome for m in refusals), outcome
    assert all(any(m in r[2] for m in refusals) for r in later)
    assert "draining: new requests refused" in server.log.read_text()
