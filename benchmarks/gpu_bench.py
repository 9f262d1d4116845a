"""GPU benchmarks with FULL-SIZE Moondream 2 random bf16 weights (their speed is the real one).

    python benchmarks/gpu_bench.py --out results.json [--quick]

(0) the ceilings measured here: device copy bandwidth and bf16 matmul rate (from idle and back to back);
(1) decode step time vs batch size next to its floor (text weights + KV bytes over measured bandwidth);
(2) vision encode time per crop next to its FLOP floor (at the clock of each: vision_bench), and a prefill
    step's time next to its FLOP floor;
(3) end-to-end engine throughput for query-with-image at several concurrencies;
(4) correctness on the GPU: the golden tiny fixture in float32 (must pass) and in bf16 (agreement reported).
Prints tables and writes everything as JSON.
"""

from __future__ import annotations

import argparse
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
from kestrel_backend.model.weights import random_weights  # noqa: E402
from kestrel_backend.parity import result_matches, split_stream, submit_case, unpack_mask  # noqa: E402
from kestrel_backend.runtime.kv_cache import PagedKVCache  # noqa: E402
from kestrel_backend.runtime.attention import SeqSlice, TorchPagedAttention  # noqa: E402
from kestrel_backend.kernels import decode_kernels as dk  # noqa: E402
from kestrel_backend.runtime.cuda_decode import CudaGraphDecoder  # noqa: E402
from kestrel_backend.runtime.cuda_graphs import capture  # noqa: E402
from kestrel_backend.runtime.vision_graphs import CropEncoderGraphs  # noqa: E402
from kestrel_backend.runtime.gpu_parts import make_attention, make_prefill_graphs  # noqa: E402


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
    back to back: then the H100 meets its power limit and lowers its clock (power_probe.py), as it does
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


