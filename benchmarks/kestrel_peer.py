"""Kestrel (m87-labs' engine: proprietary, installed apart from this project and never one of its dependencies) on
the bursts of kestrel_method.py, on the same machine and weights, for its --kestrel-rows.

Same method: images made by kestrel_method.workload (fresh for every burst), two warm-up queries, then every question
at once; the query skill with reasoning off, greedy, output capped at 3 (direct) or 30 (CoT) tokens; req/s and the
median of Kestrel's own prefill + decode time a request. One engine a batch size (max_batch_size is Kestrel's).

    python benchmarks/kestrel_peer.py --model moondream3-preview --weights DIR/model_fp8.pt --tokenizer DIR \
        [--batch-sizes 1 16 64] [--modes direct cot] [--images 256] --out kestrel_rows.json
    (weights: benchmarks/kestrel_checkpoint.py DIR [--model moondream2]; Moondream 2: --model moondream2
    --weights DIR/model.safetensors. Kestrel's kernels come in the eight kestrel-kernels-bundle wheels (88 MB
    each) that kestrel-kernels requires: install them too. HF_HUB_OFFLINE=1 where the hub is out
    of reach: Kestrel looks up the model's config there at start.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kestrel_method import OUTPUT_TOKENS, workload  # noqa: E402


async def run_batch(args, batch: int, seed: int) -> list[dict]:
    from kestrel.config import RuntimeConfig
    from kestrel.engine import InferenceEngine

    engine = await InferenceEngine.create(RuntimeConfig(model=args.model, model_path=str(args.weights),
                                                        tokenizer_path=str(args.tokenizer), max_batch_size=batch))
    rows = []
    try:
        for i, mode in enumerate(args.modes):
            settings = {"temperature": 0.0, "max_tokens": OUTPUT_TOKENS[mode]}

            def ask(pairs):
                return asyncio.gather(*[engine.query(image, q, reasoning=False, settings=settings)
                                        for image, q in pairs])

            await ask(workload(1, seed - 1 - i))
            pairs = workload(args.images, seed + 7919 * i)
            t0 = time.perf_counter()
            results = await ask(pairs)
            wall = time.perf_counter() - t0
            engine_ms = [r.metrics.prefill_time_ms + r.metrics.decode_time_ms for r in results]
            rows.append({"mode": mode, "batch": batch, "questions": len(pairs), "wall_s": wall,
                         "req_per_s": len(pairs) / wall, "engine_p50_ms": statistics.median(engine_ms),
                         "output_tokens": sum(r.metrics.output_tokens for r in results)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        await engine.shutdown()
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="moondream3-preview", help="Kestrel's model name (its registry)")
    p.add_argument("--weights", type=Path, required=True, help="the checkpoint file")
    p.add_argument("--tokenizer", type=Path, required=True, help="tokenizer.json or its folder")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--modes", nargs="+", default=["direct", "cot"], choices=["direct", "cot"])
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    seed = time.time_ns() % (1 << 31)
    rows = []
    for n, batch in enumerate(args.batch_sizes):
        rows += asyncio.run(run_batch(args, batch, seed + 104729 * n))
    table = {mode: {str(r["batch"]): [round(r["req_per_s"], 1), round(r["engine_p50_ms"])]
                    for r in rows if r["mode"] == mode} for mode in args.modes}
    import torch

    args.out.write_text(json.dumps({**table, "model": args.model, "device": torch.cuda.get_device_name(),
                                    "date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    print(json.dumps(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
