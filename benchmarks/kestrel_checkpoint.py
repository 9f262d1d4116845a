"""A Moondream 3 checkpoint in Kestrel's layout (moondream3-preview's model_fp8.pt): legacy tensor names, tau's two
matrices as one (tau_wqwv), the region's Fourier features transposed, and the experts in FP8 (e4m3) with a scale per
output row (moe_quant.up_scale / down_scale). Side-by-side runs with Kestrel load the same file in both engines (ours
dequantises the experts to bf16); the loader's test converts the tiny fixture with it.

    python benchmarks/kestrel_checkpoint.py OUT_DIR [--seed 0]
        # full-size random weights -> OUT_DIR/model_fp8.pt and tokenizer.json (on the GPU if there is one)
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_backend.model.weights import MoE, is_expert_weight  # noqa: E402

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


def fp8_experts(moe: MoE) -> MoE:
    """The same MoE layer with its experts in FP8 and a float32 scale a row, as KESTREL_FP8_EXPERTS=fp8 keeps them."""
    (fc1, fc1_scale), (fc2, fc2_scale) = to_fp8(moe.fc1), to_fp8(moe.fc2)
    return dataclasses.replace(moe, fc1=fc1, fc2=fc2, fc1_scale=fc1_scale, fc2_scale=fc2_scale)


def fp8_experts_beside_widened(moe: MoE) -> MoE:
    """fp8_experts(moe) with the widened experts kept beside them, as KESTREL_FP8_EXPERTS=both keeps them."""
    return dataclasses.replace(fp8_experts(moe), fc1_wide=moe.fc1, fc2_wide=moe.fc2)


def random_moondream3_fp8_both():
    """Moondream 3 with FULL-SIZE random bf16 weights on the GPU, its experts as KESTREL_FP8_EXPERTS=both keeps
    them (fp8_experts_beside_widened)."""
    from kestrel_backend.model.config import MoondreamConfig
    from kestrel_backend.model.moondream import Moondream
    from kestrel_backend.model.weights import random_weights

    config = MoondreamConfig.official("moondream3")
    weights = random_weights(config, dtype=torch.bfloat16, device="cuda")
    for block in weights.text.blocks:
        if block.moe is not None:
            block.moe = fp8_experts_beside_widened(block.moe)
    return Moondream(config, weights)


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


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from kestrel_backend.model.config import MoondreamConfig
    from kestrel_backend.model.weights import random_state

    config = MoondreamConfig.official("moondream3")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = random_state(config, dtype=torch.bfloat16, device=device, seed=args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(to_kestrel_layout(state, config.text.n_layers, device), args.out / "model_fp8.pt")
    shutil.copy(Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "md2-tiny" / "tokenizer.json", args.out)
    print(f"wrote {args.out / 'model_fp8.pt'} ({(args.out / 'model_fp8.pt').stat().st_size / 1e9:.1f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
