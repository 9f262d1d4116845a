"""Prompt token ids for each skill, from the checkpoint's templates."""

from __future__ import annotations

from ..errors import InvalidRequest
from ..model.config import TokenizerConfig

CAPTION_LENGTHS = ("short", "normal", "long")


def query_prompt(tok: TokenizerConfig, question_ids: list[int], has_image: bool, reasoning: bool) -> list[int]:
    t = tok.templates["query"]
    # The reference repeats the suffix (answer marker) unless it asks for a reasoning trace.
    tail = [tok.thinking_id] if reasoning else t["suffix"]
    ids = t["prefix"] + question_ids + t["suffix"] + tail
    return ids if has_image else [tok.bos_id] + ids


def caption_prompt(tok: TokenizerConfig, length: str) -> list[int]:
    if length not in CAPTION_LENGTHS:
        raise InvalidRequest(f"LENGTH must be one of {', '.join(CAPTION_LENGTHS)}, got {length!r}")
    return list(tok.templates["caption"][length])


def region_prompt(tok: TokenizerConfig, skill: str, object_ids: list[int]) -> list[int]:
    t = tok.templates[skill]
    return t["prefix"] + object_ids + t["suffix"]
