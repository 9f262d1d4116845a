"""HTTP errors in the JSON shape OpenAI clients parse, and Triton's per-request errors mapped onto them.

Triton's streaming protocol carries an error's message, not its status code, so the engine's refusals are told
apart by the messages the engine words them with (kestrel_backend/errors.py, engine.py, images.py).
"""

from __future__ import annotations

from starlette.responses import JSONResponse


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after
        self.code = code or _CODES.get(status, "error")

    @property
    def type(self) -> str:
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
          408: "request_timeout", 413: "payload_too_large", 429: "overloaded", 500: "internal_error",
          502: "upstream_failed", 503: "unavailable", 504: "timeout"}


def refused_before_admission(message: str) -> bool:
    """The request was turned away before it ran, so another replica may take it: by the engine (it is stopping, or
    its queue is full), or by tritonserver itself, which unloads the model when it stops ("Request for unknown model:
    'moondream' has no available versions")."""
    return message.startswith(("server draining", "server overloaded", "Request for unknown model"))


def all_refused(messages: list[str]) -> ApiError:
    """Every replica turned the request away before running it: 429 when one of them was full (a client should slow
    down), 503 when they are all stopping."""
    if any(m.startswith("server overloaded") for m in messages):
        return ApiError(429, "every replica is full; retry later", retry_after=1)
    return ApiError(503, "every replica is stopping; retry later", retry_after=1)


def from_triton(message: str) -> ApiError:
    """An error the moondream model answered a request with, as an HTTP error with the same message."""
    if message.startswith(("server draining", "Request for unknown model")):
        return ApiError(503, message, retry_after=1)
    if message.startswith("server overloaded") or "adapter slots" in message:
        return ApiError(429, message, retry_after=1)
    if message.startswith("server stopping"):
        return ApiError(503, message, retry_after=1)
    if message.startswith("internal error"):
        return ApiError(500, message)
    if "byte limit" in message or "pixel limit" in message:
        return ApiError(413, message)
    if message.startswith("adapter ") and "not found" in message:
        return ApiError(404, message)
    return ApiError(400, message)
