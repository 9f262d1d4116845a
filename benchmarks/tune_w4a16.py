"""Tile sweep of the W4A16 decode kernels (GPU only) at Moondream 2's full size: each kernel alone, replayed in a
CUDA graph, against the bytes it must read (packed weights, scales, zero points) over the copy ceiling.

    python benchmarks/tune_w4a16.py [--out tune.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_bench import ceilings, graph_timed  # noqa: E402
from benchmarks.w4a16_bench import random_packed  # noqa: E402
from kestrel_backend.model.config import TextConfig  # noqa: E402
from kestrel_backend.runtime.w4a16_kernels import w4_linear2_residual, w4_norm_linear  # noqa: E402


def sweep(m: int, bandwidth: float) -> list[dict]:
    cfg, gen = TextConfig(), torch.Generator(device="cuda").manual_seed(0)
    d, ff = cfg.dim, cfg.ff_dim
    wq, wf, wp, w2 = (random_packed(n, k, gen) for n, k in ((3 * d, d), (ff, d), (d, d), (d, ff)))
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, ln, bq, bfc = torch.randn(m, d, **bf), torch.ones(d, **bf), torch.zeros(3 * d, **bf), torch.zeros(ff, **bf)
    act, out = torch.randn(m, ff, **bf), torch.empty(m, d, **bf)
    if m <= 2:
        nl = [(m, bn, bk, w, 1, False) for bn, bk, w in itertools.product((2, 4, 8, 16), (512, 1024, 2048), (4, 8))]
        lr = [(m, bn, bk, w, 1, False) for bn, bk, w in itertools.product((1, 2, 4), (512, 1024, 2048), (4, 8))]
    else:
        dot = [(64 if m >= 64 else 16, bn, bk, w, st, True)
               for bn, bk, w, st in itertools.product((32, 64), (64, 128, 256), (4, 8), (2, 3))]
        nl, lr = dot, dot
    rows = []
    for name, tiles_list, fn, nbytes in (
            ("norm_linear qkv+fc1", nl, lambda t: w4_norm_linear(x, ln, ln, wq, bq, wf, bfc, tiles=t),
             wq.nbytes + wf.nbytes),
            ("linear2_residual proj+fc2", lr, lambda t: w4_linear2_residual(x, wp, act, w2, x, ln, out=out, tiles=t),
             wp.nbytes + w2.nbytes)):
        for tiles in tiles_list:
            try:
                ms = graph_timed(lambda: fn(tiles), calls=20)
            except Exception as e:  # (tiles past shared memory or registers)
                rows.append({"kernel": name, "rows": m, "tiles": tiles, "error": f"{type(e).__name__}"})
                continue
            rows.append({"kernel": name, "rows": m, "tiles": tiles, "us": ms * 1000,
                         "floor_us": nbytes / bandwidth * 1e6, "GBps": nbytes / (ms / 1000) / 1e9})
        best = min((r for r in rows if r["kernel"] == name and "us" in r), key=lambda r: r["us"])
        print(f"{name} rows {m}: best {best['tiles']} {best['us']:.1f} us (floor {best['floor_us']:.1f}, "
              f"{best['GBps']:.0f} GB/s)", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    ceiling = ceilings()
    bw = ceiling["copy_bandwidth_GBps"] * 1e9
    rows = [r for m in (1, 2, 16, 64) for r in sweep(m, bw)]
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "ceilings": ceiling, "rows": rows},
                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
