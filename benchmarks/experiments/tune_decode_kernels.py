"""Tile sweep for the fused decode kernels at full-size Moondream 2 shapes (GPU only).

    python benchmarks/experiments/tune_decode_kernels.py --out tune.json [--batches 1,8,64,128]
    python benchmarks/experiments/tune_decode_kernels.py --attention --out attention.json  (its tiles swept)

For each batch size and kernel (layer norm + qkv + fc1/GELU; out-projection + fc2 + residual; final
norm + LM head) it times every tile configuration and the cuBLAS ops the kernel replaces, as CUDA
graphs over four weight copies (more than L2 holds, like consecutive layers), and prints the best
with its weight bandwidth. What it finds goes into decode_kernels._tiles by hand. Also times the
rotary + paged attention kernel.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import graph_timed  # noqa: E402
from kestrel_backend.kernels import decode_kernels as dk  # noqa: E402

COPIES = 4  # distinct weight sets per timed call: 4 x >= 42 MB, beyond the H100's 50 MB L2


def cases(m: int, dim=2048, ff=8192, vocab=51200):
    """name -> (fused call(tiles), cuBLAS reference call, weight bytes per call, N sizes)."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, dim, **bf)
    ln_w, ln_b = torch.randn(dim, **bf), torch.randn(dim, **bf)
    attn, g = torch.randn(m, dim, **bf), torch.randn(m, ff, **bf)
    layers = [dict(qkv=torch.randn(3 * dim, dim, **bf) / 45, qkv_b=torch.randn(3 * dim, **bf),
                   fc1=torch.randn(ff, dim, **bf) / 45, fc1_b=torch.randn(ff, **bf),
                   proj=torch.randn(dim, dim, **bf) / 45, fc2=torch.randn(dim, ff, **bf) / 90,
                   bias=torch.randn(dim, **bf)) for _ in range(COPIES)]
    head, head_b = torch.randn(vocab, dim, **bf) / 45, torch.randn(vocab, **bf)
    logits = torch.empty(m, vocab, device="cuda", dtype=torch.float32)

    def each(fn):
        return lambda *a: [fn(w, *a) for w in layers]

    def ref_in(w):
        h = F.layer_norm(x, (dim,), ln_w, ln_b)
        return F.linear(h, w["qkv"], w["qkv_b"]), torch._addmm_activation(w["fc1_b"], h, w["fc1"].t(), use_gelu=True)

    return {
        "norm_qkv_fc1": (each(lambda w, t: dk.norm_linear(x, ln_w, ln_b, w["qkv"], w["qkv_b"], w["fc1"], w["fc1_b"],
                                                           gelu2=True, tiles=t)),
                         each(ref_in), 2 * (4 * dim * dim + ff * dim), (3 * dim, ff)),
        "proj_fc2_residual": (each(lambda w, t: dk.linear2_residual(attn, w["proj"], g, w["fc2"], x, w["bias"], tiles=t)),
                              each(lambda w: torch.addmm(torch.addmm(x, attn, w["proj"].t()), g, w["fc2"].t()).add_(w["bias"])),
                              2 * (dim * dim + dim * ff), (dim,)),
        "norm_lm_head": (lambda t: dk.norm_linear(x, ln_w, ln_b, head, head_b, out1=logits, tiles=t),
                         lambda: F.linear(F.layer_norm(x, (dim,), ln_w, ln_b), head, head_b).float(),
                         2 * head.numel(), (vocab,)),
    }


def configs(m: int):
    if m == 1:
        return [(1, bn, bk, w, 2, False) for bn, bk, w in itertools.product((1, 2, 4, 8), (1024, 2048), (4, 8))]
    if m <= 8:
        gemv = [(triton_pow2(m), bn, bk, 4, 2, False) for bn, bk in itertools.product((2, 4, 8), (256, 512, 1024))
                if triton_pow2(m) * bk <= 2048]
        return gemv + [(16, bn, bk, 4, 4, True) for bn, bk in itertools.product((16, 32), (128, 256))]
    if m <= 16:
        return [(16, bn, bk, 4, s, True) for bn, bk, s in itertools.product((16, 32), (128, 256), (3, 4))]
    return [(bm, bn, bk, w, s, True) for bm, bn, bk, w, s in
            itertools.product((32, 64), (16, 32, 64), (128, 256), (4, 8), (3, 4))]


def triton_pow2(m: int) -> int:
    return 1 << (m - 1).bit_length()


