"""Moondream architecture config: frozen dataclasses, defaults are Moondream 2's official sizes.

A config.json whose text section has `moe` (or whose `model_type` is moondream3) is Moondream 3: a
mixture-of-experts text model with tau attention, 32k context and linear region decoders. Its missing
keys take Moondream 3's defaults, not Moondream 2's. The Hugging Face layout nests the sections under
"config"; both that and the flat layout are read.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

# How a checkpoint's FP8 experts are kept (KESTREL_FP8_EXPERTS): widened to the dtype, both, or FP8 only
FP8_EXPERT_MODES = ("widen", "fp8", "both")


@dataclass(frozen=True)
class MoeConfig:
    """Mixture of experts in the text MLPs from layer start_layer on (Hugging Face key names)."""

    n_experts: int = 64
    n_experts_per_tok: int = 8
    start_layer: int = 4
    expert_inner_dim: int = 1024  # each expert's fc1 gives 2x this: the GELU half and the gate half


@dataclass(frozen=True)
class TextConfig:
    dim: int = 2048
    ff_dim: int = 8192
    n_layers: int = 24
    vocab_size: int = 51200
    max_context: int = 2048
    n_heads: int = 32
    n_kv_heads: int = 32
    prefix_attn: int = 730  # BOS + 729 image tokens attend bidirectionally
    rope_dim: int = 32  # rotary embedding covers the first 32 dims of each head
    rope_theta: float = 10000.0
    group_size: int | None = None  # 4-bit checkpoints: values per scale and zero point of the packed weights
    moe: MoeConfig | None = None  # Moondream 3
    tau_attn: bool = False  # Moondream 3: q and v scaled per head by token and position

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass(frozen=True)
class VisionConfig:
    enc_dim: int = 1152
    enc_patch_size: int = 14
    enc_n_layers: int = 27
    enc_ff_dim: int = 4304
    enc_n_heads: int = 16
    proj_out_dim: int = 2048
    crop_size: int = 378
    in_channels: int = 3
    max_crops: int = 12
    overlap_margin: int = 4
    proj_inner_dim: int = 8192

    @property
    def grid(self) -> int:
        """Patches per side of one crop (27 for 378 px crops of 14 px patches)."""
        return self.crop_size // self.enc_patch_size


@dataclass(frozen=True)
class RegionConfig:
    dim: int = 2048
    coord_feat_dim: int = 256
    coord_out_dim: int = 1024
    size_feat_dim: int = 512
    size_out_dim: int = 2048
    inner_dim: int = 8192
    group_size: int | None = None  # as TextConfig's
    decoder: str = "mlp"  # "mlp" (Moondream 2) or "linear" (Moondream 3: one Linear after the region's LayerNorm)


def _default_templates() -> dict:
    return {
        "caption": {"short": [1, 32708, 2, 12492, 3], "normal": [1, 32708, 2, 6382, 3], "long": [1, 32708, 2, 4059, 3]},
        "query": {"prefix": [1, 15381, 2], "suffix": [3]},
        "detect": {"prefix": [1, 7235, 476, 2], "suffix": [3]},
        "point": {"prefix": [1, 2581, 2], "suffix": [3]},
    }


def _moondream3_templates() -> dict:
    templates = _default_templates()
    templates["query"] = {"prefix": [1, 15381, 2], "answer_prefix": [3], "reasoning_prefix": [4]}
    templates["segment"] = {"prefix": [1, 17374, 2], "suffix": [3]}
    return templates


@dataclass(frozen=True)
class TokenizerConfig:
    bos_id: int = 0
    eos_id: int = 0
    answer_id: int = 3
    thinking_id: int = 4
    coord_id: int = 5
    size_id: int = 6
    start_ground_points_id: int = 7
    end_ground_id: int = 9
    templates: dict = field(default_factory=_default_templates)
    # Moondream 3 never lets an answer start with the answer marker; Moondream 2 bans it after the first token
    answer_marker_banned_from_start: bool = False


@dataclass(frozen=True)
class MoondreamConfig:
    text: TextConfig = TextConfig()
    vision: VisionConfig = VisionConfig()
    region: RegionConfig = RegionConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()

    @classmethod
    def from_dict(cls, d: dict) -> "MoondreamConfig":
        if isinstance(d.get("config"), dict):  # the Hugging Face layout
            model_type, d = d.get("model_type"), d["config"]
        else:
            model_type = d.get("model_type")
        moondream3 = model_type == "moondream3" or "moe" in (d.get("text") or {})
        parts = {}
        for name, part_cls in [("text", TextConfig), ("vision", VisionConfig), ("region", RegionConfig),
                               ("tokenizer", TokenizerConfig)]:
            values = {**(_MOONDREAM3_DEFAULTS[name] if moondream3 else {}), **(d.get(name) or {})}
            known = {f.name for f in dataclasses.fields(part_cls)}
            unknown = sorted(set(values) - known - _IGNORED_KEYS.get(name, set()))
            if unknown:
                raise ValueError(f"config.json: unknown {name} keys {unknown}")
            if name == "text" and isinstance(values.get("moe"), dict):
                values["moe"] = _moe_config(values["moe"])
            parts[name] = part_cls(**{k: v for k, v in values.items() if k in known})
        config = cls(**parts)
        config.validate()
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> "MoondreamConfig":
        with open(path) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def official(cls, family: str = "moondream2") -> "MoondreamConfig":
        """A family's official sizes: moondream2 or moondream3 (full-size random weights for benchmarks)."""
        if family not in ("moondream2", "moondream3"):
            raise ValueError(f"unknown model family {family!r}")
        return cls.from_dict({"model_type": family} if family == "moondream3" else {})

    @property
    def is_moondream3(self) -> bool:
        return self.text.moe is not None

    @property
    def crop_cost_in_tokens(self) -> int:
        """Encoding one crop as the number of text tokens whose prefill has the same matmul work (the engine's
        step budget counts both): Moondream 2 about 250, Moondream 3 about 200 (only a token's 8 experts)."""
        t, v = self.text, self.vision
        vision = v.grid * v.grid * v.enc_n_layers * (4 * v.enc_dim ** 2 + 2 * v.enc_dim * v.enc_ff_dim)
        attention = 4 * t.dim * t.dim * t.n_layers
        if t.moe is None:
            mlp = 2 * t.dim * t.ff_dim * t.n_layers
        else:  # (an expert's fc1 gives the GELU and gate halves)
            mlp = 2 * t.dim * t.ff_dim * t.moe.start_layer + (t.n_layers - t.moe.start_layer) * (
                t.moe.n_experts_per_tok * 3 * t.dim * t.moe.expert_inner_dim)
        return round(vision / (attention + mlp))

    def validate(self) -> None:
        t, v = self.text, self.vision
        if t.dim % t.n_heads or t.n_heads % t.n_kv_heads:
            raise ValueError("config.json: text dim must split evenly into heads and kv heads")
        if t.rope_dim > t.head_dim:
            raise ValueError("config.json: text head_dim must be at least rope_dim")
        if v.crop_size % v.enc_patch_size or v.enc_dim % v.enc_n_heads:
            raise ValueError("config.json: vision crop/patch sizes or heads do not divide")
        if t.prefix_attn != 1 + v.grid * v.grid:
            raise ValueError("config.json: text prefix_attn must equal 1 + (crop_size/patch)^2")
        if self.region.dim != t.dim or v.proj_out_dim != t.dim:
            raise ValueError("config.json: region dim and vision proj_out_dim must equal text dim")
        if self.region.decoder not in ("mlp", "linear"):
            raise ValueError(f"config.json: region decoder must be mlp or linear, got {self.region.decoder!r}")
        if t.moe is not None and not 0 < t.moe.n_experts_per_tok <= t.moe.n_experts:
            raise ValueError("config.json: text moe n_experts_per_tok must be between 1 and n_experts")
        if t.tau_attn and t.n_kv_heads != t.n_heads:
            raise ValueError("config.json: tau attention needs n_kv_heads == n_heads")


_MOONDREAM3_DEFAULTS = {
    "text": {"max_context": 32768, "rope_theta": 1_500_000.0, "moe": {}, "tau_attn": True},
    "vision": {},
    "region": {"decoder": "linear"},
    "tokenizer": {"templates": _moondream3_templates(), "answer_marker_banned_from_start": True},
}
# Keys of the official configs that describe nothing this engine varies (Hugging Face's
# Moondream 3 text config: the BOS token's place in the bidirectional prefix, always 1).
_IGNORED_KEYS = {"text": {"prefix_lm_left_padding"}}
# Other spellings of the MoE keys (Kestrel's config names them so).
_MOE_ALIASES = {"num_experts": "n_experts", "experts_per_token": "n_experts_per_tok"}


def _moe_config(values: dict) -> MoeConfig:
    values = {_MOE_ALIASES.get(k, k): v for k, v in values.items()}
    known = {f.name for f in dataclasses.fields(MoeConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"config.json: unknown text moe keys {unknown}")
    return MoeConfig(**values)
