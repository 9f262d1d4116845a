"""What a step's tokens become: each sequence advanced by its token (its generation decides what comes next),
text streamed as it is decoded, and a finished sequence's result shaped for its skill (answer, caption, points,
objects, segments, a chat message; reasoning and its grounding) with its metrics. A part of the Scheduler (see
scheduler.py)."""

from __future__ import annotations

import logging
import time

import torch

from ..skills.catalog import SKILLS
from ..skills.chat import chat_message
from ..skills.generation import ReasoningThenAnswer, RegionGeneration, SegmentGeneration
from ..skills.segment import coarse_segment
from .sequence import EngineResult, Sequence, StreamChunk

log = logging.getLogger("kestrel.scheduler")


class ResultShaping:
    def _advance(self, seq: Sequence, token: int, hidden: torch.Tensor) -> None:
        if not seq.t_first:
            seq.t_first = time.perf_counter()
        gen = seq.generation
        nxt = gen.on_output(token, hidden)
        self._stream(seq)
        if nxt is None:
            self._end(seq)
        elif seq.length >= seq.capacity:
            gen.finish("length")
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
        token_ids, key = [], SKILLS[seq.skill].result
        if isinstance(gen, RegionGeneration):
            output = {key: [{k: min(1.0, max(0.0, v)) for k, v in obj.items()} for obj in gen.objects]}
            n_out = len(gen.objects)
        elif isinstance(gen, SegmentGeneration):
            output = {key: [coarse_segment(gen.object_text, self.model.tokenizer, gen.text_ids, gen.coords,
                                                  gen.sizes)]}
            n_out = len(gen.tokens)
        else:
            text = seq.detok.text if seq.detok else self.model.tokenizer.decode(gen.tokens)
            output = {"answer": text}
            n_out, token_ids = len(gen.tokens), list(gen.tokens)
            if isinstance(gen, ReasoningThenAnswer):
                output["reasoning"] = self._reasoning(gen)
                n_out += len(gen.reasoning_tokens)
            if key == "message":  # (the answer and its reasoning as the assistant's message)
                output = {"message": chat_message(output)}
            elif key != "answer":
                output = {key: output.pop("answer"), **output}
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
