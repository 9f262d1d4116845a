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
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import EngineError, RequestCancelled
from ..model.layers import to_device
from ..model.lora import LoraRows
from ..model.moondream import Moondream
from ..model.weights import CheckpointError
from ..skills.chat import chat_message
from ..skills.generation import ReasoningThenAnswer, RegionGeneration, SegmentGeneration
from ..skills.sampling import launch_choice
from ..skills.segment import coarse_segment
from .attention import SeqSlice, TorchPagedAttention
from .encode_clock import EncodeClock
from .image_cache import ImageCache
from .kv_cache import PagedKVCache
from .prefix_cache import PrefixCache, page_keys
from .sequence import EngineResult, Sequence, StreamChunk

log = logging.getLogger("kestrel.scheduler")
# Rounds of the engine loop's ready callbacks between two steps (each sleep(0) runs one round). A request
# arriving from Triton's thread takes two chained rounds before it is waiting for admission (its task is
# created, then runs), and a streamed chunk one more to reach its request's coroutine: with one round per
# step, each of those waited for a whole step (under load, several steps of TTFT outside the engine's).
ROUNDS_BETWEEN_STEPS = 3
# Prefill steps that run eagerly (longer than the prefill graphs, or with adapters) are padded to a multiple of this
# many rows, and every such row count past the graphs' longest up to the step budget runs once at start-up
# (warm_eager_prefill): the first step of a row count paid per-shape work on the host (such as cuBLAS choosing its
# kernels for new matrix shapes; no Triton kernel compiled then): 10 ms a step more for Moondream 2 on an H100, 15 to
# 250 for Moondream 3, which held up a server's first burst by 9 to 17%.
EAGER_PAD = 256
# Under a backlog, the requests at the head of the queue whose images are encoded and whose prefixes are prefilled
# ahead (Scheduler._ahead_window): this many times prefix_ahead. Moondream 3 at batch 64 in chain of thought, with
# decode steps launched ahead, 8 against 4 in turns: 79.5 / 81.0 against 75.9 / 77.9 req/s (H100).
AHEAD_WINDOW_GROUPS = 8


class RowsOf:
    """Some rows of a step's tokens on their way to the host (tolist() -> those rows' tokens, in this order)."""

    def __init__(self, tokens, rows: list[int]):
        self.tokens, self.rows = tokens, rows

    def tolist(self) -> list[int]:
        every = self.tokens.tolist()
        return [every[row] for row in self.rows]


@dataclass
class PrefixAhead:
    """An image prefix prefilled before its requests are admitted (Scheduler._prefixes_ahead): written into the
    pages of a placeholder id, then kept by the prefix cache."""
    key: str
    id: int  # the placeholder's (negative: no request has it)
    inputs: torch.Tensor  # [prefix_len, dim]: BOS and the image's tokens
    first: Sequence  # the waiting request it is prefilled for: its prefill time counts this step's share

    @property
    def prefix_len(self) -> int:
        return self.inputs.shape[0]


def make_attention(cache: PagedKVCache):
    """Attention for the flat (prefill) forwards: a Triton kernel for fresh sequences on a GPU."""
    if cache.k.device.type != "cuda":
        return TorchPagedAttention(cache)
    from .prefill_attention import PrefillAttention

    return PrefillAttention(cache)


def make_prefill_graphs(model: Moondream, cache: PagedKVCache, max_context: int, max_batch: int,
                        mixed_steps: bool = False, adapters=None):
    """CUDA graphs for prefill steps on a GPU; None elsewhere. A mixed step holds up to twice max_batch sequences:
    the running ones and the new ones that take the slots of those taking their last token in it (with graphs of
    max_batch, such steps ran eagerly: chain-of-thought bursts 6 to 27% slower)."""
    if model.device.type != "cuda":
        return None
    from .prefill_graphs import PrefillGraphs

    return PrefillGraphs(model, cache, max_context, 2 * max_batch if mixed_steps else max_batch, adapters)


def make_crop_encoder(model: Moondream):
    """CUDA graphs of the vision encoder on a GPU; None (eager) elsewhere."""
    if model.device.type != "cuda":
        return None
    from .vision_graphs import CropEncoderGraphs

    return CropEncoderGraphs(model)


def make_crop_staging(model: Moondream):
    """Crops copied to the GPU ahead of their encode (runtime.crop_staging) on a GPU; None elsewhere."""
    if model.device.type != "cuda":
        return None
    from .crop_staging import CropStaging

    return CropStaging(model)


