"""Kestrel's published benchmark method (its PERFORMANCE.md and scripts/chartqa_eval.py), on our engine in-process
and through a real tritonserver over gRPC, beside Kestrel's figures and the workload's GPU floor.

The method: the `query` skill on chart images, about two questions an image (the second one finds the image's
prefix in the prefix cache), prefix cache on; after two warm-up queries every question is submitted at once as
one burst; "batch size" is the engine's max batch size; req/s = questions / wall time; P50 = the median of the
engine-reported prefill + decode time of a request. "direct" answers are a few tokens, "chain of thought" about 30:
with random weights (which rarely stop by themselves) the outputs are forced to 3 and 30 tokens, reasoning off.

Images are ChartQA-like and fresh for every run: bar and line charts drawn with numpy (white background, axes,
grid lines, 3 to 12 bars or a polyline, dark blocks where labels go) at ChartQA's sizes (700-1000 x 450-700 px),
PNG-encoded; seeded by the run, so no two runs share an image.

Floor of a burst (GPU only): the vision FLOPs of every image's crops and the prefill FLOPs of every question (the
first on an image prefills its prefix, the second only its own tokens) over the measured matmul rate, plus the
decode steps' bytes (weights once a step at full batches, and each step's KV reads) over the measured copy rate
(Moondream 3's experts at one byte a value where the checkpoint holds them in FP8, as Kestrel's do).

Each row also says what its burst's time went to (`burst`: engine steps, the engine thread's seconds by step phase,
device and pinned memory the allocators had to get, Triton kernels compiled, how many steps wrote 1, 2, ... image
prefixes) and how long the engine took to start.

    python benchmarks/kestrel_method.py [--model moondream2|moondream3] [--batch-sizes 1 4 16 64] [--images 256]
        [--triton] [--out out.json]
        [--max-step-tokens 16384 0]         # step budgets, each on a burst of its own (0: none)
        [--kestrel-rows side_by_side.json]   # Kestrel on this machine (benchmarks/kestrel_peer.py writes them)
        [--vision-stream 0 1]                # the image path's own CUDA stream, each on a burst of its own
        [--checkpoint DIR [--fp8-experts widen|fp8|both]]  # a checkpoint (Kestrel's: kestrel_checkpoint.py)
    python benchmarks/kestrel_method.py --checkpoint tests/fixtures/md2-tiny --images 4 --batch-sizes 2  (CPU smoke)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_backend.engine_config import FP8_EXPERT_MODES, RuntimeConfig  # noqa: E402
from kestrel_backend.engine import InferenceEngine  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from benchmarks.common import floor_s  # noqa: E402

# Kestrel's published H100 figures (req/s, P50 ms), its PERFORMANCE.md: Moondream 2, and Moondream 3 (FP8 experts).
KESTREL_PUBLISHED = {
    "moondream2": {"direct": {1: (41.9, 36.7), 4: (50.6, 68.9), 16: (55.1, 143), 64: (57.0, 332)},
                   "cot": {1: (16.2, 110), 4: (22.7, 183), 16: (43.7, 292), 64: (48.8, 873)}},
    "moondream3": {"direct": {1: (34.6, 46.9), 4: (42.4, 83.5), 16: (49.1, 167), 64: (53.0, 371)},
                   "cot": {1: (13.5, 132), 4: (20.8, 195), 16: (31.7, 418), 64: (41.5, 1027)}},
}
OUTPUT_TOKENS = {"direct": 3, "cot": 30}
QUESTIONS = ["What is the value of the highest bar?", "Which category has the lowest value?",
             "What is the difference between the first and the last value?", "How many bars are there?",
             "In which year was the value the highest?", "Is the trend increasing or decreasing?"]


def chart_png(rng: np.random.Generator) -> bytes:
    import pyvips

    w, h = int(rng.integers(700, 1001)), int(rng.integers(450, 701))
    img = np.full((h, w, 3), 255, np.uint8)
    left, bottom, top, right = w // 10, h - h // 8, h // 10, w - w // 20
    img[top:bottom, left - 2:left] = 0  # y axis
    img[bottom:bottom + 2, left:right] = 0  # x axis
    for y in np.linspace(top, bottom, 6).astype(int)[:-1]:
        img[y, left:right] = 220  # grid
        img[y - 4:y + 4, left - 40:left - 10] = 60  # tick label
    n = int(rng.integers(3, 13))
    xs = np.linspace(left + 10, right - 10, n + 1).astype(int)
    values = rng.uniform(0.1, 1.0, n)
    color = rng.integers(0, 200, 3)
    for i, v in enumerate(values):
        bar_top = int(bottom - v * (bottom - top))
        if rng.random() < 0.7:  # bars, else a polyline of points
            img[bar_top:bottom, xs[i] + 3:xs[i + 1] - 3] = color
        else:
            img[bar_top - 3:bar_top + 3, xs[i]:xs[i + 1]] = color
        img[bottom + 8:bottom + 16, xs[i] + 5:xs[i + 1] - 5] = 60  # category label
    img[top // 3:top // 3 + 12, w // 3:2 * w // 3] = 30  # title
    return pyvips.Image.new_from_array(img).pngsave_buffer(compression=1)


def workload(n_images: int, seed: int) -> list[tuple[bytes, str]]:
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(n_images):
        image = chart_png(rng)
        pairs += [(image, q) for q in rng.choice(QUESTIONS, 2, replace=False)]
    return pairs


def summarize(mode: str, batch: int, pairs, bodies: list[dict], wall: float) -> dict:
    engine_ms = [b["metrics"]["prefill_time_ms"] + b["metrics"]["decode_time_ms"] for b in bodies]
    ttft = [b["metrics"]["ttft_ms"] for b in bodies]
    return {"mode": mode, "batch": batch, "questions": len(pairs), "images": len({img for img, _ in pairs}),
            "wall_s": wall, "req_per_s": len(pairs) / wall, "engine_p50_ms": statistics.median(engine_ms),
            "engine_ttft_p50_ms": statistics.median(ttft),
            "output_tokens": sum(b["metrics"]["output_tokens"] for b in bodies)}


def run_engine(model, batch: int, mode: str, pairs, warmup, knobs: dict) -> dict:
    """knobs: the RuntimeConfig settings this burst's engine runs with (max_step_tokens, admit_group, ...)."""
    settings = {"temperature": 0, "max_tokens": OUTPUT_TOKENS[mode]}
    started = time.perf_counter()
    engine = InferenceEngine(RuntimeConfig(device=str(model.device), max_batch_size=batch, max_queue=1 << 16,
                                           **knobs), model)
    try:
        async def burst(items):
            return await asyncio.gather(*[engine.query(image, q, settings=settings) for image, q in items])

        start_s = time.perf_counter() - started  # (its CUDA graphs captured, its eager prefill steps warmed)
        asyncio.run(burst(warmup))
        before = burst_counters(engine)
        groups_before = collections.Counter(engine.scheduler.steps_by_prefixes_written)
        t0 = time.perf_counter()
        results = asyncio.run(burst(pairs))
        wall = time.perf_counter() - t0
        spent = {k: round(v - before.get(k, 0), 3) for k, v in burst_counters(engine).items()}
        spent = {k: v for k, v in spent.items() if v or not k.startswith("triton_variants:")}
        groups = engine.scheduler.steps_by_prefixes_written - groups_before
    finally:
        engine.shutdown()
    return {**summarize(mode, batch, pairs, [{"metrics": r.metrics} for r in results], wall),
            **knobs, "engine_start_s": start_s, "burst": spent | {"steps_by_image_prefixes_written": dict(groups)}}


