"""Continuous batching on the engine thread.

Each step prefills the whole prompt of every newly admitted sequence (one forward over a flat token
list; on a GPU its attention is one Triton kernel per layer, and one sequence alone replays a CUDA graph;
a sequence whose image prefix is in the prefix cache starts with those KV pages and prefills the rest),
then runs one decode forward over one input of every running sequence (a CUDA graph on a GPU), then
chooses all their tokens at once. With mixed steps, a step that admits sequences takes the running ones'
inputs into its prefill forward instead. Under a backlog, the image prefixes of requests still waiting for a slot
are prefilled ahead, several in one step, into the prefix cache. Sequences join between steps and leave
as soon as they finish, fail or are cancelled; their KV pages go back to the free list.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import Counter, deque

import torch

from ..errors import EngineError, RequestCancelled
from ..model.moondream import Moondream
from ..skills.sampling import launch_choice
from .admission import Admission, PrefixAhead
from .attention import TorchPagedAttention
from .gpu_parts import make_attention, make_crop_staging
from .image_cache import ImageCache
from .image_feed import ImageFeed
from .kv_cache import PagedKVCache
from .prefix_cache import PrefixCache
from .results import ResultShaping
from .sequence import Sequence, StreamChunk
from .step_runner import EAGER_PAD, StepRunner

log = logging.getLogger("kestrel.scheduler")
# Rounds of the engine loop's ready callbacks between two steps (each sleep(0) runs one round). A request
# arriving from Triton's thread takes two chained rounds before it is waiting for admission (its task is
# created, then runs), and a streamed chunk one more to reach its request's coroutine: with one round per
# step, each of those waited for a whole step (under load, several steps of TTFT outside the engine's).
ROUNDS_BETWEEN_STEPS = 3


class Scheduler(Admission, ImageFeed, StepRunner, ResultShaping):
    """The batch's state and its step; each of its jobs is a part of its own: which sequences join (admission.py),
    their images (image_feed.py), the forwards (step_runner.py), what the tokens become (results.py). Sequences
    leave here (_end)."""

    def __init__(self, model: Moondream, cache: PagedKVCache, image_cache: ImageCache, max_batch_size: int,
                 decoder=None, prefill_graphs=None, prefix_cache_size: int = 0, crop_encoder=None, adapters=None,
                 max_step_tokens: int = 0, admit_group: int = 0, mixed_steps: bool = False, prefix_ahead: int = 0,
                 batch_step_tokens: int = 0, vision_stream=None):
        self.model = model
        self.cache = cache
        self.images = image_cache
        # (prefix_cache_size counts image prefixes: that many prefixes' whole pages, whatever prompts fill them)
        self.prefixes = PrefixCache(cache, prefix_cache_size * (model.config.text.prefix_attn // cache.page_size))
        self.max_batch_size = max_batch_size
        self.max_step_tokens = max_step_tokens  # the budget of admit (0: none)
        self.batch_step_tokens = batch_step_tokens  # batch lines' budget while people are about (step_budget; 0: none)
        self.person_seen = float("-inf")  # when the last interactive request came (time.monotonic; set by the engine)
        self.admit_group = admit_group  # under a backlog, admit no fewer at once (admit; 0: as slots free)
        # A step that admits sequences runs the running ones' decode inputs in the same forward as the new prompts
        # (eager or a prefill graph) instead of a decode forward (graph) after it: every weight (every expert of a
        # mixture) is read once a step, not twice
        self.mixed_steps = mixed_steps
        # Under a backlog, once this many images of waiting requests are encoded and not in the prefix cache, a
        # step prefills their prefixes together into it (0: off): a prefill step reads every weight (every
        # expert) however few its rows, and otherwise each freed slot's image is prefilled in a step of its own
        self.prefix_ahead = prefix_ahead
        self._placeholder_ids = itertools.count(-(1 << 30), -1)
        self._slots_full = False  # (set by admit: requests wait for a slot)
        self.prefixes_ahead = 0  # image prefixes prefilled ahead of their requests
        # steps by how many image prefixes they wrote (their sequences' or ahead of them): a prefill step reads every
        # weight (every expert) however few its rows, so fewer, larger ones cost less
        self.steps_by_prefixes_written: Counter = Counter()
        self.crop_cost = model.config.crop_cost_in_tokens
        self._spent = 0  # of the budget, by this step's admissions
        self.attention = make_attention(cache)
        # a step with a conversation's later image blocks: the torch path's general mask (the GPU kernel's mask
        # knows only the image prefix; on the CPU the two are alike)
        self.block_attention = TorchPagedAttention(cache)
        self.decoder = decoder
        self.prefill_graphs = prefill_graphs  # graphs for prefill steps (make_prefill_graphs), or None
        self.crop_encoder = crop_encoder  # graphs of the vision encoder, or None (eager)
        self.vision_stream = vision_stream  # the image path's own CUDA stream (runtime.vision_stream), or None
        self.crop_staging = make_crop_staging(model)
        self.eager_pad = EAGER_PAD if model.device.type == "cuda" else 0  # (0: eager prefill steps as they are)
        self.adapters = adapters  # the AdapterRegistry that sequences' adapters are pinned in
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._wake = asyncio.Event()
        self._stopping = False
        self.steps = 0
        self.steps_mixed = 0  # of them, steps whose prefill forward took the running sequences' decode rows
        self.consecutive_failures = 0  # steps failing back to back: the device may be unusable
        self.images_encoded = 0
        self.prefix_hits = 0  # sequences admitted with their image prefix's KV pages shared
        self.phase_s = {"prefill": 0.0, "decode": 0.0, "choose": 0.0, "advance": 0.0}  # where step time goes
        self.fault_injector = None  # tests and chaos runs: a callable run inside each step
        self.step_ahead = None  # a decode step launched before the last one's tokens were read (see _decode)
        self.chosen: dict[int, int] = {}  # the tokens chosen in the last step, by sequence id
        self.steps_ahead = {"used": 0, "dropped": 0}
        self.segment_refiner = None  # runtime.segment_refiner.SegmentRefiner (Moondream 3), or None: coarse outlines
        self._refining: dict[asyncio.Task, Sequence] = {}  # segments being refined after leaving the batch
        self._aborted: EngineError | None = None  # set by abort(): every request, even one added later, ends with it

    def add(self, seq: Sequence) -> None:
        if self._aborted is not None:  # admitted (its image decoded) after the drain deadline passed
            self._end(seq, error=self._aborted)
            return
        if seq.batch:
            self.waiting.append(seq)
        else:  # ahead of every batch line waiting, behind the interactive requests that came before it
            self.waiting.insert(next((i for i, s in enumerate(self.waiting) if s.batch), len(self.waiting)), seq)
        self._wake.set()

    def abort(self, error: EngineError) -> None:
        """End every request now with `error`: waiting, running, being refined, and any added later (the drain
        deadline passed, or the engine shuts down). Their KV pages and adapter pins go back at once."""
        self._aborted = error
        for seq in list(self.waiting) + self.running:
            self._end(seq, error=error)
        for task, seq in list(self._refining.items()):
            task.cancel()
            seq.delivery.fail(error)

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    async def run(self) -> None:
        while not self._stopping:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            self.step()
            for _ in range(ROUNDS_BETWEEN_STEPS):
                await asyncio.sleep(0)
        refining = list(self._refining)
        self.abort(EngineError("engine shut down"))
        await asyncio.gather(*refining, return_exceptions=True)

    # --- one step ---
    def step(self) -> None:
        for seq in [s for s in list(self.waiting) + self.running if s.delivery.cancelled.is_set()]:
            self._end(seq, error=RequestCancelled("request cancelled"))
        t0 = time.perf_counter()  # (a new sequence's prefill time counts its image's encode, launched in admit)
        new = self.admit()
        decoding = [s for s in self.running if s not in new]
        batch = new + decoding
        if not decoding:
            self.step_ahead = None  # (its sequences have all ended)
        if not batch:
            return
        ahead: list[PrefixAhead] = []
        try:
            with torch.inference_mode():
                if self.fault_injector:
                    self.fault_injector(batch)
                self._prefixes_ahead(new, ahead)
                outputs = []
                prefilling = new or ahead
                mixed = prefilling and decoding and self.mixed_steps and self.step_ahead is None  # see mixed_steps
                if prefilling:  # whole prompts (in a mixed step also the running sequences' inputs), prefixes ahead
                    seqs = batch if mixed else new
                    logits, hidden = self.forward_flat(new, decoding if mixed else (), ahead)
                    if seqs:
                        outputs.append((seqs, logits, hidden, None))
                    self.keep_prefixes(new, ahead)
                if mixed:
                    staying = [s for s in decoding + new if s.generation.may_continue_after_next_token()]
                    if self.decoder is not None and staying:  # (the next step's rows, unless some end early)
                        self.decoder.prepare([s.id for s in staying], [s.length for s in staying])
                    decoding, self.steps_mixed = [], self.steps_mixed + 1
                t1 = time.perf_counter()
                if decoding:  # one input per running sequence (next step's alike unless sequences join now)
                    outputs.append((decoding, *self._decode(decoding, launch_ahead=not new)))
                picks = [launch_choice(logits, [seq.generation.choice() for seq in seqs], greedy)
                         for seqs, logits, _, greedy in outputs]
                if new and not mixed and self.decoder is not None and self.may_launch_first_decode(new, decoding):
                    self._launch_first_decode(new, picks[0])
                t2 = time.perf_counter()
                self._prepare_next_step()  # (on the GPU after this step's work, while the tokens are read)
                chosen = [tokens.tolist() for tokens in picks]
                t3 = time.perf_counter()
                for a in ahead:  # (each prefix its share of the step)
                    a.first.prefilled_ahead_ms += (t3 - t0) * 1000 / len(ahead)
                for seq in new:  # until its first token is chosen (and its image's encode and prefix, if done ahead)
                    seq.prefill_ms = ((t3 - t0) * 1000 + (seq.encoded_ahead.ms() if seq.encoded_ahead else 0.0)
                                      + seq.prefilled_ahead_ms)
                self.chosen = {}
                for (seqs, _, hidden, _), tokens in zip(outputs, chosen):
                    for seq, token, h in zip(seqs, tokens, hidden):
                        self.chosen[seq.id] = token
                        self._advance(seq, token, h)
                t4 = time.perf_counter()
                for phase, dt in zip(self.phase_s, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    self.phase_s[phase] += dt
            self.consecutive_failures = 0
        except Exception as e:  # fail this step's requests only; the engine keeps serving
            log.exception("engine step failed")
            self.step_ahead = None
            self.consecutive_failures += 1
            for seq in batch:
                self._end(seq, error=EngineError(f"inference step failed: {type(e).__name__}: {e}"))
        finally:
            for a in ahead:  # (the prefix cache holds the pages of those written)
                self.cache.free(a.id)
        self.steps += 1

    # --- leaving ---
    def _end(self, seq: Sequence, error: BaseException | None = None) -> None:
        self.cache.free(seq.id)
        if seq.adapter is not None:
            self.adapters.release(seq.adapter)
            seq.adapter = None
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if error is not None:
            seq.delivery.fail(error)
            return
        last = None
        if seq.detok is not None:
            last = StreamChunk(seq.detok.flush(), max(len(seq.generation.tokens) - 1, 0), final=True)
        result = self._result(seq)
        if seq.pixels is not None and self.segment_refiner is not None:
            task = asyncio.get_running_loop().create_task(self._refine(seq, result))
            self._refining[task] = seq
            task.add_done_callback(self._refining.pop)
            return
        seq.delivery.finish(result, last)
