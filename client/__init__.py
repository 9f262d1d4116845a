"""Python client for the `moondream` Triton model, over tritonclient.grpc streams (sync and asyncio).

    from client import MoondreamClient
    c = MoondreamClient("localhost:8001")
    c.query(image=open("cat.jpg", "rb").read(), question="What is this?")["answer"]
    for part in c.stream("caption", image=...): print(part.get("chunk", ""), end="")
"""

from __future__ import annotations

import asyncio
import json
import queue
import uuid
from typing import AsyncIterator, Iterator

import numpy as np
import tritonclient.grpc as grpcclient

__all__ = ["MoondreamClient", "AsyncMoondreamClient", "MoondreamError", "build_inputs"]


class MoondreamError(RuntimeError):
    """The server answered this request with an error (message from the server), or it timed out."""


def _bytes_input(name: str, value: bytes) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, [1], "BYTES")
    t.set_data_from_numpy(np.array([value], dtype=np.object_))
    return t


def _bool_input(name: str, value: bool) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, [1], "BOOL")
    t.set_data_from_numpy(np.array([value], dtype=np.bool_))
    return t


def build_inputs(skill: str, image: bytes | list[bytes] | None = None, question: str | None = None,
                 object: str | None = None, length: str | None = None, stream: bool = False,
                 reasoning: bool | None = None, settings: dict | None = None, spatial_refs=None,
                 messages: list | None = None) -> list[grpcclient.InferInput]:
    """spatial_refs (query): points (x, y) or boxes (x_min, y_min, x_max, y_max) in [0, 1], all of one kind.
    messages (chat): OpenAI-style messages; an image part may be {"type": "image", "index": i}, the i-th image sent
    as IMAGE (chat: image may be a list, one IMAGE element each). reasoning: None leaves the skill's default (off for
    query, on for chat where the model has it)."""
    inputs = [_bytes_input("SKILL", skill.encode())]
    if messages is not None:
        inputs.append(_bytes_input("MESSAGES", json.dumps(messages).encode()))
    if isinstance(image, list):
        t = grpcclient.InferInput("IMAGE", [len(image)], "BYTES")
        t.set_data_from_numpy(np.array(image, dtype=np.object_))
        inputs.append(t)
        image = None
    for name, value in (("IMAGE", image), ("QUESTION", question), ("OBJECT", object), ("LENGTH", length)):
        if value is not None:
            inputs.append(_bytes_input(name, value if isinstance(value, bytes) else value.encode()))
    if stream:
        inputs.append(_bool_input("STREAM", True))
    if reasoning is not None:
        inputs.append(_bool_input("REASONING", reasoning))
    if settings is not None:
        inputs.append(_bytes_input("SETTINGS", json.dumps(settings).encode()))
    if spatial_refs:
        refs = np.asarray(spatial_refs, dtype=np.float32)
        t = grpcclient.InferInput("SPATIAL_REFS", list(refs.shape), "FP32")
        t.set_data_from_numpy(refs)
        inputs.append(t)
    return inputs


def response_body(result) -> dict | None:
    """The JSON body of one streamed result (its TEXT_OUTPUT), or None for an empty final response."""
    text = result.as_numpy("TEXT_OUTPUT")
    return None if text is None else json.loads(text.reshape(-1)[0])


class Call:
    """One request on its own gRPC stream; iterate the JSON bodies, `cancel()` to abandon it."""

    def __init__(self, url: str, model: str, inputs, timeout: float, request_id: str | None = None):
        self._responses: queue.Queue = queue.Queue()
        self._timeout = timeout
        self._client = grpcclient.InferenceServerClient(url)
        self._client.start_stream(callback=lambda result, error: self._responses.put((result, error)))
        self.request_id = request_id or uuid.uuid4().hex
        self._client.async_stream_infer(model, inputs, request_id=self.request_id, enable_empty_final_response=True)
        self._closed = False

    def __iter__(self) -> Iterator[dict]:
        ended = False  # the request's last response is in: the server ends the stream by itself
        try:
            while True:
                try:
                    result, error = self._responses.get(timeout=self._timeout)
                except queue.Empty:
                    raise MoondreamError(f"no response within {self._timeout} s") from None
                if error is not None:
                    ended = True  # (an error is the request's last response, or the stream's end)
                    raise MoondreamError(error.message() if hasattr(error, "message") else str(error))
                response = result.get_response()
                final = response.parameters.get("triton_final_response")
                ended = final is not None and final.bool_param
                body = response_body(result)
                if body is not None:
                    yield body
                if ended:
                    return
        finally:
            # a request not ended (no response in time, or the caller stopped reading) is cancelled: closing its
            # stream gracefully waits for the whole answer, or forever from a server that stopped answering. An
            # ended one is not: a cancel racing the stream's end keeps tritonserver 2.51 from unloading the model
            self.close(cancel=not ended)

    def cancel(self) -> None:
        self.close(cancel=True)

    def close(self, cancel: bool = False) -> None:
        if not self._closed:
            self._closed = True
            self._client.stop_stream(cancel_requests=cancel)
            self._client.close()


