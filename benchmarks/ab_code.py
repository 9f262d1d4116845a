"""A/B of code trees (GPU only): the decode step of each tree's own CudaGraphDecoder with FULL-SIZE random
bf16 weights, as gpu_bench.decode_steps measures it (one or two sequences: steps launched ahead; more:
the engine's step). Each tree runs in a process of its own, the trees in turn for several rounds, so
clock drift hits them alike (separate runs differ by 5 to 10%). A tree is a directory holding
kestrel_backend/ and benchmarks/, e.g. a commit's:

    git archive HEAD kestrel_backend benchmarks | tar -x -C /tmp/base
    python benchmarks/ab_code.py /tmp/base . [--batches 1] [--contexts 64,800] [--rounds 2] [--model moondream3]
        [--fp8-experts] [--out ab.json]
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def measure(tree: str, batches: list[int], contexts: list[int], repeats: int, model_name: str,
            fp8_experts: bool = False) -> dict:
    """Step milliseconds of tree's code, `repeats` times per (batch, context). fp8_experts: Moondream 3's experts
    in FP8 with a scale a row (Kestrel's files), as KESTREL_FP8_EXPERTS=fp8 keeps them."""
    sys.path.insert(0, str(Path(tree).resolve()))  # ahead of this tree and PYTHONPATH
    import torch
    try:
        from benchmarks.common import decode_steps
    except ImportError:  # (a tree from before benchmarks/common.py)
        from benchmarks.gpu_bench import decode_steps
    from kestrel_backend.model.config import MoondreamConfig
    from kestrel_backend.model.moondream import Moondream
    from kestrel_backend.model.weights import random_weights

    torch.manual_seed(0)
    config = MoondreamConfig.official(model_name)
    model = Moondream(config, random_weights(config, dtype=torch.bfloat16, device="cuda"))
    if fp8_experts:
        from benchmarks.moondream3_bench import experts_to_fp8

        experts_to_fp8(model)
    out = {}
    for bsz in batches:
        backend = "graph-ahead" if bsz <= 2 else "graph"
        for ctx in contexts:
            out[f"{bsz}x{ctx}"] = [decode_steps(model, [bsz], ctx, 1e12, backend)[0]["step_ms"]
                                   for _ in range(repeats)]
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("trees", nargs="*")
    p.add_argument("--batches", default="1")
    p.add_argument("--contexts", default="64,800")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default="moondream2", choices=["moondream2", "moondream3"])
    p.add_argument("--fp8-experts", action="store_true", help="Moondream 3's experts in FP8 (KESTREL_FP8_EXPERTS=fp8)")
    p.add_argument("--measure", help="(internal) measure this tree and print JSON")
    p.add_argument("--out")
    args = p.parse_args()
    batches, contexts = [int(b) for b in args.batches.split(",")], [int(c) for c in args.contexts.split(",")]
    if args.measure:
        print(json.dumps(measure(args.measure, batches, contexts, args.repeats, args.model, args.fp8_experts)))
        return 0
    runs = {tree: [] for tree in args.trees}
    for r in range(args.rounds):
        for tree in args.trees:
            done = subprocess.run([sys.executable, __file__, "--measure", tree, "--batches", args.batches,
                                   "--contexts", args.contexts, "--repeats", str(args.repeats), "--model", args.model]
                                  + ["--fp8-experts"] * args.fp8_experts,
                                  capture_output=True, text=True)
            if done.returncode:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            runs[tree].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {tree}: {runs[tree][-1]}", flush=True)
    print(f"\n{'batch x context':>16} " + " ".join(f"{t[-30:]:>30}" for t in args.trees) + "   (ms: median [min, max])")
    for key in runs[args.trees[0]][0]:
        cells = []
        for tree in args.trees:
            ms = [x for run in runs[tree] for x in run[key]]
            cells.append(f"{statistics.median(ms):.4f} [{min(ms):.4f}, {max(ms):.4f}]")
        print(f"{key:>16} " + " ".join(f"{c:>30}" for c in cells))
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
