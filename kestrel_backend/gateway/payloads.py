"""What every endpoint reads from a request: its JSON body (size-limited), images (data URLs, base64, and http(s)
links where the operator allows them), the model name (and the adapter it may name), settings."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from starlette.requests import Request

from ..data_urls import image_bytes
from ..errors import InvalidRequest, shown
from .errors import ApiError


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 32 * 1024 * 1024
    max_image_bytes: int = 20 * 1024 * 1024
    fetch_image_urls: bool = False  # http(s) image links: fetched by the gateway only when the operator says so
    fetch_timeout_s: float = 10.0


async def json_body(request: Request, limits: Limits) -> dict:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise ApiError(413, f"the request body is {declared} bytes, over the {limits.max_body_bytes} byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise ApiError(413, f"the request body is over the {limits.max_body_bytes} byte limit")
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {getattr(e, 'msg', e)}") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def text_field(body: dict, name: str, required: bool = False) -> str | None:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value.strip()):
        raise ApiError(400, f"{name} is required and must be a non-empty string" if required else
                       f"{name} must be a string")
    return value


def flag(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false")
    return value


async def image_field(value, limits: Limits, name: str = "image_url") -> bytes:
    """A data URL or base64 text -> the image's bytes; an http(s) link fetched where allowed; nothing else."""
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{name} must be a data URL (data:image/jpeg;base64,...) or base64 text")
    if value.startswith(("http://", "https://")):
        data = await _fetch(value, limits, name)
    elif "://" in value[:16]:
        raise ApiError(400, f"{name}: only data URLs, base64 and (where enabled) http(s) links are taken, "
                            f"not {value[:16]!r}...")
    else:
        try:
            data = image_bytes(value.encode(), name)
        except InvalidRequest as e:
            raise ApiError(400, str(e)) from None
    if len(data) > limits.max_image_bytes:
        raise ApiError(413, f"{name} is {len(data)} bytes, over the {limits.max_image_bytes} byte limit")
    return data


async def _fetch(url: str, limits: Limits, name: str) -> bytes:
    if not limits.fetch_image_urls:
        raise ApiError(400, f"{name}: http(s) image links are not fetched by this server (its operator can enable "
                            "them with --fetch-image-urls); send the image as a data URL")
    import httpx

    try:
        async with httpx.AsyncClient(timeout=limits.fetch_timeout_s, follow_redirects=True) as http:
            async with http.stream("GET", url) as response:
                response.raise_for_status()
                data = b""
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > limits.max_image_bytes:
                        raise ApiError(413, f"{name}: the image at the link is over the {limits.max_image_bytes} "
                                            "byte limit")
                return data
    except httpx.HTTPError as e:
        raise ApiError(400, f"{name}: the image could not be fetched: {e}") from None


def settings_field(body: dict) -> dict | None:
    settings = body.get("settings")
    if settings is not None and not isinstance(settings, dict):
        raise ApiError(400, "settings must be a JSON object")
    return settings


def with_model(body: dict, settings: dict | None, served: list[str]) -> dict | None:
    """`model`: a served model's name, or `<name>/<adapter id>` (the names the official fine-tuning client gives,
    e.g. moondream3-preview/<finetune_id>@<step>), which selects that adapter."""
    model = body.get("model")
    if model is None:
        return settings
    if not isinstance(model, str):
        raise ApiError(400, "model must be a string")
    name, _, adapter = model.partition("/")
    if name not in served or (_ and not adapter):
        raise ApiError(404, f"model {shown(model)} is not served here; served: {', '.join(served)} (an adapter as "
                            f"<model>/<adapter id>)")
    if adapter:
        settings = dict(settings or {})
        if settings.get("adapter", adapter) != adapter:
            raise ApiError(400, "model names one adapter and settings.adapter another; send one of them")
        settings["adapter"] = adapter
    return settings


def routing_key(image: bytes | None, settings: dict | None) -> str | None:
    """What a replica's caches depend on: the image, and the adapter (the KV of an image's prefix differs by
    adapter)."""
    if image is None:
        return None
    digest = hashlib.sha256(image).hexdigest()
    adapter = (settings or {}).get("adapter")
    return f"{digest}+{adapter}" if adapter else digest
