"""The legacy tensor layout (Moondream 2's older checkpoints, and Kestrel's Moondream 3: vision_encoder.*,
text_model.transformer.h.N.*, region_model.*) both ways. Reading: its names onto the current ones (weights.py does
the rest). Writing: a current-layout Moondream 3 state in Kestrel's layout, its experts in FP8 with a scale a row
(moondream3-preview's model_fp8.pt), for side-by-side runs with Kestrel (benchmarks/kestrel_checkpoint.py) and the
loader's tests."""

from __future__ import annotations

import dataclasses
import re

import torch

_LEGACY_VISUAL = "vision_encoder.encoder.model.visual."
# Legacy prefix -> current prefix, for the tensors outside the repeated blocks.
_LEGACY_PREFIXES = [
    (_LEGACY_VISUAL + "patch_embed.linear.", "vision.patch_emb."),
    (_LEGACY_VISUAL + "pos_embed", "vision.pos_emb"),
    (_LEGACY_VISUAL + "norm.", "vision.post_ln."),
    ("vision_encoder.projection.mlp.", "vision.proj_mlp."),
    ("text_model.transformer.embd.wte.weight", "text.wte"),
    ("text_model.lm_head.ln.", "text.post_ln."),
    ("text_model.lm_head.linear.", "text.lm_head."),
    ("region_model.coordinate_features.weight", "region.coord_features"),
    ("region_model.size_features.weight", "region.size_features"),
    ("region_model.coordinate_encoder.", "region.coord_encoder."),
    ("region_model.coordinate_decoder.", "region.coord_decoder."),
    ("region_model.size_encoder.", "region.size_encoder."),
    ("region_model.size_decoder.", "region.size_decoder."),
    ("region_model.coordinate_head.", "region.coord_decoder."),  # (Moondream 3: single Linears after region.ln)
    ("region_model.size_head.", "region.size_decoder."),
    ("region_model.ln.", "region.ln."),
]
_LEGACY_VISION_BLOCK = re.compile(re.escape(_LEGACY_VISUAL) + r"blocks\.(\d+)\.(.+)")
_LEGACY_TEXT_BLOCK = re.compile(r"text_model\.transformer\.h\.(\d+)\.(.+)")
_LEGACY_BLOCK_PARTS = {"norm1.": "ln1.", "norm2.": "ln2.", "mixer.Wqkv.": "attn.qkv.", "mixer.out_proj.": "attn.proj."}
_LEGACY_MOONDREAM3_PARTS = {  # text blocks only
    "gate.": "mlp.router.", "mlp.experts.weight": "mlp.fc1.weight", "mlp.output_experts.weight": "mlp.fc2.weight",
    "moe_quant.up_scale": "mlp.fc1.weight_scale", "moe_quant.down_scale": "mlp.fc2.weight_scale",
    "tau_alpha": "attn.tau.alpha", "tau_wqwv": "attn.tau.wqwv", "tau_wq": "attn.tau.wq", "tau_wv": "attn.tau.wv",
}
FP8_SCALE = "_scale"  # <weight name> + this: an FP8 weight's scale per output row


def legacy_to_current(name: str) -> str | None:
    for pattern, prefix in [(_LEGACY_VISION_BLOCK, "vision"), (_LEGACY_TEXT_BLOCK, "text")]:
        m = pattern.fullmatch(name)
        if m:
            index, rest = m.groups()
            parts = _LEGACY_BLOCK_PARTS | (_LEGACY_MOONDREAM3_PARTS if prefix == "text" else {})
            for old, new in parts.items():
                if rest.startswith(old):
                    rest = new + rest[len(old):]
                    break
            return f"{prefix}.blocks.{index}.{rest}"
    for old, new in _LEGACY_PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return None


def is_legacy_layout(names) -> bool:
    return any(n.startswith(("vision_encoder.", "text_model.", "region_model.")) for n in names)


def is_expert_weight(name: str, tensor: torch.Tensor) -> bool:
    """Moondream 3's stacked experts (either layout, once normalised: [E, rows, cols] of an MLP in a text block)."""
    return tensor.dim() == 3 and name.endswith((".mlp.fc1.weight", ".mlp.fc2.weight"))


def split_tau(state: dict[str, torch.Tensor]) -> None:
    """tau's query and value matrices stored as one (wqwv: wq's rows, then wv's) -> attn.tau.wq and wv."""
    for name in [n for n in state if n.endswith(".attn.tau.wqwv")]:
        wq, wv = state.pop(name).chunk(2)
        state[name.removesuffix("wqwv") + "wq"], state[name.removesuffix("wqwv") + "wv"] = wq, wv


