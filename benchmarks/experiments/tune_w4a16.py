"""Tile sweep of the W4A16 decode kernels (GPU only) at Moondream 2's full size: each kernel alone, replayed in a
CUDA graph, against the bytes it must read (packed weights, scales, zero points) over the copy ceiling; bf16. One
or two rows: the GEMV by group sums beside the one with the reference's roundings (its default tiles).

    python benchmarks/experiments/tune_w4a16.py [--out tune.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import ceilings, graph_timed  # noqa: E402
from benchmarks.w4a16_bench import random_packed  # noqa: E402
from kestrel_backend.model.config import TextConfig  # noqa: E402
from kestrel_backend.kernels import w4a16_kernels  # noqa: E402
from kestrel_backend.kernels.w4a16_kernels import w4_linear2_residual, w4_norm_linear  # noqa: E402


def sweep(m: int, bandwidth: float) -> list[dict]:
    cfg, gen = TextConfig(), torch.Generator(device="cuda").manual_seed(0)
    d, ff = cfg.dim, cfg.ff_dim
    wq, wf, wp, w2 = (random_packed(n, k, gen) for n, k in ((3 * d, d), (ff, d), (d, d), (d, ff)))
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, ln, bq, bfc = torch.randn(m, d, **bf), torch.ones(d, **bf), torch.zeros(3 * d, **bf), torch.zeros(ff, **bf)
    act, out = torch.randn(m, ff, **bf), torch.empty(m, d, **bf)
    if m <= 2:  # the GEMV by group sums (bf16), beside the one with the reference's roundings at its default tiles
        nl = [(m, bn, bk, w, 1, False) for bn, bk, w in itertools.product((8, 16, 32), (256, 512, 1024), (2, 4))]
        lr = [(m, bn, bk, w, 1, False) for bn, bk, w in itertools.product((4, 8, 16), (512, 1024, 2048), (2, 4))]
        variants = lambda tiles_list: [(False, None)] + [(True, t) for t in tiles_list]  # noqa: E731
    else:  # tensor cores (the reference's roundings)
        nl = lr = [(64 if m >= 64 else 16, bn, bk, w, st, True)
                   for bn, bk, w, st in itertools.product((32, 64), (64, 128, 256), (4, 8), (2, 3))]
        variants = lambda tiles_list: [(False, t) for t in tiles_list]  # noqa: E731
    rows = []
    for name, tiles_list, fn, nbytes in (
            ("norm_linear qkv+fc1", nl, lambda t: w4_norm_linear(x, ln, ln, wq, bq, wf, bfc, tiles=t),
             wq.nbytes + wf.nbytes),
            ("linear2_residual proj+fc2", lr, lambda t: w4_linear2_residual(x, wp, act, w2, x, ln, out=out, tiles=t),
             wp.nbytes + w2.nbytes)):
        for group_sums, tiles in variants(tiles_list):
            w4a16_kernels.GROUP_SUMS = group_sums
            try:
                ms = graph_timed(lambda: fn(tiles), calls=20)
            except Exception as e:  # (tiles past shared memory or registers)
                rows.append({"kernel": name, "rows": m, "tiles": tiles, "error": f"{type(e).__name__}"})
                continue
            finally:
                w4a16_kernels.GROUP_SUMS = True
            rows.append({"kernel": name, "rows": m, "tiles": tiles, "group_sums": group_sums, "us": ms * 1000,
                         "floor_us": nbytes / bandwidth * 1e6, "GBps": nbytes / (ms / 1000) / 1e9})
        ours = [r for r in rows if r["kernel"] == name and "us" in r]
        best = min(ours, key=lambda r: r["us"])
        rounded = min((r for r in ours if not r["group_sums"]), key=lambda r: r["us"])
        print(f"{name} rows {m}: best {best['tiles']} (group sums {best['group_sums']}) {best['us']:.1f} us (floor "
              f"{best['floor_us']:.1f}, {best['GBps']:.0f} GB/s); with the reference's roundings "
              f"{rounded['us']:.1f} us", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 16, 64])
    args = p.parse_args()
    ceiling = ceilings()
    bw = ceiling["copy_bandwidth_GBps"] * 1e9
    rows = [r for m in args.rows for r in sweep(m, bw)]
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "ceilings": ceiling, "rows": rows},
                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
