"""A question's prefill on a cached image prefix (20 rows, one sequence: the second question on an image) in the
engine's prefill graph of 64 rows, Moondream 3 with FULL-SIZE random weights, FP8 experts beside widened copies
(KESTREL_FP8_EXPERTS=both): its 44 padded rows routed to experts or not (prefill_graphs.ROUTE_REAL_ROWS_ONLY),
with the padded rows' inputs finite (stale rows of an earlier step) or NaN (as uninitialised memory can be).
GPU only.

    python benchmarks/experiments/question_prefill.py [--out q.json]
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import timed  # noqa: E402
from benchmarks.kestrel_checkpoint import random_moondream3_fp8_both  # noqa: E402
from kestrel_backend.runtime import prefill_graphs  # noqa: E402
from kestrel_backend.runtime.attention import SeqSlice  # noqa: E402
from kestrel_backend.runtime.kv_cache import PagedKVCache  # noqa: E402

QUESTION, PREFIX = 20, 730


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    model = random_moondream3_fp8_both()
    config = model.config
    cache = PagedKVCache(config.text, 256, 16, "cuda", torch.bfloat16)
    cache.allocate(0, PREFIX + QUESTION + 64)
    x = torch.randn(QUESTION, config.text.dim, device="cuda", dtype=torch.bfloat16)
    slices = [SeqSlice(0, 0, QUESTION, PREFIX, PREFIX, torch.arange(PREFIX, PREFIX + QUESTION, device="cuda"))]
    graphs = {}
    out = {"device": torch.cuda.get_device_name(), "question_rows": QUESTION, "graph_rows": prefill_graphs.BUCKET}
    with torch.inference_mode():
        for real_rows_only in (True, False):  # (each its own graphs, captured with the setting)
            prefill_graphs.ROUTE_REAL_ROWS_ONLY = real_rows_only
            graphs[real_rows_only] = prefill_graphs.PrefillGraphs(model, cache, 2048, 1)
            graphs[real_rows_only].run(x, slices)
        for padded in ("finite", "nan"):
            for real_rows_only, g in graphs.items():
                g.x[QUESTION:].copy_(torch.randn_like(g.x[QUESTION:]) if padded == "finite"
                                     else torch.full_like(g.x[QUESTION:], float("nan")))
                name = f"{'real rows' if real_rows_only else 'every row'} routed, padded rows {padded}: ms"
                out[name] = [round(timed(lambda: g.run(x, slices), warmup=3, iters=20), 3) for _ in range(2)]
                print(name, out[name], flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
