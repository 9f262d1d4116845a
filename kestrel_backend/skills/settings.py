"""Per-request sampling settings, validated with messages that name the bad key."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import InvalidRequest, shown

DEFAULT_TEMPERATURE = 0.2
DEFAULT_TOP_P = 0.9
DEFAULT_MAX_TOKENS = 768
DEFAULT_MAX_OBJECTS = 150
KEYS = ("temperature", "top_p", "max_tokens", "max_total_tokens", "max_objects", "seed", "adapter", "variant",
        "priority")
# Which waiting requests are admitted first: every interactive one before any batch one (the gateway's Batch API
# sends its lines as batch, so a batch job fills the GPU's idle room and never holds a person's request back)
PRIORITIES = ("interactive", "batch")
# Adapter ids name a folder or file: letters, digits and . _ - @ (Kestrel's "<finetune_id>@<step>"), no path; they
# may follow a model's name and a slash, as the official fine-tuning client names them (moondream3-preview/<id>@<n>)
ADAPTER_ID = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}/)?[A-Za-z0-9_\-@][A-Za-z0-9_.\-@]{0,127}")


class SettingsError(InvalidRequest):
    pass


@dataclass(frozen=True)
class Settings:
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    max_tokens: int = DEFAULT_MAX_TOKENS
    max_objects: int = DEFAULT_MAX_OBJECTS
    seed: int | None = None
    adapter: str | None = None  # LoRA adapter id ("variant" in the reference's settings)
    # reasoning and answer together (the cloud API's max_tokens, which the gateway sends as this); max_tokens alone
    # bounds each of them, as in the reference
    max_total_tokens: int | None = None
    priority: str = "interactive"  # or "batch" (PRIORITIES)

    @classmethod
    def from_dict(cls, values: dict | None, max_tokens_limit: int = 2048, max_objects_limit: int = 150,
                  temperature: float = DEFAULT_TEMPERATURE, top_p: float = DEFAULT_TOP_P) -> "Settings":
        """temperature, top_p: the skill's defaults (segment decodes greedily unless asked, as Kestrel does)."""
        values = dict(values or {})
        unknown = sorted(set(values) - set(KEYS))
        if unknown:
            raise SettingsError(f"SETTINGS: unknown key(s) {unknown}; allowed: {', '.join(KEYS)}")
        s = cls(
            temperature=_number(values, "temperature", temperature, 0.0, 2.0),
            top_p=_number(values, "top_p", top_p, 0.0, 1.0, low_open=True),
            max_tokens=_integer(values, "max_tokens", min(DEFAULT_MAX_TOKENS, max_tokens_limit), 1, max_tokens_limit),
            max_objects=_integer(values, "max_objects", min(DEFAULT_MAX_OBJECTS, max_objects_limit), 1, max_objects_limit),
            seed=None if values.get("seed") is None else _integer(values, "seed", 0, 0, 2**63 - 1),
            max_total_tokens=None if values.get("max_total_tokens") is None else
            _integer(values, "max_total_tokens", 0, 1, 2 * max_tokens_limit),
            adapter=_adapter(values),
            priority=_priority(values),
        )
        return s


def _number(values, key, default, low, high, low_open=False) -> float:
    v = values.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise SettingsError(f"SETTINGS: {key} must be a finite number, got {shown(v)}")
    if v < low or v > high or (low_open and v == low):
        side = "(" if low_open else "["
        raise SettingsError(f"SETTINGS: {key} must be in {side}{low}, {high}], got {v}")
    return float(v)


def _integer(values, key, default, low, high) -> int:
    v = values.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise SettingsError(f"SETTINGS: {key} must be an integer, got {shown(v)}")
    if v < low or v > high:
        raise SettingsError(f"SETTINGS: {key} must be between {low} and {high}, got {v}")
    return v


def _adapter(values) -> str | None:
    if values.get("adapter") is not None and values.get("variant") is not None:
        raise SettingsError("SETTINGS: adapter and variant both given; they are one setting, send one")
    key = "adapter" if values.get("adapter") is not None else "variant"
    v = values.get(key)
    if v is None:
        return None
    if not isinstance(v, str) or not ADAPTER_ID.fullmatch(v) or ".." in v:
        raise SettingsError(f"SETTINGS: {key} must be an adapter id (letters, digits, . _ - @; at most 128), "
                            f"alone or after a model's name and a slash, got {shown(v)}")
    return v


def _priority(values) -> str:
    v = values.get("priority", PRIORITIES[0])
    if v not in PRIORITIES:
        raise SettingsError(f"SETTINGS: priority must be one of {', '.join(PRIORITIES)}, got {shown(v)}")
    return v
