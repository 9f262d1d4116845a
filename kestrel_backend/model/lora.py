"""LoRA adapters of the text model (the reference's "variants", Kestrel's "adapters").

An adapter adds `x @ A^T @ B^T` to the outputs of the projections it targets, in every layer: the reference's
adapt the attention's qkv and proj and the MLP's fc1 and fc2, Kestrel's the MLP's only. As in the reference,
the proj delta is computed from the layer's normed input (the same x as qkv's), not from the attention output.
Files are the reference's `final.pt` (a flat dict of tensors, renamed with its fixed rules) or safetensors with
the same names, or Kestrel's checkpoints (a dict whose `lora_state_dict` holds its LoRA module's tensors:
`kestrel_tensors`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import TextConfig

TARGETS = ("qkv", "proj", "fc1", "fc2")
_TARGET_PATH = {"qkv": "attn.qkv", "proj": "attn.proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
_TARGET_KEY = re.compile(rf"text\.blocks\.\d+\.({'|'.join(map(re.escape, _TARGET_PATH.values()))})\.[AB]")
# The reference's renaming of training-time names (applied in this order, every match replaced).
_RENAME_RULES = [("text_model.transformer.h", "text.blocks"), (".mixer", ".attn"), (".out_proj", ".proj"),
                 (".Wqkv", ".qkv"), (".parametrizations.weight.0", "")]


class AdapterError(ValueError):
    """An adapter file is unreadable or does not fit the model."""


@dataclass(eq=False)
class LoraAdapter:
    name: str
    rank: int
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]  # per layer: target -> (A [r, in], B [out, r]);
    # the targets it leaves out get no delta
    uid: int = 0  # which load of this name (the registry's count): keys what was computed with it
    slot: int = 0  # its slot in the device's LoraPool (0: not in one)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for ab in layer.values() for t in ab)


def renamed(key: str) -> str:
    for old, new in _RENAME_RULES:
        key = key.replace(old, new)
    return key


def target_shapes(config: TextConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adapted projection."""
    qkv_out = config.dim + 2 * config.n_kv_heads * config.head_dim
    return {"qkv": (config.dim, qkv_out), "proj": (config.dim, config.dim), "fc1": (config.dim, config.ff_dim),
            "fc2": (config.ff_dim, config.dim)}


# Kestrel's LoRA module for a dense MLP: fc1's A and B are its up_a [r, dim] and up_b [ff, r], fc2's its down_a
# [r, ff] and down_b [dim, r]. Its text part is registered twice (`text_lora.` and `_text.`), its optional vision
# part (`vision_lora.`, `_vision.`) is never built for the files its API serves, so never applied.
_KESTREL_DENSE = re.compile(r"(?:text_lora|_text)\.dense\.(\d+)\.(up|down)_(a|b)")
_KESTREL_UNUSED = ("vision_lora.", "_vision.")


def kestrel_tensors(lora_state: dict) -> dict[str, torch.Tensor]:
    """A Kestrel checkpoint's `lora_state_dict` in the reference's names (text.blocks.N.mlp.fc1.A, ...)."""
    state = {}
    for key, tensor in lora_state.items():
        if key.startswith(_KESTREL_UNUSED):
            continue
        m = _KESTREL_DENSE.fullmatch(key)
        if m is None:
            what = "Moondream 3's expert layers" if ".moe." in key else "a projection this engine does not adapt"
            raise AdapterError(f"unexpected tensor '{key}' ({what})")
        layer, proj, ab = m.groups()
        name = f"text.blocks.{layer}.mlp.{'fc1' if proj == 'up' else 'fc2'}.{ab.upper()}"
        if name in state and not torch.equal(state[name], tensor):
            raise AdapterError(f"tensor '{key}' differs from its twin under the other prefix")
        state[name] = tensor
    return state


