"""One line of a batch job: its request (the cloud's line format) as a call of the moondream model, and its answer or
error as the line of the results file.

    {"id": "img_001", "skill": "caption", "image": "<base64>", "length": "short"}
    {"id": 7, "skill": "query", "images": ["<base64>", "<base64>"], "question": "What differs?"}
    {"skill": "chat", "messages": [...OpenAI-style, images as image_url parts...], "max_tokens": 64}

Every skill of the table (skills/catalog.py) is taken; query's `images` (several) is asked through the chat skill,
which places a conversation's images. Lines are sent with priority batch: the engine admits every interactive
request first.
"""

from __future__ import annotations

from ...skills.catalog import SKILLS
from .. import moondream_api, openai_chat
from ..errors import ApiError
from ..moondream_api import Call
from ..payloads import Limits, known_fields, settings_field, text_field, with_model

PRIORITY = "batch"


class LineError(Exception):
    """A line's error, with the cloud's code: invalid_request, image_decode_failed, unknown_skill, processing_error."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


async def line_call(line: dict, model: str, limits: Limits, served: list[str]) -> Call:
    skill_name = line.get("skill")
    if not isinstance(skill_name, str) or skill_name not in SKILLS:
        raise LineError("unknown_skill", f"skill must be one of {', '.join(SKILLS)}")
    try:
        if skill_name == "chat" or (skill_name == "query" and "images" in line):
            return await _conversation(line, model, limits, served)
        return await _single(SKILLS[skill_name], line, model, limits, served)
    except ApiError as e:
        raise LineError("image_decode_failed" if e.status == 400 and _about_an_image(e.message) else
                        "invalid_request", e.message) from None


async def _single(spec, line: dict, model: str, limits: Limits, served: list[str]) -> Call:
    known_fields(line, {"id", "skill", "image", "settings", "spatial_refs", spec.text} |
                 ({"reasoning"} if spec.reasoning else set()))
    settings = _batch(with_model({"model": model}, settings_field(line), served))
    return await moondream_api.skill_call(spec, line, settings, limits, "image",
                                          reasoning_default=True)  # (the cloud's batch reasons by default)


async def _conversation(line: dict, model: str, limits: Limits, served: list[str]) -> Call:
    if line["skill"] == "query":  # several images: one user turn holding them and the question
        known_fields(line, {"id", "skill", "images", "question", "reasoning", "settings"})
        images, question = line.get("images"), text_field(line, "question", limits, required=True)
        if not isinstance(images, list) or not images:
            raise ApiError(400, "images must be a non-empty list of base64 images")
        body = {"messages": [{"role": "user", "content": [
            *({"type": "image_url", "image_url": image} for image in images), {"type": "text", "text": question}]}],
            "reasoning": line.get("reasoning", True), **_settings_as_openai(line)}
    else:
        known_fields(line, {"id", "skill", "messages", "reasoning", "temperature", "top_p", "seed", "max_tokens",
                            "max_completion_tokens"})
        body = {k: v for k, v in line.items() if k not in ("id", "skill")}
    call, _ = await openai_chat.parse({**body, "model": model}, limits, served, priority=PRIORITY)
    return call


def _settings_as_openai(line: dict) -> dict:
    settings = settings_field(line) or {}
    return {k: settings[k] for k in ("temperature", "top_p", "seed", "max_tokens") if k in settings}


def _batch(settings: dict | None) -> dict:
    return {**(settings or {}), "priority": PRIORITY}


def _about_an_image(message: str) -> bool:
    """The gateway's and the engine's image refusals name the image first (images.py, payloads.image_field)."""
    return message.startswith(("image", "IMAGE")) and "is required" not in message or "image_url" in message


def ok_line(index: int, line_id, skill: str, called: str, body: dict) -> dict:
    """skill: the line's; called: the skill that answered it (chat, for a query of several images)."""
    result = {k: v for k, v in moondream_api.result(called, body).items()
              if k not in ("request_id", "finish_reason", "metrics")}
    if skill != called:  # a query's answer, however it was asked
        message = result.pop("message", {})
        result = {"answer": message.get("content", "")} | ({"reasoning": message["reasoning"]}
                                                            if message.get("reasoning") else {})
    metrics = body.get("metrics") or {}
    return {"line_index": index, "id": line_id, "status": "ok", "result": result,
            "usage": {"input_tokens": metrics.get("input_tokens", 0), "output_tokens": metrics.get("output_tokens", 0)}}


def error_line(index: int, line_id, code: str, message: str) -> dict:
    return {"line_index": index, "id": line_id, "status": "error", "error": {"code": code, "message": message}}


def failed_call(e: ApiError) -> LineError | None:
    """The engine's answer to a line as its error; None when the line should run again later (every replica was
    full or stopping: nothing about the line itself)."""
    if e.status in (429, 503):
        return None
    if e.status in (400, 404, 413):
        return LineError("image_decode_failed" if e.message.startswith("IMAGE") else "invalid_request", e.message)
    return LineError("processing_error", e.message)