def burst_counters(engine) -> dict:
    """What a burst's time went to: engine steps, the engine thread's seconds by step phase, the device memory the
    caching allocator had to get (cudaMalloc calls, and retries after freeing its cache: each a device sync), the
    pinned host blocks it had to get, and Triton kernels compiled."""
    import torch

    s = engine.scheduler
    counters = {"steps": s.steps, "steps_mixed": s.steps_mixed, "prefixes_ahead": s.prefixes_ahead,
                **{f"decode_steps_launched_ahead_{k}": v for k, v in s.steps_ahead.items()},
                **{f"{k}_s": v for k, v in s.phase_s.items()}}
    if torch.cuda.is_available():
        m = torch.cuda.memory_stats()
        counters |= {"cuda_mallocs": m.get("num_device_alloc", 0), "alloc_retries": m.get("num_alloc_retries", 0)}
        h = torch.cuda.host_memory_stats()  # (pinned blocks: each new one a cudaHostAlloc on the engine thread)
        counters |= {"pinned_allocs": h.get("num_host_alloc", 0),
                     "pinned_alloc_s": h.get("host_alloc_time.total", 0) / 1e6}
        counters |= {f"triton_variants:{name}": n for name, n in triton_variants().items()}
    return counters


def triton_variants() -> dict[str, int]:
    """Compiled variants of each of the engine's Triton kernels so far (a new one during a burst: a compile, seconds
    of the engine thread, unless Triton's disk cache has it)."""
    from triton.runtime.jit import JITFunction

    counts = {}
    for module in [m for name, m in sys.modules.items() if name.startswith("kestrel_backend")]:
        for name, fn in vars(module).items():
            fn = getattr(fn, "fn", fn)  # (an autotuner's kernel)
            if isinstance(fn, JITFunction):
                counts[name] = sum(len(cache[0]) for cache in fn.device_caches.values())
    return counts


