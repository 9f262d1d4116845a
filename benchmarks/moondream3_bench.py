"""Moondream 3 on the GPU: the float32 GPU engine against md3-tiny's golden outputs, then decode steps of FULL-SIZE
random bf16 weights against their floor (the dense weights, the routed experts and the KV bytes, over the copy
ceiling measured in the same run), and the weights' device memory.

    python benchmarks/moondream3_bench.py [--out md3.json]

Kestrel's method on Moondream 3: benchmarks/kestrel_method.py --model moondream3.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_bench import ceilings, decode_steps, engine_golden_check, table  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from kestrel_backend.model.moondream import Moondream  # noqa: E402
from kestrel_backend.model.weights import random_weights  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    res = {"device": torch.cuda.get_device_name(), "golden": engine_golden_check("md3-tiny")}
    print(json.dumps(res["golden"]), flush=True)
    res["ceilings"] = ceilings()
    bandwidth = res["ceilings"]["copy_bandwidth_GBps"] * 1e9
    torch.manual_seed(0)
    config = MoondreamConfig.official("moondream3")
    before = torch.cuda.memory_allocated()
    model = Moondream(config, random_weights(config, dtype=torch.bfloat16, device="cuda"))
    res["weights_GB"] = (torch.cuda.memory_allocated() - before) / 1e9
    rows = []
    with torch.inference_mode():
        for context in (64, 800):
            rows += decode_steps(model, [1], context, bandwidth, "graph-ahead")
            rows += decode_steps(model, [16, 64], context, bandwidth, "graph")
            print(table(rows[-3:]), flush=True)
    res["decode"] = rows
    res["peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
    print(json.dumps({k: v for k, v in res.items() if k != "decode"}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
