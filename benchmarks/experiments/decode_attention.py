"""Decode attention of many rows over paged image contexts (GPU only): the per-row kernel
(decode_kernels.rotary_paged_attention, one program a row and head; 4 context splits as the decode graphs of 32 rows
and more had them) against grouped_attention (one program a group of rows on one prefix and head), and the prefill
kernel's one-row work items (how a mixed step's decode rows went) against grouped_attention on gathered rows.
Moondream's heads (32 of 64, bf16), rows at 776 positions whose first 720 are an image prefix that no rows, pairs
of rows or all rows share; microseconds a layer (a call among 20 in a CUDA graph), and grouped_attention's relative
difference from the per-row kernel. --tiles: grouped_attention's tiles swept (positions a tile, stages, warps).

    python benchmarks/experiments/decode_attention.py [--rows 16 64] [--tiles] [--out decode_attention.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.common import graph_timed  # noqa: E402
from kestrel_backend.kernels import decode_kernels as dk  # noqa: E402
from kestrel_backend.kernels import grouped_attention as ga  # noqa: E402
from kestrel_backend.kernels import prefill_attention as pa  # noqa: E402
from kestrel_backend.kernels.grouped_attention import GROUP, group_rows, grouped_attention  # noqa: E402

HEADS, HEAD_DIM, ROPE_HALF, PAGE = 32, 64, 16, 16
LENGTH, PREFIX = 776, 720  # positions a row (its new token included); the image prefix's whole pages


def tables_for(rows: int, sharing: str, length: int = LENGTH) -> tuple[torch.Tensor, int]:
    """Page tables of rows at `length` positions: each row's own pages after the prefix's (PREFIX, or the whole row if
    shorter), shared by no rows, pairs or all. -> (tables, pages)."""
    per_row, prefix_pages = -(-length // PAGE), min(PREFIX, length) // PAGE
    tables, prefixes, next_page = [], {}, 0
    for row in range(rows):
        key = {"none": row, "pairs": row // 2, "all": 0}[sharing]
        if key not in prefixes:
            prefixes[key] = list(range(next_page, next_page + prefix_pages))
            next_page += prefix_pages
        tables.append(prefixes[key] + list(range(next_page, next_page + per_row - prefix_pages)))
        next_page += per_row - prefix_pages
    perm = torch.randperm(next_page + 1)  # pages scattered over the cache, as the free list leaves them
    return perm[torch.tensor(tables)].to(torch.int32).cuda(), next_page + 1


def decode_inputs(tables: torch.Tensor, pages: int, length: int) -> tuple[torch.Tensor, ...]:
    """The per-row kernel's inputs for rows at `length` positions (the new token's included) over these page tables:
    random caches of `pages` pages, the rows' lengths and their new tokens' cache rows, random qkv rows and rope
    angles -> (k_cache, v_cache, lens, slots, qkv, cos, sin)."""
    rows = tables.shape[0]
    k_cache = torch.randn(pages * PAGE, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    lens = torch.full((rows,), length, dtype=torch.int32, device="cuda")
    slots = (tables[:, (length - 1) // PAGE].long() * PAGE + (length - 1) % PAGE).int()
    qkv = torch.randn(rows, 3 * HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    cos, sin = torch.rand(rows, ROPE_HALF, device="cuda"), torch.rand(rows, ROPE_HALF, device="cuda")
    return k_cache, v_cache, lens, slots, qkv, cos, sin


TILES = [(64, 2, 4), (64, 3, 4), (64, 4, 4), (32, 4, 4), (128, 2, 4), (128, 3, 4), (64, 2, 8), (32, 2, 2), (64, 2, 2),
         (32, 2, 4)]


def graphed_us(fn) -> float:
    """Microseconds of one fn() on the GPU, as one of 20 calls in a CUDA graph (the engine's steps are graphs; an
    eager call's launch from Python showed in the time: H200, 64 rows on one prefix, 98-142 eager against 63.5)."""
    return graph_timed(fn, calls=20) * 1e3


def measure(rows: int, sharing: str, tiles: bool = False) -> dict:
    tables, pages = tables_for(rows, sharing)
    k_cache, v_cache, lens, slots, qkv, cos, sin = decode_inputs(tables, pages, LENGTH)
    groups, shared = np.zeros((rows, GROUP), np.int32), np.zeros(rows, np.int32)
    n_groups = group_rows(tables.cpu().numpy(), np.full(rows, LENGTH - 1), PAGE, groups, shared)
    groups, shared = torch.from_numpy(groups).cuda(), torch.from_numpy(shared).cuda()
    heads = qkv.view(rows, 3 * HEADS, HEAD_DIM)
    q, k, v = heads[:, :HEADS], heads[:, HEADS:2 * HEADS], heads[:, 2 * HEADS:]

    def per_row(splits):
        return dk.rotary_paged_attention(qkv, cos, sin, k_cache, v_cache, tables, lens, slots, HEADS, PAGE, splits)

    def grouped():
        return grouped_attention(q, k, v, k_cache, v_cache, tables, lens, slots, groups, shared, PAGE, cos, sin)

    reference = per_row(1).float()
    difference = float((grouped().float() - reference).norm() / reference.norm())
    step_rows = torch.arange(rows, dtype=torch.int32, device="cuda")
    positions = torch.arange(LENGTH - 1, device="cuda")
    context = (tables[:, positions // PAGE].long() * PAGE + positions % PAGE).reshape(-1)
    work = torch.tensor([[row, 1, 0, 0, LENGTH - 1, row * (LENGTH - 1)] for row in range(rows)],
                        dtype=torch.int32, device="cuda").reshape(-1)
    us = {"per-row kernel": graphed_us(lambda: per_row(1)),
          "per-row kernel, 4 splits": graphed_us(lambda: per_row(4)), "grouped": graphed_us(grouped),
          "prefill kernel, one-row items": graphed_us(lambda: pa.prefill_attention(q, k, v, k_cache, v_cache,
                                                                                  slots.long(), work, context)),
          "grouped, gathered rows": graphed_us(lambda: grouped_attention(q, k, v, k_cache, v_cache, tables, lens, slots,
                                                                         groups, shared, PAGE, rows=step_rows))}
    default = ga.KV_BLOCK, ga.STAGES, ga.WARPS
    for ga.KV_BLOCK, ga.STAGES, ga.WARPS in TILES if tiles else []:
        us[f"grouped, {ga.KV_BLOCK} positions a tile, {ga.STAGES} stages, {ga.WARPS} warps"] = graphed_us(grouped)
    ga.KV_BLOCK, ga.STAGES, ga.WARPS = default
    return {"groups": n_groups, "us_a_layer": {name: round(t, 1) for name, t in us.items()},
            "grouped_relative_difference": round(difference, 5),
            "kv_mb_per_row_reads": round(rows * (LENGTH - 1) * HEADS * HEAD_DIM * 4 / 1e6, 1)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    p.add_argument("--tiles", action="store_true", help="also grouped_attention at other tiles")
    p.add_argument("--out", default="decode_attention.json")
    args = p.parse_args()
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "length": LENGTH, "shared_prefix": PREFIX, "runs": {}}
    for rows in args.rows:
        for sharing in ("none", "pairs", "all"):
            res["runs"][f"{rows} rows, prefix shared by {sharing}"] = run = measure(rows, sharing, args.tiles)
            print(f"{rows:3d} rows, shared by {sharing:5s}: {run}", flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
