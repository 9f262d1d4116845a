"""Prompt token ids for each skill, from the checkpoint's templates."""

from __future__ import annotations

from ..errors import InvalidRequest, shown
from ..model.config import TokenizerConfig

CAPTION_LENGTHS = ("short", "normal", "long")


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