def read_adapter_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    state = {}
    for path in files:
        try:
            if path.suffix == ".safetensors":
                from safetensors.torch import load_file

                tensors = load_file(str(path))
            else:
                tensors = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as e:
            raise AdapterError(f"cannot read {path.name} ({type(e).__name__}: {e})") from e
        if isinstance(tensors, dict) and isinstance(tensors.get("lora_state_dict"), dict):  # (Kestrel's checkpoint)
            state.update(kestrel_tensors(tensors["lora_state_dict"]))
            continue
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise AdapterError(f"{path.name} is not a flat dict of tensors")
        state.update({renamed(k): v for k, v in tensors.items()})
    return state


def build_adapter(name: str, state: dict[str, torch.Tensor], config: TextConfig, max_rank: int,
                  dtype: torch.dtype, device) -> LoraAdapter:
    """Check every tensor against the model (errors name the tensor) and move them to the device. A target is
    adapted in every layer or in none."""
    shapes = target_shapes(config)
    named = {m.group(1) for m in map(_TARGET_KEY.fullmatch, state) if m}
    targets = [t for t in TARGETS if _TARGET_PATH[t] in named]
    expected = {f"text.blocks.{i}.{_TARGET_PATH[t]}.{ab}" for i in range(config.n_layers) for t in targets
                for ab in "AB"}
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if not state:
        raise AdapterError("no tensors")
    for kind, names in (("missing", missing), ("unexpected", extra)):
        if names:
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise AdapterError(f"{kind} tensor '{names[0]}'{more}")
    rank = 0
    for i in range(config.n_layers):
        for target in targets:
            n_in, n_out = shapes[target]
            key = f"text.blocks.{i}.{_TARGET_PATH[target]}"
            a, b = state[f"{key}.A"], state[f"{key}.B"]
            r = a.shape[0] if a.dim() == 2 else -1
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != n_in or tuple(b.shape) != (n_out, r):
                raise AdapterError(f"tensors '{key}.A' {tuple(a.shape)} and '{key}.B' {tuple(b.shape)} do not fit: "
                                   f"expected ({r if r > 0 else 'r'}, {n_in}) and ({n_out}, r)")
            if not (a.is_floating_point() and b.is_floating_point()):
                raise AdapterError(f"tensor '{key}.A' or '.B' is not floating point")
            rank = max(rank, r)
    if rank > max_rank:
        raise AdapterError(f"rank {rank} is above the limit of {max_rank} (KESTREL_MAX_ADAPTER_RANK)")

    def on_device(t):
        return t.to(device=device, dtype=dtype).contiguous()

    layers = [{t: (on_device(state[f"text.blocks.{i}.{_TARGET_PATH[t]}.A"]),
                   on_device(state[f"text.blocks.{i}.{_TARGET_PATH[t]}.B"])) for t in targets}
              for i in range(config.n_layers)]
    return LoraAdapter(name, rank, layers)


class LoraRows:
    """Which rows of one flat forward use which adapter: (start, end, adapter) spans, adapter-less rows left
    out. `add` puts each span's delta onto y in place."""

    def __init__(self, spans: list[tuple[int, int, LoraAdapter]]):
        self.spans = spans

    @classmethod
    def of(cls, adapters: list[LoraAdapter | None], lengths: list[int]) -> "LoraRows | None":
        """One adapter (or None) and row count per sequence, in row order; None when no row has one."""
        spans, start = [], 0
        for adapter, n in zip(adapters, lengths):
            if adapter is not None:
                if spans and spans[-1][2] is adapter and spans[-1][1] == start:
                    spans[-1] = (spans[-1][0], start + n, adapter)
                else:
                    spans.append((start, start + n, adapter))
            start += n
        return cls(spans) if spans else None

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, target: str) -> torch.Tensor:
        for start, end, adapter in self.spans:
            if target in adapter.layers[layer]:
                a, b = adapter.layers[layer][target]
                y[start:end] += (x[start:end] @ a.t()) @ b.t()
        return y
