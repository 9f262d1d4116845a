"""Checkpoints both engines load, for side-by-side runs with Kestrel (benchmarks/kestrel_peer.py), full-size random
weights (on the GPU if there is one), tokenizer.json beside them:
- Moondream 3 in Kestrel's layout (moondream3-preview's model_fp8.pt; model/legacy_layout.py writes it): legacy tensor
  names, tau's two matrices as one (tau_wqwv), the region's Fourier features transposed, and the experts in FP8 (e4m3)
  with a scale per output row (moe_quant.up_scale / down_scale); ours dequantises the experts to bf16 (or keeps them:
  KESTREL_FP8_EXPERTS);
- Moondream 2 in the official layout as the hub ships it (model.safetensors, names under "model.", which Kestrel
  requires and ours strips).

    python benchmarks/kestrel_checkpoint.py OUT_DIR [--model moondream3 | moondream2] [--seed 0]
        # -> OUT_DIR/model_fp8.pt (Moondream 3) or OUT_DIR/model.safetensors (Moondream 2), and tokenizer.json
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_backend.model.legacy_layout import fp8_experts_beside_widened, to_kestrel_layout  # noqa: E402


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


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--model", default="moondream3", choices=["moondream3", "moondream2"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from safetensors.torch import save_file

    from kestrel_backend.model.config import MoondreamConfig
    from kestrel_backend.model.weights import random_state

    config = MoondreamConfig.official(args.model)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = random_state(config, dtype=torch.bfloat16, device=device, seed=args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model == "moondream3":
        path = args.out / "model_fp8.pt"
        torch.save(to_kestrel_layout(state, config.text.n_layers, device), path)
    else:
        path = args.out / "model.safetensors"
        save_file({"model." + name: tensor.cpu() for name, tensor in state.items()}, str(path))
    shutil.copy(Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "md2-tiny" / "tokenizer.json", args.out)
    print(f"wrote {path} ({path.stat().st_size / 1e9:.1f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
