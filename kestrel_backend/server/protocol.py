"""Wire format of the `moondream` model: request tensors in, JSON TEXT_OUTPUT bodies out (README's table of inputs,
docs/architecture.md's "Wire format")."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..data_urls import image_bytes
from ..errors import InvalidRequest, shown
from ..runtime.sequence import EngineResult
from ..skills.catalog import SKILLS
from ..skills.chat import ChatMessage, parse_messages

# JSON objects MESSAGES may hold (messages and their parts): counted in its bytes before it is parsed, since parsing
# a million parts holds the GIL, and so every request, for seconds
MAX_MESSAGE_OBJECTS = 4096


@dataclass(frozen=True)
class WireRequest:
    skill: str
    image: bytes | None
    question: str | None
    object: str | None
    length: str
    stream: bool
    reasoning: bool | None  # None: not sent (the skill's default)
    settings: dict | None
    spatial_refs: list[tuple[float, ...]] | None = None
    messages: list[ChatMessage] | None = None  # chat


def _one(name: str, arr: np.ndarray):
    if arr.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one element, got shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def _bytes_tensor(name: str, arr: np.ndarray) -> np.ndarray:
    if arr.dtype != np.object_:
        raise InvalidRequest(f"{name} must be a BYTES tensor, got {arr.dtype}")
    return arr


def _element_bytes(name: str, value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if not isinstance(value, (bytes, bytearray)):
        raise InvalidRequest(f"{name} must hold bytes")
    return bytes(value)


def _bytes(name: str, arr: np.ndarray | None) -> bytes | None:
    if arr is None:
        return None
    return _element_bytes(name, _one(name, _bytes_tensor(name, arr)))


def _images(arr: np.ndarray | None) -> list[bytes]:
    """IMAGE's elements (one; the chat skill takes several, its messages naming them by index), each encoded image
    bytes, a data URL or base64."""
    if arr is None:
        return []
    values = _bytes_tensor("IMAGE", arr).reshape(-1)
    names = [f"IMAGE[{i}]" for i in range(len(values))] if len(values) > 1 else ["IMAGE"]
    images = [image_bytes(_element_bytes(name, value), name) for name, value in zip(names, values)]
    if len(images) > 1 and not all(images):  # (messages name images by position: none may drop out)
        raise InvalidRequest(f"{names[images.index(b'')]} is empty")
    return images


def _text(name: str, arr: np.ndarray | None, max_bytes: int | None = None) -> str | None:
    """max_bytes: refused undecoded when longer (the engine bounds text by what its context can hold)."""
    raw = _bytes(name, arr)
    if raw is None:
        return None
    if max_bytes is not None and len(raw) > max_bytes:
        raise InvalidRequest(f"{name} is too long: {len(raw)} bytes, more than the model's context can hold")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest(f"{name} is not valid UTF-8 text") from None


def _json(name: str, arr: np.ndarray | None, max_objects: int | None = None):
    """A JSON input's value (None when absent); max_objects: refused unparsed if it could hold more objects."""
    text = _text(name, arr)
    if text is None:
        return None
    if max_objects is not None and text.count("{") > max_objects:
        raise InvalidRequest(f"{name} holds more than {max_objects} objects (messages and their parts)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"{name} is not valid JSON: {e.msg}") from None
    except RecursionError:
        raise InvalidRequest(f"{name} is nested too deeply") from None


def _flag(name: str, arr: np.ndarray | None) -> bool | None:
    if arr is None:
        return None
    if arr.dtype != np.bool_:
        raise InvalidRequest(f"{name} must be a BOOL tensor, got {arr.dtype}")
    return bool(_one(name, arr))


# Kestrel's own Triton tensors, accepted beside SETTINGS for drop-in compatibility: input -> (key, dtype)
KESTREL_SETTING_TENSORS = {"TEMPERATURE": ("temperature", np.float32), "TOP_P": ("top_p", np.float32),
                           "MAX_TOKENS": ("max_tokens", np.int32), "MAX_OBJECTS": ("max_objects", np.int32)}


def _merge_setting_tensors(get, settings: dict | None) -> dict | None:
    for name, (key, dtype) in KESTREL_SETTING_TENSORS.items():
        arr = get(name)
        if arr is None:
            continue
        if arr.dtype != dtype:
            raise InvalidRequest(f"{name} must be a {np.dtype(dtype).name.upper()} tensor, got {arr.dtype}")
        settings = dict(settings or {})
        if key in settings:
            raise InvalidRequest(f"{name} and SETTINGS.{key} both given; send one of them")
        value = _one(name, arr)
        settings[key] = float(value) if dtype == np.float32 else int(value)
    return settings


def _spatial_refs(arr: np.ndarray | None) -> list[tuple[float, ...]] | None:
    """SPATIAL_REFS: rows of (x, y) points or (x_min, y_min, x_max, y_max) boxes. The tensor's type and shape are
    checked here; the values, as for every caller, by the engine's query."""
    if arr is None or arr.size == 0:  # (Kestrel's backend also reads an empty tensor as none)
        return None
    if arr.dtype != np.float32:
        raise InvalidRequest(f"SPATIAL_REFS must be an FP32 tensor, got {arr.dtype}")
    if arr.ndim != 2 or arr.shape[1] not in (2, 4):
        raise InvalidRequest(f"SPATIAL_REFS must have shape [N, 2] (points) or [N, 4] (boxes), got {list(arr.shape)}")
    return [tuple(float(v) for v in row) for row in arr]


def parse_request(get: Callable[[str], np.ndarray | None], max_text_bytes: int | None = None) -> WireRequest:
    """`get(name)` returns an input as numpy (None when absent). Raises InvalidRequest naming the input.
    max_text_bytes: QUESTION and OBJECT longer than this are refused before they are decoded."""
    skill = _text("SKILL", get("SKILL"))
    if skill is None:
        raise InvalidRequest("SKILL is required")
    if skill not in SKILLS:
        raise InvalidRequest(f"SKILL must be one of {', '.join(SKILLS)}; got {shown(skill)}")
    spec = SKILLS[skill]
    settings = _json("SETTINGS", get("SETTINGS"))
    if settings is not None and not isinstance(settings, dict):
        raise InvalidRequest("SETTINGS must be a JSON object")
    settings = _merge_setting_tensors(get, settings)
    spatial_refs = _spatial_refs(get("SPATIAL_REFS"))
    if spatial_refs is not None and not spec.spatial_refs:
        raise InvalidRequest(f"SPATIAL_REFS is only taken by the {_taking('spatial_refs')} skill, not {skill}")
    images = _images(get("IMAGE"))
    if len(images) > 1 and spec.image != "many":
        raise InvalidRequest(f"IMAGE holds {len(images)} images; only the {_taking('image', 'many')} skill takes "
                             "more than one")
    image = images[0] if images else None
    messages = _json("MESSAGES", get("MESSAGES"), MAX_MESSAGE_OBJECTS)
    if spec.text == "messages":
        if messages is None:
            raise InvalidRequest(f"MESSAGES is required for SKILL {skill}")
        messages = parse_messages(messages, [i for i in images if i])
    elif messages is not None:
        raise InvalidRequest(f"MESSAGES is only taken by the {_taking('text', 'messages')} skill, not {skill}")
    return WireRequest(
        skill=skill,
        image=image,
        question=_text("QUESTION", get("QUESTION"), max_text_bytes),
        object=_text("OBJECT", get("OBJECT"), max_text_bytes),
        length=_text("LENGTH", get("LENGTH")) or "normal",
        stream=bool(_flag("STREAM", get("STREAM"))),
        reasoning=_flag("REASONING", get("REASONING")),
        settings=settings,
        spatial_refs=spatial_refs,
        messages=messages,
    )


def _taking(field: str, value=True) -> str:
    """The skills whose entry has field == value, for a message."""
    return " and ".join(s.name for s in SKILLS.values() if getattr(s, field) == value)


def result_body(request_id: str, result: EngineResult) -> dict:
    return {"request_id": request_id, "finish_reason": result.finish_reason, **result.output, "metrics": result.metrics}


def chunk_body(text: str, token_index: int) -> dict:
    return {"chunk": text, "completed": False, "token_index": token_index}


def final_stream_body(request_id: str, result: EngineResult, remainder: str) -> dict:
    return {**result_body(request_id, result), "chunk": remainder, "completed": True}
