"""Images for the sequences a step admits: embeddings from the image cache, else one batched encode; a
conversation's later images placed in its prompt; and, behind a step's work on the GPU, the images of the next
step's sequences encoded ahead and their crops staged. A part of the Scheduler (see scheduler.py)."""

from __future__ import annotations

import itertools
import logging

import torch

from ..errors import EngineError
from .encode_clock import EncodeClock
from .sequence import Sequence
from .vision_stream import VISION_AHEAD_REQUESTS, on_vision_stream

log = logging.getLogger("kestrel.scheduler")


class ImageFeed:
    def attach_images(self, seqs: list[Sequence]) -> list[Sequence]:
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
            emb = self._embedding_of(later.key, later.held_embedding)
            overrides[later.index] = emb
            start = seq.prefix_len + later.index
            blocks.append((start, start + emb.shape[0]))
        seq.prompt_overrides, seq.blocks, seq.later_images = overrides, tuple(blocks), []

    def _embedding(self, seq: Sequence) -> torch.Tensor | None:
        """seq's image embedding (see _embedding_of)."""
        return self._embedding_of(seq.image_key, seq.held_embedding)

    def _embedding_of(self, key: str, held: torch.Tensor | None) -> torch.Tensor | None:
        """An image's embedding: the one a request holds (found cached on arrival), else the image cache's, if there;
        the step's GPU work queued from here on reads it after its encode (on the vision stream, if there is one)."""
        emb = held if held is not None else self.images.get(key)
        if emb is not None and self.vision_stream is not None:
            self.vision_stream.wait_for(key)
        return emb

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
            with on_vision_stream(self.vision_stream):
                embeddings = self.model.encode_cropped([self._crops(key, group) for key, group in pending.items()],
                                                       self.crop_encoder)
                if self.vision_stream is not None:
                    self.vision_stream.hand_over(dict(zip(pending, embeddings)))
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
            self.encode_ahead()
        if self.crop_staging is not None:
            try:
                with on_vision_stream(self.vision_stream):  # (the encodes that take them run there)
                    self.crop_staging.stage(self.waiting, self.images)
            except Exception:  # (the encode copies the crops in itself)
                log.exception("staging crops on the GPU failed")

    def encode_ahead(self) -> None:
        """Encode the images of the sequences at the head of the queue, as many as the next step can admit (at
        least two: a question or two on the next image), within what the step's budget has left; at least one
        image, so that an image larger than the budget is still encoded. Each image's encode time is counted in
        the prefill time of the sequence it was encoded for."""
        window = max(self.max_batch_size - len(self.running), 2, self._ahead_window() if self._slots_full else 0)
        if self.vision_stream is not None:  # (encodes there run beside the decode steps: further ahead)
            window = max(window, VISION_AHEAD_REQUESTS)
        needing: dict[str, Sequence] = {}  # image key -> the first sequence that needs its encode
        head = list(itertools.islice(self.waiting, window))
        people = [seq for seq in head if not seq.batch]
        if people:  # a person's request waits: its image alone (the step is short)
            head = people
        room = self.step_budget(batch=not people) - self._spent
        for seq in head:
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
        with on_vision_stream(self.vision_stream):  # (its events timing the encode where it runs)
            clock = EncodeClock(self.model.device)
            encoded = self._encode(pending)
            if encoded:
                clock.stop(len(pending))
        if encoded:
            for seq in needing.values():  # (not one that arrived holding the cached embedding: it waited for none)
                seq.encoded_ahead = clock

    def _crops(self, key: str, group: list[Sequence]):
        """(crops, tiling) of an image to encode, from the sequences that need it (those that arrived while it
        was cached carry none): its crops staged on the GPU if they are."""
        cropped = next(c for seq in group for c in [seq.cropped if seq.image_key == key else None] +
                       [later.cropped for later in seq.later_images if later.key == key] if c is not None)
        staged = self.crop_staging.take(key) if self.crop_staging is not None else None
        return cropped if staged is None else (staged, cropped[1])
