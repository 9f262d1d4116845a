"""What the GPU benchmarks share: timing (wall clock, CUDA graphs), the device's measured ceilings (copy bandwidth,
matmul rate) and the floors they give (weight bytes, FLOPs), decode steps of a model at batch sizes, the float32
golden check of the GPU engine, fresh query images, and tables. Not a benchmark itself."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kestrel_backend.engine_config import RuntimeConfig  # noqa: E402
from kestrel_backend.engine import InferenceEngine  # noqa: E402
from kestrel_backend.model import vision  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from kestrel_backend.model.moondream import Moondream  # noqa: E402
from kestrel_backend.parity import result_matches, split_stream, submit_case, unpack_mask  # noqa: E402
from kestrel_backend.runtime.kv_cache import PagedKVCache  # noqa: E402
from kestrel_backend.runtime.attention import SeqSlice, TorchPagedAttention  # noqa: E402
from kestrel_backend.kernels import decode_kernels as dk  # noqa: E402
from kestrel_backend.runtime.cuda_decode import CudaGraphDecoder  # noqa: E402
from kestrel_backend.runtime.cuda_graphs import capture  # noqa: E402
from kestrel_backend.runtime.vision_graphs import CropEncoderGraphs  # noqa: E402



def timed(fn, warmup=3, iters=20, idle_s: float = 0.0) -> float:
    """Median milliseconds of fn() with CUDA events; each call after idle_s seconds of an idle GPU if given."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if idle_s:
            time.sleep(idle_s)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def captured(fn, calls: int = 1, warmups: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` fn() calls, after `warmups` rounds of them on a side stream (the engine's
    capture: Triton compiles, the allocator settles)."""
    return capture(lambda: [fn() for _ in range(calls)], warmups=warmups)


def graph_timed(fn, calls: int = 8, iters: int = 10) -> float:
    """Milliseconds per fn() with `calls` of them replayed as one CUDA graph: the GPU time alone, without
    Python's launch cost (which dominates kernels of a few microseconds)."""
    return timed(captured(fn, calls).replay, warmup=2, iters=iters) / calls


def steps_launched_ahead(decoder: CudaGraphDecoder, bsz: int, context: int, n: int = 200) -> float:
    """Milliseconds per step when each step is launched before the previous one's tokens are read, its
    inputs fed back on the GPU, as the scheduler does for greedy text: wall time over n steps."""
    ids, bans = list(range(bsz)), [()] * bsz
    greedy = decoder.run([11] * bsz, ids, [context] * bsz, bans)[2]
    for i in range(n + 3):
        if i == 3:  # after a warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        following = decoder.run([decoder.FED_BACK] * bsz, ids, [context + (i + 1) % 8] * bsz, bans)[2]
        greedy.tolist()  # the host reads the previous step's tokens while the GPU runs this one
        greedy = following
    greedy.tolist()
    return (time.perf_counter() - t0) / n * 1000


def engine_step(decoder: CudaGraphDecoder, bsz: int, context: int):
    """A decode step of bsz sequences as the scheduler runs it: positions move on (context to context + 7),
    the next step is staged during this one; the step returns the greedy tokens (one or two sequences: chosen
    in the step) or the logits' argmax."""
    # (distinct tokens: with Moondream 3's experts, rows alike would all route to the same experts)
    ids, tokens, steps = list(range(bsz)), [11 + 97 * i for i in range(bsz)], itertools.count()

    def step():
        positions = [context + next(steps) % 8] * bsz
        logits, _, greedy = decoder.run(tokens, ids, positions, [()] * bsz)
        decoder.prepare(ids, [p + 1 for p in positions])
        return logits.argmax(-1) if greedy is None else greedy
    return step


def ceilings() -> dict:
    """Device copy bandwidth and bf16 matmul rate, each from idle (the clock at its peak). The matmul also
    back to back: then the H100 meets its power limit and lowers its clock (experiments/power_probe.py), as it does
    under back-to-back vision encodes."""
    n = 1 << 30  # 1 GiB
    src, dst = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16), torch.empty(n // 2, device="cuda", dtype=torch.bfloat16)
    ms = timed(lambda: dst.copy_(src))
    bw = 2 * n / (ms / 1000)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms_mm = timed(lambda: a @ b, iters=10)
    back_to_back = captured(lambda: a @ b, calls=12)  # about as long as 10 encodes of 13 crops
    ms_sustained = timed(back_to_back.replay, iters=10) / 12
    del src, dst, a, b, back_to_back
    torch.cuda.empty_cache()
    flop = 2 * 8192**3
    return {"copy_bandwidth_GBps": bw / 1e9, "bf16_matmul_TFLOPs": flop / (ms_mm / 1000) / 1e12,
            "bf16_matmul_sustained_TFLOPs": flop / (ms_sustained / 1000) / 1e12}


def text_weight_bytes(config: MoondreamConfig, rows: int = 1, fp8_experts: bool = False) -> int:
    """bf16 bytes of the text weights a decode step of `rows` sequences reads (biases aside). Moondream 3: its dense
    layers, and in each expert layer the router and the experts the rows chose: top-k for one row, for more the
    expected number of distinct experts under uniform routing, E * (1 - (1 - k / E)^rows); fp8_experts: those
    experts one byte a value and a float32 scale a row."""
    t = config.text
    qkv = t.dim + 2 * t.n_kv_heads * t.head_dim
    attention = t.dim * qkv + t.dim * t.dim + (2 * t.n_heads * qkv if t.tau_attn else 0)
    total = t.n_layers * attention + t.dim * t.vocab_size
    for layer in range(t.n_layers):
        if t.moe is not None and layer >= t.moe.start_layer:
            m = t.moe
            experts = m.n_experts * (1 - (1 - m.n_experts_per_tok / m.n_experts) ** rows)
            total += t.dim * m.n_experts
            expert_values = 3 * t.dim * m.expert_inner_dim
            total += int(experts * (expert_values / 2 + 2 * (2 * m.expert_inner_dim + t.dim) if fp8_experts
                                    else expert_values))
        else:
            total += 2 * t.dim * t.ff_dim
    return 2 * total


def random_kv_cache(cfg, bsz: int, context: int, sharing: int = 1) -> PagedKVCache:
    """A KV cache of random values holding bsz sequences of context + 9 positions (16-position pages); sharing > 1:
    groups of that many share the pages of a 730-token image prefix, as requests on one image do."""
    cache = PagedKVCache(cfg, bsz * (-(-(context + 9) // 16)), 16, "cuda", torch.bfloat16)
    shared_pages = cfg.prefix_attn // 16
    for i in range(bsz):
        first = i - i % sharing
        cache.allocate(i, context + 9, cache.tables[first][:shared_pages] if i != first else ())
    cache.k.normal_()
    cache.v.normal_()
    return cache


def decode_steps(model: Moondream, batches, context: int, bandwidth: float, backend: str,
                 sharing: int = 1, weight_bytes=text_weight_bytes) -> list[dict]:
    """One decode step (forward + LM head + greedy choice) for `batch` sequences holding about `context` tokens
    each (context to context + 7: positions move on between steps, as in the engine). sharing > 1: groups of
    that many sequences share the pages of a 730-token image prefix, as requests on one image do with the
    prefix cache (the floor still counts every sequence's KV bytes). weight_bytes(config, rows): the weight bytes
    of the floor."""
    cfg = model.config.text
    rows = []
    for bsz in batches:
        cache = random_kv_cache(cfg, bsz, context, sharing)
        x = torch.randn(bsz, cfg.dim, device="cuda", dtype=torch.bfloat16)
        if backend.startswith("graph"):
            decoder = CudaGraphDecoder(model, cache, bsz, context + 9)
            step = engine_step(decoder, bsz, context)
        else:
            attention = TorchPagedAttention(cache)
            pos = torch.full((1,), context, device="cuda")
            slices = [SeqSlice(i, i, i + 1, context, 730, pos) for i in range(bsz)]
            positions_t = torch.full((bsz,), context, device="cuda")

            def step():
                attention.plan(slices)
                return model.logits(model.forward(x, positions_t, attention)).argmax(-1)

        dk.PDL_ENABLED = backend != "graph-no-pdl"  # read when the graph is captured, in the first step
        try:
            with torch.inference_mode():
                ms = steps_launched_ahead(decoder, bsz, context) if backend == "graph-ahead" else timed(step, iters=50)
        finally:
            dk.PDL_ENABLED = True
        kv_bytes = bsz * (context + 4) * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 2
        floor = (weight_bytes(model.config, bsz) + kv_bytes) / bandwidth * 1000
        rows.append({"backend": backend + (f", prefix shared by {sharing}" if sharing > 1 else ""), "batch": bsz,
                     "context": context, "step_ms": ms, "floor_ms": floor,
                     "ratio": ms / floor, "tokens_per_s": bsz / ms * 1000})
        del cache
        torch.cuda.empty_cache()
    return rows


def engine_golden_check(fixture_name: str = "md2-tiny", max_batch_size: int = 32,
                        mixed_steps: int = RuntimeConfig.mixed_steps,
                        vision_stream: int = RuntimeConfig.vision_stream) -> dict:
    """The whole GPU engine path (prefill, CUDA-graph decode of fused kernels, batched sampling) in float32
    against the reference's greedy tokens and boxes on the tiny fixture: 32 mixed requests at once (a bucket of
    MANY_ROWS sequences: past 640 positions its attention is split over the context), the same 32 again (their
    image prefixes now from the prefix cache: a prefill step of several sequences after cached positions), then
    each case alone (one-sequence steps take the GEMV kernels, launched with PDL; the
    image cases prefill after their cached prefix in a graph). The cases with adapters decode in the LoRA
    graphs, beside rows without. fixture_name: another golden fixture (md3-tiny: Moondream 3's layers in the
    decode graphs, its expert kernels in prefill and decode). With fewer slots than requests and mixed_steps, most
    requests join while others decode: their prefill steps take the decode rows (KESTREL_MIXED_STEPS)."""
    fixture = ROOT / "tests" / "fixtures" / fixture_name
    adapters = fixture / "adapters"
    all_cases = json.loads((fixture / "cases.json").read_text())["cases"]
    cases = [c for c in all_cases if c["kind"] in ("query", "caption", "point", "detect", "segment", "chat")]
    refiner = fixture / "seg_refiner"
    engine = InferenceEngine.create(RuntimeConfig(model_path=str(fixture), device="cuda", dtype="float32",
                                                  max_batch_size=max_batch_size, mixed_steps=mixed_steps,
                                                  vision_stream=vision_stream,
                                                  adapter_dir=str(adapters) if adapters.is_dir() else "",
                                                  seg_refiner_path=str(refiner) if refiner.is_dir() else ""))
    try:
        async def run():
            batch = (cases * 3)[:32]
            return batch, await asyncio.gather(*[submit_case(engine, fixture, c) for c in batch])

        batch, results = asyncio.run(run())
        again, results_again = asyncio.run(run())
        batch, results = batch + again, results + results_again

        async def one_at_a_time():  # decode steps of one sequence: the GEMV kernels, PDL
            return [await submit_case(engine, fixture, c) for c in cases]

        batch, results = batch + cases, results + asyncio.run(one_at_a_time())
        ok = sum(result_matches(engine, c, r) for c, r in zip(batch, results))
        stats = engine.stats()
        out = {"engine_fp32_golden_equal": f"{ok}/{len(batch)}", "pages_free_after": engine.no_request_holds_pages(),
               "prefix_hits": stats["prefix_hits"], "decode_steps_launched_ahead": dict(engine.scheduler.steps_ahead),
               "steps_mixed": engine.scheduler.steps_mixed}
        if refiner.is_dir():
            out["segment_refiner_gpu"] = segment_refiner_check(engine, fixture, all_cases)
        return out
    finally:
        engine.shutdown()


def segment_refiner_check(engine, fixture: Path, cases: list[dict]) -> dict:
    """The segment refiner on the GPU (vision encoder with its early features, the head) against Kestrel's
    pipeline's masks, per golden case: the head's sigmoid mask (max abs diff), refined-mask pixels that differ."""
    from kestrel_backend.images import decode_image
    from kestrel_backend.skills.segment import coarse_segment

    try:
        import cv2  # noqa: F401
        import resvg  # noqa: F401
    except ImportError as e:  # (a machine with the engine's GPU dependencies only)
        return {"skipped": f"segment's CPU libraries are not installed: {e}"}
    golden, out = np.load(fixture / "golden.npz"), {}
    for case in (c for c in cases if c.get("refiner_soft")):
        seg = coarse_segment("", engine.model.tokenizer, *split_stream(case["stream"]))
        image = decode_image((fixture / case["image"]).read_bytes())
        soft, mask = engine.scheduler.segment_refiner.refined_mask(image, seg["svg_path"], seg["bbox"])
        h, w = mask.shape
        expected = unpack_mask(golden[case["mask_refined"]], h, w)
        out[case["name"]] = {"soft_max_abs_diff": float(np.abs(soft - golden[case["refiner_soft"]]).max()),
                             "mask_pixels_differ": int((mask != expected).sum()), "mask_pixels": int(expected.sum())}
    return out


def vision_crop_flops(v) -> int:
    """Matmul FLOPs of one crop through the encoder: patch embedding, every layer's projections, MLP and attention."""
    tokens, d = v.grid * v.grid, v.enc_dim
    per_layer = 2 * tokens * d * (3 * d + d + 2 * v.enc_ff_dim) + 2 * 2 * tokens * tokens * d
    return v.enc_n_layers * per_layer + 2 * tokens * 3 * v.enc_patch_size**2 * d


def prefill_flops(config: MoondreamConfig, cached: int, new: int, prefix: int | None = None) -> int:
    """Matmul FLOPs of prefilling `new` tokens after `cached` ones (the layers over each new token, the attention
    over the pairs each sees: the first `prefix` positions see each other) and the LM head over the last one."""
    t = config.text
    prefix = t.prefix_attn if prefix is None else prefix
    per_token = 2 * (text_weight_bytes(config) // 2 - t.dim * t.vocab_size)  # 2 FLOPs per weight
    pairs = sum(prefix if p < prefix else p + 1 for p in range(cached, cached + new))
    return new * per_token + t.n_layers * 4 * t.n_heads * t.head_dim * pairs + 2 * t.dim * t.vocab_size


def vision_bench(model: Moondream, ceilings: dict, variant: str = "graph", n: int = 13) -> dict:
    """n crops in one batch: 13 is one full 12-tile image plus its global crop. variant: "graph" (what the
    engine runs: CropEncoderGraphs), "eager" or "compiled" (torch.compile of the eager encode). Ratios to the
    FLOP floor: "ratio" back-to-back encodes against the matmul rate from idle (mixed clocks, the measure of
    earlier runs); "ratio_sustained" against the back-to-back rate; for the engine's graphs,
    "ratio_from_idle": encodes that each follow 0.2 s idle (as a lone image query meets the GPU) against the
    rate from idle."""
    v = model.config.vision
    crops = torch.randn(n, 3, v.crop_size, v.crop_size, device="cuda", dtype=torch.bfloat16)
    if variant == "graph":
        encode = CropEncoderGraphs(model)
    else:
        fn = torch.compile(vision.encode_crops) if variant == "compiled" else vision.encode_crops
        encode = lambda x: fn(x, model.weights.vision, v)  # noqa: E731
    with torch.inference_mode():
        t0 = time.perf_counter()
        encode(crops)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        ms = timed(lambda: encode(crops), iters=10)
        idle_ms = timed(lambda: encode(crops), warmup=0, iters=10, idle_s=0.2) if variant == "graph" else None
    flops = n * vision_crop_flops(v)
    floor = flops / (ceilings["bf16_matmul_TFLOPs"] * 1e12) * 1000
    floor_sustained = flops / (ceilings["bf16_matmul_sustained_TFLOPs"] * 1e12) * 1000
    row = {"variant": variant, "first_call_s": first_s, "crops": n, "ms": ms, "ms_per_crop": ms / n,
           "floor_ms_per_crop": floor / n, "ratio": ms / floor, "ratio_sustained": ms / floor_sustained}
    if idle_ms is not None:
        row.update({"from_idle_ms": idle_ms, "ratio_from_idle": idle_ms / floor})
    return row


def fresh_queries(n: int, length: int, prefix: int, first_pos: int = 0) -> list[SeqSlice]:
    """A prefill step's slices: n sequences (sequence ids 0..n-1) of `length` tokens, `prefix` of them the
    image's, from position first_pos on (those before it cached), one after another in the step's rows."""
    rows = length - first_pos
    return [SeqSlice(i, i * rows, (i + 1) * rows, first_pos, prefix, torch.arange(first_pos, length, device="cuda"))
            for i in range(n)]


def query_images(n: int = 8) -> list[bytes]:
    """The end-to-end benchmarks' images: n random 640x480 JPEGs."""
    import pyvips

    rng = np.random.default_rng(0)
    return [pyvips.Image.new_from_array(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)).jpegsave_buffer()
            for _ in range(n)]


async def gather_limited(fn, n: int, limit: int) -> list:
    """fn(0), ..., fn(n - 1), at most `limit` in flight: a new one starts as one ends."""
    slots = asyncio.Semaphore(limit)

    async def limited(i):
        async with slots:
            return await fn(i)
    return await asyncio.gather(*[limited(i) for i in range(n)])


def p95(ascending: list[float]) -> float:
    """The 95th percentile of values sorted ascending (the nearest rank at or below)."""
    return ascending[min(len(ascending) - 1, int(0.95 * len(ascending)))]


def throughput_row(concurrency: int, wall_s: float, ttfts_ms: list[float], output_tokens: int) -> dict:
    ttft = sorted(ttfts_ms)
    return {"concurrency": concurrency, "requests": len(ttft), "req_per_s": len(ttft) / wall_s,
            "output_tok_per_s": output_tokens / wall_s, "ttft_p50_ms": ttft[len(ttft) // 2], "ttft_p95_ms": p95(ttft)}


def table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))
    return "\n".join([" | ".join(keys)] + [" | ".join(fmt(r.get(k)) for k in keys) for r in rows])


def crop_count(image: bytes, config: MoondreamConfig) -> int:
    """The crops the engine encodes for an image: its global view and its tiles."""
    from kestrel_backend.images import decode_image

    return len(vision.crop_image(decode_image(image), config.vision)[0])


def floor_s(config: MoondreamConfig, pairs, question_tokens: list[int], out_tokens: int, batch: int,
            ceilings: dict, fp8_experts: bool = False) -> float:
    """A burst of (image, question) pairs' GPU floor (kestrel_method.py's docstring says how it is counted;
    fp8_experts: Moondream 3's experts read in FP8)."""
    v, t = config.vision, config.text
    flops, seen = 0, set()
    for (image, _), q in zip(pairs, question_tokens):
        prompt = q + 5  # (the query template's tokens)
        if image in seen:
            flops += prefill_flops(config, t.prefix_attn, prompt)
        else:
            seen.add(image)
            flops += crop_count(image, config) * vision_crop_flops(v) + prefill_flops(config, 0, t.prefix_attn + prompt)
    steps = -(-len(pairs) // batch) * out_tokens
    kv_per_token = t.n_layers * 2 * t.n_kv_heads * t.head_dim * 2
    kv_bytes = len(pairs) * sum(t.prefix_attn + 20 + i for i in range(out_tokens)) * kv_per_token
    decode_bytes = steps * text_weight_bytes(config, batch, fp8_experts) + kv_bytes
    return flops / (ceilings["bf16_matmul_TFLOPs"] * 1e12) + decode_bytes / (ceilings["copy_bandwidth_GBps"] * 1e9)
