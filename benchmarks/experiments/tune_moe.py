"""Tile sizes and paths of Moondream 3's expert MLP (kernels/moe_kernels.py), timed on the GPU with full-size expert
weights (bf16, random) at a decode step's token count and a prefill's, in TFLOP/s and GB/s of expert weights.

    python benchmarks/experiments/tune_moe.py             # the prefill tile candidates below; the kernels against the grouped GEMM
    python benchmarks/experiments/tune_moe.py --decode    # a sweep of the up and the down kernel's tiles at 16 and 64 tokens
    python benchmarks/experiments/tune_moe.py --one-token # the same inside whole decode steps of one sequence (full-size model)
    python benchmarks/experiments/tune_moe.py --prefill   # a sweep of both kernels' tiles at short prefills' token counts
    add --fp8 (not with --one-token): the experts in FP8 with a scale a row, as Kestrel's checkpoints hold them; the
    first form then also times the grouped GEMM on widened copies (KESTREL_FP8_EXPERTS=both), widened each call
    (fp8) and W8A8 (FP8 activations, torch's FP8 grouped GEMM; with and without its fast accumulation), with each
    one's error against the float32 MLP over the same FP8 weights
"""

import dataclasses
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import graph_timed  # noqa: E402
from kestrel_backend.model.config import MoeConfig  # noqa: E402
from kestrel_backend.model.legacy_layout import fp8_experts  # noqa: E402
from kestrel_backend.model.weights import Linear, MoE  # noqa: E402
from kestrel_backend.kernels import moe_kernels as mk  # noqa: E402

CANDIDATES = {
    "kernels": None,
    "m64 n64/128 w4/8": (dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4), dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8)),
    "m128 n128 w8 s4": (dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
                        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4)),
    "m128 n64 k32 w4": (dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=4),
                        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=4)),
    "m64 n128 w4 s4": (dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
                       dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)),
}


def tile_grid(columns, depths, warps, stages, rows=(16,)) -> list[dict]:
    return [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
            for m, n, k, w, s in itertools.product(rows, columns, depths, warps, stages)]


def ranked(time_pair, base: tuple, which: int, candidates) -> list[tuple[float, dict]]:
    """(ms, tiles) of each candidate for kernel `which` (0 up, 1 down) beside base's tiles for the other, fastest
    first; time_pair((up, down)) -> ms. Candidates past the GPU's shared memory are left out."""
    results = []
    for tiles in candidates:
        pair = (tiles, base[1]) if which == 0 else (base[0], tiles)
        try:
            results.append((time_pair(pair), tiles))
        except Exception:  # (tiles past the shared memory)
            continue
    return sorted(results, key=lambda r: r[0])


def kernel_sweep(x_for, moe, m, counts=(16, 64), grid=None) -> None:
    """Each kernel's tiles in turn (the other at its current tiles), at these token counts (on the kernels' path,
    not the grouped GEMM's)."""
    default, grouped_from = mk._tiles, mk.GROUPED_GEMM_PAIRS
    mk.GROUPED_GEMM_PAIRS = 10 ** 9
    grid = grid or tile_grid((32, 64, 128), (64, 128), (4, 8), (3, 4))
    for tokens in counts:
        x, current = x_for(tokens), default(tokens, torch.bfloat16, moe.fc1_scale is not None)
        experts = m.n_experts * (1 - (1 - m.n_experts_per_tok / m.n_experts) ** tokens)
        weight_bytes = experts * 3 * x.shape[1] * m.expert_inner_dim * moe.fc1.element_size()

        def time_pair(pair) -> float:
            mk._tiles = lambda *_: pair
            return graph_timed(lambda: mk.moe_mlp_cuda(x, moe), calls=8)

        ms = time_pair(current)
        print(f"{tokens} tokens, current: {ms:.4f} ms, {weight_bytes / ms / 1e6:.0f} GB/s", flush=True)
        for which in (0, 1):
            best_ms, best = ranked(time_pair, current, which, [current[which]] + grid)[0]
            print(f"{tokens} tokens, best {'up' if which == 0 else 'down'}: {best} {best_ms:.4f} ms, "
                  f"{weight_bytes / best_ms / 1e6:.0f} GB/s", flush=True)
    mk._tiles, mk.GROUPED_GEMM_PAIRS = default, grouped_from


def one_token_sweep() -> None:
    """Tiles of one token's expert kernels timed inside the whole decode step (launched ahead, context 64): there
    they share the GPU with the attention path on the other stream, and the best tiles for the MLP alone lose."""
    from benchmarks.common import ceilings, decode_steps
    from kestrel_backend.model.config import MoondreamConfig
    from kestrel_backend.model.moondream import Moondream
    from kestrel_backend.model.weights import random_weights

    bandwidth = ceilings()["copy_bandwidth_GBps"] * 1e9
    config = MoondreamConfig.official("moondream3")
    model = Moondream(config, random_weights(config, dtype=torch.bfloat16, device="cuda"))
    chosen = mk.ONE_TOKEN_TILES

    def step(pair, context=64) -> float:
        mk.ONE_TOKEN_TILES = tuple(pair)
        return decode_steps(model, [1], context, bandwidth, "graph-ahead")[0]["step_ms"]

    grid = tile_grid((16, 32, 64), (64, 128), (2, 4, 8), (2, 3, 4))
    with torch.inference_mode():
        print(f"current: {step(chosen):.4f} ms", flush=True)
        for which in (0, 1):
            results = ranked(step, chosen, which, grid)
            for ms, tiles in results[:4]:
                print(f"{'up' if which == 0 else 'down'} {ms:.4f} ms {tiles}", flush=True)
            chosen = (results[0][1], chosen[1]) if which == 0 else (chosen[0], results[0][1])
        print(f"best pair: {step(chosen):.4f} ms at context 64, {step(chosen, 800):.4f} at 800: {chosen}", flush=True)


