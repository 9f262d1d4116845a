"""Gaze served for real: over gRPC (SKILL=gaze, the eye or the face as SPATIAL_REFS) and through the gateway's
/v1/gaze, equal to the reference's golden answers; drawn by the CLI; refused on Moondream 3."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import GATEWAY_KEY, TINY, http_request
from PIL import Image

from client import MoondreamClient, MoondreamError
from client.draw import GAZE
from kestrel_backend.engine import InferenceEngine, InvalidRequest
from kestrel_backend.engine_config import RuntimeConfig

CASES = {c["name"]: c for c in json.loads((TINY / "cases.json").read_text())["cases"] if c["kind"] == "gaze"}
EYE, FACE = CASES["gaze_medium"], CASES["gaze_face_medium"]
BOX = ("x_min", "y_min", "x_max", "y_max")


def close(got: dict, want: dict) -> bool:
    return abs(got["x"] - want["x"]) <= 1e-4 and abs(got["y"] - want["y"]) <= 1e-4


def test_gaze_over_grpc_equals_the_reference(triton_server):
    md, image = MoondreamClient(triton_server["grpc"]), (TINY / EYE["image"]).read_bytes()
    assert close(md.gaze(image, eye=EYE["eye"])["gaze"], EYE["gaze"])
    face = md.gaze(image, face=[FACE["face"][k] for k in BOX], settings={"seed": FACE["seed"]})
    assert close(face["gaze"], FACE["gaze"]) and face["metrics"]["output_tokens"] >= 10
    with pytest.raises(MoondreamError, match="gaze takes one point"):
        md.answer("gaze", image=image, spatial_refs=[[0.1, 0.2], [0.3, 0.4]])
    with pytest.raises(MoondreamError, match="SPATIAL_REFS values must be finite and within"):
        md.gaze(image, eye=(1.5, 0.2))


def test_gaze_through_the_gateway(gateway):
    import base64

    image = base64.b64encode((TINY / EYE["image"]).read_bytes()).decode()
    headers = {"X-Moondream-Auth": GATEWAY_KEY}
    status, body, _ = http_request(gateway.url, "/v1/gaze", {"image_url": image, "eye": dict(zip("xy", EYE["eye"]))},
                                   headers)
    assert status == 200 and close(body["gaze"], EYE["gaze"]) and body["request_id"]
    status, body, _ = http_request(gateway.url, "/v1/gaze", {"image_url": image, "face": FACE["face"],
                                                            "settings": {"seed": FACE["seed"]}}, headers)
    assert status == 200 and close(body["gaze"], FACE["gaze"])
    for bad in ({"image_url": image}, {"image_url": image, "eye": {"x": 0.1}},
                {"image_url": image, "eye": {"x": 0.1, "y": 0.2}, "face": FACE["face"]}):
        status, body, _ = http_request(gateway.url, "/v1/gaze", bad, headers)
        assert status == 400 and ("eye" in body["error"]["message"]), body


def test_the_cli_draws_gaze_as_an_arrow_from_the_eye(triton_server, tmp_path):
    out = tmp_path / "gaze.png"
    run = subprocess.run([sys.executable, "-m", "client", "gaze", "--url", triton_server["grpc"], "--image",
                          str(TINY / EYE["image"]), "--eye", ",".join(map(str, EYE["eye"])), "--draw", str(out)],
                         capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=120)
    assert run.returncode == 0, run.stderr
    gaze = json.loads(run.stdout)["gaze"]
    picture = Image.open(out).convert("RGB")
    w, h = picture.size
    assert picture.getpixel((min(int(gaze["x"] * w), w - 1), min(int(gaze["y"] * h), h - 1))) == GAZE


def test_gaze_is_refused_on_moondream_3():
    eng = InferenceEngine.create(RuntimeConfig(model_path=str(TINY.parent / "md3-tiny"), device="cpu",
                                               dtype="float32"))
    try:
        import asyncio

        with pytest.raises(InvalidRequest, match="gaze is not supported by Moondream 3.*needs Moondream 2"):
            asyncio.run(eng.gaze((TINY / EYE["image"]).read_bytes(), [EYE["eye"]]))
    finally:
        eng.shutdown()
