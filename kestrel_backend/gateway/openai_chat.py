"""OpenAI's Chat Completions (`POST /v1/chat/completions`), served by the moondream model's chat skill.

Images come as `image_url` parts (data URLs or base64; http(s) links where the operator allows them); the gateway
sends their bytes as IMAGE and the part as an index into it. The assistant's message carries `reasoning` and
`reasoning_details` where the model reasoned (on by default, as Kestrel's chat), as the official client reads them.
"""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from client import build_inputs
from .errors import ApiError
from .moondream_api import Call, sse
from .payloads import Limits, check_text_length, counting_reasoning, flag, image_field, routing_key, with_model

# a conversation's images, counted before any is decoded or fetched: more than any served model's context holds
# (Moondream 2's takes two, Moondream 3's five); the engine refuses what its context does not hold
MAX_IMAGES = 16


async def parse(body: dict, limits: Limits, served: list[str], priority: str | None = None) -> tuple[Call, str]:
    """-> (the call, the model name to answer with). priority: the engine's (settings.py; the Batch API's lines)."""
    model = body.get("model") or served[0]
    settings = counting_reasoning(with_model({"model": model}, _settings(body), served))
    if priority is not None:
        settings = {**(settings or {}), "priority": priority}
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list")
    if (count := _image_parts(messages)) > MAX_IMAGES:
        raise ApiError(400, f"messages hold {count} images; a conversation takes at most {MAX_IMAGES}")
    images: list[bytes] = []
    messages = [await _message(i, m, images, limits) for i, m in enumerate(messages)]
    check_text_length(sum(map(_text_chars, messages)), "messages' text", limits)
    if body.get("n", 1) != 1:
        raise ApiError(400, "n: one choice a request is served")
    stream = bool(flag(body, "stream"))
    inputs = build_inputs("chat", image=images or None, messages=messages, stream=stream,
                          reasoning=_reasoning(body.get("reasoning")), settings=settings)
    return Call("chat", inputs, routing_key(images[0] if images else None, settings), stream), model


def _image_parts(messages: list) -> int:
    return sum(_is_image(part) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
               for part in m["content"])


def _is_image(part) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


def _settings(body: dict) -> dict | None:
    settings = {}
    for key, name in (("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed"),
                      ("max_tokens", "max_completion_tokens"), ("max_tokens", "max_tokens")):
        if body.get(name) is not None and key not in settings:
            settings[key] = body[name]
    return settings or None


def _reasoning(value) -> bool | None:
    """`reasoning`: true / false, or OpenRouter's object form ({"enabled": ...}, or an effort, meaning on)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, dict):
        return bool(value.get("enabled", True))
    raise ApiError(400, "reasoning must be true, false or an object")


async def _message(i: int, m, images: list[bytes], limits: Limits):
    """The message with its image parts' bytes moved into `images` (the part becomes an index into them)."""
    if not isinstance(m, dict) or not isinstance(m.get("content"), (str, list, type(None))):
        raise ApiError(400, f"messages[{i}] must be an object with a role and text or a list of parts as content")
    if not isinstance(m.get("content"), list):
        return m
    parts = []
    for j, part in enumerate(m["content"]):
        if _is_image(part):
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            images.append(await image_field(url, limits, f"messages[{i}].content[{j}].image_url"))
            part = {"type": "image", "index": len(images) - 1}
        parts.append(part)
    return {**m, "content": parts}


def _text_chars(message: dict) -> int:
    content = message.get("content")
    if isinstance(content, str):
        return len(content)
    return sum(len(p["text"]) for p in content or () if isinstance(p, dict) and isinstance(p.get("text"), str))


def include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, "stream_options must be an object, its include_usage true or false")
    return bool(options.get("include_usage"))


def completion_id() -> str:
    """Each completion's own id (the request's id on the server is not in every streamed body)."""
    return f"chatcmpl-{uuid.uuid4().hex}"


def completion(body: dict, model: str) -> dict:
    m = body["metrics"]
    return {"id": completion_id(), "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": body["message"], "finish_reason":
                                         body["finish_reason"], "logprobs": None}], "usage": usage(m)}


def usage(metrics: dict) -> dict:
    return {"prompt_tokens": metrics["input_tokens"], "completion_tokens": metrics["output_tokens"],
            "total_tokens": metrics["input_tokens"] + metrics["output_tokens"],
            "prompt_tokens_details": {"cached_tokens": metrics.get("cached_tokens", 0)}}


def events(bodies, model: str, include_usage: bool) -> AsyncIterator[str]:
    """chat.completion.chunk events: the role, the answer's pieces as they come, the finish reason (with the
    reasoning, which is not streamed), usage if asked, then [DONE]."""
    async def gen():
        created, chunk_id, started = int(time.time()), completion_id(), False

        def chunk(delta: dict, finish=None, **extra) -> str:
            return sse({"id": chunk_id, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra})
        try:
            async for body in bodies:
                if not started:
                    started = True
                    yield chunk({"role": "assistant", "content": ""})
                if body.get("chunk"):
                    yield chunk({"content": body["chunk"]})
                if body.get("completed"):
                    message = body["message"]
                    extra = {k: message[k] for k in ("reasoning", "reasoning_details") if k in message}
                    yield chunk(extra, body["finish_reason"])
                    if include_usage:
                        yield sse({"id": chunk_id, "object": "chat.completion.chunk", "created": created,
                                   "model": model, "choices": [], "usage": usage(body["metrics"])})
        finally:
            await bodies.aclose()  # (cancels the call when the client went away)
        yield sse("[DONE]")
    return gen()
