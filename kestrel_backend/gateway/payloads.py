"""What every endpoint reads from a request: its JSON body (size-limited), images (data URLs, base64, and http(s)
links where the operator allows them), the model name (and the adapter it may name), settings."""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass, field

from starlette.requests import Request

from ..data_urls import image_bytes
from ..errors import InvalidRequest, shown
from .errors import ApiError
from .fetch import LinkFetcher


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 32 * 1024 * 1024
    max_image_bytes: int = 20 * 1024 * 1024
    fetch_image_urls: bool = False  # http(s) image links: fetched by the gateway only when the operator says so
    fetch_timeout_s: float = 10.0  # the whole fetch of a link, redirects included
    fetch_allow: tuple[str, ...] = ()  # networks links may reach although not public (e.g. "10.0.0.0/8")
    body_timeout_s: float = 30.0  # the whole request body must arrive within this
    # Text longer than this is refused here, before it is sent on: no served model's context holds it (128 characters
    # a token over Moondream 3's 32,768), and sending it on would cost every request on this gateway the upload's
    # time. (The engine refuses by its own model's limit, which is smaller.)
    max_text_chars: int = 4 * 2**20
    fetcher: LinkFetcher = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "fetcher", LinkFetcher(self.max_image_bytes, self.fetch_timeout_s, self.fetch_allow))


async def json_body(request: Request, limits: Limits) -> dict:
    """The request's JSON object: its size bounded, its arrival within body_timeout_s, no lone surrogate in any of
    its strings (JSON may escape one; it is not text, and nothing downstream could encode it)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise ApiError(413, f"the request body is {declared} bytes, over the {limits.max_body_bytes} byte limit")
    try:
        chunks = await asyncio.wait_for(_read_body(request, limits.max_body_bytes), limits.body_timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s") from None
    try:
        body = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {getattr(e, 'msg', e)}") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        _refuse_surrogates(body, "body")
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    return body


async def _read_body(request: Request, max_bytes: int) -> list[bytes]:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"the request body is over the {max_bytes} byte limit")
        chunks.append(chunk)
    return chunks


def _refuse_surrogates(value, where: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, f"{where} holds a lone UTF-16 surrogate (an escape like \\ud800 without its pair), "
                                "which is not text") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _refuse_surrogates(k, where)
            _refuse_surrogates(v, f"{where}.{shown(k, 40)}" if where != "body" else shown(k, 40))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _refuse_surrogates(v, f"{where}[{i}]")


def known_fields(body: dict, allowed: set[str]) -> None:
    """A field the endpoint does not take is refused, naming it: a typo must not pass for a default."""
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, f"unknown field(s) {', '.join(shown(u, 40) for u in unknown)}; this endpoint takes "
                            f"{', '.join(sorted(allowed))}")


def text_field(body: dict, name: str, limits: Limits, required: bool = False) -> str | None:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value.strip()):
        raise ApiError(400, f"{name} is required and must be a non-empty string" if required else
                       f"{name} must be a string")
    check_text_length(len(value), name, limits)
    return value


def check_text_length(chars: int, name: str, limits: Limits) -> None:
    if chars > limits.max_text_chars:
        raise ApiError(400, f"{name} is too long: {chars} characters, more than any served model's context can hold "
                            f"({limits.max_text_chars}, --max-text-chars)")


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
        if not limits.fetch_image_urls:
            raise ApiError(400, f"{name}: http(s) image links are not fetched by this server (its operator can "
                                "enable them with --fetch-image-urls); send the image as a data URL")
        data = await limits.fetcher.fetch(value, name)
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


def settings_field(body: dict) -> dict | None:
    settings = body.get("settings")
    if settings is not None and not isinstance(settings, dict):
        raise ApiError(400, "settings must be a JSON object")
    return settings


def with_model(body: dict, settings: dict | None, served: list[str]) -> dict | None:
    """`model`: a served model's name, or `<name>/<adapter id>` (the names the official fine-tuning client gives,
    e.g. moondream3-preview/<finetune_id>@<step>), which selects that adapter; a top-level `variant` (the official
    Node client's) selects one too, as settings.variant does. Two of them naming different adapters: 400."""
    settings = _with_variant(body, settings)
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
        named = settings.get("adapter", settings.get("variant", adapter))
        if named != adapter:
            raise ApiError(400, f"model names adapter {shown(adapter, 40)} and variant or settings another "
                                f"({shown(named, 40)}); send one of them")
        settings.pop("variant", None)
        settings["adapter"] = adapter
    return settings


def _with_variant(body: dict, settings: dict | None) -> dict | None:
    variant = body.get("variant")
    if variant is None:
        return settings
    if not isinstance(variant, str) or not variant:
        raise ApiError(400, "variant must be an adapter id (a non-empty string)")
    settings = dict(settings or {})
    named = settings.get("adapter", settings.get("variant", variant))
    if named != variant:
        raise ApiError(400, f"variant {shown(variant, 40)} and settings' {shown(named, 40)} name different adapters; "
                            "send one of them")
    settings.pop("adapter", None)
    settings["variant"] = variant
    return settings


def counting_reasoning(settings: dict | None) -> dict | None:
    """The API's max_tokens bounds what the caller gets, reasoning included (as the cloud counts it): sent to the
    engine as max_total_tokens too (its max_tokens alone bounds reasoning and answer each, as the reference does)."""
    if settings and settings.get("max_tokens") is not None and "max_total_tokens" not in settings:
        return {**settings, "max_total_tokens": settings["max_tokens"]}
    return settings


def routing_key(image: bytes | None, settings: dict | None) -> str | None:
    """What a replica's caches depend on: the image, and the adapter (the KV of an image's prefix differs by
    adapter)."""
    if image is None:
        return None
    digest = hashlib.sha256(image).hexdigest()
    adapter = (settings or {}).get("adapter") or (settings or {}).get("variant")
    return f"{digest}+{adapter}" if adapter else digest
