"""Tile sizes of Moondream 3's expert kernels (runtime/moe_kernels.py), timed on the GPU with full-size expert
weights (bf16, random) at a decode step's token count and a prefill's, in TFLOP/s and GB/s of expert weights.

    python benchmarks/tune_moe.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gpu_bench import graph_timed  # noqa: E402
from kestrel_backend.model.config import MoeConfig  # noqa: E402
from kestrel_backend.runtime import moe_kernels as mk  # noqa: E402

CANDIDATES = {
    "current": None,
    "m64 n64/128 w4/8": (dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4), dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8)),
    "m128 n128 w8 s4": (dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
                        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4)),
    "m128 n64 k32 w4": (dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4),
                        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=4)),
    "m64 n128 w4 s4": (dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
                       dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)),
}


def main() -> None:
    m, dim = MoeConfig(), 2048
    gen = torch.Generator(device="cuda").manual_seed(0)
    fc1 = torch.randn(m.n_experts, 2 * m.expert_inner_dim, dim, device="cuda", generator=gen).mul_(dim ** -0.5).bfloat16()
    fc2 = torch.randn(m.n_experts, dim, m.expert_inner_dim, device="cuda", generator=gen).mul_(1 / 32).bfloat16()
    router_w = torch.randn(m.n_experts, dim, device="cuda", generator=gen).mul_(dim ** -0.5).bfloat16()
    router_b = torch.zeros(m.n_experts, device="cuda", dtype=torch.bfloat16)
    default = mk._tiles
    for tokens in (1, 64, 742, 8 * 742):
        x = torch.randn(tokens, dim, device="cuda", generator=gen).bfloat16()
        flop = 2 * tokens * m.n_experts_per_tok * 3 * dim * m.expert_inner_dim
        experts = m.n_experts * (1 - (1 - m.n_experts_per_tok / m.n_experts) ** tokens)
        weight_bytes = experts * 3 * dim * m.expert_inner_dim * 2
        for name, tiles in CANDIDATES.items():
            if tiles is not None and tokens <= 128:
                continue  # (the candidates are prefill tiles)
            mk._tiles = default if tiles is None else (lambda t, dtype, tiles=tiles: tiles)
            try:
                ms = graph_timed(lambda: mk.moe_mlp_cuda(x, router_w, router_b, fc1, fc2, m.n_experts_per_tok), calls=4)
                print(f"{tokens:5d} tokens {name:18s} {ms:8.3f} ms  {flop / ms / 1e9:7.1f} TFLOP/s  "
                      f"{weight_bytes / ms / 1e6:7.0f} GB/s", flush=True)
            except Exception as e:  # a tile that does not fit: say so, go on
                print(f"{tokens:5d} tokens {name:18s} failed: {type(e).__name__}: {str(e)[:80]}", flush=True)
        mk._tiles = default


if __name__ == "__main__":
    main()