def check_kernel_shapes(cfg) -> None:
    """Refuse at load, with the widths named, a text model the GPU kernels cannot run (rather than failing inside
    Triton's compiler at the first step)."""
    from ..kernels.decode_kernels import shape_problems

    problems = shape_problems(cfg.dim, cfg.ff_dim, cfg.head_dim, cfg.rope_dim, cfg.vocab_size)
    if problems:
        raise CheckpointError(f"the GPU engine's kernels cannot serve this text model: {'; '.join(problems)} "
                              "(the CPU engine can: KESTREL_DEVICE=cpu)")


def make_decoder(model: Moondream, cache: PagedKVCache, max_batch: int, max_context: int, adapters=None):
    """CUDA graphs of the fused Triton decode kernels on a GPU; None (torch attention) elsewhere."""
    if model.device.type != "cuda":
        return None
    from .cuda_decode import CudaGraphDecoder

    check_kernel_shapes(model.config.text)

    return CudaGraphDecoder(model, cache, max_batch, max_context, adapters)


class Scheduler:
    def __init__(self, model: Moondream, cache: PagedKVCache, image_cache: ImageCache, max_batch_size: int,
                 decoder=None, prefill_graphs=None, prefix_cache_size: int = 0, crop_encoder=None, adapters=None,
                 max_step_tokens: int = 0, admit_group: int = 0, mixed_steps: bool = False, prefix_ahead: int = 0):
        self.model = model
        self.cache = cache
        self.images = image_cache
        # (prefix_cache_size counts image prefixes: that many prefixes' whole pages, whatever prompts fill them)
        self.prefixes = PrefixCache(cache, prefix_cache_size * (model.config.text.prefix_attn // cache.page_size))
        self.max_batch_size = max_batch_size
        self.max_step_tokens = max_step_tokens  # the budget of _admit (0: none)
        self.admit_group = admit_group  # under a backlog, admit no fewer at once (_admit; 0: as slots free)
        # A step that admits sequences runs the running ones' decode inputs in the same forward as the new prompts
        # (eager or a prefill graph) instead of a decode forward (graph) after it: every weight (every expert of a
        # mixture) is read once a step, not twice
        self.mixed_steps = mixed_steps
        # Under a backlog, once this many images of waiting requests are encoded and not in the prefix cache, a
        # step prefills their prefixes together into it (0: off): a prefill step reads every weight (every
        # expert) however few its rows, and otherwise each freed slot's image is prefilled in a step of its own
        self.prefix_ahead = prefix_ahead
        self._placeholder_ids = itertools.count(-(1 << 30), -1)
        self._slots_full = False  # (set by _admit: requests wait for a slot)
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
        self._ahead = None  # a decode step launched before the last one's tokens were read (see _decode)
        self._chosen: dict[int, int] = {}  # the tokens chosen in the last step, by sequence id
        self.steps_ahead = {"used": 0, "dropped": 0}
        self.segment_refiner = None  # runtime.segment_refiner.SegmentRefiner (Moondream 3), or None: coarse outlines
        self._refining: dict[asyncio.Task, Sequence] = {}  # segments being refined after leaving the batch
        self._aborted: EngineError | None = None  # set by abort(): every request, even one added later, ends with it

    def add(self, seq: Sequence) -> None:
        if self._aborted is not None:  # admitted (its image decoded) after the drain deadline passed
            self._end(seq, error=self._aborted)
            return
        self.waiting.append(seq)
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
        t0 = time.perf_counter()  # (a new sequence's prefill time counts its image's encode, launched in _admit)
        new = self._admit()
        decoding = [s for s in self.running if s not in new]
        batch = new + decoding
        if not decoding:
            self._ahead = None  # (its sequences have all ended)
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
                mixed = prefilling and decoding and self.mixed_steps and self._ahead is None  # see mixed_steps
                if prefilling:  # whole prompts (in a mixed step also the running sequences' inputs), prefixes ahead
                    seqs = batch if mixed else new
                    logits, hidden = self._forward_flat(new, decoding if mixed else (), ahead)
                    if seqs:
                        outputs.append((seqs, logits, hidden, None))
                    self._keep_prefixes(new, ahead)
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
                if new and not mixed and self.decoder is not None and self._may_launch_first_decode(new, decoding):
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
                self._chosen = {}
                for (seqs, _, hidden, _), tokens in zip(outputs, chosen):
                    for seq, token, h in zip(seqs, tokens, hidden):
                        self._chosen[seq.id] = token
                        self._advance(seq, token, h)
                t4 = time.perf_counter()
                for phase, dt in zip(self.phase_s, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    self.phase_s[phase] += dt
            self.consecutive_failures = 0
        except Exception as e:  # fail this step's requests only; the engine keeps serving
            log.exception("engine step failed")
            self._ahead = None
            self.consecutive_failures += 1
            for seq in batch:
                self._end(seq, error=EngineError(f"inference step failed: {type(e).__name__}: {e}"))
        finally:
            for a in ahead:  # (the prefix cache holds the pages of those written)
                self.cache.free(a.id)
        self.steps += 1

    def _admit(self) -> list[Sequence]:
        """Waiting sequences into the batch, in arrival order, while slots, pages and the step's budget last. A
        sequence whose image prefix another one prefills in this step waits for the next step, which reads that
        prefix from the prefix cache (questions on one image arrive together: admitted together, each would
        prefill the 730 tokens). The budget (max_step_tokens) keeps a step short while requests pile up: the
        running sequences' next tokens wait for the whole step's encodes and prefills. A sequence taking its last
        token (max_tokens) in this step gives its slot up now: the next request prefills in the same step, rather
        than in a step of its own after the GPU waited for the host to read that token and admit it. With
        admit_group, while more wait than there are free slots, none is admitted until that many slots are free."""
        new, deferred, prefilling, encoding = [], [], set(), set()
        spent, ahead = 0, self._encodes_ahead()
        leaving = sum(not seq.generation.may_continue_after_next_token() for seq in self.running)
        if self._ahead is not None and leaving < len(self.running) and any(
                seq.id in self._ahead[0] for seq in self.running):
            # this step's decode was launched last step: requests join the next one, in its prefill forward (mixed),
            # rather than in one of their own (a forward reads every weight: every expert of a mixture)
            # (nor prefixes ahead, which would be a forward of their own, nor images encoded further ahead than
            # the next two requests' in this step: the GPU's queue holds the next decode step already). Unless every
            # running sequence takes its last token in it: then there is no next step to join, and a prefill
            # launched now runs right after it on the GPU, not after the host has read its tokens.
            self._spent, self._slots_full = 0, False
            return []
        free = self.max_batch_size - (len(self.running) - leaving)
        if self.running and free < min(self.admit_group, len(self.waiting)):
            self._spent, self._slots_full = 0, True  # (the budget goes to encoding waiting images ahead)
            return []  # a prefill step of a few rows reads every weight (every expert) as one of many would
        while self.waiting and len(self.running) - leaving < self.max_batch_size:
            seq = self.waiting[0]
            keys = self._usable_keys(seq)
            shared = self.prefixes.lookup(keys)
            prefix_cached = len(shared) >= self._prefix_pages
            if seq.image_key is not None and not prefix_cached and seq.prefix_key in prefilling or \
                    ahead and self._needs_encode(seq):
                deferred.append(self.waiting.popleft())  # (its image is encoded ahead in this step: see below)
                continue
            cost = self._prefill_cost(seq, len(shared), encoding)
            if new and self.max_step_tokens and spent + cost > self.max_step_tokens:
                break  # (a request larger than the budget still runs: in a step of its own)
            need = self.cache.pages_for(seq.capacity) - len(shared)
            if need > self.cache.pages_free:
                self.prefixes.reclaim(need, keep=set(keys))
                if need > self.cache.pages_free:
                    break  # wait for pages; FIFO keeps big requests from starving
            self.waiting.popleft()
            spent += cost
            if seq.image_key is not None:
                encoding.add(seq.image_key)
            self.cache.allocate(seq.id, seq.capacity, shared)
            seq.length = seq.cached_tokens = len(shared) * self.cache.page_size
            self.prefix_hits += bool(shared)
            if seq.image_key is not None and not prefix_cached and self.prefixes.capacity:
                prefilling.add(seq.prefix_key)
            self.running.append(seq)
            new.append(seq)
        self.waiting.extendleft(reversed(deferred))  # (at the head again, in their order)
        self._spent = spent
        self._slots_full = bool(self.waiting) and len(self.running) - leaving >= self.max_batch_size
        return self._attach_images(new)

    def _encodes_ahead(self) -> bool:
        """Whether new images are encoded ahead, after a step's work (_encode_ahead), rather than in the step
        that admits their sequences: with a step budget, and sequences running (whose steps the encode can
        follow while the engine thread reads their tokens; an idle engine encodes at once)."""
        return bool(self.max_step_tokens and self.running)

    def _needs_encode(self, seq: Sequence) -> bool:
        return seq.image_key is not None and seq.cropped is not None and seq.image_key not in self.images

    def _prefill_cost(self, seq: Sequence, shared_pages: int, encoding: set[str]) -> int:
        """The work admitting seq adds to this step, in prompt tokens: those its prefill writes (an image prefix
        from the prefix cache is not written again), and its image's crops if this step encodes them."""
        tokens = max(self._prompt_len(seq) - shared_pages * self.cache.page_size, 1)
        if self._needs_encode(seq) and seq.image_key not in encoding:
            tokens += len(seq.cropped[0]) * self.crop_cost
        return tokens

    @property
    def _prefix_pages(self) -> int:
        """Whole pages of an image prefix."""
        return self.model.config.text.prefix_attn // self.cache.page_size

    def _page_keys(self, seq: Sequence) -> list[str]:
        """The prefix cache's keys of seq's prompt's whole pages (computed once, at admission: later images and
        spatial refs are in their place then)."""
        if seq.page_keys is None:
            prefix_attn = self.model.config.text.prefix_attn
            seed = f"{seq.adapter.name}#{seq.adapter.uid}" if seq.adapter is not None else ""
            seq.page_keys = page_keys(seed, seq.prompt_units(prefix_attn, prefix_attn - 1), self.cache.page_size)
        return seq.page_keys

    def _prompt_len(self, seq: Sequence) -> int:
        """Its prompt's positions, its image prefix's included (known before admission sets seq.prefix_len)."""
        return (self.model.config.text.prefix_attn if seq.image_key is not None else 0) + len(seq.token_ids)

    def _usable_keys(self, seq: Sequence) -> list[str]:
        """The keys of the pages seq may take from the cache: all but the one holding its last prompt position,
        whose prefill gives the first token."""
        return self._page_keys(seq)[:(self._prompt_len(seq) - 1) // self.cache.page_size]

    def _keep_prefixes(self, prefilled: list[Sequence], ahead: list[PrefixAhead] = ()) -> None:
        """Offer the prompts' whole pages just written to the prefix cache (in stream order, later steps read them
        after this one has written them), and the image prefixes prefilled ahead."""
        written = [seq for seq in prefilled if seq.image_key is not None and not seq.cached_tokens]
        for seq in prefilled:
            self.prefixes.insert(self._page_keys(seq), self.cache.tables[seq.id])
        for a in ahead:
            self.prefixes.insert(self._page_keys(a.first)[:self._prefix_pages], self.cache.tables[a.id])
        self.prefixes_ahead += len(ahead)
        if written or ahead:
            self.steps_by_prefixes_written[len(written) + len(ahead)] += 1

    def _ahead_window(self) -> int:
        """How many requests at the head of the queue have their images encoded and prefilled ahead."""
        return AHEAD_WINDOW_GROUPS * self.prefix_ahead

    def _prefixes_ahead(self, new: list[Sequence], ahead: list[PrefixAhead]) -> None:
        """Under a backlog (every slot taken, requests waiting), the image prefixes of the requests at the head of the
        queue to prefill in this step (appended to `ahead`, each in the pages of a placeholder id), once at least
        prefix_ahead of their images are encoded and not in the prefix cache: those requests then join with their
        prefix cached (a question's few rows, in a decode step), and the prefixes are prefilled several in one
        step. Within what the step's budget has left, leaving the pages the next request needs. No request
        with an adapter (its prefix's KV depends on it)."""
        if not (self.prefix_ahead and self.prefixes.capacity and self._slots_full):
            return
        taken = {seq.prefix_key for seq in new}
        window = list(itertools.islice(self.waiting, self._ahead_window()))
        ready: dict[str, tuple[Sequence, torch.Tensor]] = {}
        for seq in window:
            key = seq.prefix_key
            if seq.image_key is None or seq.adapter is not None or key in ready or key in taken or \
                    self.prefixes.holds(self._page_keys(seq)[:self._prefix_pages]):
                continue
            emb = self._embedding(seq)
            if emb is not None:
                ready[key] = (seq, emb)
        if len(ready) < self.prefix_ahead:
            return
        room = self.max_step_tokens - self._spent if self.max_step_tokens else 1 << 62
        reserve = self.cache.pages_for(self.waiting[0].capacity)
        needed = {key for seq in window if seq.image_key is not None  # (prefixes of other images may make room)
                  for key in self._page_keys(seq)[:self._prefix_pages]}
        for key, (seq, emb) in ready.items():
            rows = emb.shape[0] + 1  # (BOS and the image: image_prefix's rows, built once they fit)
            if rows > room:
                break
            self.prefixes.reclaim(self.cache.pages_for(rows) + reserve, keep=needed)
            if self.cache.pages_free < self.cache.pages_for(rows) + reserve:
                break
            ahead.append(PrefixAhead(key, next(self._placeholder_ids), self.model.image_prefix(emb), seq))
            self.cache.allocate(ahead[-1].id, rows)
            room -= rows
        self._spent = self.max_step_tokens - room if self.max_step_tokens else 0

    def _attach_images(self, seqs: list[Sequence]) -> list[Sequence]:
        """Image prefixes (and a conversation's later image blocks) for newly admitted sequences: cached embeddings,
        else one batched encode."""
        self._restore_held(seqs)
        pending: dict[str, list[Sequence]] = {}
        for seq in seqs:
            if seq.image_key is not None and seq.held_embedding is None and seq.image_key not in self.images:
                pending.setdefault(seq.image_key, []).append(seq)
            for later in seq.later_images:
                if later.held_embedding is None and later.key not in self.images:
                    pending.setdefault(later.key, []).append(seq)
        if pending and not self._encode(pending):
            seqs = [seq for seq in seqs if seq.image_key not in pending
                    and not any(later.key in pending for later in seq.later_images)]
        for seq in seqs:
            if seq.image_key is not None:
                emb = self._embedding(seq)
                seq.cropped = seq.held_embedding = None
                seq.prefix_len = emb.shape[0] + 1
                seq.next_input = self.model.image_prefix(emb)
            if seq.later_images:
                self._place_later_images(seq)
        return seqs

    def _place_later_images(self, seq: Sequence) -> None:
        """A conversation's later images' rows into its prompt, each a block of its own for the attention."""
        overrides, blocks = dict(seq.prompt_overrides or {}), []
        for later in seq.later_images:
            emb = later.held_embedding if later.held_embedding is not None else self.images.get(later.key)
            overrides[later.index] = emb
            start = seq.prefix_len + later.index
            blocks.append((start, start + emb.shape[0]))
        seq.prompt_overrides, seq.blocks, seq.later_images = overrides, tuple(blocks), []

    def _embedding(self, seq: Sequence) -> torch.Tensor | None:
        """seq's image embedding: the one it holds (found cached on arrival), else the image cache's, if there."""
        return seq.held_embedding if seq.held_embedding is not None else self.images.get(seq.image_key)

    def _restore_held(self, seqs) -> None:
        """Embeddings that admitted requests found cached on arrival and the cache has evicted since: back into
        it, as a cache hit would have refreshed them (the requests themselves use the embedding they hold)."""
        for seq in seqs:
            if seq.held_embedding is not None and seq.image_key not in self.images:
                self.images.put(seq.image_key, seq.held_embedding)

    def _encode(self, pending: dict[str, list[Sequence]]) -> bool:
        """Encode the images of pending (image key -> the sequences that need it) as one batch into the image
        cache. On failure, end those sequences (and only them) with the error: -> False."""
        try:
            embeddings = self.model.encode_cropped([self._crops(key, group) for key, group in pending.items()],
                                                   self.crop_encoder)
        except Exception as e:
            log.exception("image encoding failed")
            for seq in [seq for group in pending.values() for seq in group]:
                self._end(seq, error=EngineError(f"image encoding failed: {type(e).__name__}: {e}"))
            return False
        for key, emb in zip(pending, embeddings):
            self.images.put(key, emb)
        self.images_encoded += len(pending)
        return True

    def _prepare_next_step(self) -> None:
        """The GPU's share of the next step, launched behind this step's work so that it runs while the engine
        thread reads this step's tokens, streams them and admits: the images of the sequences the next step
        admits encoded, and later images' crops copied in. A failure here ends no other request."""
        if self._encodes_ahead():
            self._encode_ahead()
        if self.crop_staging is not None:
            try:
                self.crop_staging.stage(self.waiting, self.images)
            except Exception:  # (the encode copies the crops in itself)
                log.exception("staging crops on the GPU failed")

    def _encode_ahead(self) -> None:
        """Encode the images of the sequences at the head of the queue, as many as the next step can admit (at
        least two: a question or two on the next image), within what the step's budget has left; at least one
        image, so that an image larger than the budget is still encoded. Each image's encode time is counted in
        the prefill time of the sequence it was encoded for."""
        room = self.max_step_tokens - self._spent
        window = max(self.max_batch_size - len(self.running), 2, self._ahead_window() if self._slots_full else 0)
        needing: dict[str, Sequence] = {}  # image key -> the first sequence that needs its encode
        for seq in itertools.islice(self.waiting, window):
            if not self._needs_encode(seq) or seq.image_key in needing:
                continue
            cost = len(seq.cropped[0]) * self.crop_cost
            if needing and cost > room:
                break
            room -= cost
            needing[seq.image_key] = seq
        if not needing:
            return
        pending = {key: [seq for seq in self.waiting if seq.image_key == key] for key in needing}
        clock = EncodeClock(self.model.device)
        if self._encode(pending):
            clock.stop(len(pending))
            for seq in needing.values():  # (not one that arrived holding the cached embedding: it waited for none)
                seq.encoded_ahead = clock

    def _crops(self, key: str, group: list[Sequence]):
        """(crops, tiling) of an image to encode, from the sequences that need it (those that arrived while it
        was cached carry none): its crops staged on the GPU if they are."""
        cropped = next(c for seq in group for c in [seq.cropped if seq.image_key == key else None] +
                       [later.cropped for later in seq.later_images if later.key == key] if c is not None)
        staged = self.crop_staging.take(key) if self.crop_staging is not None else None
        return cropped if staged is None else (staged, cropped[1])

    def _inputs(self, seqs: list[Sequence]) -> torch.Tensor:
        """This step's input embedding of each running sequence: a token's, or a region head's."""
        m = self.model
        ids = [seq.next_input if isinstance(seq.next_input, int) else 0 for seq in seqs]
        x = m.embed_tokens(ids)
        for i, seq in enumerate(seqs):
            if not isinstance(seq.next_input, int):
                x[i] = seq.next_input.reshape(-1)
        return x

    def _decode(self, seqs: list[Sequence], launch_ahead: bool = False):
        """-> (logits, hidden, greedy tokens when the step chose them already, or None). launch_ahead:
        the next step will decode the same sequences, if none finishes."""
        if self.decoder is None:
            return *self._forward_flat([], seqs), None
        ids, positions = [s.id for s in seqs], [s.length for s in seqs]
        choices = [s.generation.choice() for s in seqs]
        banned = [c.banned for c in choices]
        rows, outputs = self._launched_ahead(seqs, ids, positions, banned)
        if outputs is not None:
            logits, hidden, greedy = outputs  # launched last step, with these inputs (and maybe rows since ended)
            self.steps_ahead["used"] += 1
        else:
            slots = [s.adapter.slot if s.adapter is not None else 0 for s in seqs]
            logits, hidden, greedy = self.decoder.run([s.next_input for s in seqs], ids, positions, banned, slots)
        for seq in seqs:
            seq.length += 1
        positions = [s.length for s in seqs]
        if launch_ahead and greedy is not None and rows is None and self._may_launch_ahead(seqs, choices):
            self._launch_ahead(ids, positions, banned)  # (while the GPU runs this step)
        else:
            self.decoder.prepare(ids, positions)  # stage the next step's rows while the GPU runs this one
        return logits, hidden, greedy

    def _launched_ahead(self, seqs: list[Sequence], ids, positions, banned):
        """The decode step launched last step, if it computed these sequences' inputs: -> (None, its outputs) if it
        holds exactly them, (their rows in it, their outputs) if it also holds rows that have ended since (ended by
        a stop token, cancelled: their tokens are dropped, their cache writes land in pages they give back), else
        (None, None): it is dropped (its writes land in slots that this step rewrites)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None, None
        held = {seq_id: (row, pos, ban) for row, (seq_id, pos, ban) in enumerate(zip(*ahead[:3]))}
        rows = [held.get(seq_id, (None,))[0] for seq_id in ids]
        if None in rows or any(held[i][1:] != (p, b) for i, p, b in zip(ids, positions, banned)) or not all(
                isinstance(s.next_input, int) and s.next_input == self._chosen.get(s.id) for s in seqs):
            self.steps_ahead["dropped"] += 1
            return None, None
        logits, hidden, greedy = ahead[3]
        if rows == list(range(len(ahead[0]))):
            return None, (logits, hidden, greedy)
        index = to_device(rows, torch.long, logits.device)
        return rows, (logits.index_select(0, index), hidden.index_select(0, index), RowsOf(greedy, rows))

    def _launch_ahead(self, ids: list[int], positions: list[int], banned: list[tuple[int, ...]]) -> None:
        """Launch a decode step of these sequences before the host has read their inputs, the tokens the GPU's last
        step chose (fed back on the GPU): the next step uses it if the guess holds, else drops it."""
        self._ahead = (ids, positions, banned, self.decoder.run([self.decoder.FED_BACK] * len(ids), ids, positions,
                                                                banned))

    def _may_launch_ahead(self, seqs: list[Sequence], choices) -> bool:
        """Whether to launch the next decode step of seqs (all the sequences it will hold) now: its inputs are
        predictable, and no waiting request could take a free slot in it (_admit holds requests back while a step
        launched ahead is in flight: one step, as none is launched again while they wait)."""
        room = self.waiting and len(seqs) < self.max_batch_size
        return not room and self._predictable(seqs, choices)

    def _may_launch_first_decode(self, new: list[Sequence], decoding: list[Sequence]) -> bool:
        """Whether the sequences this step prefilled alone (not mixed) have their first decode step launched now,
        behind their prefill, taking its tokens on the GPU: when the next step decodes exactly them (every running
        sequence takes its last token in this step, no waiting request could take a free slot), and their inputs
        are predictable (greedy text, no adapter). At one slot that is every request: the GPU would otherwise wait
        for the host to read the prefill's token and launch the step (the image encoded ahead fills that wait for
        every second request only)."""
        if any(s.generation.may_continue_after_next_token() for s in decoding) or any(
                s.adapter is not None for s in new):
            return False
        return self._may_launch_ahead(new, [s.generation.choice() for s in new])

    def _launch_first_decode(self, new: list[Sequence], tokens) -> None:
        """Launch the decode step after the prefill of `new` ahead, its inputs the prefill's chosen tokens (still on
        the GPU: TokensToHost)."""
        self.decoder.feed_back(tokens.on_device)
        self._launch_ahead([s.id for s in new], [s.length for s in new],
                           [s.generation.banned_after_next_token() for s in new])

    @staticmethod
    def _predictable(seqs: list[Sequence], choices) -> bool:
        """Whether the next step's inputs are this step's tokens, with the same bans: every sequence
        generates text greedily and has room for another token, which its max_tokens allows (one ending with this
        step's token leaves the next step, which would drop a step launched ahead: for a direct answer of 3 tokens,
        one step in 3)."""
        return all(s.generation.feeds_back_tokens and c.temperature == 0 and s.length < s.capacity
                   and s.generation.may_continue_after_next_token() for s, c in zip(seqs, choices))

    def _forward_flat(self, prefilling: list[Sequence], decoding: list[Sequence] = (),
                      ahead: list[PrefixAhead] = ()):
        """One forward over a flat token list through self.attention: the whole prompts of `prefilling` (from the
        first position not in the cache yet), then one input of each of `decoding`, then the image prefixes of
        `ahead`. -> (logits, last hidden) of each sequence of prefilling and decoding, in that order."""
        m, pieces = self.model, []
        for seq in prefilling:
            x = m.embed_prompt(seq.token_ids, seq.prompt_overrides)
            pieces.append((torch.cat([seq.next_input, x], dim=0) if seq.prefix_len else x)[seq.length:])
        if decoding:
            pieces += list(self._inputs(decoding)[:, None, :])
        pieces += [a.inputs for a in ahead]
        seqs, prefill = list(prefilling) + list(decoding), bool(prefilling or ahead)
        spans = [(s.id, s.length, s.prefix_len, s.blocks) for s in seqs] + [(a.id, 0, a.prefix_len, ()) for a in ahead]
        positions = to_device(np.concatenate([np.arange(first, first + len(x)) for (_, first, _, _), x in
                                              zip(spans, pieces)]), torch.long, m.device)  # (one copy a step)
        slices, start = [], 0
        for (seq_id, first, prefix_len, blocks), x in zip(spans, pieces):
            blocks = tuple(b for b in blocks if b[1] > first)  # (those this step's rows still write)
            slices.append(SeqSlice(seq_id, start, start + len(x), first, prefix_len, positions[start:start + len(x)],
                                   blocks))
            start += len(x)
        for seq, x in zip(seqs, pieces):
            seq.length += len(x)
        x = torch.cat(pieces)
        lora = LoraRows.of([s.adapter for s in seqs] + [None] * len(ahead), [len(p) for p in pieces])
        blocks = any(s.blocks for s in slices)  # (later image blocks: the torch attention's general mask takes them)
        graphs = self.prefill_graphs
        if prefill and graphs is not None and (lora is None or graphs.takes_adapters) and not blocks and \
                graphs.fits([len(p) for p in pieces]):
            slots = None if lora is None else [s.adapter.slot if s.adapter else 0 for s in seqs] + [0] * len(ahead)
            logits, hidden = graphs.run(x, slices, slots)
            return logits[:len(seqs)], hidden[:len(seqs)]
        pad = -x.shape[0] % self.eager_pad if prefill and self.eager_pad else 0
        if pad:  # (padded rows: computed, neither stored nor attended to, dropped; no adapter's span covers them)
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
            positions = torch.cat([positions, positions.new_zeros(pad)])
        attention = self.block_attention if blocks else self.attention
        attention.plan(slices)
        hidden = m.forward(x, positions, attention, lora)
        last = hidden.index_select(0, to_device([s.end - 1 for s in slices[:len(seqs)]], torch.long, hidden.device))
        return m.logits(last), last

    def warm_eager_prefill(self, up_to: int) -> None:
        """Run an eager prefill step of every padded row count from past the prefill graphs' longest to up_to (at
        most what the free KV pages hold) once, now, not under the first requests (see EAGER_PAD). Its sequences
        are placeholders whose pages go back at once."""
        if not self.eager_pad:
            return
        m, longest = self.model, self.prefill_graphs.max_rows if self.prefill_graphs is not None else 0
        up_to = min(up_to, self.cache.pages_free * self.cache.page_size)
        with torch.inference_mode():
            for rows in range(longest + self.eager_pad, up_to + 1, self.eager_pad):
                ids = range(-1, -1 - -(-rows // 1024), -1)  # (ids no request has) of up to 1024 rows each
                slices, start = [], 0
                for seq_id in ids:
                    n = min(1024, rows - start)
                    self.cache.allocate(seq_id, n)
                    positions = torch.arange(n, device=m.device)
                    slices.append(SeqSlice(seq_id, start, start + n, 0, 0, positions))
                    start += n
                try:
                    self.attention.plan(slices)
                    x = torch.randn(rows, m.config.text.dim, device=m.device, dtype=m.dtype)  # (spread over experts)
                    m.forward(x, torch.cat([s.positions for s in slices]), self.attention)
                finally:
                    for seq_id in ids:
                        self.cache.free(seq_id)

    def _advance(self, seq: Sequence, token: int, hidden: torch.Tensor) -> None:
        if not seq.t_first:
            seq.t_first = time.perf_counter()
        gen = seq.generation
        nxt = gen.on_output(token, hidden)
        self._stream(seq)
        if nxt is None:
            self._end(seq)
        elif seq.length >= seq.capacity:
            gen._finish("length")
            self._end(seq)
        else:
            seq.next_input = nxt

    def _stream(self, seq: Sequence) -> None:
        if seq.detok is None:
            return
        tokens = seq.generation.tokens
        while seq.streamed_tokens < len(tokens):
            text = seq.detok.add(tokens[seq.streamed_tokens])
            seq.streamed_tokens += 1
            if text:
                seq.delivery.chunk(StreamChunk(text, seq.streamed_tokens - 1))

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

    async def _refine(self, seq: Sequence, result: EngineResult) -> None:
        """A finished segment's outline refined (its pages are free already), then delivered. A refinement that
        fails keeps the coarse outline: the request still gets its answer."""
        segments = result.output["segments"]
        try:
            segments[0] = await self.segment_refiner.refine(segments[0], seq.pixels)
        except Exception:
            log.exception("segment refinement failed: answering with the coarse outline")
        seq.pixels = None
        result.metrics["refine_time_ms"] = round((time.perf_counter() - seq.t_end) * 1000, 3)
        seq.delivery.finish(result, None)

    def _result(self, seq: Sequence) -> EngineResult:
        gen, now = seq.generation, time.perf_counter()
        seq.t_end = now
        token_ids = []
        if isinstance(gen, RegionGeneration):
            key = "objects" if gen.with_size else "points"
            output = {key: [{k: min(1.0, max(0.0, v)) for k, v in obj.items()} for obj in gen.objects]}
            n_out = len(gen.objects)
        elif isinstance(gen, SegmentGeneration):
            output = {"segments": [coarse_segment(gen.object_text, self.model.tokenizer, gen.text_ids, gen.coords,
                                                  gen.sizes)]}
            n_out = len(gen.tokens)
        else:
            text = seq.detok.text if seq.detok else self.model.tokenizer.decode(gen.tokens)
            output = {"caption" if seq.skill == "caption" else "answer": text}
            n_out, token_ids = len(gen.tokens), list(gen.tokens)
            if isinstance(gen, ReasoningThenAnswer):
                output["reasoning"] = self._reasoning(gen)
                n_out += len(gen.reasoning_tokens)
            if seq.skill == "chat":
                output = {"message": chat_message(output)}
        metrics = {
            "input_tokens": seq.input_tokens,
            "output_tokens": n_out,
            "prefill_time_ms": round(seq.prefill_ms, 3),
            "decode_time_ms": round((now - seq.t_first) * 1000, 3),
            "ttft_ms": round((seq.t_first - seq.t_submit) * 1000, 3),
            "cached_tokens": seq.cached_tokens,
        }
        return EngineResult(output, gen.finish_reason, metrics, token_ids)

    def _reasoning(self, gen: ReasoningThenAnswer) -> dict:
        tok = self.model.tokenizer
        texts = [tok.decode(chunk) for chunk in gen.chunks]
        grounding, start = [], 0
        for text, coords in zip(texts, gen.coords):
            if len(coords) > 1:
                points = [(coords[i], coords[i + 1]) for i in range(0, len(coords) - 1, 2)]
                grounding.append({"start_idx": start, "end_idx": start + len(text), "points": points})
            start += len(text)
        return {"text": "".join(texts), "grounding": grounding}
