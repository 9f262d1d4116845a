"""The vision encoder's attention on the GPU: our kernel (model/vision_attention_cuda.py, 64 + 16 columns a 72-wide
head) under several tiles, beside PyTorch's kernels (cuDNN's, the default on an H100, appears to pad the heads to
128, FlashAttention's to 96): the attention alone (on the encoder's qkv GEMM output), and the whole encoder of 13
crops (one 12-tile image and its global crop, eager) with ours or PyTorch's default, each next to the default's
output (max abs difference, bf16).

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
from kestrel_backend.model import vision, vision_attention_cuda  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from kestrel_backend.model.weights import random_weights  # noqa: E402

OUR_TILES = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3),
             (64, 32, 4, 3), (64, 128, 4, 2), (256, 64, 8, 3)]  # BLOCK_M, BLOCK_N, warps, stages
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

    def sdpa_rows(qkv, crops, heads_, tiles=None):  # what the encoder did before our kernel
        q, k, vv = (t.view(crops, -1, heads_, dim // heads_).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        return F.scaled_dot_product_attention(q, k, vv).transpose(1, 2).reshape(qkv.shape[0], dim)

    def ours(what: str, crops: int, run, reference, per) -> None:
        for tiles in OUR_TILES:
            try:
                out, ms = run(tiles), timed(lambda: run(tiles))
            except Exception as e:  # (tiles past the GPU's shared memory)
                rows.append({"what": what, "crops": crops, "backend": "ours", "tiles": tiles, "error": str(e)[:200]})
                continue
            rows.append({"what": what, "crops": crops, "backend": "ours", "tiles": tiles, "ms": ms, **per(ms),
                         "max_abs_diff": (out - reference).abs().max().item()})
            print(json.dumps(rows[-1]), flush=True)

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
            reference = F.scaled_dot_product_attention(q, k, vv)
            per = lambda ms: {"TFLOPs": flops / ms / 1e9}  # noqa: E731
            compare("attention", n, lambda: F.scaled_dot_product_attention(q, k, vv), reference, per)
            reference = reference.transpose(1, 2).reshape(n * tokens, dim)
            rows_qkv = qkv.view(-1, 3 * dim)
            ours("attention", n, lambda tiles: vision_attention_cuda.vision_attention(rows_qkv, n, heads, tiles),
                 reference, per)
        crops = torch.randn(13, 3, v.crop_size, v.crop_size, device="cuda", dtype=torch.bfloat16)
        per = lambda ms: {"ms_per_crop": ms / 13}  # noqa: E731
        attention = vision_attention_cuda.vision_attention
        vision_attention_cuda.vision_attention = sdpa_rows
        reference = vision.encode_crops(crops, w, v)
        compare("encoder", 13, lambda: vision.encode_crops(crops, w, v), reference, per)

        def encode_with(tiles):
            vision_attention_cuda.vision_attention = lambda qkv, c, h: attention(qkv, c, h, tiles)
            return vision.encode_crops(crops, w, v)
        ours("encoder", 13, encode_with, reference, per)
        vision_attention_cuda.vision_attention = attention
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