# --- writing Kestrel's layout ---

FP8_MAX = 448.0  # the largest e4m3 value
_VISUAL = "vision_encoder.encoder.model.visual."
_FIXED = {"vision.patch_emb.": _VISUAL + "patch_embed.linear.", "vision.pos_emb": _VISUAL + "pos_embed",
          "vision.post_ln.": _VISUAL + "norm.", "vision.proj_mlp.": "vision_encoder.projection.mlp.",
          "text.wte": "text_model.transformer.embd.wte.weight", "text.post_ln.": "text_model.lm_head.ln.",
          "text.lm_head.": "text_model.lm_head.linear.",
          "region.coord_features": "region_model.coordinate_features.weight",
          "region.size_features": "region_model.size_features.weight",
          "region.coord_encoder.": "region_model.coordinate_encoder.",
          "region.size_encoder.": "region_model.size_encoder.",
          "region.coord_decoder.": "region_model.coordinate_head.",
          "region.size_decoder.": "region_model.size_head.",
          "region.ln.": "region_model.ln."}


def kestrel_name(name: str, tensor: torch.Tensor) -> str:
    """A current-layout Moondream 3 tensor's name (with or without "model.") in Kestrel's layout."""
    name = name.removeprefix("model.")
    for old, new in _FIXED.items():
        if name.startswith(old):
            return new + name[len(old):]
    kind, _, index, rest = name.split(".", 3)
    if kind == "vision":
        return f"{_VISUAL}blocks.{index}.{rest.replace('ln1.', 'norm1.').replace('ln2.', 'norm2.')}"
    parts = {"attn.qkv.": "mixer.Wqkv.", "attn.proj.": "mixer.out_proj.", "mlp.router.": "gate.",
             "attn.tau.alpha": "tau_alpha"}
    if is_expert_weight(name, tensor):
        parts = {"mlp.fc1.weight": "mlp.experts.weight", "mlp.fc2.weight": "mlp.output_experts.weight"}
    for old, new in parts.items():
        rest = rest.replace(old, new)
    return f"text_model.transformer.h.{index}.{rest}"


def to_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, cols] -> (FP8 weight, float32 scale per row [E, rows]): weight ~ fp8 * scale."""
    scale = weight.float().abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX
    return (weight.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


def fp8_experts(moe):
    """The same MoE layer with its experts in FP8 and a float32 scale a row, as KESTREL_FP8_EXPERTS=fp8 keeps them."""
    (fc1, fc1_scale), (fc2, fc2_scale) = to_fp8(moe.fc1), to_fp8(moe.fc2)
    return dataclasses.replace(moe, fc1=fc1, fc2=fc2, fc1_scale=fc1_scale, fc2_scale=fc2_scale)


def fp8_experts_beside_widened(moe):
    """fp8_experts(moe) with the widened experts kept beside them, as KESTREL_FP8_EXPERTS=both keeps them."""
    return dataclasses.replace(fp8_experts(moe), fc1_wide=moe.fc1, fc2_wide=moe.fc2)


def to_kestrel_layout(state: dict[str, torch.Tensor], n_layers: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Current-layout tensors -> Kestrel's (on device, one tensor at a time, so a full-size state converts on a GPU
    and lands in host memory once)."""
    out = {}
    for name in list(state):
        tensor = state[name]
        if ".attn.tau.w" in name:
            continue
        if name.endswith("_features"):
            tensor = tensor.T.contiguous()
        if is_expert_weight(name, tensor):
            fp8, scale = to_fp8(tensor.to(device))
            layer = name.removeprefix("model.").split(".")[2]
            kind = "up_scale" if ".fc1." in name else "down_scale"
            out[f"text_model.transformer.h.{layer}.moe_quant.{kind}"] = scale.cpu()
            tensor = fp8
        out[kestrel_name(name, tensor)] = tensor.cpu()
    for i in range(n_layers):
        prefix = "model." if f"model.text.blocks.{i}.attn.tau.wq" in state else ""
        wq, wv = state[f"{prefix}text.blocks.{i}.attn.tau.wq"], state[f"{prefix}text.blocks.{i}.attn.tau.wv"]
        out[f"text_model.transformer.h.{i}.tau_wqwv"] = torch.cat([wq, wv]).cpu()
    return out
