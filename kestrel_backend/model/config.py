"""Moondream 2 (and 0.5B) architecture config: frozen dataclasses, defaults are the official sizes."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path


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


def _default_templates() -> dict:
    return {
        "caption": {"short": [1, 32708, 2, 12492, 3], "normal": [1, 32708, 2, 6382, 3], "long": [1, 32708, 2, 4059, 3]},
        "query": {"prefix": [1, 15381, 2], "suffix": [3]},
        "detect": {"prefix": [1, 7235, 476, 2], "suffix": [3]},
        "point": {"prefix": [1, 2581, 2], "suffix": [3]},
    }


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


@dataclass(frozen=True)
class MoondreamConfig:
    text: TextConfig = TextConfig()
    vision: VisionConfig = VisionConfig()
    region: RegionConfig = RegionConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()

    @classmethod
    def from_dict(cls, d: dict) -> "MoondreamConfig":
        parts = {}
        for name, part_cls in [("text", TextConfig), ("vision", VisionConfig), ("region", RegionConfig),
                               ("tokenizer", TokenizerConfig)]:
            values = d.get(name, {}) or {}
            known = {f.name for f in dataclasses.fields(part_cls)}
            unknown = sorted(set(values) - known)
            if unknown:
                raise ValueError(f"config.json: unknown {name} keys {unknown}")
            parts[name] = part_cls(**{k: v for k, v in values.items() if k in known})
        config = cls(**parts)
        config.validate()
        return config

    @classmethod
    def from_file(cls, path: str | Path) -> "MoondreamConfig":
        with open(path) as f:
            return cls.from_dict(json.load(f))

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
