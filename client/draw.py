"""A skill's answer drawn on its image (`python -m client detect|point|segment|gaze ... --draw out.png`): boxes
outlined, points as dots, a segment's outline filled translucent, gaze as an arrow from the eye; coordinates in
[0, 1] of the image, as the answers give them."""

from __future__ import annotations

import io

from PIL import Image, ImageDraw

BOX, POINT, MASK = (47, 111, 222), (232, 69, 60), (232, 69, 60, 120)
DRAWN = ("detect", "point", "segment", "gaze")
GAZE = (242, 180, 0)


def draw(image: bytes, skill: str, body: dict) -> Image.Image:
    picture = Image.open(io.BytesIO(image)).convert("RGB")
    w, h = picture.size
    pen = ImageDraw.Draw(picture)
    line = max(2, round(min(w, h) / 200))
    for b in body.get("objects", []):
        pen.rectangle([b["x_min"] * w, b["y_min"] * h, b["x_max"] * w, b["y_max"] * h], outline=BOX, width=line)
    for p in body.get("points", []):
        r = 3 * line
        pen.ellipse([p["x"] * w - r, p["y"] * h - r, p["x"] * w + r, p["y"] * h + r], fill=POINT,
                    outline=(255, 255, 255), width=max(1, line // 2))
    if skill == "gaze" and body.get("gaze") and body.get("from"):  # (from: the eye, or the face box's centre)
        (ex, ey), g = body["from"], body["gaze"]
        pen.line([ex * w, ey * h, g["x"] * w, g["y"] * h], fill=GAZE, width=line)
        r = 3 * line
        pen.ellipse([g["x"] * w - r, g["y"] * h - r, g["x"] * w + r, g["y"] * h + r], fill=GAZE)
    for segment in body.get("segments", []):
        if segment.get("svg_path") and segment.get("bbox"):
            from kestrel_backend.skills.segment_masks import path_mask  # (resvg: the server's own renderer)

            mask = Image.fromarray(path_mask(segment["svg_path"], segment["bbox"], w, h) * MASK[3])
            picture.paste(Image.new("RGB", picture.size, MASK[:3]), mask=mask)
    return picture
