"""`python -m client ... --draw`: the answer drawn on the image, by the CLI against a real tritonserver (detect,
point), and a segment's outline from its SVG path and box."""

import io
import json
import subprocess
import sys
from pathlib import Path

from conftest import TINY
from PIL import Image

from client.draw import BOX, POINT, draw

IMAGE = TINY / "images" / "medium.png"


def _drawn(triton_server, tmp_path, skill: str) -> tuple[dict, Image.Image]:
    out = tmp_path / f"{skill}.png"
    run = subprocess.run([sys.executable, "-m", "client", skill, "--url", triton_server["grpc"], "--image", str(IMAGE),
                          "--object", "face", "--settings", '{"max_objects": 3}', "--draw", str(out)],
                         capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=120)
    assert run.returncode == 0, run.stderr
    picture = Image.open(out).convert("RGB")
    assert picture.size == Image.open(IMAGE).size
    return json.loads(run.stdout), picture


def test_detect_draws_a_box_for_each_object(triton_server, tmp_path):
    body, picture = _drawn(triton_server, tmp_path, "detect")
    w, h = picture.size
    inside = [b for b in body["objects"] if 0 <= b["x_min"] < b["x_max"] <= 1 and 0 <= b["y_min"] < b["y_max"] <= 1]
    assert inside
    for b in inside:  # each box's left edge, halfway down, is the box colour
        assert picture.getpixel((int(b["x_min"] * w) + 1, int((b["y_min"] + b["y_max"]) / 2 * h))) == BOX


def test_point_draws_a_dot_at_each_point(triton_server, tmp_path):
    body, picture = _drawn(triton_server, tmp_path, "point")
    w, h = picture.size
    assert body["points"]
    for p in body["points"]:
        assert picture.getpixel((min(int(p["x"] * w), w - 1), min(int(p["y"] * h), h - 1))) == POINT


def test_a_segment_outline_is_filled_inside_its_box_only():
    white = io.BytesIO()
    Image.new("RGB", (200, 100), (255, 255, 255)).save(white, "PNG")
    body = {"segments": [{"svg_path": "M 0 0 L 1 0 L 1 1 L 0 1 Z",
                          "bbox": {"x_min": 0.25, "y_min": 0.2, "x_max": 0.75, "y_max": 0.8}}]}
    picture = draw(white.getvalue(), "segment", body)
    centre, corner = picture.getpixel((100, 50)), picture.getpixel((10, 10))
    assert corner == (255, 255, 255) and centre[0] > centre[1] + 60  # (red laid over white inside the outline)


def test_draw_is_refused_where_there_is_nothing_to_draw():
    run = subprocess.run([sys.executable, "-m", "client", "caption", "--image", str(IMAGE), "--draw", "x.png"],
                         capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert run.returncode == 2 and "--draw takes detect, point, segment" in run.stderr
