"""The GPU issue's batch-1 target alone (GPU only): one sequence's decode step launched ahead, as the engine
runs greedy text, at contexts 64 and 800, against the copy ceiling measured just before it in the same round.
gpu_bench's functions, with FULL-SIZE random bf16 weights; a minute instead of gpu_bench's three, so several
rounds show how far the ratio moves with the ceiling.

    python benchmarks/batch1_ratio.py [--rounds 3] [--out batch1.json]
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ceilings, decode_steps  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from kestrel_backend.model.moondream import Moondream  # noqa: E402
from kestrel_backend.model.weights import random_weights  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.manual_seed(0)
    config = MoondreamConfig()
    model = Moondream(config, random_weights(config, dtype=torch.bfloat16, device="cuda"))
    rounds = []
    for _ in range(args.rounds):
        ceiling = ceilings()
        rows = [decode_steps(model, [1], ctx, ceiling["copy_bandwidth_GBps"] * 1e9, "graph-ahead")[0]
                for ctx in (64, 800)]
        rounds.append({"ceilings": ceiling, "rows": rows})
        print(f"copy {ceiling['copy_bandwidth_GBps']:.0f} GB/s: " + ", ".join(
            f"context {r['context']} {r['step_ms']:.4f} ms = {r['ratio']:.3f}x" for r in rows), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
