"""Tile sizes of Moondream 3's expert kernels (runtime/moe_kernels.py), timed on the GPU with full-size expert
weights (bf16, random) at a decode step's token count and a prefill's, in TFLOP/s and GB/s of expert weights.

    python benchmarks/tune_moe.py            # the prefill candidates below
    python benchmarks/tune_moe.py --decode   # a sweep of the up and the down kernel's tiles at 16 and 64 tokens
"""

import itertools
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


def decode_sweep(x_for, router_w, router_b, fc1, fc2, m) -> None:
    """Each kernel's tiles in turn (the other at its current tiles), at a decode step's token counts."""
    default = mk._tiles
    grid = [dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
            for n, k, w, s in itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 4))]
    for tokens in (16, 64):
        x, current = x_for(tokens), default(tokens, torch.bfloat16)
        experts = m.n_experts * (1 - (1 - m.n_experts_per_tok / m.n_experts) ** tokens)
        weight_bytes = experts * 3 * x.shape[1] * m.expert_inner_dim * 2
        for which in (0, 1):
            best = None
            for tiles in [current[which]] + grid:
                pair = (tiles, current[1]) if which == 0 else (current[0], tiles)
                mk._tiles = lambda t, dtype, pair=pair: pair
                try:
                    ms = graph_timed(lambda: mk.moe_mlp_cuda(x, router_w, router_b, fc1, fc2, m.n_experts_per_tok),
                                     calls=8)
                except Exception:  # (tiles past the shared memory)
                    continue
                if best is None or ms < best[0]:
                    best = (ms, tiles)
                if tiles is current[which]:
                    print(f"{tokens} tokens, current: {ms:.4f} ms, {weight_bytes / ms / 1e6:.0f} GB/s", flush=True)
            print(f"{tokens} tokens, best {'up' if which == 0 else 'down'}: {best[1]} {best[0]:.4f} ms, "
                  f"{weight_bytes / best[0] / 1e6:.0f} GB/s", flush=True)
    mk._tiles = default


def main() -> None:
    m, dim = MoeConfig(), 2048
    gen = torch.Generator(device="cuda").manual_seed(0)
    fc1 = torch.randn(m.n_experts, 2 * m.expert_inner_dim, dim, device="cuda", generator=gen).mul_(dim ** -0.5).bfloat16()
    fc2 = torch.randn(m.n_experts, dim, m.expert_inner_dim, device="cuda", generator=gen).mul_(1 / 32).bfloat16()
    router_w = torch.randn(m.n_experts, dim, device="cuda", generator=gen).mul_(dim ** -0.5).bfloat16()
    router_b = torch.zeros(m.n_experts, device="cuda", dtype=torch.bfloat16)
    if "--decode" in sys.argv:
        return decode_sweep(lambda t: torch.randn(t, dim, device="cuda", generator=gen).bfloat16(), router_w,
                            router_b, fc1, fc2, m)
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
