"""Property-based fuzzing of the real gateway and tritonserver (hypothesis, bounded in time): whatever JSON arrives
at any endpoint, and whatever tensors arrive at the moondream model, the answer is a 4xx (or a 200) in the JSON error
shape that the gateway's OpenAPI schema names, never a 5xx; afterwards the server is ready and no KV page is held."""

import json
import time
import urllib.error
import urllib.request

import jsonschema
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from conftest import GATEWAY_KEY
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_triton_server import idle_metrics

from client.metrics import metric_sum

FUZZ_SECONDS = 20  # each of the two fuzzers (CI's budget for both: under 60 s)
PATHS = ["/v1/query", "/v1/caption", "/v1/detect", "/v1/point", "/v1/segment", "/v1/chat/completions"]
KEYS = ["question", "image_url", "object", "length", "stream", "reasoning", "spatial_refs", "settings", "model",
        "variant", "messages", "stream_options", "max_tokens", "temperature", "n", "junk"]
SETTING_KEYS = ["temperature", "top_p", "max_tokens", "max_objects", "seed", "adapter", "variant", "bogus"]
TEXT = st.text(max_size=40)
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**6), st.floats(allow_nan=True), TEXT)
JSON = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                    st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)
IMAGE = st.sampled_from(["data:image/png;base64,AAAA", "", "not base64 at all", "http://127.0.0.1:1/x.png",
                         "data:image/png;base64," + "iVBORw0KGgo" * 3])
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "x"]),
                                           "content": st.one_of(TEXT, st.lists(JSON, max_size=3))}), max_size=3)
SETTINGS = st.dictionaries(st.sampled_from(SETTING_KEYS), SCALAR, max_size=4)
VALUES = {"image_url": IMAGE, "messages": MESSAGES, "settings": SETTINGS,
          "spatial_refs": st.lists(st.lists(st.floats(-1, 2), max_size=5), max_size=3)}
BODY = st.one_of(JSON, st.dictionaries(st.sampled_from(KEYS), st.deferred(lambda: SCALAR), max_size=6),
                 st.builds(dict, st.lists(st.sampled_from(KEYS), max_size=6, unique=True).flatmap(
                     lambda keys: st.fixed_dictionaries({k: VALUES.get(k, JSON) for k in keys}))))


def bounded(body):
    """Every generated request that may run is kept short: at most 2 tokens (a fuzzer, not a soak)."""
    if isinstance(body, dict):
        settings_ = body.get("settings")
        body = {**body, "settings": {**settings_, "max_tokens": 2} if isinstance(settings_, dict) else
                {"max_tokens": 2}} if "settings" not in body or isinstance(settings_, dict) else body
        body.setdefault("max_tokens", 2) if "messages" in body else None
    return body


@pytest.fixture(scope="module")
def schema(gateway):
    with urllib.request.urlopen(gateway.url + "/openapi.json", timeout=10) as r:
        return json.loads(r.read())


def test_fuzzing_the_gateway_answers_no_5xx_and_only_what_its_schema_names(gateway, triton_server, schema):
    deadline = time.time() + FUZZ_SECONDS
    seen = set()

    @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(PATHS), body=BODY)
    def fuzz(path, body):
        body = bounded(body)
        try:
            raw = json.dumps(body).encode()
        except (ValueError, TypeError):
            return
        request = urllib.request.Request(gateway.url + path, data=raw, headers={
            "Content-Type": "application/json", "X-Moondream-Auth": GATEWAY_KEY})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                status, text = response.status, response.read()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read()
        seen.add(status)
        assert status < 500, (path, body, status, text[:300])
        documented = schema["paths"][path]["post"]["responses"]
        assert str(status) in documented, (path, status)
        if not text.startswith(b"data:"):  # (a stream's events are not one JSON document)
            jsonschema.validate(json.loads(text), documented[str(status)]["content"]["application/json"]["schema"])
    while time.time() < deadline:  # rounds of fresh examples until the time is spent
        fuzz()
    assert 400 in seen
    assert urllib.request.urlopen(gateway.url + "/readyz", timeout=10).status == 200
    assert metric_sum(idle_metrics(triton_server), "kestrel_engine_state", state="kv_pages_used") == 0


TENSOR_NAMES = ["SKILL", "QUESTION", "OBJECT", "LENGTH", "SETTINGS", "MESSAGES", "IMAGE", "STREAM", "REASONING",
                "TEMPERATURE", "TOP_P", "MAX_TOKENS", "MAX_OBJECTS", "SPATIAL_REFS"]
BYTES_VALUES = st.one_of(st.binary(max_size=30), TEXT.map(str.encode),
                         st.sampled_from([b"query", b"caption", b"detect", b"point", b"chat", b"segment"]),
                         JSON.map(lambda v: json.dumps(v).encode()))


@st.composite
def tensor(draw, name):
    kind = draw(st.sampled_from(["BYTES", "FP32", "INT32", "BOOL"]))
    shape = draw(st.sampled_from([[1], [2], [1, 2], [2, 4], [0]]))
    size = int(np.prod(shape))
    if kind == "BYTES":
        value = np.array(draw(st.lists(BYTES_VALUES, min_size=size, max_size=size)) or [], dtype=np.object_)
    elif kind == "FP32":
        value = np.array(draw(st.lists(st.floats(width=32), min_size=size, max_size=size)), dtype=np.float32)
    elif kind == "INT32":
        value = np.array(draw(st.lists(st.integers(-2**31, 2**31 - 1), min_size=size, max_size=size)),
                         dtype=np.int32)
    else:
        value = np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size)), dtype=np.bool_)
    value = value.reshape(shape)
    t = grpcclient.InferInput(name, list(value.shape), kind)
    t.set_data_from_numpy(value)
    return t


def test_fuzzing_the_models_tensors_answers_errors_not_crashes(triton_server):
    deadline = time.time() + FUZZ_SECONDS
    client = grpcclient.InferenceServerClient(triton_server.grpc)
    answers = []
    client.start_stream(callback=lambda result, error: answers.append((result, error)))
    cap = grpcclient.InferInput("MAX_TOKENS", [1], "INT32")
    cap.set_data_from_numpy(np.array([2], dtype=np.int32))

    @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(names=st.lists(st.sampled_from(TENSOR_NAMES), unique=True, max_size=5), data=st.data())
    def fuzz(names, data):
        inputs = [data.draw(tensor(n)) for n in names if n != "MAX_TOKENS"] + [cap]
        client.async_stream_infer("moondream", inputs)
    try:
        while time.time() < deadline:
            fuzz()
        time.sleep(1.0)
    finally:
        client.stop_stream()
    errors = [e for _, e in answers if e is not None]
    assert errors and all("internal error" not in e.message() for e in errors), \
        [e.message() for e in errors if "internal error" in e.message()][:5]
    assert urllib.request.urlopen(triton_server.http + "/v2/health/ready", timeout=10).status == 200
    assert metric_sum(idle_metrics(triton_server), "kestrel_engine_state", state="kv_pages_used") == 0
