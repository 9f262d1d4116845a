"""Admission: which waiting sequences join the next step (slots, KV pages, the step's budget, image prefixes that
another sequence prefills in this step), and, under a backlog, which image prefixes are prefilled ahead of their
requests into the prefix cache. A part of the Scheduler (see scheduler.py): it reads and sets the scheduler's
queues and counters."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from .prefix_cache import page_keys
from .sequence import Sequence

# Under a backlog, the requests at the head of the queue whose images are encoded and whose prefixes are prefilled
# ahead (Admission._ahead_window): this many times prefix_ahead. Moondream 3 at batch 64 in chain of thought, with
# decode steps launched ahead, 8 against 4 in turns: 79.5 / 81.0 against 75.9 / 77.9 req/s (H100).
AHEAD_WINDOW_GROUPS = 8
# A person's request that came this recently means people are about: batch lines then yield (they join steps of a
# smaller budget, Admission.step_budget, and leave a decode thread free, InferenceEngine._batch_decodes)
PEOPLE_ABOUT_S = 2.0


@dataclass
class PrefixAhead:
    """An image prefix prefilled before its requests are admitted (Admission._prefixes_ahead): written into the
    pages of a placeholder id, then kept by the prefix cache."""
    key: str
    id: int  # the placeholder's (negative: no request has it)
    inputs: torch.Tensor  # [prefix_len, dim]: BOS and the image's tokens
    first: Sequence  # the waiting request it is prefilled for: its prefill time counts this step's share

    @property
    def prefix_len(self) -> int:
        return self.inputs.shape[0]


class Admission:
    def admit(self) -> list[Sequence]:
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
        if self.step_ahead is not None and leaving < len(self.running) and any(
                seq.id in self.step_ahead[0] for seq in self.running):
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
            if seq.batch and any(not s.batch for s in new + deferred):
                break  # a step that admits a person's request, or encodes its image for the next, admits no batch
                # line: the person's first token waits for no batch prefill
            keys = self._usable_keys(seq)
            shared = self.prefixes.lookup(keys)
            prefix_cached = len(shared) >= self._prefix_pages
            if seq.image_key is not None and not prefix_cached and seq.prefix_key in prefilling or \
                    ahead and self._needs_encode(seq):
                deferred.append(self.waiting.popleft())  # (its image is encoded ahead in this step: see below)
                continue
            cost = self._prefill_cost(seq, len(shared), encoding)
            budget = self.step_budget(seq.batch)
            if new and budget and spent + cost > budget:
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
        return self.attach_images(new)

    def people_about(self) -> bool:
        """Whether a person's (interactive) request came in the last PEOPLE_ABOUT_S: batch work yields while so."""
        return time.monotonic() - self.person_seen < PEOPLE_ABOUT_S

    def step_budget(self, batch: bool) -> int:
        """The step's budget for admitting a batch line (or encoding its image ahead), or a person's request: while
        people's requests are about, batch lines get the smaller batch_step_tokens, so that a person's request that
        comes waits for a shorter step in flight (a batch's steps are otherwise as long as the budget allows)."""
        if batch and self.batch_step_tokens and self.people_about():
            return min(self.batch_step_tokens, self.max_step_tokens or self.batch_step_tokens)
        return self.max_step_tokens

    def _encodes_ahead(self) -> bool:
        """Whether new images are encoded ahead, after a step's work (encode_ahead), rather than in the step
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

    def keep_prefixes(self, prefilled: list[Sequence], ahead: list[PrefixAhead] = ()) -> None:
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