def attention_times() -> list[dict]:
    from kestrel_backend.model.config import TextConfig
    from kestrel_backend.model.text import rope_table

    cfg, page, rows = TextConfig(), 16, []
    table = rope_table(cfg, "cuda")
    for bsz, ctx in ((1, 64), (1, 800), (64, 64), (64, 800)):
        pages = -(-(ctx + 1) // page)
        k = torch.randn(bsz * pages * page, cfg.n_kv_heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        tables = torch.arange(bsz * pages, device="cuda", dtype=torch.int32).view(bsz, pages)
        pos = torch.full((bsz,), ctx, device="cuda")
        slots = tables[:, ctx // page].long() * page + ctx % page
        qkv = torch.randn(bsz, 3 * cfg.dim, device="cuda", dtype=torch.bfloat16)
        cos, sin = table[pos, :, 0].contiguous(), table[pos, :, 1].contiguous()
        ms = graph_timed(lambda: dk.rotary_paged_attention(qkv, cos, sin, k, v, tables, (pos + 1).int(), slots,
                                                           cfg.n_heads, page))
        kv_bytes = bsz * (ctx + 1) * 2 * cfg.dim * 2
        rows.append({"batch": bsz, "context": ctx, "us": ms * 1000, "kv_GBps": kv_bytes / ms / 1e6})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def attention_sweep() -> list[dict]:
    """The attention kernel's keys a block, warps, pipeline stages and context splits, each (batch, context) with
    pages scattered over the cache as the free list leaves them: the five best and the default's time."""
    from benchmarks.experiments.decode_attention import HEAD_DIM, HEADS, PAGE, ROPE_HALF, decode_inputs, tables_for

    out = []
    for bsz, ctx in ((1, 64), (1, 800), (16, 800), (64, 64), (64, 800)):
        tables, pages = tables_for(bsz, "none", ctx + 1)
        k, v, lens, slots, qkv, cos, sin = decode_inputs(tables, pages, ctx + 1)
        default_splits = dk.context_splits(bsz, HEADS)

        def call(block, warps, stages, splits):
            out_, part_ml, part_acc = dk._attention_buffers(qkv, HEADS, HEAD_DIM, splits)
            launch = dk.pdl_launch(qkv.device, bsz)

            def run():
                dk._rotary_paged_attention_kernel[(bsz, HEADS, splits)](
                    qkv, qkv.stride(0), cos, sin, k, v, tables, lens, slots, out_, part_ml, part_acc,
                    tables.stride(0), HEAD_DIM ** -0.5, H=HEADS, HKV=HEADS, D=HEAD_DIM, HALF=ROPE_HALF, PAGE=PAGE,
                    BLOCK_N=block, SPLITS=splits, num_warps=warps, num_stages=stages, **launch)
                if splits > 1:
                    dk._combine_splits_kernel[(bsz * HEADS,)](part_ml, part_acc, out_, D=HEAD_DIM, SPLITS=splits,
                                                             num_warps=1, **launch)
            return graph_timed(run, calls=20) * 1000

        results = []
        for block, warps, stages, splits in itertools.product((64, 128, 256), (2, 4, 8), (1, 2, 3),
                                                               sorted({1, 2, 4, default_splits})):
            try:
                results.append((call(block, warps, stages, splits), (block, warps, stages, splits)))
            except Exception as e:  # e.g. out of shared memory or registers
                print(f"  attention {bsz}x{ctx} {(block, warps, stages, splits)}: {type(e).__name__}", flush=True)
        results.sort()
        default = (dk.ATTENTION_KV_BLOCK, 4, 3, default_splits)  # (as rotary_paged_attention launches it)
        out.append({"batch": bsz, "context": ctx, "default (block, warps, stages, splits)": default,
                    "default_us": round(call(*default), 2),
                    "kv_GBps_best": round(bsz * (ctx + 1) * 2 * HEADS * HEAD_DIM * 2 / results[0][0] / 1e3, 1),
                    "top5": [(round(us, 2), t) for us, t in results[:5]]})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="tune.json")
    p.add_argument("--batches", default="1,2,4,8,16,64,128")
    p.add_argument("--attention", action="store_true", help="only the attention kernel's tiles, swept")
    args = p.parse_args()
    if args.attention:
        Path(args.out).write_text(json.dumps({"attention_sweep": attention_sweep()}, indent=1))
        return 0
    out = {"attention": attention_times(), "linear": []}
    for m in [int(b) for b in args.batches.split(",")]:
        for name, (fused, ref, weight_bytes, n_sizes) in cases(m).items():
            copies = 1 if name == "norm_lm_head" else COPIES
            ref_ms = graph_timed(ref) / copies
            results = []
            for tiles in configs(m):
                if any(n % tiles[1] for n in n_sizes):
                    continue
                try:
                    ms = graph_timed(lambda: fused(tiles)) / copies
                except Exception as e:  # e.g. out of shared memory: skip the config
                    print(f"  {name} m={m} {tiles}: {type(e).__name__}", flush=True)
                    continue
                results.append((ms, tiles))
            results.sort()
            best_ms, best = results[0]
            default = dk._tiles(m, n_sizes, (2048,), torch.bfloat16)
            default_ms = graph_timed(lambda: fused(default)) / copies
            row = {"batch": m, "kernel": name, "best_tiles": best, "best_us": best_ms * 1000,
                   "best_GBps": weight_bytes / best_ms / 1e6, "default_tiles": default, "default_us": default_ms * 1000,
                   "cublas_us": ref_ms * 1000, "top5": [(round(ms * 1000, 1), t) for ms, t in results[:5]]}
            print(json.dumps(row), flush=True)
            out["linear"].append(row)
            Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
