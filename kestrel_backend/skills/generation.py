"""Per-request decode state machines.

Every model step consumes one input per sequence (a token id or an embedding) and yields that
position's logits and hidden state. Before the step's tokens are chosen (all rows at once, see
sampling.py) each Generation says how it wants its token chosen (`choice()`); then `on_output`
gets that token and the hidden state and says what to feed next, or None when it is done. The
same objects run alone (single.py) or inside the engine's batch, so heterogeneous skills share
one decode step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..model.config import TokenizerConfig
from .sampling import Choice
from .settings import Settings

NextInput = int | torch.Tensor | None


@dataclass
class Prompt:
    """What a request prefills: an optional image embedding (after BOS) then token ids, some of whose
    embeddings may be replaced (overrides: prompt index -> embedding, as for spatial refs, or rows, as for a
    conversation's later images, whose ranges are blocks)."""

    token_ids: list[int]
    image_embedding: torch.Tensor | None = None
    overrides: dict | None = None
    blocks: tuple[tuple[int, int], ...] = ()  # prompt index ranges [start, end) that see themselves bidirectionally


class Generation:
    finish_reason: str | None = None
    # its next input is always the token it chose, and it never reads the hidden state: the engine may
    # then start its next step on the GPU before the chosen token reaches the host
    feeds_back_tokens = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def choice(self) -> Choice:
        """How this step's token is chosen (default: greedy)."""
        return Choice()

    def may_continue_after_next_token(self) -> bool:
        """Whether a step after the one choosing the next token can be needed (False: that token is the last one
        max_tokens allows, so a step launched ahead for it would be wasted)."""
        return True

    def banned_after_next_token(self) -> tuple[int, ...]:
        """The tokens the choice after the next one bans (for a step launched before the next token is read): asked
        only of generations that feed back their tokens."""
        raise NotImplementedError

    def on_output(self, token: int, hidden: torch.Tensor) -> NextInput:
        raise NotImplementedError

    def finish(self, reason: str) -> None:
        self.finish_reason = reason


def _seed(settings: Settings) -> int:
    return settings.seed if settings.seed is not None else int(torch.randint(0, 2**62, ()).item())


class TextGeneration(Generation):
    """Answer or caption text: stop at EOS or max_tokens; the answer marker is banned after the first token."""

    feeds_back_tokens = True

    def __init__(self, tok: TokenizerConfig, settings: Settings, seed: int | None = None):
        self.tok, self.settings = tok, settings
        self.tokens: list[int] = []
        self._steps = 0
        self._seed = _seed(settings) if seed is None else seed

    def choice(self) -> Choice:
        settings = self.settings
        return Choice(settings.temperature, settings.top_p, self._seed, self._steps, self._banned(self._steps))

    def _banned(self, steps: int) -> tuple[int, ...]:
        return (self.tok.answer_id,) if steps or self.tok.answer_marker_banned_from_start else ()

    def may_continue_after_next_token(self) -> bool:
        return len(self.tokens) + 1 < self.settings.max_tokens

    def banned_after_next_token(self) -> tuple[int, ...]:
        return self._banned(self._steps + 1)

    def on_output(self, token, hidden) -> NextInput:
        self._steps += 1
        if token == self.tok.eos_id:
            self.finish("stop")
            return None
        self.tokens.append(token)
        if len(self.tokens) >= self.settings.max_tokens:
            self.finish("length")
            return None
        return token


class ReasoningThenAnswer(Generation):
    """Query with a reasoning trace: think until the answer marker (coords grounded), then answer."""

    def __init__(self, tok: TokenizerConfig, settings: Settings, model):
        self.tok, self.settings, self.model = tok, settings, model
        self.reasoning_tokens: list[int] = []
        self.chunks: list[list[int]] = [[]]  # reasoning split at grounding markers
        self.coords: list[list[float]] = [[]]
        self.answer: TextGeneration | None = None
        self._steps = 0
        self._seed = _seed(settings)

    @property
    def tokens(self) -> list[int]:
        return self.answer.tokens if self.answer else []

    def choice(self) -> Choice:
        if self.answer is not None:
            return self.answer.choice()
        banned = (self.tok.eos_id, self.tok.size_id) if self._steps else ()
        return Choice(self.settings.temperature, self.settings.top_p, self._seed, self._steps, banned)

    def on_output(self, token, hidden) -> NextInput:
        if self.answer is not None:
            nxt = self.answer.on_output(token, hidden)
            self.finish_reason = self.answer.finish_reason
            return nxt
        self._steps += 1
        if token == self.tok.answer_id or len(self.reasoning_tokens) >= self._reasoning_limit:
            self.answer = TextGeneration(self.tok, self._answer_settings(), seed=self._seed + 1)
            return self.tok.answer_id
        if token in (self.tok.start_ground_points_id, self.tok.end_ground_id):
            self.chunks.append([])
            self.coords.append([])
        self.reasoning_tokens.append(token)
        self.chunks[-1].append(token)
        if token == self.tok.coord_id:
            coord = self.model.coordinate(hidden)
            self.coords[-1].append(float(coord))
            return self.model.coordinate_embedding(coord)
        return token

    @property
    def _reasoning_limit(self) -> int:
        """max_tokens, or less where max_total_tokens leaves the answer at least one token."""
        total = self.settings.max_total_tokens
        return self.settings.max_tokens if total is None else max(0, min(self.settings.max_tokens, total - 1))

    def _answer_settings(self) -> Settings:
        total = self.settings.max_total_tokens
        if total is None:
            return self.settings
        return replace(self.settings, max_tokens=max(1, min(self.settings.max_tokens,
                                                            total - len(self.reasoning_tokens))))


class RegionGeneration(Generation):
    """Point (x, y) or detect (x, y, w, h): each object decodes x, then y, then (detect) size."""

    def __init__(self, tok: TokenizerConfig, settings: Settings, model, with_size: bool):
        self.tok, self.model, self.with_size = tok, model, with_size
        self.max_objects = settings.max_objects
        self.objects: list[dict] = []
        self._state = "token"
        self._x = self._y = None

    def on_output(self, token, hidden) -> NextInput:
        m = self.model
        if self._state == "token":
            if m.ends_object_list(token, hidden):
                self.finish("stop")
                return None
            if len(self.objects) >= self.max_objects:
                self.finish("length")
                return None
            self._x = m.coordinate(hidden)
            self._state = "y"
            return m.coordinate_embedding(self._x)
        if self._state == "y":
            self._y = m.coordinate(hidden)
            if self.with_size:
                self._state = "size"
            else:
                self.objects.append({"x": float(self._x), "y": float(self._y)})
                self._state = "token"
            return m.coordinate_embedding(self._y)
        size = m.size(hidden)
        x, y, w, h = float(self._x), float(self._y), float(size[0]), float(size[1])
        self.objects.append({"x_min": x - w / 2, "y_min": y - h / 2, "x_max": x + w / 2, "y_max": y + h / 2})
        self._state = "token"
        return m.size_embedding(size)


class SegmentGeneration(Generation):
    """Segment: the model writes the box (coordinate and size tokens, decoded by the region heads) and the outline
    (text); nothing is constrained. Stops at EOS or max_tokens, every token counted."""

    def __init__(self, tok: TokenizerConfig, settings: Settings, model, object_text: str = ""):
        self.tok, self.settings, self.model = tok, settings, model
        self.object_text = object_text
        self.tokens: list[int] = []  # every token chosen
        self.text_ids: list[int] = []  # the outline's
        self.coords: list[float] = []
        self.sizes: list[tuple[float, float]] = []
        self._seed = _seed(settings)

    def choice(self) -> Choice:
        return Choice(self.settings.temperature, self.settings.top_p, self._seed, len(self.tokens))

    def on_output(self, token, hidden) -> NextInput:
        if token == self.tok.eos_id:
            self.finish("stop")
            return None
        self.tokens.append(token)
        m, nxt = self.model, token
        if token == self.tok.coord_id:
            coord = m.coordinate(hidden)
            self.coords.append(float(coord))
            nxt = m.coordinate_embedding(coord)
        elif token == self.tok.size_id:
            size = m.size(hidden)
            self.sizes.append((float(size[0]), float(size[1])))
            nxt = m.size_embedding(size)
        else:
            self.text_ids.append(token)
        if len(self.tokens) >= self.settings.max_tokens:
            self.finish("length")
            return None
        return nxt
