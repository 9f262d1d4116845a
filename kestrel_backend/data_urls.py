"""Images sent as text (JSON carries no raw bytes): a `data:image/...;base64,` URL or bare base64, to bytes.
No image library here: the gateway uses it too, and the engine validates the bytes when it decodes them."""

from __future__ import annotations

import base64
import binascii
import re

from .errors import InvalidRequest

_BASE64 = re.compile(rb"[A-Za-z0-9+/_\-\s]+={0,2}\s*")


def image_bytes(raw: bytes | None, name: str = "IMAGE") -> bytes | None:
    """Encoded image bytes as they are, or a data URL / base64 text decoded. Encoded images start with binary
    magic bytes, so they never pass for base64 text."""
    if raw is None or not raw:
        return raw
    if raw.startswith(b"data:"):
        header, comma, payload = raw.partition(b",")
        if not comma or not header.endswith(b";base64"):
            raise InvalidRequest(f"{name} data URL must be data:image/<type>;base64,<data>")
        return _base64(payload, f"{name} data URL's payload is not valid base64")
    if _BASE64.fullmatch(raw):
        return _base64(raw, f"{name} is neither image bytes nor valid base64")
    return raw


def _base64(text: bytes, error: str) -> bytes:
    text = re.sub(rb"\s", b"", text)
    try:
        if b"-" in text or b"_" in text:
            return base64.urlsafe_b64decode(text + b"=" * (-len(text) % 4))
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(error) from None
