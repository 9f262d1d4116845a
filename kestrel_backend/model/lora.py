"""LoRA adapters of the text model (the reference's "variants", Kestrel's "adapters").

An adapter adds `x @ A^T @ B^T` to the outputs of the projections it targets, in every layer: the reference's
adapt the attention's qkv and proj and the MLP's fc1 and fc2, Kestrel's the MLP's only. As in the reference,
the proj delta is computed from the layer's normed input (the same x as qkv's), not from the attention output.
Moondream 3's adapters (Kestrel's, what the official fine-tuning service trains) add fc1 and fc2 deltas to its
dense layers and a LoRA of each expert to its expert layers: expert e's fc1 output [h | g] gets
`x @ up_A[e]^T @ up_B[e]^T` before gelu(h) * (g + 1), and its fc2 output `a @ down_A[e]^T @ down_B[e]^T` before the
routing weight scales it.
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
EXPERT_TARGETS = ("experts_up", "experts_down")  # Moondream 3's expert layers: A [E, r, in], B [E, out, r]
_TARGET_PATH = {"qkv": "attn.qkv", "proj": "attn.proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2",
                "experts_up": "mlp.experts.up", "experts_down": "mlp.experts.down"}
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
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]  # per layer: target -> (A [r, in], B [out, r]),
    # the experts' (A [E, r, in], B [E, out, r]); the targets it leaves out get no delta
    expert_rank: int = 0  # the experts' rank (Moondream 3; 0: none adapted)
    uid: int = 0  # which load of this name (the registry's count): keys what was computed with it
    slot: int = 0  # its slot in the device's pool (0: not in one)
    pool: object = None  # that pool (its tensors are what the GPU kernels read)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for ab in layer.values() for t in ab)


def renamed(key: str) -> str:
    for old, new in _RENAME_RULES:
        key = key.replace(old, new)
    return key


def target_shapes(config: TextConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each adapted projection (an expert's, for the expert targets)."""
    qkv_out = config.dim + 2 * config.n_kv_heads * config.head_dim
    shapes = {"qkv": (config.dim, qkv_out), "proj": (config.dim, config.dim), "fc1": (config.dim, config.ff_dim),
              "fc2": (config.ff_dim, config.dim)}
    if config.moe is not None:
        inner = config.moe.expert_inner_dim
        shapes |= {"experts_up": (config.dim, 2 * inner), "experts_down": (inner, config.dim)}
    return shapes


def expert_layers(config: TextConfig) -> range:
    """The layers whose MLP is experts (none on Moondream 2)."""
    return range(config.moe.start_layer if config.moe else config.n_layers, config.n_layers)


# Kestrel's LoRA module for a dense MLP: fc1's A and B are its up_a [r, dim] and up_b [ff, r], fc2's its down_a
# [r, ff] and down_b [dim, r]; for the N-th expert layer (layer start_layer + N) its `moe.N` up_a [E, r, dim], up_b
# [E, 2 * inner, r] ([h | g] rows, as fc1's), down_a [E, r, inner], down_b [E, dim, r]. Its text part is registered
# twice (`text_lora.` and `_text.`), its optional vision part (`vision_lora.`, `_vision.`) is never built for the
# files its API serves, so never applied.
_KESTREL_TEXT = re.compile(r"(?:text_lora|_text)\.(dense|moe)\.(\d+)\.(up|down)_(a|b)")
_KESTREL_UNUSED = ("vision_lora.", "_vision.")


def kestrel_tensors(lora_state: dict) -> dict[str, torch.Tensor]:
    """A Kestrel checkpoint's `lora_state_dict` in the reference's names (text.blocks.N.mlp.fc1.A, ...; an expert
    layer's as text.experts.N.up.A, N counted from the first expert layer, which build_adapter places)."""
    state = {}
    for key, tensor in lora_state.items():
        if key.startswith(_KESTREL_UNUSED):
            continue
        m = _KESTREL_TEXT.fullmatch(key)
        if m is None:
            raise AdapterError(f"unexpected tensor '{key}' (a projection this engine does not adapt)")
        kind, layer, proj, ab = m.groups()
        if kind == "moe":
            name = f"text.experts.{layer}.{proj}.{ab.upper()}"
        else:
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


_EXPERT_INDEX = re.compile(r"text\.experts\.(\d+)\.(up|down)\.([AB])")


def _placed_expert_tensors(state: dict[str, torch.Tensor], config: TextConfig) -> dict[str, torch.Tensor]:
    """Kestrel's expert-layer names (text.experts.N...) as the layer's own (text.blocks.<start + N>.mlp.experts...)."""
    first = expert_layers(config).start
    placed = {}
    for key, tensor in state.items():
        m = _EXPERT_INDEX.fullmatch(key)
        if m is None:
            placed[key] = tensor
            continue
        n, proj, ab = m.groups()
        if config.moe is None:
            raise AdapterError(f"tensor 'moe.{n}.{proj}_{ab.lower()}' adapts experts, and this model has none (an "
                               "adapter of Moondream 3)")
        placed[f"text.blocks.{first + int(n)}.mlp.experts.{proj}.{ab}"] = tensor
    return placed


