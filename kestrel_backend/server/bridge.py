"""What TritonPythonModel delegates to: requests in on Triton's thread, served on the engine loop.

execute() only parses and submits (asyncio.run_coroutine_threadsafe); each request is then served
by a coroutine on the engine loop. Every call into tritonserver (responses, metric updates, the
cancellation checks) is a blocking round trip, so none is made on the engine loop: responses and
metrics go out through the Outbox's thread, a watcher thread checks for cancelled requests. Both
are daemon threads: a round trip that never returns (tritonserver stopping) cannot keep the model's
process alive. Every request ends with exactly one TRITONSERVER_RESPONSE_COMPLETE_FINAL flag.

Stopping: tritonserver (SIGTERM, or an unload) refuses new requests to a model it is unloading and waits for those
in flight before it calls finalize(), for up to its exit timeout. The Python backend tells a model nothing before
finalize(), so the watcher asks tritonserver's HTTP endpoint whether this model is still ready (stop_probe.py says
why not pb_utils.is_model_ready); once it is not, the engine drains (KESTREL_DRAIN_TIMEOUT_S) and ends what still
runs with a clear error before tritonserver's deadline cuts it.
"""

from __future__ import annotations

import asyncio
import faulthandler
import functools
import logging
import os
import signal
import threading
import time
import uuid

from ..engine import REQUEST_ARRIVAL, InferenceEngine
from ..engine_config import RuntimeConfig
from ..errors import EngineDraining, EngineOverloaded, InvalidRequest, RequestCancelled
from ..skills.catalog import SKILLS
from .metrics import TritonMetrics
from .outbox import GuardedSender, Outbox, Outgoing
from .protocol import WireRequest, chunk_body, final_stream_body, parse_request, result_body
from .stop_probe import StopProbe

log = logging.getLogger("kestrel.triton")
WATCH_INTERVAL_S = 0.05


