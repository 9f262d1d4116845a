"""Prompt token ids for each skill, from the checkpoint's templates, and the checks a request's text and spatial refs
pass before they become tokens (TextLimit, check_spatial_refs)."""

from __future__ import annotations

from ..errors import InvalidRequest, shown
from ..model.config import TokenizerConfig
from .catalog import SKILLS

CAPTION_LENGTHS = SKILLS["caption"].text_choices


def template(tok: TokenizerConfig, skill: str) -> dict:
    t = tok.templates.get(skill)
    if not t:
        raise InvalidRequest(f"SKILL {skill} is not supported by this model (its config.json has no {skill} template)")
    return t


def spatial_ref_tokens(tok: TokenizerConfig, refs) -> list[int]:
    """Two coordinate tokens per point; a box adds a size token."""
    return [i for ref in refs for i in ([tok.coord_id] * 2 + ([tok.size_id] if len(ref) == 4 else []))]


def query_tail(tok: TokenizerConfig, reasoning: bool) -> list[int]:
    """What ends a query's prompt: the answer marker, or the reasoning marker. Moondream 2's template has a suffix
    (the answer marker), which the reference repeats unless it asks for a reasoning trace (then the thinking marker
    follows it); Moondream 3's names answer_prefix and reasoning_prefix."""
    t = template(tok, "query")
    if "answer_prefix" in t:
        return t["reasoning_prefix"] if reasoning else t["answer_prefix"]
    if reasoning and t["suffix"] != [tok.answer_id]:
        raise InvalidRequest("REASONING is not supported by this model (its query template has no answer marker)")
    return t["suffix"] + ([tok.thinking_id] if reasoning else t["suffix"])


def query_prompt(tok: TokenizerConfig, question_ids: list[int], has_image: bool, reasoning: bool,
                 spatial_refs=()) -> list[int]:
    """[BOS (text-only)] prefix, spatial-ref tokens, question, then the answer or the reasoning marker."""
    ids = template(tok, "query")["prefix"] + spatial_ref_tokens(tok, spatial_refs) + question_ids + \
        query_tail(tok, reasoning)
    return ids if has_image else [tok.bos_id] + ids


def spatial_refs_start(tok: TokenizerConfig, has_image: bool) -> int:
    """The prompt index of query_prompt's first spatial-ref token."""
    return len(template(tok, "query")["prefix"]) + (0 if has_image else 1)


def caption_prompt(tok: TokenizerConfig, length: str) -> list[int]:
    lengths = template(tok, "caption")
    if length not in lengths:
        allowed = [n for n in CAPTION_LENGTHS if n in lengths]
        raise InvalidRequest(f"LENGTH must be one of {', '.join(allowed)} for this model, got {shown(length)}")
    return list(lengths[length])


def region_prompt(tok: TokenizerConfig, skill: str, object_ids: list[int]) -> list[int]:
    t = template(tok, skill)
    return t["prefix"] + object_ids + t["suffix"]


class TextLimit:
    """The most characters a request's text may have: the context's tokens times the longest token's length in
    characters (a text longer than that cannot fit; checked before the tokenizer runs)."""

    def __init__(self, max_chars: int, max_context: int):
        self.max_chars, self.max_context = max_chars, max_context
        self.max_bytes = 4 * max_chars  # (a character is at most 4 bytes of UTF-8)

    @classmethod
    def for_tokenizer(cls, tokenizer, max_context: int) -> "TextLimit":
        longest = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)
        return cls(max_context * max(longest, 1), max_context)

    def check(self, chars: int, field: str) -> None:
        if chars > self.max_chars:
            raise InvalidRequest(f"{field} is too long: {chars} characters, more than the model's context of "
                                 f"{self.max_context} tokens can hold ({self.max_chars})")


def check_spatial_refs(refs, image) -> list[tuple[float, ...]]:
    """Points (x, y) or boxes (x_min, y_min, x_max, y_max), every value in [0, 1]."""
    if not refs:
        return []
    if not image:
        raise InvalidRequest("SPATIAL_REFS need an IMAGE: they point into it")
    out = []
    for ref in refs:
        ref = tuple(float(v) for v in ref)
        if len(ref) not in (2, 4):
            raise InvalidRequest(f"SPATIAL_REFS: each must be (x, y) or (x_min, y_min, x_max, y_max), got {ref}")
        if not all(0.0 <= v <= 1.0 for v in ref):  # (NaN fails this too)
            raise InvalidRequest(f"SPATIAL_REFS values must be finite and within [0, 1], got {ref}")
        if len(ref) == 4 and (ref[2] < ref[0] or ref[3] < ref[1]):
            raise InvalidRequest(f"SPATIAL_REFS boxes must have x_min <= x_max and y_min <= y_max, got {ref}")
        out.append(ref)
    return out
