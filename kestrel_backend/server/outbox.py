"""Responses and metric updates leave through one thread of their own, not from the engine loop.

A response sender's send() is a blocking round trip to tritonserver, and so is a metric update. On the
engine loop, one send per streamed token per request held up every decode step (at 64 streaming
requests, the H100 made half the tokens through tritonserver that it made in-process). Here the loop
only queues; the thread sends, in order per request. Chunks of one request that are still queued when
the thread gets to them go out as one response: a slow link costs fewer, larger chunks instead of
delaying everyone's next token. Everything runs in the order it was queued.

Metric updates are round trips to tritonserver too, and one that tritonserver does not answer deadlocks the stub:
once the server starts unloading the model it reads the stub's messages no more, and the update waits forever
holding the GIL (the stub then never finishes finalize(), tritonserver waits out its exit timeout and leaves the
stub behind). So a metric update is only made while tritonserver is sure to answer: while some request is in flight
(it unloads no model with requests in flight). A request's own metrics run just before its final response
(Outgoing.before; the last request in flight also carries the engine's gauges), and every update stops once the
server is seen stopping (stop_metrics). (The other hang seen at a stop, a gRPC stream cancelled just as it ended,
is the gateway's to avoid: gateway/upstream.py.)
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

log = logging.getLogger("kestrel.triton")


@dataclass
class Outgoing:
    sender: object
    body: dict | None = None  # None: no output tensor (errors, a bare final flag)
    final: bool = False
    error: object = None  # a pb_utils.TritonError
    before: Callable | None = None  # a metric update made just before this is sent (the request still in flight)


def merged(items: list[Outgoing]) -> list[Outgoing]:
    """Each request's consecutive non-final chunks joined into one (text joined, the last token_index);
    every request's responses stay in their order."""
    out: list[Outgoing] = []
    last_chunk: dict[int, Outgoing] = {}  # per sender: its chunk that the next one may join
    for item in items:
        key = id(item.sender)
        mergeable = item.body is not None and not item.final and item.error is None and "chunk" in item.body
        open_chunk = last_chunk.pop(key, None)
        if mergeable and open_chunk is not None:
            open_chunk.body = {**item.body, "chunk": open_chunk.body["chunk"] + item.body["chunk"]}
            last_chunk[key] = open_chunk
            continue
        out.append(item)
        if mergeable:
            last_chunk[key] = item
    return out


class GuardedSender:
    """A request's response sender used from two threads: the outbox sends, the watcher asks
    is_cancelled(). Once the final response is out, is_cancelled() answers False without asking
    tritonserver: asked about requests it had completed, 2.51 crashed under load (SIGSEGV in
    TRITONBACKEND_ResponseFactoryIsCancelled). The lock keeps a check from overlapping the final send."""

    def __init__(self, sender, final_flag: int):
        self._sender = sender
        self._final_flag = final_flag
        self._lock = threading.Lock()
        self._done = False

    def send(self, *response, flags: int = 0) -> None:
        with self._lock:
            try:
                self._sender.send(*response, flags=flags)
            finally:
                self._done = self._done or bool(flags & self._final_flag)

    def is_cancelled(self) -> bool:
        with self._lock:
            return not self._done and self._sender.is_cancelled()


class Outbox:
    def __init__(self, pb):
        self.pb = pb
        self.final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self._queue: queue.SimpleQueue[Outgoing | Callable | None] = queue.SimpleQueue()
        self._metrics_on = True
        self._thread = threading.Thread(target=self._run, name="kestrel-outbox", daemon=True)
        self._thread.start()

    def put(self, item: Outgoing) -> None:
        self._queue.put(item)

    def call(self, fn: Callable, *args) -> None:
        """Run fn(*args) on the outbox's thread (a metric update)."""
        self._queue.put(functools.partial(fn, *args))

    def stop_metrics(self) -> None:
        """No metric update from now on (the server is stopping: see the module's docstring)."""
        self._metrics_on = False

    def close(self, timeout: float = 10.0) -> None:
        """Send the responses still queued, then stop the thread; metric updates are dropped."""
        self.stop_metrics()
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            while not self._queue.empty():  # whatever else is waiting: sent in one go, chunks merged
                items.append(self._queue.get())
            if not self._run_batch(items):
                return

    def _run_batch(self, items: list) -> bool:
        """False once the batch held the stop mark. (A function of its own so that no local outlives the batch:
        a response sender kept alive keeps its response factory, and the model, until its final response is out.)"""
        responses: list[Outgoing] = []
        for item in items + [None]:
            if isinstance(item, Outgoing):
                responses.append(item)
                continue
            for response in merged(responses):  # (in order, before the call queued after them)
                self._run_metric(response.before)
                self._send(response)
            responses = []
            self._run_metric(item)
        return not any(i is None for i in items)

    def _run_metric(self, call: Callable | None) -> None:
        if call is None or not self._metrics_on:
            return
        try:
            call()
        except Exception:  # a metric update that failed must not stop the responses
            log.warning("a metric update failed", exc_info=True)

    def _send(self, item: Outgoing) -> None:
        flags = self.final if item.final else 0
        try:
            if item.body is None and item.error is None:
                item.sender.send(flags=flags)
                return
            outputs = [] if item.body is None else [self.pb.Tensor(
                "TEXT_OUTPUT", np.array([json.dumps(item.body, ensure_ascii=False).encode()], dtype=np.object_))]
            item.sender.send(self.pb.InferenceResponse(output_tensors=outputs, error=item.error), flags=flags)
        except Exception:  # the client went away, or the request was already completed: only this one fails
            log.warning("sending a response failed", exc_info=True)
