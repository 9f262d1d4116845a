"""One request inside the engine: its prompt, decode state machine, pages and delivery channel."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..model.lora import LoraAdapter
from ..model.tokenizer import IncrementalDetokenizer
from ..skills.generation import Generation

log = logging.getLogger("kestrel.engine")


class StreamChunk(str):
    """A piece of streamed text; `token_index` is the index of the last output token it covers.
    The last chunk of a stream (`final`, possibly empty) is the remainder flushed at the end."""

    token_index: int
    final: bool

    def __new__(cls, text: str, token_index: int, final: bool = False):
        obj = super().__new__(cls, text)
        obj.token_index = token_index
        obj.final = final
        return obj


@dataclass
class EngineResult:
    output: dict  # {"answer"} / {"caption"} / {"points"} / {"objects"} / {"segments"} (+ {"reasoning"})
    finish_reason: str  # stop | length
    metrics: dict
    token_ids: list[int] = field(default_factory=list)  # the answer's or caption's tokens (text skills), as chosen


class Delivery:
    """Thread-safe channel from the engine thread back to the caller's event loop. Streamed chunks wait in
    a queue for the caller to take them, or go straight to a sink the caller gave (forward_to)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stream: bool):
        self.loop = loop
        self.stream = stream
        self.chunks: asyncio.Queue = asyncio.Queue()
        self.result: asyncio.Future = loop.create_future()
        self.cancelled = threading.Event()
        self._sink = None

    def forward_to(self, sink) -> None:
        """From now on call sink(chunk) for each chunk, on the caller's loop (call it there), the chunks
        already queued first: no task wakes up per chunk."""
        self._sink = sink
        while not self.chunks.empty():
            item = self.chunks.get_nowait()
            if item is None:  # (end of stream: stays queued for any iterator)
                self.chunks.put_nowait(None)
                break
            self._deliver(item)

    def cancel(self) -> None:
        """The caller gives up: the engine drops the request at its next step. Call on the caller's loop.
        The caller may never await the result now, so its RequestCancelled is marked as seen (asyncio
        would otherwise log it as a future exception that was never retrieved)."""
        self.cancelled.set()
        self.result.add_done_callback(lambda future: future.cancelled() or future.exception())

    async def ended(self, timeout_s: float = 2.0) -> None:
        """Until the engine has let go of the request (its result set, its pages freed): after cancel(), so that
        what the caller reports next (its final response, the engine's gauges) sees the pages back."""
        try:
            await asyncio.wait_for(asyncio.shield(self.result), timeout_s)
        except BaseException:  # (its error, a cancellation, or the timeout: the engine lets go at its next step)
            pass

    def _call(self, fn, *args):
        """fn(*args) on the caller's loop: at once when the engine thread runs that loop itself (the Triton
        adapter's requests), else queued to it from the engine thread."""
        if self.loop.is_closed():
            return
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is self.loop:
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    def chunk(self, chunk: StreamChunk) -> None:
        if self.stream:
            self._call(self._deliver, chunk)

    def finish(self, result: EngineResult, last_chunk: StreamChunk | None) -> None:
        if self.stream and last_chunk is not None:
            self._call(self._deliver, last_chunk)
        self._call(self._set, result, None)

    def _deliver(self, chunk: StreamChunk) -> None:
        if self.cancelled.is_set():  # the caller gave up (its final response may be out already)
            return
        if self._sink is None:
            self.chunks.put_nowait(chunk)
            return
        try:
            self._sink(chunk)
        except Exception:  # (it runs inside the engine's step: its failure must stay this request's)
            log.exception("a stream's chunk sink failed: dropping its request")
            self.cancelled.set()

    def fail(self, error: BaseException) -> None:
        self._call(self._set, None, error)

    def _set(self, result, error):
        if not self.result.done():
            self.result.set_exception(error) if error else self.result.set_result(result)
        self.chunks.put_nowait(None)  # end of stream