class MoondreamClient:
    def __init__(self, url: str = "localhost:8001", model: str = "moondream", timeout: float = 300.0):
        self.url, self.model, self.timeout = url, model, timeout

    def call(self, skill: str, **kw) -> Call:
        return Call(self.url, self.model, build_inputs(skill, **kw), self.timeout)

    def stream(self, skill: str, **kw) -> Iterator[dict]:
        """Chunk bodies ({"chunk", "completed": false}) then the final body ("completed": true)."""
        return iter(self.call(skill, stream=True, **kw))

    def answer(self, skill: str, **kw) -> dict:
        """The one body of a request not streamed (any skill: build_inputs' keywords)."""
        bodies = list(self.call(skill, **kw))
        if len(bodies) != 1:
            raise MoondreamError(f"expected one response, got {len(bodies)}")
        return bodies[0]

    def query(self, question: str, image: bytes | None = None, reasoning: bool = False, settings: dict | None = None,
              spatial_refs=None) -> dict:
        return self.answer("query", image=image, question=question, reasoning=reasoning, settings=settings,
                         spatial_refs=spatial_refs)

    def chat(self, messages: list, image: bytes | list[bytes] | None = None, reasoning: bool | None = None,
             settings: dict | None = None) -> dict:
        """{"message": {"role": "assistant", "content", ...}, "finish_reason", "metrics"}. image: the bytes that a
        {"type": "image", "index": 0} part refers to, or a list of them (index i: the i-th)."""
        return self.answer("chat", image=image, messages=messages, reasoning=reasoning, settings=settings)

    def caption(self, image: bytes, length: str = "normal", settings: dict | None = None) -> dict:
        return self.answer("caption", image=image, length=length, settings=settings)

    def detect(self, image: bytes, object: str, settings: dict | None = None) -> dict:
        return self.answer("detect", image=image, object=object, settings=settings)

    def point(self, image: bytes, object: str, settings: dict | None = None) -> dict:
        return self.answer("point", image=image, object=object, settings=settings)

    def segment(self, image: bytes, object: str, settings: dict | None = None) -> dict:
        return self.answer("segment", image=image, object=object, settings=settings)

    def gaze(self, image: bytes, eye: tuple[float, float] | None = None,
             face: tuple[float, float, float, float] | None = None, settings: dict | None = None) -> dict:
        """{"gaze": {"x", "y"} or None}: where the person looks, from a point on their eye, or (more accurate) their
        face's box (x_min, y_min, x_max, y_max). Moondream 2."""
        if (eye is None) == (face is None):
            raise ValueError("give eye (x, y) or face (x_min, y_min, x_max, y_max)")
        return self.answer("gaze", image=image, spatial_refs=[list(eye if eye is not None else face)],
                           settings=settings)


class AsyncMoondreamClient:
    """asyncio face of MoondreamClient: the gRPC stream callbacks are awaited without blocking the loop."""

    def __init__(self, url: str = "localhost:8001", model: str = "moondream", timeout: float = 300.0):
        self._sync = MoondreamClient(url, model, timeout)

    async def stream(self, skill: str, **kw) -> AsyncIterator[dict]:
        call = await asyncio.to_thread(self._sync.call, skill, stream=True, **kw)
        it = iter(call)
        try:
            while True:
                body = await asyncio.to_thread(next, it, None)
                if body is None:
                    return
                yield body
        finally:
            call.cancel()

    async def query(self, question: str, image: bytes | None = None, **kw) -> dict:
        return await asyncio.to_thread(self._sync.query, question, image, **kw)

    async def chat(self, messages: list, image: bytes | None = None, **kw) -> dict:
        return await asyncio.to_thread(self._sync.chat, messages, image, **kw)

    async def caption(self, image: bytes, length: str = "normal", **kw) -> dict:
        return await asyncio.to_thread(self._sync.caption, image, length, **kw)

    async def detect(self, image: bytes, object: str, **kw) -> dict:
        return await asyncio.to_thread(self._sync.detect, image, object, **kw)

    async def point(self, image: bytes, object: str, **kw) -> dict:
        return await asyncio.to_thread(self._sync.point, image, object, **kw)

    async def segment(self, image: bytes, object: str, **kw) -> dict:
        return await asyncio.to_thread(self._sync.segment, image, object, **kw)
