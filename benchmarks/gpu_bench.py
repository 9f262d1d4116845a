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
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kestrel_backend.engine_config import RuntimeConfig  # noqa: E402
from kestrel_backend.engine import InferenceEngine  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from kestrel_backend.model.moondream import Moondream  # noqa: E402
from kestrel_backend.model.weights import random_weights  # noqa: E402
from kestrel_backend.runtime.kv_cache import PagedKVCache  # noqa: E402
from kestrel_backend.runtime.attention import TorchPagedAttention  # noqa: E402
from kestrel_backend.kernels import decode_kernels as dk  # noqa: E402
from kestrel_backend.runtime.gpu_parts import make_attention, make_prefill_graphs  # noqa: E402
from benchmarks.common import (ROOT, ceilings, decode_steps, engine_golden_check, fresh_queries,  # noqa: E402
                               gather_limited, prefill_flops, query_images, table, throughput_row, timed,
                               vision_bench)


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