@dataclass(eq=False)
class LaterImage:
    """An image of a conversation other than the one after BOS (skills/chat.py): its rows replace the prompt's
    placeholder ids from `index` on, a block that sees itself bidirectionally."""

    key: str
    index: int  # in the prompt ids
    cropped: tuple[np.ndarray, tuple[int, int]] | None = None  # until encoded (None: it was cached on arrival)
    held_embedding: torch.Tensor | None = None  # the image cache's, when it was cached on arrival


@dataclass(eq=False)
class Sequence:
    id: int
    skill: str
    token_ids: list[int]
    generation: Generation
    delivery: Delivery
    image_key: str | None = None
    cropped: tuple[np.ndarray, tuple[int, int]] | None = None  # (crops, tiling), until encoded
    # the image cache's embedding when the request arrived (then it has no crops), held until admission: should
    # the cache evict it meanwhile, the scheduler puts it back instead of failing the request
    held_embedding: torch.Tensor | None = None
    capacity: int = 0  # positions reserved in the KV cache
    detok: IncrementalDetokenizer | None = None
    adapter: LoraAdapter | None = None  # pinned in the engine's AdapterRegistry until the sequence ends
    prompt_overrides: dict[int, torch.Tensor] | None = None  # prompt index -> embedding (spatial refs)
    pixels: np.ndarray | None = None  # segment's image, for its refiner
    later_images: list[LaterImage] = field(default_factory=list)
    page_keys: list[str] | None = None  # the prefix cache's keys of its prompt's whole pages (set at admission)
    batch: bool = False  # a batch job's line: admitted after every interactive request waiting (Settings.priority)
    # filled by the scheduler
    prefix_len: int = 0
    blocks: tuple[tuple[int, int], ...] = ()  # the later images' positions [start, end): bidirectional within each
    length: int = 0  # positions written so far
    cached_tokens: int = 0  # positions whose KV pages came from the prefix cache
    next_input: int | torch.Tensor | None = None
    streamed_tokens: int = 0
    t_submit: float = field(default_factory=time.perf_counter)  # when the request reached the engine
    t_first: float = 0.0
    t_end: float = 0.0  # when it left the batch
    prefill_ms: float = 0.0
    encoded_ahead: object = None  # the EncodeClock of its image's encode, if done before it was admitted
    prefilled_ahead_ms: float = 0.0  # its share of the step that prefilled its image prefix before it was admitted

    @property
    def prefix_key(self) -> str | None:
        """What the image prefix's KV pages depend on: the image, and the adapter (it changes every layer's KV)."""
        if self.image_key is None or self.adapter is None:
            return self.image_key
        return f"{self.image_key}+{self.adapter.name}#{self.adapter.uid}"

    def prompt_units(self, prefix_attn: int, image_rows: int) -> list:
        """What each prompt position holds, for the prefix cache's keys: the image prefix's positions (BOS too) the
        image, a later image's rows that image, a spatial ref's embedding this request alone, else the token id."""
        units: list = [("image", self.image_key)] * prefix_attn if self.image_key is not None else []
        tail: list = list(self.token_ids)
        for later in self.later_images:
            tail[later.index:later.index + image_rows] = [("image", later.key)] * image_rows
        for index in self.prompt_overrides or {}:
            tail[index] = ("embedding", self.id)
        return units + tail

    @property
    def input_tokens(self) -> int:
        return self.prefix_len + len(self.token_ids)


class EngineStream:
    """Async iterator of StreamChunk (str); joined they equal the final text. `await result()`. Or
    forward_to(sink), on the caller's loop: each chunk is handed to sink(chunk) as it comes."""

    def __init__(self, delivery: Delivery):
        self._delivery = delivery

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamChunk:
        item = await self._delivery.chunks.get()
        if item is None:
            self._delivery.chunks.put_nowait(None)  # stay exhausted
            raise StopAsyncIteration
        return item

    def forward_to(self, sink) -> None:
        self._delivery.forward_to(sink)

    async def result(self) -> EngineResult:
        return await self._delivery.result

    def cancel(self) -> None:
        self._delivery.cancel()

    async def ended(self) -> None:
        """After cancel(): until the engine has let go of the request (its pages freed)."""
        await self._delivery.ended()
