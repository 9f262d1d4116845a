"""InferenceEngine: the public async API (query, caption, point, detect, segment) over the engine thread.

`InferenceEngine.create(config)` loads the model and starts ONE thread running its own asyncio
loop; that loop owns the device and runs the scheduler. The API coroutines may be awaited from any
event loop on any thread: work hops to the engine loop, results hop back.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .engine_config import RuntimeConfig
from .errors import EngineDraining, EngineError, EngineOverloaded, InvalidRequest, RequestCancelled
from .images import ImageLimits, decode_image, mirrored_png
from .model.hub import MODELS
from .model.moondream import Moondream
from .model.seg_refiner import RefinerHead
from .model.tokenizer import IncrementalDetokenizer
from .runtime.gpu_parts import make_crop_encoder, make_decoder, make_prefill_graphs, make_vision_stream
from .runtime.image_cache import ImageCache, image_key
from .runtime.kv_cache import PagedKVCache
from .runtime.lora_registry import AdapterRegistry
from .runtime.scheduler import Scheduler
from .runtime.segment_refiner import SegmentRefiner
from .runtime.sequence import Delivery, EngineResult, EngineStream, LaterImage, Sequence, StreamChunk
from .skills.catalog import SKILLS
from .skills.chat import ChatMessage, chat_prompt, first_image, supports_reasoning
from .skills.generation import Generation, ReasoningThenAnswer, RegionGeneration, SegmentGeneration, TextGeneration
from .skills.prompts import (TextLimit, caption_prompt, check_spatial_refs, query_prompt, region_prompt,
                             spatial_refs_start)
from .skills import gaze as gaze_skill
from .skills.settings import Settings
from .slots import Slots

log = logging.getLogger("kestrel.engine")
UNHEALTHY_AFTER_FAILED_STEPS = 3
# When the request being submitted reached the server (time.perf_counter()), set by a front end in the request's
# task before it calls the engine: a request's TTFT counts from there, the wait for the engine loop included (it
# runs one step at a time). Unset: from the engine call.
REQUEST_ARRIVAL: contextvars.ContextVar[float | None] = contextvars.ContextVar("request_arrival", default=None)
EAGER_WARM_ROWS = 16384  # eager prefill steps are warmed at start-up up to the step budget, at most this many rows

__all__ = ["InferenceEngine", "EngineResult", "EngineStream", "StreamChunk", "EngineOverloaded", "EngineDraining",
           "EngineError", "RequestCancelled", "InvalidRequest"]


class InferenceEngine:
    def __init__(self, config: RuntimeConfig, model: Moondream, refiner_head=None):
        """refiner_head: Moondream 3's segment refiner (model.seg_refiner.RefinerHead), or None: coarse segments."""
        self.config = config
        self.model = model
        _use_device(model.device)  # (CUDA's current device is per thread: this one captures the graphs)
        _quantize(model, config)
        text = model.config.text
        self.max_context = min(config.max_context or text.max_context, text.max_context)
        num_pages = config.kv_pages or default_kv_pages(self.max_context, config.page_size, config.max_batch_size)
        self.kv = PagedKVCache(text, num_pages, config.page_size, model.device, model.dtype)
        self.images = ImageCache(config.image_cache_size)
        self.image_limits = ImageLimits(config.max_image_bytes, config.max_image_pixels)
        self.text_limit = TextLimit.for_tokenizer(model.tokenizer, self.max_context)
        self._ids = itertools.count(1)
        threads = config.image_worker_count() + 1
        self._decoders = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kestrel-decode")
        # batch lines' images take every decode thread while nobody is about, all but one while people are: a
        # person's image finds a thread free. (On an H200, 3,000 fresh images over 64 gRPC streams sent as batch lines
        # held to five of six threads at all times: 43.5 req/s; as interactive requests, on all six: 48.5.)
        self._batch_decodes = Slots(lambda: threads - 1 if self.scheduler.people_about() else threads)
        self._decoding: dict[str, asyncio.Future] = {}  # image key -> its crops, while being decoded
        self.adapters = AdapterRegistry(config.adapter_dir, config.max_adapters, config.max_adapter_rank,
                                        model.config.text, model.device, model.dtype, self._decoders)
        self._admitting = 0
        self.draining = False  # set by drain(): no new request is admitted
        self.loop = asyncio.new_event_loop()
        if config.adapter_dir:  # adapters expected: their device pool (and its decode graphs) made now
            self.adapters.ensure_pool()
        decoder = make_decoder(model, self.kv, config.max_batch_size, self.max_context, self.adapters)
        if decoder is not None:
            decoder.warmup()  # capture every batch-size bucket now, not under the first requests
        prefill_graphs = make_prefill_graphs(model, self.kv, self.max_context, config.max_batch_size,
                                             bool(config.mixed_steps), self.adapters)
        if prefill_graphs is not None:
            prefill_graphs.warmup()
        crop_encoder = make_crop_encoder(model)
        if crop_encoder is not None:
            crop_encoder.warmup()
        self.scheduler = Scheduler(model, self.kv, self.images, config.max_batch_size, decoder, prefill_graphs,
                                   config.prefix_cache_size, crop_encoder, self.adapters, config.max_step_tokens,
                                   config.admit_group, bool(config.mixed_steps),
                                   config.resolved_prefix_ahead(model.config.text.moe is not None),
                                   config.batch_step_tokens, make_vision_stream(model, bool(config.vision_stream)))
        warm_rows = min(config.max_step_tokens or EAGER_WARM_ROWS, EAGER_WARM_ROWS)
        mixed_rows = config.max_batch_size if config.mixed_steps else 0  # (the decode rows a mixed step takes on)
        self.scheduler.warm_eager_prefill(warm_rows + mixed_rows)
        if refiner_head is not None:
            self.scheduler.segment_refiner = SegmentRefiner(model, refiner_head, self._decoders)
        if config.chaos_fail_after_steps:
            log.warning("KESTREL_CHAOS_FAIL_AFTER_STEPS=%d: every step after that many will fail (chaos testing)",
                        config.chaos_fail_after_steps)
            self.scheduler.fault_injector = _chaos(self.scheduler, config.chaos_fail_after_steps)
        self._thread = threading.Thread(target=self._run_loop, name="kestrel-engine", daemon=True)
        self._started = threading.Event()
        self._thread.start()
        self._started.wait()

    @classmethod
    def create(cls, config: RuntimeConfig) -> "InferenceEngine":
        path = config.checkpoint()
        if config.uses_tiny_checkpoint:
            log.warning("NO WEIGHTS CONFIGURED: serving the tiny RANDOM-WEIGHT test checkpoint %s; answers are noise. "
                        "Set KESTREL_MODEL=moondream2 or KESTREL_MODEL_PATH for a real model.", path)
        model = Moondream.from_checkpoint(path, dtype=config.torch_dtype(), device=config.torch_device(),
                                          tokenizer_dir=config.tokenizer_dir(),
                                          fp8_experts=config.fp8_experts)
        if model.tokenizer is None:
            raise ValueError(f"{path}: no tokenizer.json next to the weights")
        head = None
        if model.config.is_moondream3:
            head_path = config.seg_refiner()
            if head_path is None:
                log.warning("segment serves coarse outlines: no refiner (set KESTREL_SEG_REFINER_PATH to the "
                            "moondream/SegHeadRefiner model.pt)")
            else:
                head = RefinerHead.load(head_path, model.device, model.dtype)
        return cls(config, model, head)

    def _run_loop(self) -> None:
        _use_device(self.model.device)
        asyncio.set_event_loop(self.loop)
        self._task = self.loop.create_task(self.scheduler.run())
        self.loop.call_soon(self._started.set)
        self.loop.run_until_complete(self._task)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread; requests still in flight end with EngineError."""
        if not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.scheduler.stop)
        self._thread.join(timeout)
        self._decoders.shutdown(wait=True, cancel_futures=True)
        if not self._thread.is_alive():
            self.loop.close()

    def drain(self, timeout_s: float | None = None) -> None:
        """The server is stopping (any thread may call this): new requests are refused with EngineDraining at once,
        those already admitted run on for up to timeout_s (KESTREL_DRAIN_TIMEOUT_S by default), then whatever still
        runs ends with a clear EngineError (so that tritonserver, which waits for every request in flight, can exit
        before its own exit timeout)."""
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        self.loop.call_soon_threadsafe(self._start_drain, timeout_s)

    def _start_drain(self, timeout_s: float) -> None:
        if self.draining:
            return
        self.draining = True
        log.warning("draining: new requests refused; %d running and %d queued get up to %g s to finish",
                    len(self.scheduler.running), self._queue_depth, timeout_s)
        error = EngineError(f"server stopping: the request was still running {timeout_s:g} s after the stop began "
                            "(KESTREL_DRAIN_TIMEOUT_S)")
        self.loop.call_later(timeout_s, self.scheduler.abort, error)

    @property
    def healthy(self) -> bool:
        """False once the engine thread died or steps keep failing back to back (an unusable device)."""
        return self._thread.is_alive() and self.scheduler.consecutive_failures < UNHEALTHY_AFTER_FAILED_STEPS

    @property
    def _queue_depth(self) -> int:
        """Requests accepted but not yet running: being admitted (image decode) or waiting for a slot."""
        return len(self.scheduler.waiting) + self._admitting

    def threads_alive(self) -> list[threading.Thread]:
        """The engine's threads still running (its loop's, its image decoders'): none once shutdown() returned."""
        return [t for t in [self._thread, *self._decoders._threads] if t.is_alive()]

    def next_sequence_id(self) -> int:
        return next(self._ids)

    def no_request_holds_pages(self) -> bool:
        """Every KV page is free or kept by the prefix cache alone, and no adapter is pinned: what must hold once
        requests have ended."""
        s = self.stats()
        return s["pages_used"] == 0 and s["pages_free"] + s["pages_cached"] == s["pages_total"] and \
            self.adapters.pinned == 0

    # --- counts for metrics ---
    def stats(self) -> dict:
        s = self.scheduler
        cached = s.prefixes.idle_pages  # held by the prefix cache alone: taken back when admission needs them
        return {"pages_total": self.kv.num_pages, "pages_used": self.kv.pages_used - cached, "pages_cached": cached,
                "pages_free": self.kv.pages_free, "prefix_hits": s.prefix_hits,
                "queue_depth": self._queue_depth, "images_decoding": len(self._decoding), "running": len(s.running),
                "draining": int(self.draining),
                "images_encoded": s.images_encoded, "images_cached": len(self.images), "steps": s.steps,
                "step_phase_seconds": dict(s.phase_s)}

    # --- public API ---
    async def query(self, image: bytes | None = None, question: str = "", reasoning: bool = False,
                    stream: bool = False, settings: dict | None = None, spatial_refs=None):
        """spatial_refs: points (x, y) and boxes (x_min, y_min, x_max, y_max) in [0, 1] that the question
        refers to, put into the prompt as the reference does."""
        if not isinstance(question, str) or not question.strip():
            raise InvalidRequest("QUESTION is required and must be non-empty text")
        s = self._settings(settings)
        refs = check_spatial_refs(spatial_refs, image)
        ids = self._encode(question, "QUESTION")
        return await self._submit("query", image, ids, s, stream, reasoning=reasoning, spatial_refs=refs)

    async def caption(self, image: bytes, length: str = "normal", stream: bool = False, settings: dict | None = None):
        return await self._submit("caption", self._need_image(image), caption_prompt(self.model.config.tokenizer, length),
                                  self._settings(settings), stream)

    async def point(self, image: bytes, object: str, settings: dict | None = None) -> EngineResult:
        return await self._region("point", image, object, settings)

    async def detect(self, image: bytes, object: str, settings: dict | None = None) -> EngineResult:
        return await self._region("detect", image, object, settings)

    async def segment(self, image: bytes, object: str, settings: dict | None = None) -> EngineResult:
        """{"segments": [{"svg_path", "bbox", ...}]}: the object's outline (refined when the refiner is loaded)."""
        self._check_served("segment")
        if not isinstance(object, str) or not object.strip():
            raise InvalidRequest("OBJECT is required and must be non-empty text")
        ids = region_prompt(self.model.config.tokenizer, "segment", self._encode(object.strip(), "OBJECT"))
        s = self._settings(settings, greedy=True)
        return await self._submit("segment", self._need_image(image), ids, s, False, object_text=object.strip())

    async def gaze(self, image: bytes, spatial_refs=None, settings: dict | None = None) -> EngineResult:
        """Where the person looks (skills/gaze.py): SPATIAL_REFS one point, their eye, or one box, their face (the
        more accurate form: twenty eye points, on the image and its mirror image). {"gaze": {"x", "y"}}, or
        {"gaze": None} when the model finds none. settings.seed draws the face form's eye points."""
        self._check_served("gaze")
        refs = check_spatial_refs(spatial_refs, self._need_image(image))
        if len(refs) != 1:
            raise InvalidRequest("SPATIAL_REFS: gaze takes one point (the eye, x, y) or one box (the face, x_min, y_min, "
                                 f"x_max, y_max), got {len(refs)}")
        s = self._settings({**(settings or {}), "max_objects": 1}, greedy=True)
        if len(refs[0]) == 2:
            result = await self._gaze_at(image, refs[0], s)
            return EngineResult({"gaze": result.output["gaze"][0] if result.output["gaze"] else None},
                                result.finish_reason, result.metrics, result.token_ids)
        mirror = await asyncio.get_running_loop().run_in_executor(self._decoders, mirrored_png, image, self.image_limits)
        eyes = gaze_skill.eye_samples(refs[0], random.Random(s.seed))
        results = await asyncio.gather(*[self._gaze_at(mirror if flipped else image, (x, y), s)
                                         for x, y, flipped in eyes])
        found = [(1 - p["x"] if flipped else p["x"], p["y"]) for (_, _, flipped), r in zip(eyes, results)
                 for p in r.output["gaze"]]
        metrics = {k: sum(r.metrics[k] for r in results) for k in ("input_tokens", "output_tokens", "cached_tokens")}
        metrics["ttft_ms"] = max(r.metrics["ttft_ms"] for r in results)
        return EngineResult({"gaze": gaze_skill.mean_gaze(found)}, "stop", metrics, [])

    async def _gaze_at(self, image: bytes, eye: tuple[float, float], settings: Settings) -> EngineResult:
        ids, at = gaze_skill.gaze_prompt(lambda text: self.model.tokenizer.encode(text).ids)
        return await self._submit("gaze", image, ids, settings, False, spatial_refs=[gaze_skill.eye_ref(eye)],
                                  refs_at=at)

    async def chat(self, messages: list[ChatMessage], reasoning: bool | None = None, stream: bool = False,
                   settings: dict | None = None):
        """A conversation (skills/chat.py: parse_messages), answered as its last user turn's query. reasoning: on by
        default where the model has a reasoning marker, as in Kestrel's chat."""
        tok = self.model.config.tokenizer
        if reasoning is None:
            reasoning = supports_reasoning(tok)
        self.text_limit.check(sum(len(m.text) for m in messages), "MESSAGES' text")
        images, image_rows = sum(len(m.images) for m in messages), self.model.config.text.prefix_attn - 1
        if images * image_rows >= self.max_context:  # (refused before any image is decoded or its rows laid out)
            raise InvalidRequest(f"MESSAGES: its {images} images need {images * image_rows} positions, more than the "
                                 f"model's context of {self.max_context}; send fewer images")
        ids, later = chat_prompt(tok, messages, lambda text: self._encode(text, "MESSAGES' text"), reasoning,
                                 image_rows)
        return await self._submit("chat", first_image(messages), ids, self._settings(settings), stream,
                                  reasoning=reasoning, later_images=later)

    async def submit_tokens(self, skill: str, image: bytes | None, ids: list[int], settings: dict | None = None,
                            stream: bool = False, reasoning: bool = False, spatial_refs=None):
        """Token-level entry (parity and tests): ids are the question (query), the object (point/detect),
        or the whole prompt (caption)."""
        generation = SKILLS[skill].generation
        s = self._settings(settings, greedy=generation == "segment")
        object_text = self.model.tokenizer.decode(ids) if generation == "segment" else ""
        if generation in ("region", "segment"):
            ids = region_prompt(self.model.config.tokenizer, skill, ids)
        refs = check_spatial_refs(spatial_refs, image)
        return await self._submit(skill, image, ids, s, stream, reasoning=reasoning, spatial_refs=refs,
                                  object_text=object_text)

    # --- internals ---
    def _settings(self, settings: dict | None, greedy: bool = False) -> Settings:
        """greedy: the skill samples greedily unless SETTINGS asks otherwise (segment, as in Kestrel)."""
        if settings is not None and not isinstance(settings, dict):
            raise InvalidRequest("SETTINGS must be a JSON object")
        defaults = {"temperature": 0.0, "top_p": 1.0} if greedy else {}
        return Settings.from_dict(settings, max_tokens_limit=self.max_context,
                                  max_objects_limit=self.config.max_objects, **defaults)

    def _adapter_id(self, name: str) -> str:
        """An adapter's id from SETTINGS' name of it: the id alone, or after a model's name and a slash (as the
        official fine-tuning client names finetunes: moondream3-preview/<finetune_id>@<step>), which must be a name
        of the served model."""
        model, _, adapter_id = name.rpartition("/")
        if model and model not in self.model_names:
            raise InvalidRequest(f"SETTINGS: adapter {name!r} is for model {model!r}; this server serves "
                                 f"{' or '.join(self.model_names)}")
        return adapter_id

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names the served model answers to: KESTREL_MODEL's when it names a published model, else its family's
        published names."""
        if self.config.model in MODELS:
            return (self.config.model,)
        return tuple(n for n in MODELS if n.startswith("moondream3") == self.model.config.is_moondream3)

    def _encode(self, text: str, field: str) -> list[int]:
        """Token ids of a request's text, refused first if it is longer than the context could hold (the tokenizer
        holds the GIL: a long text would stall every request) or is not text (a lone surrogate)."""
        self.text_limit.check(len(text), field)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(f"{field} holds a lone UTF-16 surrogate, which is not text") from None
        return self.model.tokenizer.encode(text).ids

    def _check_served(self, skill: str) -> None:
        """A skill that needs a tokenizer template the loaded model lacks (segment: Moondream 3's), or that the model's
        family was not trained for (gaze: Moondream 2's), is refused."""
        spec = SKILLS[skill]
        if spec.template is not None and spec.template not in self.model.config.tokenizer.templates or \
                self.model.name not in spec.families:
            raise InvalidRequest(f"SKILL {skill} is not supported by {self.model.name}, the loaded model: {skill} "
                                 f"needs {spec.models}")

    @staticmethod
    def _need_image(image) -> bytes:
        if not image:
            raise InvalidRequest("IMAGE is required for this skill")
        return image

    async def _region(self, skill, image, obj, settings) -> EngineResult:
        if not isinstance(obj, str) or not obj.strip():
            raise InvalidRequest("OBJECT is required and must be non-empty text")
        ids = region_prompt(self.model.config.tokenizer, skill, self._encode(" " + obj, "OBJECT"))
        return await self._submit(skill, self._need_image(image), ids, self._settings(settings), False)

    def crop_image(self, data: bytes):
        """An image's crops as the engine encodes them (decoded within the engine's image limits)."""
        return self.model.crop_image(decode_image(data, self.image_limits))

    def _pixels_and_crop(self, data: bytes, crop: bool):
        """Segment's image: its pixels are kept for the refiner (and cropped unless the image cache has it)."""
        pixels = decode_image(data, self.image_limits)
        return pixels, self.model.crop_image(pixels) if crop else None

    async def _decode_once(self, key: str, data: bytes, batch: bool = False):
        """The image's crops, decoded off the engine thread once for all requests that bring it meanwhile
        (a burst of questions on one new image). shield: a cancelled request leaves the others' decode be."""
        decoding = self._decoding.get(key)
        if decoding is None:
            decoding = self._decoding[key] = asyncio.ensure_future(self._decode(data, batch))
            decoding.add_done_callback(lambda _: self._decoding.pop(key, None))
        return await asyncio.shield(decoding)

    async def _decode(self, data: bytes, batch: bool):
        async with self._batch_decodes.slot() if batch else contextlib.nullcontext():
            return await self.loop.run_in_executor(self._decoders, self.crop_image, data)

    def _generation(self, skill: str, settings: Settings, reasoning: bool, object_text: str = "") -> Generation:
        tok, generation = self.model.config.tokenizer, SKILLS[skill].generation
        if generation == "segment":
            return SegmentGeneration(tok, settings, self.model, object_text)
        if generation == "region":
            return RegionGeneration(tok, settings, self.model, with_size=SKILLS[skill].result == "objects")
        if reasoning:
            return ReasoningThenAnswer(tok, settings, self.model)
        return TextGeneration(tok, settings)

    async def _submit(self, skill, image, ids, settings, stream, reasoning=False, spatial_refs=(), object_text="",
                      later_images=(), refs_at=None):
        arrived = REQUEST_ARRIVAL.get() or time.perf_counter()  # TTFT counts from here (image decode, admission waits)
        delivery = Delivery(asyncio.get_running_loop(), stream)
        admit = self._accept(skill, image, ids, settings, delivery, reasoning, spatial_refs, arrived, object_text,
                             later_images, refs_at)
        admitted = False
        try:
            if delivery.loop is self.loop:  # a caller on the engine loop (the Triton adapter): no hop between loops
                await admit
            else:
                await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(admit, self.loop))
            admitted = True
            if stream:
                return EngineStream(delivery)
            return await delivery.result
        except asyncio.CancelledError:
            delivery.cancel()  # the caller went away: drop the request at the next step
            if admitted:
                await delivery.ended()
            raise

    async def _accept(self, skill, image, ids, settings, delivery, reasoning, spatial_refs, arrived: float,
                      object_text: str = "", later_images=(), refs_at: int | None = None) -> None:
        """Runs on the engine loop: bounded queue, image decode (off-thread), adapter, context check. later_images:
        a conversation's other images, (bytes, index of their rows in ids)."""
        if self.draining:
            raise EngineDraining("server draining: it is stopping and takes no new request; retry on another replica")
        if self._queue_depth >= self.config.max_queue:
            raise EngineOverloaded(f"server overloaded: {self.config.max_queue} requests already queued; retry later")
        self._admitting += 1
        adapter, batch = None, settings.priority == "batch"
        if not batch:
            self.scheduler.person_seen = time.monotonic()  # (before its image's decode: see _batch_decodes)
        try:
            key = cropped = pixels = held = None
            if image is not None:
                if not isinstance(image, (bytes, bytearray)):
                    raise InvalidRequest("IMAGE must be encoded image bytes")
                key = image_key(bytes(image))
                held = self.images.get(key)
                if skill == "segment" and self.scheduler.segment_refiner is not None:
                    pixels, cropped = await self.loop.run_in_executor(self._decoders, self._pixels_and_crop,
                                                                      bytes(image), held is None)
                elif held is None:
                    cropped = await self._decode_once(key, bytes(image), batch)
            later = []
            for data, index in later_images:
                later_key = image_key(bytes(data))
                later_held = self.images.get(later_key)
                later.append(LaterImage(later_key, index, held_embedding=later_held, cropped=None if later_held
                                        is not None else await self._decode_once(later_key, bytes(data), batch)))
            tok = self.model.config.tokenizer
            overrides = None
            if skill == "query":
                ids = query_prompt(tok, ids, key is not None, reasoning, spatial_refs)
                if spatial_refs:
                    overrides = self.model.spatial_ref_overrides(spatial_refs, spatial_refs_start(tok, key is not None))
            elif refs_at is not None:  # (a prompt with its coordinate placeholders in place: gaze's eye)
                overrides = self.model.spatial_ref_overrides(spatial_refs, refs_at)
            gen = self._generation(skill, settings, reasoning, object_text)
            prefix = self.model.config.text.prefix_attn if key is not None else 0
            prompt_len = prefix + len(ids)
            if prompt_len >= self.max_context:
                if SKILLS[skill].text == "messages":
                    raise InvalidRequest(f"MESSAGES: the conversation needs {prompt_len} positions with its images, "
                                         f"more than the model's context of {self.max_context}; send fewer or "
                                         "shorter turns")
                field = SKILLS[skill].wire_input() if SKILLS[skill].text_required else "prompt"
                raise InvalidRequest(f"{field} is too long: {prompt_len} tokens with the image, context is {self.max_context}")
            capacity = min(self.max_context, prompt_len + _new_positions(gen, settings, reasoning))
            if self.kv.pages_for(capacity) > self.kv.num_pages:
                raise InvalidRequest(f"request needs {self.kv.pages_for(capacity)} KV pages, the cache has {self.kv.num_pages}")
            if settings.adapter is not None:
                adapter = await self.adapters.acquire(self._adapter_id(settings.adapter))
            detok = IncrementalDetokenizer(self.model.tokenizer) if stream_text(skill, delivery.stream) else None
            seq = Sequence(self.next_sequence_id(), skill, ids, gen, delivery, image_key=key, cropped=cropped,
                           held_embedding=held, capacity=capacity, detok=detok, adapter=adapter,
                           prompt_overrides=overrides, t_submit=arrived, pixels=pixels, later_images=later,
                           batch=batch)
            self.scheduler.add(seq)
        except BaseException:
            if adapter is not None:
                self.adapters.release(adapter)
            raise
        finally:
            self._admitting -= 1


def _quantize(model: Moondream, config: RuntimeConfig) -> None:
    """KESTREL_VISION_FP8 and KESTREL_PREFILL_FP8: FP8 copies of the vision encoder's and of the text model's qkv, fc1
    and fc2 weights (model/fp8.py), where the GPU has FP8 tensor cores. A model an earlier engine quantised is set
    back: this engine's settings decide."""
    from .model.text import quantize_prefill
    from .model.vision import quantize_encoder

    model.weights.vision.fp8 = model.weights.text.fp8 = None
    for name, on, weights, quantize, dim in (
            ("KESTREL_VISION_FP8", config.vision_fp8, model.weights.vision, quantize_encoder,
             model.config.vision.enc_dim),
            ("KESTREL_PREFILL_FP8", config.prefill_fp8, model.weights.text, quantize_prefill, model.config.text.dim)):
        if on:
            _check_fp8_ready(model, name, dim)
            quantize(weights)
            log.info("%s: qkv, fc1 and fc2 in FP8 too", name)


def _check_fp8_ready(model: Moondream, name: str, dim: int) -> None:
    import torch

    if model.device.type != "cuda" or torch.cuda.get_device_capability(model.device) < (8, 9):
        raise ValueError(f"{name}=1 needs a GPU with FP8 tensor cores (compute capability 8.9 or later: "
                         f"L4, L40S, H100, H200, B200); the model is on {model.device}")
    if model.dtype != torch.bfloat16:
        raise ValueError(f"{name}=1 needs KESTREL_DTYPE=bfloat16, not {model.dtype}")
    if dim % 32:  # (the FP8 tensor cores' K step)
        raise ValueError(f"{name}=1 needs a width that is a multiple of 32, not {dim}")


# Tokens per batch slot in the default KV cache: Moondream 2's whole context. A model of longer context (Moondream
# 3: 32k) gets this much per slot (plus room for one full-length sequence) instead of max_batch_size full contexts,
# which would not fit on any GPU; KESTREL_KV_PAGES sets the cache outright.
DEFAULT_TOKENS_PER_SLOT = 2048


def default_kv_pages(max_context: int, page_size: int, max_batch_size: int) -> int:
    pages = lambda tokens: -(-tokens // page_size)  # noqa: E731
    return max(pages(max_context), max_batch_size * pages(min(max_context, DEFAULT_TOKENS_PER_SLOT)))


def _use_device(device) -> None:
    """Make the model's GPU the calling thread's current one (several engines, one per GPU, in one server)."""
    import torch

    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def stream_text(skill: str, stream: bool) -> bool:
    """Only streamed text needs incremental detokenization; other text is decoded once at the end."""
    return stream and SKILLS[skill].streams


def _chaos(scheduler: Scheduler, after: int):
    def fail_late_steps(batch):
        if scheduler.steps >= after:
            raise RuntimeError("chaos: injected device failure")
    return fail_late_steps


def _new_positions(gen: Generation, settings: Settings, reasoning: bool) -> int:
    """KV positions a request can write after its prompt (reserved up front: no preemption)."""
    if isinstance(gen, RegionGeneration):  # x, y (and the size) of each object
        return (3 if gen.with_size else 2) * settings.max_objects
    return settings.max_tokens * (2 if reasoning else 1) + 1