def main() -> None:
    m, dim = MoeConfig(), 2048
    gen = torch.Generator(device="cuda").manual_seed(0)
    fc1 = torch.randn(m.n_experts, 2 * m.expert_inner_dim, dim, device="cuda", generator=gen).mul_(dim ** -0.5).bfloat16()
    fc2 = torch.randn(m.n_experts, dim, m.expert_inner_dim, device="cuda", generator=gen).mul_(1 / 32).bfloat16()
    router_w = torch.randn(m.n_experts, dim, device="cuda", generator=gen).mul_(dim ** -0.5).bfloat16()
    router_b = torch.zeros(m.n_experts, device="cuda", dtype=torch.bfloat16)
    moe = MoE(Linear(router_w, router_b), fc1, fc2, m.n_experts_per_tok)
    if "--fp8" in sys.argv:  # the experts as Kestrel's checkpoints hold them
        moe = fp8_experts(moe)
    if "--one-token" in sys.argv:
        return one_token_sweep()
    x_for = lambda t: torch.randn(t, dim, device="cuda", generator=gen).bfloat16()  # noqa: E731
    if "--decode" in sys.argv:
        return kernel_sweep(x_for, moe, m)
    if "--prefill" in sys.argv:
        return kernel_sweep(x_for, moe, m, (300, 742, 1484), tile_grid((64, 128), (64, 128), (4, 8), (3, 4), (64, 128)))
    default, grouped_from, w8a8 = mk._tiles, mk.GROUPED_GEMM_PAIRS, mk.W8A8_PREFILL
    fp8 = moe.fc1_scale is not None
    if fp8:  # the float32 reference over the same weights, and the widened copies of `both`
        wide = [mk.widened(w, s, torch.bfloat16) for w, s in ((moe.fc1, moe.fc1_scale), (moe.fc2, moe.fc2_scale))]
        both = dataclasses.replace(moe, fc1_wide=wide[0], fc2_wide=wide[1])
        exact = MoE(Linear(router_w.float(), router_b.float()), wide[0].float(), wide[1].float(), moe.top_k)
    for tokens in (1, 64, 300, 512, 742, 1024, 1484, 2968, 8 * 742):
        x = torch.randn(tokens, dim, device="cuda", generator=gen).bfloat16()
        flop = 2 * tokens * m.n_experts_per_tok * 3 * dim * m.expert_inner_dim
        experts = m.n_experts * (1 - (1 - m.n_experts_per_tok / m.n_experts) ** tokens)
        weight_bytes = experts * 3 * dim * m.expert_inner_dim * moe.fc1.element_size()
        paths = {"current": (None, grouped_from, moe, w8a8, True)}  # tiles, grouped from, layer, W8A8, fast accum
        if tokens > 128:  # prefills: the kernels' tile candidates, and the grouped GEMM path
            paths |= {name: (tiles, 10 ** 9, moe, w8a8, True) for name, tiles in CANDIDATES.items()}
            paths |= {"grouped GEMM": (None, 0, moe, False, True)}
            if fp8:
                paths |= {"grouped GEMM both": (None, 0, both, False, True), "W8A8": (None, 0, moe, True, True),
                          "W8A8 exact accum": (None, 0, moe, True, False)}
        want = mk.moe_mlp_cuda(x.float(), exact) if fp8 and tokens >= 512 else None
        for name, (tiles, grouped_pairs, layer, w8a8_path, fast) in paths.items():
            mk._tiles = default if tiles is None else (lambda *_, tiles=tiles: tiles)
            mk.GROUPED_GEMM_PAIRS, mk.W8A8_PREFILL, mk.W8A8_FAST_ACCUM = grouped_pairs, w8a8_path, fast
            try:
                ms = graph_timed(lambda: mk.moe_mlp_cuda(x, layer), calls=4)
                err = "" if want is None else \
                    f"  rel err {((mk.moe_mlp_cuda(x, layer).float() - want).norm() / want.norm()).item():.1e}"
                print(f"{tokens:5d} tokens {name:18s} {ms:8.3f} ms  {flop / ms / 1e9:7.1f} TFLOP/s  "
                      f"{weight_bytes / ms / 1e6:7.0f} GB/s{err}", flush=True)
            except Exception as e:  # a tile that does not fit: say so, go on
                print(f"{tokens:5d} tokens {name:18s} failed: {type(e).__name__}: {str(e)[:80]}", flush=True)
        mk._tiles, mk.GROUPED_GEMM_PAIRS, mk.W8A8_PREFILL, mk.W8A8_FAST_ACCUM = default, grouped_from, w8a8, True


if __name__ == "__main__":
    main()
