"""Compile every Triton kernel of the GPU paths for the GPUs people deploy on, on a machine without a GPU: the
launches of the real launch wrappers are intercepted, with the wrappers told what each architecture has
(programmatic dependent launch from Hopper on; about 100 KB of shared memory a block on sm86, sm89 and sm120,
so the small tiles there), and each is compiled to a cubin with Triton's own compiler for that architecture.
Catches what the interpreter does not see (typing, layouts, the PDL intrinsics, shared memory beyond the
GPU's). Run by tests/test_gpu_kernels.py in a subprocess, without TRITON_INTERPRET. The GPU machine's Triton
may differ from this one's. A cold compile (no Triton cache) of every variant takes about 6 minutes an architecture
on one CPU: sm90 gets every one, the others the bf16 ones at 1, 2 and 64 rows, the architectures in parallel, a
process a CPU (sm90, the longest, first).

A variant is named by Triton's own cache key (the kernel's source and what it calls, with the lines they start on, so a
comment that moves a kernel down its file changes its key; the signature, the constexprs,
the options, the architecture, Triton's version and its cache-invalidating settings): the key of every variant that
compiled is kept in fixtures/compiled_kernels.json with its shared memory, as Triton's cache would keep the cubin. A
variant whose key is there is not compiled again (Triton's compile is a function of that key); a changed kernel, or
another Triton, has new keys and is compiled. `--record` compiles every variant, ignoring the file, and rewrites it;
`--update` compiles the variants the file lacks and rewrites it with today's variants (after a kernel changed).

    python tests/compile_kernels.py [--record | --update]   -> one line per kernel variant; exit 1 on failure
"""

import dataclasses
import hashlib
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import get_cache_invalidating_env_vars, get_cache_key, make_backend
from triton.runtime.jit import JITFunction, mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

from kestrel_backend.model.config import MoeConfig, TextConfig, VisionConfig
from kestrel_backend.kernels.packed import PackedWeight
from kestrel_backend.model.weights import Linear, MoE
from kestrel_backend.kernels.fp8_linear import Fp8Weight, fp8_linear
from kestrel_backend.kernels.layer_norm_cuda import shifted_layer_norm, shifted_layer_norm_fp8
from kestrel_backend.model.fp8 import FP8_FF_STEP
from kestrel_backend.kernels.rope_cuda import rope_qk_inplace
from kestrel_backend.kernels.tau_cuda import tau_inplace, tau_rows
from kestrel_backend.kernels import decode_kernels as dk
from kestrel_backend.kernels import shared as kernel_shared
from kestrel_backend.kernels import lora_kernels as lk
from kestrel_backend.kernels import moe_kernels as mk
from kestrel_backend.kernels.moe_lora import ExpertLora, pair_delta
from kestrel_backend.kernels import w4a16_kernels as w4
from kestrel_backend.kernels.grouped_attention import GROUP, grouped_attention
from kestrel_backend.kernels.prefill_attention import prefill_attention

DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
          torch.float64: "fp64", torch.float8_e4m3fn: "fp8e4nv"}
# capability: (shared memory a block, PDL): A100, A10/A40, L4/L40/RTX 4090, H100/H200, B200, RTX 5090/RTX PRO 6000
ARCHITECTURES = {80: (166912, False), 86: (101376, False), 89: (101376, False), 90: (232448, True),
                 100: (232448, True), 120: (101376, True)}
SHARED_MEMORY = {cap: smem for cap, (smem, _) in ARCHITECTURES.items()}
FULL_CAPABILITY = 90  # every variant (float32 too: the checks against the reference run on an H100; every row count);
# the other GPUs the bf16 variants at 1, 2 and 64 rows (a cold compile of every variant takes minutes an architecture)
launches = []
RECORD = Path(__file__).parent / "fixtures" / "compiled_kernels.json"  # cache key -> shared memory of those compiled
os.environ["TRITON_DISABLE_LINE_INFO"] = "1"  # (no debug line tables: a tenth less compile time, the same code)


def _record(self, grid):
    return lambda *args, **kwargs: launches.append((self, args, kwargs))


def _type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + DTYPES[value.dtype]
    if isinstance(value, TensorDescriptor):  # (Hopper's TMA loads: the type names the block)
        return mangle_type(value)
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    return "fp32"


