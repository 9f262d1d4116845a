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