def kernel_check() -> dict:
    """The fused decode kernels against float64 torch on fresh random data (scattered pages for the
    attention), in float32 and bfloat16: relative errors."""
    from kestrel_backend.model.config import TextConfig
    from kestrel_backend.model.text import attend, rope_table, split_qkv_with_rope

    torch.manual_seed(0)
    rel = lambda got, ref: float((got.double() - ref).norm() / ref.norm())
    out = {}
    cfg = TextConfig()
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[1]
        f = dict(device="cuda", dtype=dtype)
        for m in (1, 64):
            x = torch.randn(m, cfg.dim, **f) * 3 + 1
            ln_w, ln_b = torch.randn(cfg.dim, **f), torch.randn(cfg.dim, **f)
            w1, b1 = torch.randn(3 * cfg.dim, cfg.dim, **f) / 45, torch.randn(3 * cfg.dim, **f)
            w2, b2 = torch.randn(cfg.ff_dim, cfg.dim, **f) / 45, torch.randn(cfg.ff_dim, **f)
            o1, o2 = dk.norm_linear(x, ln_w, ln_b, w1, b1, w2, b2, gelu2=True)
            h = torch.nn.functional.layer_norm(x.double(), (cfg.dim,), ln_w.double(), ln_b.double())
            out[f"norm_linear_{name}_m{m}"] = max(rel(o1, h @ w1.double().T + b1.double()), rel(
                o2, torch.nn.functional.gelu(h @ w2.double().T + b2.double(), approximate="tanh")))
            a, c = torch.randn(m, cfg.dim, **f), torch.randn(m, cfg.ff_dim, **f)
            p1, p2, bias = torch.randn(cfg.dim, cfg.dim, **f) / 45, torch.randn(cfg.dim, cfg.ff_dim, **f) / 90, b1[:cfg.dim]
            ref = x.double() + a.double() @ p1.double().T + c.double() @ p2.double().T + bias.double()
            out[f"linear2_residual_{name}_m{m}"] = rel(dk.linear2_residual(a, p1, c, p2, x, bias), ref)

        page, lens = 16, [1, 17, 730, 800, 1500]
        hkv, d = cfg.n_kv_heads, cfg.head_dim
        n_pages = sum(-(-n // page) for n in lens) + 3
        k = torch.randn(n_pages * page, hkv, d, **f)
        v = torch.randn_like(k)
        perm = torch.randperm(n_pages, device="cuda").tolist()
        tables = torch.zeros(len(lens), max(lens) // page + 1, dtype=torch.int32, device="cuda")
        for i, n in enumerate(lens):
            need = -(-n // page)
            tables[i, :need] = torch.tensor(perm[:need], dtype=torch.int32)
            perm = perm[need:]
        last = torch.tensor(lens, device="cuda") - 1
        slots = tables[torch.arange(len(lens), device="cuda"), last // page].long() * page + last % page
        qkv = torch.randn(len(lens), (cfg.n_heads + 2 * hkv) * d, **f)
        table = rope_table(cfg, "cuda")
        cos, sin = table[last, :, 0].contiguous(), table[last, :, 1].contiguous()
        k[slots], v[slots] = float("nan"), float("nan")  # must be written by the kernel before anyone reads them
        got = dk.rotary_paged_attention(qkv, cos, sin, k, v, tables, torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                        slots, cfg.n_heads, page)
        q_ref, k_ref, v_ref = (t.cuda() for t in split_qkv_with_rope(  # the torch rotary (CPU), float64
            qkv.double().cpu(), cos.double().cpu(), sin.double().cpu(), cfg))
        errs = [rel(k[slots], k_ref), rel(v[slots], v_ref)]
        for i, n in enumerate(lens):
            pos = torch.arange(n, device="cuda")
            rows = tables[i, pos // page].long() * page + pos % page
            ref = attend(q_ref[i:i + 1], k[rows].double(), v[rows].double())
            errs.append(rel(got[i].view(1, cfg.n_heads, d), ref))
        out[f"rotary_paged_attention_{name}"] = max(errs)
        out[f"norm_linear_attention_{name}_vs_two_kernels"] = one_kernel_check(cfg, f)
    return out


def one_kernel_check(cfg, f: dict, runs: int = 30) -> dict:
    """norm_linear_attention (attention programs waiting on qkv programs) against norm_linear (same tiles)
    followed by rotary_paged_attention, repeated on the same data, one split and many: the largest
    relative difference per case, 0 unless a synchronisation fault read unwritten q/k/v."""
    page, out = 16, {}
    for lens, splits in (([65], 1), ([800], 8), ([1500], 16)):
        m, h, d = len(lens), cfg.n_heads, cfg.head_dim
        tables = torch.randperm(100 * m, device="cuda").int().view(m, 100)  # scattered pages
        last = torch.tensor(lens, device="cuda") - 1
        slots = (tables[torch.arange(m, device="cuda"), last // page].long() * page + last % page).int()
        seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        k, v = torch.randn(100 * m * page, h, d, **f), torch.randn(100 * m * page, h, d, **f)
        x = torch.randn(m, cfg.dim, **f)
        ln_w, ln_b = torch.randn(cfg.dim, **f), torch.randn(cfg.dim, **f)
        wq, bq = torch.randn(3 * cfg.dim, cfg.dim, **f) / 45, torch.randn(3 * cfg.dim, **f)
        wf, bf = torch.randn(cfg.ff_dim, cfg.dim, **f) / 45, torch.randn(cfg.ff_dim, **f)
        cos, sin = torch.rand(m, cfg.rope_dim // 2, device="cuda"), torch.rand(m, cfg.rope_dim // 2, device="cuda")
        same_tiles = dk.one_kernel_tiles(m, (3 * cfg.dim, cfg.ff_dim), cfg.dim, x.dtype)
        qkv, fc1 = dk.norm_linear(x, ln_w, ln_b, wq, bq, wf, bf, gelu2=True, tiles=same_tiles)
        ref = dk.rotary_paged_attention(qkv, cos, sin, k, v, tables, seq_lens, slots, h, page, splits=splits).double()
        worst = 0.0
        for _ in range(runs):
            sync = torch.zeros(dk.one_kernel_counters(h, m), dtype=torch.int32, device="cuda")
            got, got_fc1 = dk.norm_linear_attention(x, ln_w, ln_b, wq, bq, wf, bf, cos, sin, k, v, tables, seq_lens,
                                                    slots, page, sync, splits)
            worst = max(worst, float((got.double() - ref).norm() / ref.norm()),
                        float((got_fc1.double() - fc1.double()).norm() / fc1.double().norm()))
        out[f"ctx{lens[0]}_splits{splits}"] = worst
    return out


def engine_golden_check(fixture_name: str = "md2-tiny", max_batch_size: int = 32,
                        mixed_steps: int = RuntimeConfig.mixed_steps) -> dict:
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


def prefill_bench(model: Moondream, rate: float, n: int, prompt: int = 12) -> list[dict]:
    """A prefill step of n fresh image queries (730 prefix + prompt tokens each), with the torch attention path
    and with the engine's (make_attention: the Triton kernel on a GPU), eager; and as the engine runs it, the
    CUDA graph of that forward (make_prefill_graphs) where the step has rows for one (the model's context,
    what the engine allows), fresh and with each image prefix's whole pages cached, as requests on images in
    the prefix cache run it (those also eager, to compare). Floor: the layers' matmul FLOPs over every token,
    the attention's over the pairs each token sees, the LM head's over the last token of each sequence (none
    for the cached-prefix rows: their 22 tokens each are bound by reading the weights, like a decode step)."""
    t = model.config.text
    prefix, length = t.prefix_attn, t.prefix_attn + prompt
    cache = PagedKVCache(t, n * -(-length // 16), 16, "cuda", torch.bfloat16)
    for i in range(n):
        cache.allocate(i, length)
    x = torch.randn(n * length, t.dim, device="cuda", dtype=torch.bfloat16)
    flops = n * prefill_flops(model.config, 0, length)
    rows = []
    engine_attention = make_attention(cache)

    def eager(attention, first_pos: int):
        slices = fresh_queries(n, length, prefix, first_pos)
        attention.plan(slices)
        return model.logits(model.forward(x[:slices[-1].end], torch.cat([s.positions for s in slices]), attention)[
            [s.end - 1 for s in slices]])

    for name, attention in (("torch attention", TorchPagedAttention(cache)), ("engine, eager", engine_attention)):
        with torch.inference_mode():
            ms = timed(lambda: eager(attention, 0), iters=10)
        rows.append({"attention": name, "sequences": n, "tokens": n * length, "ms": ms})
    graphs = make_prefill_graphs(model, cache, t.max_context, n)
    cached = prefix // 16 * 16
    fresh, with_cached = fresh_queries(n, length, prefix), fresh_queries(n, length, prefix, cached)
    with torch.inference_mode():
        if graphs.fits([length] * n):
            ms = timed(lambda: graphs.run(x, fresh), iters=10)
            rows.append({"attention": "engine, CUDA graph", "sequences": n, "tokens": n * length, "ms": ms})
        for name, step in (("engine, eager", lambda: eager(engine_attention, cached)),
                           ("engine, CUDA graph", lambda: graphs.run(x[:with_cached[-1].end], with_cached))):
            if name == "engine, eager" or graphs.fits([length - cached] * n):
                ms = timed(step, iters=10)
                rows.append({"attention": name + ", prefix pages cached", "sequences": n,
                             "tokens": n * (length - cached), "ms": ms, "floor_ms": None, "ratio": None})
    for row in rows:
        if "floor_ms" not in row:
            row["floor_ms"] = flops / rate * 1000
            row["ratio"] = row["ms"] / row["floor_ms"]
    del cache
    torch.cuda.empty_cache()
    return rows


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


def throughput_row(concurrency: int, wall_s: float, ttfts_ms: list[float], output_tokens: int) -> dict:
    ttft = sorted(ttfts_ms)
    return {"concurrency": concurrency, "requests": len(ttft), "req_per_s": len(ttft) / wall_s,
            "output_tok_per_s": output_tokens / wall_s, "ttft_p50_ms": ttft[len(ttft) // 2],
            "ttft_p95_ms": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))]}


def e2e_bench(model: Moondream, concurrencies, max_tokens: int, prefix_cache_size: int) -> list[dict]:
    """Queries on 8 images, over and over: after the warm-up, their image embeddings are cached, and with
    prefix_cache_size > 0 the KV pages of their image prefixes too."""
    images = query_images()
    rows = []
    for conc in concurrencies:
        engine = InferenceEngine(RuntimeConfig(device="cuda", dtype="bfloat16", max_batch_size=max(concurrencies),
                                               max_queue=4096, prefix_cache_size=prefix_cache_size), model)
        try:
            def one(i):
                return engine.query(images[i % len(images)], "Describe this image.",
                                    settings={"temperature": 0, "max_tokens": max_tokens})

            asyncio.run(gather_limited(one, min(conc, 4), conc))  # warm-up (and the image cache)
            t0 = time.perf_counter()
            out = asyncio.run(gather_limited(one, conc * 2, conc))
            wall = time.perf_counter() - t0
            stats = engine.stats()
            phases = {k: round(v, 3) for k, v in stats["step_phase_seconds"].items()}
            print(f"concurrency {conc}: wall {wall:.3f} s, engine seconds by phase {phases}, steps {stats['steps']}, "
                  f"prefix cache hits {stats['prefix_hits']}", flush=True)
            rows.append(throughput_row(conc, wall, [r.metrics["ttft_ms"] for r in out],
                                       sum(r.metrics["output_tokens"] for r in out)))
        finally:
            engine.shutdown()
    return rows


def correctness() -> dict:
    from kestrel_backend import parity

    fixture = ROOT / "tests" / "fixtures" / "md2-tiny"
    out = {}
    checker = parity.Checker(fixture)
    checker.model = Moondream.from_checkpoint(fixture, dtype=torch.float32, device="cuda")
    results = [checker.run(c) for c in checker.cases]
    out["fp32_cuda_passed"] = sum(ok for ok, _ in results)
    out["fp32_cuda_cases"] = len(results)
    checker = parity.Checker(fixture)
    checker.model = Moondream.from_checkpoint(fixture, dtype=torch.bfloat16, device="cuda")
    same = total = 0
    for c in checker.cases:
        if c["kind"] in ("query", "caption"):
            _, msg = checker.run(c)
            total += 1
            same += "tokens equal" in msg
    out["bf16_cuda_token_sequences_equal"] = f"{same}/{total}"
    return out


def table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v))
    return "\n".join([" | ".join(keys)] + [" | ".join(fmt(r.get(k)) for k in keys) for r in rows])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu_bench.json")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    import triton

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d")}
    res["correctness"] = correctness()
    res["correctness"]["fused_kernel_rel_err"] = kernel_check()
    res["correctness"].update(engine_golden_check())
    print("correctness", res["correctness"], flush=True)
    res["ceilings"] = ceilings()
    print("ceilings", res["ceilings"], flush=True)
    config = MoondreamConfig()
    model = Moondream(config, random_weights(config, dtype=torch.bfloat16, device="cuda"))
    from kestrel_backend.model.tokenizer import load_tokenizer

    model.tokenizer = load_tokenizer(ROOT / "tests" / "fixtures" / "md2-tiny")
    batches = [1, 2, 8, 64] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128]
    for ctx in (64, 800):
        rows = []
        # ahead: each step launched before the previous one's tokens are read (greedy text, one or two
        # sequences); no-pdl: the kernels without programmatic dependent launch (one or two sequences)
        few = [b for b in batches if b <= dk.GEMV_MAX_ROWS]  # (steps launched ahead need the GEMV form's greedy)
        for backend, sizes in (("graph", batches), ("graph-ahead", few), ("graph-no-pdl", few), ("torch", few)):
            rows += decode_steps(model, sizes, ctx, res["ceilings"]["copy_bandwidth_GBps"] * 1e9, backend)
        if ctx > model.config.text.prefix_attn:  # sequences on 8 images, as the prefix cache has them
            rows += decode_steps(model, [b for b in batches if b >= 16], ctx,
                                 res["ceilings"]["copy_bandwidth_GBps"] * 1e9, "graph", sharing=8)
        res[f"decode_ctx{ctx}"] = rows
        print(f"\ndecode steps, context {ctx}\n" + table(rows), flush=True)
    rate = res["ceilings"]["bf16_matmul_TFLOPs"] * 1e12
    res["vision"] = [vision_bench(model, res["ceilings"], variant, n) for variant in ("graph", "eager")
                     for n in (13, 52)]
    try:
        res["vision"].append(vision_bench(model, res["ceilings"], "compiled"))
    except Exception as e:  # report, do not lose the rest of the run
        res["vision_compile_error"] = f"{type(e).__name__}: {e}"[:500]
    print("\nvision\n" + table(res["vision"]), flush=True)
    res["prefill"] = [row for n in ((1, 16) if args.quick else (1, 4, 16)) for row in prefill_bench(model, rate, n)]
    print("\nprefill (fresh image queries)\n" + table(res["prefill"]), flush=True)
    levels = [1, 8] if args.quick else [1, 4, 16, 64]
    res["e2e"] = e2e_bench(model, levels, max_tokens=64, prefix_cache_size=RuntimeConfig.prefix_cache_size)
    print("\nend to end (query with image, 64 tokens)\n" + table(res["e2e"]), flush=True)
    res["e2e_no_prefix_cache"] = e2e_bench(model, levels, max_tokens=64, prefix_cache_size=0)
    print("\nend to end, prefix cache off\n" + table(res["e2e_no_prefix_cache"]), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