def build_adapter(name: str, state: dict[str, torch.Tensor], config: TextConfig, max_rank: int,
                  dtype: torch.dtype, device) -> LoraAdapter:
    """Check every tensor against the model (errors name the tensor) and move them to the device. A target is
    adapted in every layer it applies to (the dense targets in the dense layers, the experts' in the expert layers)
    or in none. max_rank bounds the adapter's rank as Kestrel counts it: its dense rank, and its experts' rank
    times the experts a token takes (Kestrel's training splits one rank over them)."""
    state = _placed_expert_tensors(state, config)
    shapes = target_shapes(config)
    experts = expert_layers(config)
    named = {m.group(1) for m in map(_TARGET_KEY.fullmatch, state) if m}
    targets = [t for t in (*TARGETS, *EXPERT_TARGETS) if _TARGET_PATH[t] in named]
    if config.moe is not None and {"qkv", "proj"} & set(targets):  # (Kestrel's adapt the MLPs only)
        key = next(k for k in sorted(state) if ".attn." in k)
        raise AdapterError(f"unexpected tensor '{key}' (Moondream 3's adapters adapt the MLPs only)")
    layers_of = {t: experts if t in EXPERT_TARGETS else range(experts.start) for t in targets}
    expected = {f"text.blocks.{i}.{_TARGET_PATH[t]}.{ab}" for t in targets for i in layers_of[t] for ab in "AB"}
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if not state:
        raise AdapterError("no tensors")
    for kind, names in (("missing", missing), ("unexpected", extra)):
        if names:
            more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
            raise AdapterError(f"{kind} tensor '{names[0]}'{more}")
    rank = expert_rank = 0
    for target in targets:
        n_in, n_out = shapes[target]
        lead = (config.moe.n_experts,) if target in EXPERT_TARGETS else ()
        for i in layers_of[target]:
            key = f"text.blocks.{i}.{_TARGET_PATH[target]}"
            a, b = state[f"{key}.A"], state[f"{key}.B"]
            r = a.shape[-2] if a.dim() == len(lead) + 2 else -1
            if r < 1 or tuple(a.shape) != (*lead, r, n_in) or tuple(b.shape) != (*lead, n_out, r):
                want_a, want_b = (*lead, r if r > 0 else "r", n_in), (*lead, n_out, "r")
                raise AdapterError(f"tensors '{key}.A' {tuple(a.shape)} and '{key}.B' {tuple(b.shape)} do not fit: "
                                   f"expected ({', '.join(map(str, want_a))}) and ({', '.join(map(str, want_b))})")
            if not (a.is_floating_point() and b.is_floating_point()):
                raise AdapterError(f"tensor '{key}.A' or '.B' is not floating point")
            if target in EXPERT_TARGETS:
                expert_rank = max(expert_rank, r)
            else:
                rank = max(rank, r)
    counted = max(rank, expert_rank * (config.moe.n_experts_per_tok if config.moe else 1))
    if counted > max_rank:
        raise AdapterError(f"rank {counted} is above the limit of {max_rank} (KESTREL_MAX_ADAPTER_RANK)")

    def on_device(t):
        return t.to(device=device, dtype=dtype).contiguous()

    layers = [{t: (on_device(state[f"text.blocks.{i}.{_TARGET_PATH[t]}.A"]),
                   on_device(state[f"text.blocks.{i}.{_TARGET_PATH[t]}.B"])) for t in targets if i in layers_of[t]}
              for i in range(config.n_layers)]
    return LoraAdapter(name, rank, layers, expert_rank)


class LoraRows:
    """Which rows of one flat forward use which adapter: (start, end, adapter) spans, adapter-less rows left
    out. `add` puts each span's delta onto y in place."""

    def __init__(self, spans: list[tuple[int, int, LoraAdapter]]):
        self.spans = spans
        self._row_slots = None  # (row_slots' tensor, copied to the device once a forward)

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

    def add_expert(self, y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, layer: int, target: str,
                   expert: int) -> torch.Tensor:
        """The reference form of an expert target: y [len(rows), out] and x [len(rows), in] are the forward's rows
        `rows` that went to `expert`; each gets its adapter's delta of that expert, in place."""
        for start, end, adapter in self.spans:
            if target in adapter.layers[layer]:
                a, b = adapter.layers[layer][target]
                mine = (rows >= start) & (rows < end)
                if bool(mine.any()):
                    y[mine] += (x[mine] @ a[expert].t()) @ b[expert].t()
        return y

    @property
    def pool(self):
        """The device pool the adapters are placed in (the GPU kernels read it), or None."""
        return self.spans[0][2].pool

    def row_slots(self, n: int, device) -> torch.Tensor:
        """Each of the forward's n rows' slot in the pool (0: no adapter), int32 on the device."""
        if self._row_slots is None or len(self._row_slots) != n:
            from .layers import to_device

            slots = torch.zeros(n, dtype=torch.int32)
            for start, end, adapter in self.spans:
                slots[start:end] = adapter.slot
            self._row_slots = to_device(slots, torch.int32, device)
        return self._row_slots


class SlotRows:
    """The rows' adapters as the GPU kernels alone read them (Moondream 3): each row's slot in an ExpertLoraPool, from
    a device buffer (a prefill graph's static input), so a forward of these rows can be captured once for any mix of
    adapters. Dense layers' fc1 and fc2 deltas go through the same pair-delta kernel as the experts' (one expert)."""

    def __init__(self, pool, row_slots: torch.Tensor):
        self.pool, self._slots = pool, row_slots

    def row_slots(self, n: int, device) -> torch.Tensor:
        return self._slots[:n]

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, target: str) -> torch.Tensor:
        if target not in ("fc1", "fc2"):  # (Moondream 3's adapters adapt the MLPs only)
            return y
        from ..kernels.moe_lora import pair_delta

        lora = self.pool.layer(layer, self._slots[:x.shape[0]])
        a, bt = (lora.up_a, lora.up_bt) if target == "fc1" else (lora.down_a, lora.down_bt)
        pair_delta(x, a, bt, lora, y, x.shape[0])
        return y
