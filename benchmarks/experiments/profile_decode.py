"""Where one CUDA-graph decode step's time goes (full-size random weights, GPU only).

    python benchmarks/experiments/profile_decode.py [--batch 1] [--context 800] [--model moondream2|moondream3] [--four-bit]
        [--fp8-experts] [--kernels 12] [--timeline kernels.txt]

Prints the step's time, what a boundary between CUDA graphs costs (the step's graph replayed back to
back, alone and with 2 or 8 steps in one graph), the kernels inside the replayed graph with their GPU
time, and what is left between them (launch gaps, ramp-up and tails of short kernels); --timeline writes one
replay's kernels with their start and end times and streams (Moondream 3 runs its MLP on a stream of its own).
"""

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import captured, engine_step, steps_launched_ahead, timed  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from kestrel_backend.model.moondream import Moondream  # noqa: E402
from kestrel_backend.model.weights import random_weights  # noqa: E402
from kestrel_backend.runtime.cuda_decode import CudaGraphDecoder  # noqa: E402
from kestrel_backend.kernels.decode_kernels import GEMV_MAX_ROWS  # noqa: E402
from kestrel_backend.runtime.kv_cache import PagedKVCache  # noqa: E402


def graph_boundaries(decoder: CudaGraphDecoder, graph, batch: int, context: int) -> None:
    """The step's graph replayed 20 times back to back, against graphs of 2 and 8 steps (the same kernels
    captured again): the difference per step is what a boundary between graphs costs."""
    key = next(iter(decoder.graphs))  # the captured step's bucket and variant
    graphs = {1: graph, **{n: captured(lambda: decoder._step(*key), calls=n) for n in (2, 8)}}
    times = {n: [] for n in graphs}
    for _ in range(10):
        for n, g in graphs.items():
            times[n].append(timed(lambda: [g.replay() for _ in range(16 // n)], warmup=1, iters=3) / 16)
    print("per step, back to back: " + ", ".join(f"{n} step(s) per graph {statistics.median(t):.4f} ms"
                                                  for n, t in times.items()), flush=True)
    if batch <= GEMV_MAX_ROWS:  # (steps launched ahead need the GEMV form's greedy choice)
        print(f"launched ahead (as gpu_bench): {steps_launched_ahead(decoder, batch, context):.4f} ms", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=800)
    p.add_argument("--model", default="moondream2", choices=["moondream2", "moondream3"])
    p.add_argument("--four-bit", action="store_true", help="Moondream 2's text blocks as packed 4-bit weights")
    p.add_argument("--fp8-experts", action="store_true", help="Moondream 3's experts in FP8, a scale a row")
    p.add_argument("--kernels", type=int, default=12, help="how many of the largest kernels to list")
    p.add_argument("--timeline", help="write one replay's kernels (start and end us, stream, name) to this file")
    args = p.parse_args()
    config = MoondreamConfig.official(args.model)
    model = Moondream(config, random_weights(config, dtype=torch.bfloat16, device="cuda"))
    if args.four_bit:
        from benchmarks.w4a16_bench import four_bit

        model = four_bit(model)
    if args.fp8_experts:
        from benchmarks.moondream3_bench import experts_to_fp8

        experts_to_fp8(model)
    cache = PagedKVCache(config.text, args.batch * (args.context // 16 + 2), 16, "cuda", torch.bfloat16)
    for i in range(args.batch):
        cache.allocate(i, args.context + 9)
    decoder = CudaGraphDecoder(model, cache, args.batch, args.context + 9)
    # distinct tokens, as engine_step's: with Moondream 3's experts, rows alike would all route to the same experts
    ids, positions = list(range(args.batch)), [args.context] * args.batch
    tokens = [11 + 97 * i for i in range(args.batch)]
    decoder.run(tokens, ids, positions)
    graph = next(iter(decoder.graphs.values()))  # the one graph that step captured

    variants = {"graph replay alone": graph.replay, "run()": lambda: decoder.run(tokens, ids, positions),
                "run() + argmax": lambda: decoder.run(tokens, ids, positions)[0].argmax(-1),
                "engine step (moving positions, prepare, greedy choice)":
                    engine_step(decoder, args.batch, args.context)}
    times = {name: [] for name in variants}
    for _ in range(10):  # interleaved rounds: clock drift hits every variant alike
        for name, fn in variants.items():
            times[name].append(timed(fn, warmup=2, iters=10))
    for name, t in times.items():
        print(f"{name}: {statistics.median(t):.3f} ms", flush=True)
    graph_boundaries(decoder, graph, args.batch, args.context)
    replay_ms, step_ms = statistics.median(times["graph replay alone"]), statistics.median(times["run()"])
    # host time of each part of a step: what the GPU waits for, except prepare (staged during the step before)
    moved = itertools.count()
    parts = {"prepare (fill the rows)": lambda: decoder.prepare(ids, [args.context - next(moved) % 2] * args.batch),
             "upload (rows staged)": lambda: decoder.inputs.upload(tokens, ids, positions, decoder.buckets[-1]),
             "replay launch": graph.replay}
    for name, fn in parts.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        host_us = (time.perf_counter() - t0) / 20 * 1e6
        torch.cuda.synchronize()
        print(f"host time of {name}: {host_us:.1f} us")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.self_device_time_total for e in kernels) / 10 / 1000
    print(f"batch {args.batch}, context {args.context}: step {step_ms:.3f} ms (graph replay alone {replay_ms:.3f} ms); "
          f"kernels busy {busy_ms:.3f} ms, between kernels {replay_ms - busy_ms:.3f} ms")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:args.kernels]:
        print(f"  {e.self_device_time_total / 10:9.1f} us  {e.count // 10:4d} x  {e.key[:90]}")
    if args.timeline:
        write_timeline(prof, args.timeline)


def write_timeline(prof, path: str) -> None:
    """The last replay's kernels in start order, times from its first kernel's start: which stream's kernels
    wait for which (the critical path of a step with work on two streams)."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    per_replay = len(kernels) // 10
    last = kernels[-per_replay:]
    t0 = last[0]["ts"]
    with open(path, "w") as out:
        for e in last:
            out.write(f"{e['ts'] - t0:9.1f} {e['ts'] + e['dur'] - t0:9.1f} {e['args'].get('stream', '?'):>4} "
                      f"{e['name'][:80]}\n")
    print(f"timeline of one replay ({per_replay} kernels): {path}")


if __name__ == "__main__":
    main()