def compile_launch(fn: JITFunction, args, kwargs, capability: int, recorded: dict) -> tuple[str, int]:
    """Compile one launch's variant for this architecture, unless its cache key is recorded: -> (key, shared memory
    a block); raises if it does not compile or needs more shared memory than the GPU has."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    kwargs.pop("launch_pdl", None)
    values = dict(zip(fn.arg_names, args)) | kwargs
    constexprs = {p.name: values[p.name] for p in fn.params if p.is_constexpr}
    signature = {name: "constexpr" if name in constexprs else _type(values[name]) for name in fn.arg_names}
    src, target = ASTSource(fn, signature, constexprs), GPUTarget("cuda", capability, 32)
    backend = make_backend(target)  # (the key as triton.compile computes it)
    parsed = backend.parse_options(dict(options, **src.parse_options()))
    key = hashlib.sha256(get_cache_key(src, backend, parsed, get_cache_invalidating_env_vars()).encode()).hexdigest()
    shared = recorded.get(key)
    if shared is None:
        shared = triton.compile(src, target=target, options=options).metadata.shared
    if shared > SHARED_MEMORY[capability]:
        raise RuntimeError(f"needs {shared} bytes of shared memory, the GPU has {SHARED_MEMORY[capability]}")
    return key, shared


def launch_everything(capability: int) -> None:
    cfg = TextConfig()
    h, d, page = cfg.n_heads, cfg.head_dim, 16
    full = capability == FULL_CAPABILITY
    for dtype in (torch.bfloat16, torch.float32) if full else (torch.bfloat16,):
        f = dict(dtype=dtype)
        for m in (1, 2, 4, 32, 64) if full else (1, 2, 64):
            x = torch.zeros(m, cfg.dim, **f)
            ln = torch.zeros(cfg.dim, **f)
            wq, bq, wf, bf = (torch.zeros(3 * cfg.dim, cfg.dim, **f), torch.zeros(3 * cfg.dim, **f),
                              torch.zeros(cfg.ff_dim, cfg.dim, **f), torch.zeros(cfg.ff_dim, **f))
            dk.norm_linear(x, ln, ln, wq, bq, wf, bf, gelu2=True)
            dk.norm_linear(x, ln, ln, wf, bf, out1=torch.zeros(m, cfg.ff_dim),
                           banned=torch.zeros(m, 2, dtype=torch.int32), best=dk.greedy_keys(m, "cpu"))
            dk.linear2_residual(x, wq[:cfg.dim], torch.zeros(m, cfg.ff_dim, **f), wf.T.contiguous(), x, ln)
            pq, pf, pp, p2 = (PackedWeight(torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n * k // 128, **f),
                                           torch.zeros(n * k // 128, **f), 128, dtype)
                              for n, k in ((3 * cfg.dim, cfg.dim), (cfg.ff_dim, cfg.dim), (cfg.dim, cfg.dim),
                                           (cfg.dim, cfg.ff_dim)))  # (4-bit checkpoints' scales: bf16)
            w4.w4_norm_linear(x, ln, ln, pq, bq, pf, bf)
            w4.w4_linear2_residual(x, pp, torch.zeros(m, cfg.ff_dim, **f), p2, x, ln)
            if m == 1:
                w4.dequantize_packed(pf)
            cache = torch.zeros(64 * page, h, d, **f)
            tables, lens = torch.zeros(m, 4, dtype=torch.int32), torch.ones(m, dtype=torch.int32)
            cos = torch.zeros(m, cfg.rope_dim // 2)
            for splits in (1, 2, 4, 8):  # (context_splits, MANY_ROWS_SPLITS, ONE_KERNEL_SPLITS)
                dk.rotary_paged_attention(torch.zeros(m, 3 * cfg.dim, **f), cos, cos, cache, cache, tables, lens,
                                          lens, h, page, splits)
                if m == 1 and splits in (1, 8):
                    dk.norm_linear_attention(x, ln, ln, wq, bq, wf, bf, cos, cos, cache, cache, tables, lens, lens,
                                             page, torch.zeros(dk.one_kernel_counters(h, 1), dtype=torch.int32), splits)
            dk.greedy_tokens(dk.greedy_keys(m, "cpu"), host_out=torch.zeros(m, dtype=torch.int32))
            dk.banned_greedy(torch.zeros(m, cfg.vocab_size), torch.zeros(m, 2, dtype=torch.int32),
                             torch.zeros(m, dtype=torch.int32), torch.zeros(m, dtype=torch.int32))
            i32 = dict(dtype=torch.int32)
            segs, ranks = (torch.zeros(m, **i32), torch.zeros(m + 1, **i32), torch.zeros(m, **i32)), torch.zeros(9, **i32)
            for r in (16, 32, 64):  # LoRA pools of these rank capacities
                v = torch.zeros(m, 4 * r)
                lk.lora_shrink(x, torch.zeros(9, 3 * r, cfg.dim, **f), segs, ranks, v)
                lk.lora_expand_in(torch.zeros(m, 3 * cfg.dim, **f), torch.zeros(m, cfg.ff_dim, **f), v,
                                  torch.zeros(9, 3 * cfg.dim, r, **f), torch.zeros(9, cfg.ff_dim, r, **f),
                                  torch.zeros(9, r, cfg.ff_dim, **f), segs, ranks)
                lk.lora_expand_out(x, v, torch.zeros(9, cfg.dim, r, **f), torch.zeros(9, cfg.dim, r, **f), segs, ranks)
            dk.embed_rows(torch.zeros(m, dtype=torch.int32), torch.zeros(16, cfg.dim, **f), x,
                          torch.zeros(m, dtype=torch.int32))
            rope_qk_inplace(torch.zeros(m, 3 * cfg.dim, **f), cos, cos, 2 * h, d)  # (prefill)
        q = torch.zeros(64, 3 * h, d, **f)
        prefill_attention(q[:, :h], q[:, h:2 * h], q[:, 2 * h:], cache, cache, torch.zeros(64, dtype=torch.int64),
                          torch.tensor([0, 64, 10, 0, 16, 0], dtype=torch.int32), torch.zeros(16, dtype=torch.int64))
        i32 = dict(dtype=torch.int32)
        for rotate in (True, False):  # the decode step's unrotated qkv; a flat step's rotated rows, gathered
            cos = torch.zeros(64, cfg.rope_dim // 2) if rotate else None
            grouped_attention(q[:, :h], q[:, h:2 * h], q[:, 2 * h:], cache, cache, torch.zeros(64, 4, **i32),
                              torch.ones(64, **i32), torch.zeros(64, **i32), torch.zeros(64, GROUP, **i32),
                              torch.zeros(64, **i32), page, cos, cos,
                              None if rotate else torch.zeros(64, **i32))
        moe = MoeConfig()  # Moondream 3's experts: few tokens (decode) and many (prefill) take other tiles
        tau_inplace(torch.zeros(4, 3 * cfg.dim, **f), torch.zeros(4, 2 * h, **f), torch.zeros(h, **f),
                    torch.zeros(4, dtype=torch.int64), h, d)
        tau_rows(torch.zeros(1, 3 * cfg.dim, **f), torch.zeros(2 * h, 3 * cfg.dim, **f), torch.zeros(h, **f),
                 torch.zeros(1, dtype=torch.int32), h, d)
        fc1 = torch.zeros(moe.n_experts, 2 * moe.expert_inner_dim, cfg.dim, **f)
        fc2 = torch.zeros(moe.n_experts, cfg.dim, moe.expert_inner_dim, **f)
        bf16_experts = MoE(Linear(torch.zeros(moe.n_experts, cfg.dim, **f), torch.zeros(moe.n_experts, **f)), fc1, fc2,
                           moe.n_experts_per_tok)
        fp8 = torch.float8_e4m3fn
        fp8_experts = dataclasses.replace(bf16_experts, fc1=fc1.to(fp8), fc2=fc2.to(fp8),  # (KESTREL_FP8_EXPERTS)
                                          fc1_scale=torch.ones(fc1.shape[:2], device=fc1.device),
                                          fc2_scale=torch.ones(fc2.shape[:2], device=fc1.device))
        kinds = (bf16_experts, fp8_experts) if capability >= 89 else (bf16_experts,)  # (e4m3: from Ada on)
        for t in (1, 8, 64, 256):
            for experts in kinds:
                mk.moe_mlp_cuda(torch.zeros(t, cfg.dim, **f), experts)
        dims = {"up": (cfg.dim, 2 * moe.expert_inner_dim), "down": (moe.expert_inner_dim, cfg.dim)}
        dense = {"up": (cfg.dim, cfg.ff_dim), "down": (cfg.ff_dim, cfg.dim)}

        def adapters(t, shapes, n_experts, rank):  # (a Moondream 3 adapter pool's layer: ExpertLoraPool)
            (ui, uo), (di, do) = shapes["up"], shapes["down"]
            return ExpertLora(*(torch.zeros(2, n_experts, rank, n, **f) for n in (ui, uo, di, do)),
                              torch.zeros(2, dtype=torch.int32), torch.zeros(t, dtype=torch.int32))

        for t in (1, 8, 64):  # adapters' deltas: the expert kernels' paths, and a dense layer's (one expert)
            expert_lora = adapters(t, dims, moe.n_experts, 4)
            for experts in kinds:
                mk.moe_mlp_cuda(torch.zeros(t, cfg.dim, **f), experts, summed=False, lora=expert_lora)
            dense_lora = adapters(t, dense, 1, 32)
            for (k, n), a, bt in ((dense["up"], dense_lora.up_a, dense_lora.up_bt),
                                  (dense["down"], dense_lora.down_a, dense_lora.down_bt)):
                pair_delta(torch.zeros(t, k, **f), a, bt, dense_lora, torch.zeros(t, n, **f), t)
        pairs = 1024 * moe.n_experts_per_tok  # (the grouped GEMM's rows, in expert order)
        expert_lora, order = adapters(1024, dims, moe.n_experts, 4), torch.zeros(pairs, dtype=torch.int32)
        count = torch.zeros(1, dtype=torch.int32)
        pair_delta(torch.zeros(1024, cfg.dim, **f), expert_lora.up_a, expert_lora.up_bt, expert_lora,
                   torch.zeros(pairs, dims["up"][1], **f), pairs, moe.n_experts_per_tok, order, order, count,
                   dst_by_pair=False)
        pair_delta(torch.zeros(pairs, dims["down"][0], **f), expert_lora.down_a, expert_lora.down_bt, expert_lora,
                   torch.zeros(pairs, cfg.dim, **f), pairs, moe.n_experts_per_tok, order, order, count,
                   src_by_token=False, dst_by_pair=False)
        for t in (16, 64):  # (a prefill graph's: only its real rows routed)
            mk.moe_mlp_cuda(torch.zeros(t, cfg.dim, **f), kinds[-1], valid=torch.ones(1, dtype=torch.int32))
        if capability >= 89:
            mk.widened(fp8_experts.fc2, fp8_experts.fc2_scale, torch.bfloat16)
        pairs = 1024 * moe.n_experts_per_tok  # (the grouped GEMM path of long prefills: the kernels of our own)
        mk.route_and_group(torch.zeros(1024, moe.n_experts, **f), moe.n_experts_per_tok, f["dtype"])
        mk.gated_gelu(torch.zeros(pairs, 2 * moe.expert_inner_dim, **f))
        for into in (None, torch.zeros(1024, cfg.dim, **f)):  # (the experts' sum alone; added to the residual)
            mk.combine_rows(torch.zeros(pairs, cfg.dim, **f), torch.zeros(pairs, dtype=torch.int32),
                            torch.zeros(1024, moe.n_experts_per_tok, **f), f["dtype"], into, torch.zeros(cfg.dim, **f))
        if capability == 90 and f["dtype"] == torch.bfloat16:  # (W8A8: torch's FP8 grouped GEMM runs on sm90 only)
            mk.gathered_fp8_rows(torch.zeros(1024, cfg.dim, **f), torch.zeros(pairs, dtype=torch.int32),
                                 moe.n_experts_per_tok)
            mk.gated_gelu_fp8(torch.zeros(pairs, 2 * moe.expert_inner_dim, **f))
        vision = torch.zeros(729, VisionConfig().enc_dim, **f)
        shifted_layer_norm(vision, torch.zeros(1, vision.shape[1]), vision[0], vision[0])
        if capability >= 89 and f["dtype"] == torch.bfloat16:  # (the FP8 paths: TMA from Hopper on)
            v = VisionConfig()  # (KESTREL_VISION_FP8: qkv's norm apart, fc2 without a bias)
            fp8_block_launches(vision, v.enc_ff_dim + -v.enc_ff_dim % FP8_FF_STEP, None, capability >= 90, True)
            t = TextConfig()  # (KESTREL_PREFILL_FP8: one norm for qkv and fc1, fc2 adds its bias too)
            fp8_block_launches(torch.zeros(256, t.dim, **f), t.ff_dim, torch.zeros(t.dim, **f), capability >= 90,
                               False)


def fp8_block_launches(x: torch.Tensor, ff: int, fc2_bias, tma: bool, qkv_norm_apart: bool) -> None:
    """One block's FP8 path (model/fp8.py) on rows x: the norm that quantises them and bounds fc1's output (and,
    qkv_norm_apart, one that only quantises, before qkv), qkv, fc1 writing e4m3, fc2 onto x."""
    dim, fp8, f = x.shape[1], torch.float8_e4m3fn, dict(dtype=x.dtype)
    zeros = torch.zeros(dim)
    if qkv_norm_apart:
        shifted_layer_norm_fp8(x, zeros, x[0], x[0])
    x8, scale, bound = shifted_layer_norm_fp8(x, zeros, x[0], x[0], gelu_bound=(1.0, 1.0))
    w = Fp8Weight(torch.zeros(3 * dim, dim, dtype=fp8), torch.ones(3 * dim))
    fp8_linear(x8, scale, w, torch.zeros(3 * dim, **f), tma=tma)  # qkv
    w = Fp8Weight(torch.zeros(ff, dim, dtype=fp8), torch.ones(ff))
    hidden8 = fp8_linear(x8, scale, w, torch.zeros(ff, **f), gelu=True, out_scale=bound, tma=tma)  # fc1
    w = Fp8Weight(torch.zeros(dim, ff, dtype=fp8), torch.ones(dim))
    fp8_linear(hidden8, bound, w, fc2_bias, accumulate=x, tma=tma)  # fc2, onto the residual stream


def compile_for(capability: int, recorded: dict) -> tuple[list[str], int, dict]:
    """Every kernel variant the wrappers launch on a GPU of this capability, compiled (or found in `recorded`):
    (report lines, failures, the key and shared memory of each that compiled)."""
    shared, pdl = ARCHITECTURES[capability]
    JITFunction.__getitem__ = _record
    # (the wrappers ask the device what it has; there is none here)
    dk._has_pdl = lambda device: pdl
    kernel_shared.small_shared_memory = lambda device: shared < 200 * 1024
    launches.clear()
    launch_everything(capability)
    seen, lines, failed, compiled = set(), [], 0, {}
    for fn, args, kwargs in launches:
        variant = (fn.__name__, tuple(_type(a) for a in args), tuple(sorted(kwargs.items())))
        if variant in seen:
            continue
        seen.add(variant)
        t0 = time.perf_counter()
        try:
            key, compiled[key] = compile_launch(fn, args, dict(kwargs), capability, recorded)
            how = "recorded" if key in recorded else f"{time.perf_counter() - t0:.1f} s"
            lines.append(f"ok   sm{capability} {fn.__name__} {sorted(kwargs.items())} ({how})")
        except Exception as e:  # report every failure, not just the first
            failed += 1
            lines.append(f"FAIL sm{capability} {fn.__name__} {sorted(kwargs.items())}: {e}")
    return lines, failed, compiled


def main() -> int:
    """The architectures in parallel, a process each while CPUs last (a cold compile of one takes minutes)."""
    record, update = "--record" in sys.argv[1:], "--update" in sys.argv[1:]
    recorded = {} if record or not RECORD.exists() else json.loads(RECORD.read_text())["shared_memory"]
    caps = sorted(ARCHITECTURES, key=lambda c: c != FULL_CAPABILITY)
    failed, compiled = 0, {}
    workers = min(len(caps), os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for lines, failures, keys in pool.map(compile_for, caps, [recorded] * len(caps)):
            print("\n".join(lines), flush=True)
            failed, compiled = failed + failures, compiled | keys
    new = sorted(set(compiled) - set(recorded))
    print(f"{len(compiled)} variants: {len(compiled) - len(new)} recorded, {len(new)} compiled now", flush=True)
    if (record or update) and not failed:
        RECORD.write_text(json.dumps({"about": "written by tests/compile_kernels.py --record or --update: the Triton "
                                      "cache key of every kernel variant that compiled, and its shared memory a block",
                                      "triton": triton.__version__, "shared_memory": dict(sorted(compiled.items()))},
                                     indent=0) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
