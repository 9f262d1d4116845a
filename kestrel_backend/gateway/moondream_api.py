"""The Moondream API (what the official `moondream` client and Kestrel's HTTP server speak): /v1/query, /v1/caption,
/v1/detect, /v1/point, /v1/segment. Each request becomes one call of the moondream model; streamed answers are
Server-Sent Events `data: {"chunk", "completed": false, ...}`, the last one the whole result with
`"completed": true`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import AsyncIterator

from client import build_inputs
from ..skills.catalog import SKILLS
from .errors import ApiError
from .payloads import (Limits, counting_reasoning, flag, image_field, known_fields, routing_key, settings_field,
                       text_field, with_model)

COMMON_FIELDS = {"image_url", "stream", "model", "variant", "settings", "spatial_refs"}
ENDPOINTS = [s for s in SKILLS.values() if s.api_endpoint]  # /v1/<name>
FIELDS = {s.name: COMMON_FIELDS | {s.text} | ({"reasoning"} if s.reasoning else set()) for s in ENDPOINTS}


@dataclass
class Call:
    """One request for the moondream model."""

    skill: str
    inputs: list
    key: str | None  # the replica routing key
    stream: bool  # answered as server-sent events


async def parse(skill: str, body: dict, limits: Limits, served: list[str]) -> Call:
    spec = SKILLS[skill]
    known_fields(body, FIELDS[skill])
    stream = bool(flag(body, "stream")) and spec.api_streams
    return await skill_call(spec, body, with_model(body, settings_field(body), served), limits, "image_url",
                            stream=stream, triton_stream=stream and spec.streams)  # (segment's events: from its result)


async def skill_call(spec, body: dict, settings: dict | None, limits: Limits, image_key: str,
                     reasoning_default: bool | None = None, stream: bool = False, triton_stream: bool = False) -> Call:
    """A skill's call from a body whose fields are already checked: the image (under image_key), the skill's text,
    reasoning (reasoning_default where the body has none; None: the skill's), spatial_refs. Also a batch line's."""
    image = None
    if spec.image == "required" or body.get(image_key) is not None:
        if body.get(image_key) is None:
            raise ApiError(400, f"{image_key} is required")
        image = await image_field(body[image_key], limits, image_key)
    kw = dict(image=image, settings=settings)
    text = text_field(body, spec.text, limits, required=spec.text_required)
    if text is not None:
        kw[spec.text] = text
    if spec.reasoning:
        reasoning = flag(body, "reasoning")
        kw.update(reasoning=reasoning_default if reasoning is None else reasoning,
                  settings=counting_reasoning(settings))
    refs = spatial_refs_field(body)
    if refs is not None:
        kw["spatial_refs"] = refs
    return Call(spec.name, build_inputs(spec.name, stream=triton_stream, **kw), routing_key(image, settings), stream)


def spatial_refs_field(body: dict) -> list | None:
    """`spatial_refs`: [x, y] points or [x_min, y_min, x_max, y_max] boxes, not a mix (None: none given)."""
    refs = body.get("spatial_refs")
    if refs is None:
        return None
    if not isinstance(refs, list) or not all(isinstance(r, list) and len(r) in (2, 4) and
                                             all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in r)
                                             for r in refs):
        raise ApiError(400, "spatial_refs must be a list of [x, y] points or [x_min, y_min, x_max, y_max] boxes")
    if len({len(r) for r in refs}) > 1:
        raise ApiError(400, "spatial_refs must be all points or all boxes, not a mix")
    return refs or None


GAZE_FIELDS = {"image_url", "eye", "face", "model", "variant", "settings"}


async def parse_gaze(body: dict, limits: Limits, served: list[str]) -> Call:
    """POST /v1/gaze (ours: the cloud API has no gaze): `image_url` and `eye` {x, y}, or `face` {x_min, y_min,
    x_max, y_max} for the more accurate form; `settings.seed` draws that form's eye points."""
    known_fields(body, GAZE_FIELDS)
    settings = with_model(body, settings_field(body), served)
    if body.get("image_url") is None:
        raise ApiError(400, "image_url is required")
    image = await image_field(body["image_url"], limits)
    if (body.get("eye") is None) == (body.get("face") is None):
        raise ApiError(400, "send one of eye {x, y} (a point on the person's eye) or face {x_min, y_min, x_max, y_max}")
    keys = ("x", "y") if body.get("eye") is not None else ("x_min", "y_min", "x_max", "y_max")
    where = body.get("eye") if body.get("eye") is not None else body["face"]
    if not isinstance(where, dict) or set(where) != set(keys) or not all(
            isinstance(where[k], (int, float)) and not isinstance(where[k], bool) for k in keys):
        raise ApiError(400, f"{'eye' if len(keys) == 2 else 'face'} must be an object of the numbers "
                            f"{', '.join(keys)} in [0, 1]")
    inputs = build_inputs("gaze", image=image, settings=settings, spatial_refs=[[where[k] for k in keys]])
    return Call("gaze", inputs, routing_key(image, settings), False)


def result(skill: str, body: dict) -> dict:
    """The model's final body as the API answers it (segment: the first outline's path and box)."""
    body = {k: v for k, v in body.items() if k not in ("chunk", "completed", "token_index")}
    if skill != "segment":
        return body
    segment = (body.get("segments") or [{}])[0]
    out = {"request_id": body["request_id"], "finish_reason": body["finish_reason"],
           "path": segment.get("svg_path", ""), "bbox": segment.get("bbox"), "metrics": body["metrics"]}
    if segment.get("parse_error"):
        out["parse_error"] = segment["parse_error"]
    return out


def events(skill: str, bodies) -> AsyncIterator[str]:
    """Server-sent events of a streamed call: the model's chunks as they come (segment: its box, its path, then the
    result, as Kestrel's server streams them)."""
    async def gen():
        try:
            async for body in bodies:
                if skill != "segment":
                    yield sse(body)
                    continue
                final = result(skill, body)
                if final.get("bbox"):
                    yield sse({"type": "bbox", "bbox": final["bbox"]})
                if final["path"]:
                    yield sse({"type": "path_delta", "chunk": final["path"], "completed": False})
                yield sse({"type": "final", "chunk": "", "completed": True, **final})
        finally:
            await bodies.aclose()  # (cancels the call when the client went away)
    return gen()


def sse(data) -> str:
    return f"data: {json.dumps(data) if not isinstance(data, str) else data}\n\n"