def burst_part(url: str, items, max_tokens: int) -> dict:
    """One client process's share of a burst over gRPC, each request on its own stream: (bodies, start, end)."""
    import uuid

    import tritonclient.grpc.aio as grpcaio

    from client import build_inputs, response_body

    async def one(client, image, question):
        async def request():
            yield {"model_name": "moondream", "request_id": uuid.uuid4().hex, "inputs": build_inputs(
                "query", image=image, question=question, settings={"temperature": 0, "max_tokens": max_tokens})}
        async for result, error in client.stream_infer(request()):
            if error is not None:
                raise RuntimeError(f"the server answered with an error: {error}")
            body = response_body(result)
            if body is not None:
                return body

    async def all_at_once():
        client = grpcaio.InferenceServerClient(url)
        try:
            return await asyncio.gather(*[one(client, image, q) for image, q in items])
        finally:
            await client.close()

    t0 = time.perf_counter()
    bodies = asyncio.run(all_at_once())
    return {"bodies": bodies, "start": t0, "end": time.perf_counter()}


def run_triton(batch: int, modes, pairs_for, warmup, processes: int, checkpoint, port: int) -> list[dict]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from benchmarks.triton_bench import served

    rows, ports = [], (port - 1, port, port + 1)
    url = f"localhost:{port}"
    with served(batch, ports, checkpoint) as (_, ready_s), ProcessPoolExecutor(
            processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        print(f"tritonserver ready after {ready_s:.1f} s (max batch {batch})", flush=True)
        for mode in modes:
            burst_part(url, warmup, OUTPUT_TOKENS[mode])
            pairs = pairs_for(mode)
            shares = [pairs[i::processes] for i in range(processes)]
            parts = list(pool.map(burst_part, [url] * processes, shares, [OUTPUT_TOKENS[mode]] * processes))
            wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
            rows.append(summarize("triton " + mode, batch, pairs, [b for p in parts for b in p["bodies"]], wall))
    return rows


def _cell(figure) -> str:
    return f"{figure[0]} ({figure[1]})" if figure else ""


def _ratio(ours: float, figure) -> str:
    return f"{ours / figure[0]:.2f}" if figure else ""


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--modes", nargs="+", default=["direct", "cot"], choices=["direct", "cot"])
    p.add_argument("--images", type=int, default=256, help="images a burst (two questions each)")
    p.add_argument("--checkpoint", type=Path, help="a checkpoint folder (default: full-size random bf16 weights)")
    p.add_argument("--model", default="moondream2", choices=sorted(KESTREL_PUBLISHED),
                   help="the family of the random weights and of Kestrel's published figures")
    p.add_argument("--triton", action="store_true", help="also through tritonserver (the nvidia-pytriton wheel)")
    p.add_argument("--client-processes", type=int, default=4)
    p.add_argument("--grpc-port", type=int, default=8201)
    p.add_argument("--kestrel-rows", type=Path, help="Kestrel measured on this machine, to print beside ours")
    p.add_argument("--max-step-tokens", type=int, nargs="+", default=[RuntimeConfig.max_step_tokens],
                   help="the engine's step budgets to run, each in turn on a burst of its own (0: none)")
    p.add_argument("--admit-groups", type=int, nargs="+", default=[RuntimeConfig.admit_group],
                   help="the engine's admission groups (KESTREL_ADMIT_GROUP), each in turn on a burst of its own")
    p.add_argument("--mixed-steps", type=int, nargs="+", default=[RuntimeConfig.mixed_steps], choices=[0, 1],
                   help="KESTREL_MIXED_STEPS settings, each in turn on a burst of its own")
    p.add_argument("--prefix-ahead", type=int, nargs="+", default=[RuntimeConfig.prefix_ahead],
                   help="KESTREL_PREFIX_AHEAD settings, each in turn on a burst of its own")
    p.add_argument("--vision-fp8", type=int, nargs="+", default=[RuntimeConfig.vision_fp8], choices=[0, 1],
                   help="KESTREL_VISION_FP8 settings, each in turn on a burst of its own")
    p.add_argument("--prefill-fp8", type=int, nargs="+", default=[RuntimeConfig.prefill_fp8], choices=[0, 1],
                   help="KESTREL_PREFILL_FP8 settings, each in turn on a burst of its own")
    p.add_argument("--vision-stream", type=int, nargs="+", default=[RuntimeConfig.vision_stream], choices=[0, 1],
                   help="KESTREL_VISION_STREAM settings, each in turn on a burst of its own (0 1 0 1: in turns)")
    p.add_argument("--fp8-experts", default="widen", choices=FP8_EXPERT_MODES,
                   help="what becomes of a checkpoint's FP8 experts (Kestrel's files): as KESTREL_FP8_EXPERTS")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    import torch

    from kestrel_backend.model.moondream import Moondream
    from kestrel_backend.model.tokenizer import load_tokenizer
    from kestrel_backend.model.weights import random_weights

    cuda = torch.cuda.is_available()
    if args.checkpoint:
        model = Moondream.from_checkpoint(args.checkpoint, dtype=torch.bfloat16 if cuda else torch.float32,
                                          device="cuda" if cuda else "cpu", fp8_experts=args.fp8_experts)
    else:
        config = MoondreamConfig.official(args.model)
        model = Moondream(config, random_weights(config, dtype=torch.bfloat16, device="cuda"),
                          load_tokenizer(Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "md2-tiny"))
    fp8_experts = any(b.moe is not None and b.moe.fc1_scale is not None for b in model.weights.text.blocks)
    ceilings = None
    if cuda:
        from benchmarks.common import ceilings as measure_ceilings

        ceilings = measure_ceilings()
    run_seed = time.time_ns() % (1 << 32)
    bursts = iter(range(1 << 30))

    def fresh_burst(mode=None):  # every burst its own images
        return workload(args.images, run_seed + 7919 * next(bursts))

    warmup = workload(1, run_seed - 1)
    kestrel_side = json.loads(args.kestrel_rows.read_text()) if args.kestrel_rows else {}
    rows = []
    for batch in args.batch_sizes:
        lists = {"max_step_tokens": args.max_step_tokens, "admit_group": args.admit_groups,
                 "mixed_steps": args.mixed_steps, "prefix_ahead": args.prefix_ahead, "vision_fp8": args.vision_fp8,
                 "prefill_fp8": args.prefill_fp8, "vision_stream": args.vision_stream}
        for mode, *values in itertools.product(args.modes, *lists.values()):
            pairs = fresh_burst()
            knobs = dict(zip(lists, values))
            row = run_engine(model, batch, mode, pairs, warmup, knobs)
            gc.collect()  # (an engine is freed with its cycles only: its KV cache and graphs, before the next one's)
            if cuda:
                torch.cuda.empty_cache()
            if ceilings:
                tokens = [len(model.tokenizer.encode(q).ids) for _, q in pairs]
                row["floor_req_per_s"] = len(pairs) / floor_s(model.config, pairs, tokens, OUTPUT_TOKENS[mode],
                                                               batch, ceilings, fp8_experts)
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.triton:  # the server's engine needs the GPU memory that ours cached (without this it failed to start)
            gc.collect()
            torch.cuda.empty_cache()
            rows += run_triton(batch, args.modes, fresh_burst, warmup, args.client_processes, args.checkpoint,
                               args.grpc_port)
            print(json.dumps(rows[-len(args.modes):]), flush=True)
    print("\n| mode | batch | step budget, admit group, mixed, prefix ahead, vision FP8, prefill FP8, vision stream "
          "| req/s | engine P50 ms | engine TTFT p50 ms | floor req/s "
          "| Kestrel published req/s (P50) | ours / published | Kestrel here req/s (P50) | ours / here |\n"
          + "| --- " * 11 + "|")
    for r in rows:
        mode = r["mode"].split()[-1]
        pub = KESTREL_PUBLISHED[args.model][mode].get(r["batch"])
        here = kestrel_side.get(mode, {}).get(str(r["batch"]))
        r["kestrel_published"], r["kestrel_here"] = pub, here
        print(f"| {r['mode']} | {r['batch']} | {r.get('max_step_tokens', '')}, {r.get('admit_group', '')}, "
              f"{r.get('mixed_steps', '')}, {r.get('prefix_ahead', '')}, {r.get('vision_fp8', '')}, "
              f"{r.get('prefill_fp8', '')}, {r.get('vision_stream', '')} | "
              f"{r['req_per_s']:.1f} | "
              f"{r['engine_p50_ms']:.0f} | "
              f"{r['engine_ttft_p50_ms']:.0f} | {r.get('floor_req_per_s', float('nan')):.0f} | {_cell(pub)} | "
              f"{_ratio(r['req_per_s'], pub)} | {_cell(here)} | {_ratio(r['req_per_s'], here)} |")
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu", "model": args.model,
                                        "date": time.strftime("%Y-%m-%d"), "ceilings": ceilings,
                                        "checkpoint": str(args.checkpoint or "random"),
                                        "fp8_experts": args.fp8_experts,
                                        "images_per_burst": args.images, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