class TritonBridge:
    def __init__(self, model_config: dict, pb, instance: tuple[str, int] | None = None):
        """instance: (kind, device id) of this model instance, as Triton gives them to initialize()."""
        faulthandler.enable(all_threads=True)  # a crash of the stub then leaves every thread's stack in the log
        self.pb = pb
        self.model_name = model_config.get("name", "moondream")
        params = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}
        self.engine = InferenceEngine.create(RuntimeConfig.from_sources(os.environ, params, instance))
        self.metrics = TritonMetrics(pb)
        self.outbox = Outbox(pb)
        self._inflight: dict[asyncio.Task, object] = {}
        self._inflight_lock = threading.Lock()
        self._stopping = threading.Event()
        self.stop_probe = StopProbe.for_parent_server(self.model_name)
        if self.stop_probe is None:
            log.warning("tritonserver serves no HTTP: a server stop cannot be seen, so requests running then are not "
                        "drained (KESTREL_DRAIN_TIMEOUT_S) but run until tritonserver's exit timeout")
        threading.Thread(target=self._watch, name="kestrel-watch", daemon=True).start()

    # --- Triton's thread ---
    def execute(self, requests) -> None:
        for request in requests:
            received = time.perf_counter()
            sender = GuardedSender(request.get_response_sender(), self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            request_id = request.request_id() or uuid.uuid4().hex
            try:
                wire = parse_request(lambda name: self._input(request, name), self.engine.text_limit.max_bytes)
            except InvalidRequest as e:
                final = self._error(sender, str(e))
                final.before = functools.partial(self.metrics.request_done, "unknown", "invalid", 0.0)
                self.outbox.put(final)
                continue
            asyncio.run_coroutine_threadsafe(self._serve(request_id, wire, sender, received), self.engine.loop)

    def _input(self, request, name: str):
        tensor = self.pb.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    def shutdown(self) -> None:
        self.outbox.stop_metrics()  # first: tritonserver answers no metric update while it unloads the model
        self._stopping.set()
        self.engine.shutdown()
        self.outbox.close()  # after the engine: the errors it ends in-flight requests with go out too

    # --- engine loop ---
    async def _serve(self, request_id: str, wire: WireRequest, sender, received: float) -> None:
        """received: when execute() took the request (the engine's TTFT counts from there)."""
        self._inflight[asyncio.current_task()] = sender
        REQUEST_ARRIVAL.set(received)  # (this task's context only)
        outcome, result, final = "error", None, None
        try:
            if wire.stream and SKILLS[wire.skill].streams:
                result, final = await self._serve_stream(request_id, wire, sender)
            else:
                result = await self._call(wire, stream=False)
                final = Outgoing(sender, result_body(request_id, result), final=True)
            outcome = "success"
        except (asyncio.CancelledError, RequestCancelled):  # client gone (watcher) or engine-side cancel
            outcome, final = "cancelled", Outgoing(sender, final=True)
        except InvalidRequest as e:
            outcome, final = "invalid", self._error(sender, str(e))
        except EngineOverloaded as e:
            outcome, final = "overloaded", self._error(sender, str(e), unavailable=True)
        except EngineDraining as e:
            outcome, final = "draining", self._error(sender, str(e), unavailable=True)
        except Exception as e:
            log.exception("request %s failed", request_id)
            final = self._error(sender, f"internal error: {type(e).__name__}: {e}")
        finally:
            m = result.metrics if result else {}
            settings = wire.settings or {}
            done = functools.partial(self.metrics.request_done, wire.skill, outcome, time.perf_counter() - received,
                                     m["ttft_ms"] / 1000 if m else None, m.get("output_tokens", 0),
                                     settings.get("adapter") or settings.get("variant"), m.get("cached_tokens", 0))
            final = final or Outgoing(sender, final=True)
            with self._inflight_lock:  # (no gauge update is queued behind the last request's final response)
                last = len(self._inflight) == 1
                # its metrics go out while it is still in flight; the last one's carry the gauges of an idle engine
                final.before = (lambda: (done(), self.metrics.engine_state(self.engine.stats()))) if last else done
                self._inflight.pop(asyncio.current_task(), None)
                self.outbox.put(final)

    async def _call(self, wire: WireRequest, stream: bool):
        skill = SKILLS[wire.skill]
        return await getattr(self.engine, skill.name)(**skill.arguments(wire, stream))

    async def _serve_stream(self, request_id: str, wire: WireRequest, sender):
        stream = await self._call(wire, stream=True)
        remainder = ""

        def on_chunk(chunk):  # called by the engine as it streams (this loop): straight into the outbox
            nonlocal remainder
            if chunk.final:
                remainder = chunk
            elif chunk:
                self._send(sender, chunk_body(chunk, chunk.token_index), final=False)

        stream.forward_to(on_chunk)
        try:
            result = await stream.result()
        except asyncio.CancelledError:
            stream.cancel()
            await stream.ended()  # (the final response, and the gauges with it, then see its pages back)
            raise
        return result, Outgoing(sender, final_stream_body(request_id, result, remainder), final=True)

    # --- watcher thread ---
    def _watch(self) -> None:
        """Cancel requests whose client went away; drain once the server stops; keep the engine gauges fresh; stop
        an unhealthy server."""
        cancelled: set[asyncio.Task] = set()
        while not self._stopping.wait(WATCH_INTERVAL_S):
            self._cancel_abandoned(cancelled)
            if self.stop_probe and not self.engine.draining and self.stop_probe.stopping():
                self.outbox.stop_metrics()  # (the server unloads the model once no request is in flight)
                self.engine.drain()
            with self._inflight_lock:  # (see outbox.py: metric updates only while a request is in flight)
                if self._inflight:
                    self.outbox.call(self.metrics.engine_state, self.engine.stats())
            if not self.engine.healthy:
                self._stop_server()
                return

    def _cancel_abandoned(self, cancelled: set[asyncio.Task]) -> None:
        """Cancel the requests whose client went away, each once (a second cancel would cut short its wait for its
        pages). A function of its own so that no loop variable keeps a request's sender alive while the watcher
        sleeps (see Outbox._run_batch)."""
        for task, sender in list(self._inflight.items()):
            if task not in cancelled and sender.is_cancelled():
                cancelled.add(task)
                self.engine.loop.call_soon_threadsafe(task.cancel)
        cancelled &= set(self._inflight)

    def _stop_server(self) -> None:
        """The engine cannot serve (device unusable): ask tritonserver (our parent) to shut down. Readiness
        turns false at once and the process exits, so the container restarts (Kubernetes restarts the pod)."""
        log.critical("engine unhealthy (%d inference steps failed in a row): shutting tritonserver down",
                     self.engine.scheduler.consecutive_failures)
        os.kill(os.getppid(), signal.SIGTERM)

    # --- sending (queued: the outbox's thread sends) ---
    def _send(self, sender, body: dict, final: bool) -> None:
        self.outbox.put(Outgoing(sender, body, final))

    def _error(self, sender, message: str, unavailable: bool = False) -> Outgoing:
        TE = self.pb.TritonError
        return Outgoing(sender, final=True, error=TE(message, TE.UNAVAILABLE) if unavailable else TE(message))
