"""Which of PyTorch's attention kernels the vision encoder should use (GPU only). Its heads are 72 wide, which
no kernel tiles exactly: cuDNN's (the default on an H100) appears to pad them to 128, FlashAttention's to 96.
For each backend that takes the encoder's shapes: the attention alone (q, k, v as the encoder makes them: views of
its qkv GEMM), and the whole encoder of 13 crops (one 12-tile image and its global crop, eager), each next to the
default's output (max abs difference, bf16).

    python benchmarks/vision_attention.py [--crops 13 64] [--out vision_attention.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_bench import timed  # noqa: E402
from kestrel_backend.model import vision  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from kestrel_backend.model.weights import random_weights  # noqa: E402

BACKENDS = {"default": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def under(backend):
    return sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()  # (None: the dispatcher's)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--crops", type=int, nargs="+", default=[13, 64])
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    config = MoondreamConfig.official("moondream2")
    v, w = config.vision, random_weights(config, dtype=torch.bfloat16, device="cuda").vision
    heads, tokens, dim = v.enc_n_heads, v.grid * v.grid, v.enc_dim
    rows = []

    def compare(what: str, crops: int, run, reference, per=None) -> None:
        """Time run() under each backend, beside reference's output; per(ms): more figures for the row."""
        for name, backend in BACKENDS.items():
            row = {"what": what, "crops": crops, "backend": name}
            try:
                with under(backend):
                    out, ms = run(), timed(run)
            except RuntimeError as e:  # (a backend that refuses these shapes or strides)
                rows.append(row | {"error": str(e)[:200]})
                continue
            rows.append(row | {"ms": ms, **per(ms), "max_abs_diff": (out - reference).abs().max().item()})
            print(json.dumps(rows[-1]), flush=True)

    with torch.inference_mode():
        for n in args.crops:
            qkv = torch.randn(n, tokens, 3 * dim, device="cuda", dtype=torch.bfloat16)
            q, k, vv = (t.view(n, tokens, heads, dim // heads).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
            flops = 4 * n * heads * tokens * tokens * (dim // heads)
            compare("attention", n, lambda: F.scaled_dot_product_attention(q, k, vv),
                    F.scaled_dot_product_attention(q, k, vv), lambda ms: {"TFLOPs": flops / ms / 1e9})
        crops = torch.randn(13, 3, v.crop_size, v.crop_size, device="cuda", dtype=torch.bfloat16)
        compare("encoder", 13, lambda: vision.encode_crops(crops, w, v), vision.encode_crops(crops, w, v),
                lambda ms: {"ms_per_crop": ms / 13})
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
