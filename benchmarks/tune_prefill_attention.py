"""Tiles of the prefill attention kernel (runtime/prefill_attention.py) on the GPU: the kernel alone, as CUDA
graphs, for 1 / 4 / 16 fresh image queries (730 prefix + 12 prompt tokens each), next to the torch path it
replaces; each variant's output and cache rows checked against that path.

    python benchmarks/tune_prefill_attention.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gpu_bench import fresh_queries, graph_timed  # noqa: E402
from kestrel_backend.model.config import TextConfig  # noqa: E402
from kestrel_backend.runtime import prefill_attention as pa  # noqa: E402
from kestrel_backend.runtime.attention import TorchPagedAttention  # noqa: E402
from kestrel_backend.runtime.kv_cache import PagedKVCache  # noqa: E402

TILES = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2), (128, 64, 4, 2),
         (128, 32, 4, 2), (32, 64, 4, 2), (64, 128, 4, 2), (64, 64, 8, 2)]  # BLOCK_M, BLOCK_N, warps, stages


def main() -> None:
    cfg = TextConfig()
    h, d, prefix, length = cfg.n_heads, cfg.head_dim, cfg.prefix_attn, cfg.prefix_attn + 12
    for n in (1, 4, 16):
        cache = PagedKVCache(cfg, n * -(-length // 16), 16, "cuda", torch.bfloat16)
        for i in range(n):
            cache.allocate(i, length)
        slices = fresh_queries(n, length, prefix)
        q, k, v = (t.view(-1, h, d) for t in torch.randn(n * length, 3 * h * d, device="cuda",
                                                          dtype=torch.bfloat16).split(h * d, 1))
        reference = TorchPagedAttention(cache)
        reference.plan(slices)
        slots = torch.as_tensor(cache.rows((s.seq_id, s.first_pos, s.end - s.start) for s in slices), device="cuda")
        flops = n * 4 * h * d * (prefix * prefix + sum(prefix + i + 1 for i in range(length - prefix)))
        with torch.inference_mode():
            ref = reference(0, q, k, v)  # into layer 0 of the cache; the variants write layer 1
            ms = graph_timed(lambda: reference(0, q, k, v), calls=4)
            print(f"{n} x {length} tokens: torch path {ms * 1000:.0f} us", flush=True)
            for tile in TILES:
                pa.BLOCK_M, pa.BLOCK_N, pa.WARPS, pa.STAGES = tile
                work = torch.tensor(pa.work_items(slices), dtype=torch.int32, device="cuda")
                out = pa.prefill_attention(q, k, v, cache.k[1], cache.v[1], slots, work)
                err = (out.float() - ref.float()).abs().max().item()
                rows = torch.equal(cache.k[1], cache.k[0]) and torch.equal(cache.v[1], cache.v[0])
                ms = graph_timed(lambda: pa.prefill_attention(q, k, v, cache.k[1], cache.v[1], slots, work), calls=4)
                print(f"  {tile[0]} x {tile[1]}, {tile[2]} warps, {tile[3]} stages: {ms * 1000:.0f} us "
                      f"({flops / ms / 1e9:.0f} TFLOP/s), max difference {err:.4f}, cache rows equal: {rows}",
                      flush=True)


if __name__ == "__main__":
    main()
