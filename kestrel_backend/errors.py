"""Errors a request can end with; the Triton adapter maps each to an error response."""


class InvalidRequest(ValueError):
    """The request itself is bad; the message names the input."""


class EngineOverloaded(RuntimeError):
    """The admission queue is full: retry later."""


class EngineDraining(RuntimeError):
    """The server is stopping: it takes no new request. Retry on another replica."""


class EngineError(RuntimeError):
    """A request failed inside the engine (not the caller's fault)."""


class RequestCancelled(RuntimeError):
    """The caller cancelled the request (or went away)."""


def shown(value, limit: int = 64) -> str:
    """A bad value as an error message quotes it: its repr, cut to `limit` characters and a count, so that a
    100,000-character input does not come back in full."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
