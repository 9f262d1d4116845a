"""Fused Triton kernels for the decode step, where a few tokens meet all the weights (memory bound).

A decode step is one pass over 2.6 GB of weights; what costs beyond that is the number of kernels
and how well each streams its weight. Per layer we run three kernels instead of eight:

- `norm_linear`: layer norm fused into the matmuls that read it (qkv and fc1 share the normed input
  in Moondream's parallel block, so one launch covers both; fc1 gets its GELU as an epilogue);
- `rotary_paged_attention`: rotary embedding, the KV-cache write and paged attention for one new
  token per sequence;
- `linear2_residual`: out-projection and fc2 summed onto the residual with their bias.

For one sequence, `norm_linear_attention` makes the first two one kernel (the attention runs while
fc1's weight streams), and the LM head (`norm_linear` with `best`) also makes the greedy choice.

They also run under TRITON_INTERPRET=1 on the CPU, which is how the tests check them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from . import shared
from .shared import LN_EPS, after_previous_kernel, dot_precision, gelu_tanh, input_chunk, mac, power_of_two_chunk, row_stats, stats_chunk, store_columns

@triton.jit
def _weight_tile(w_ptr, offs_n, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows offs_n, columns [k0, k0 + BLOCK_K) of a weight [N, K]."""
    return tl.load(w_ptr + offs_n[:, None] * K + (k0 + tl.arange(0, BLOCK_K))[None, :])


@triton.jit
def _streamed_matmul(acc, x_ptr, x_stride, mean, rstd, g_ptr, b_ptr, w_ptr, w_first, offs_m, m_mask, offs_n,
                     K: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """acc + x[offs_m] @ w[offs_n].T over all K, w [N, K] contiguous, x layer-normed chunk by chunk as
    it streams past if given the norm (input_chunk). w_first is the weight's first K chunk, which the
    caller loads before waiting for the previous kernel: in the GEMV form; with tensor cores the loop
    loads it (a chunk held ahead would need shared memory)."""
    if USE_DOT:
        for k0 in range(0, K, BLOCK_K):
            w = _weight_tile(w_ptr, offs_n, k0, K, BLOCK_K)
            x = input_chunk(x_ptr, x_stride, offs_m, m_mask, k0, BLOCK_K, mean, rstd, g_ptr, b_ptr,
                             w_ptr.dtype.element_ty)
            acc = mac(acc, x, w, USE_DOT, PRECISION)
    else:  # each chunk's load issued before the chunk ahead of it is used: two in flight
        w = w_first
        for k0 in range(BLOCK_K, K, BLOCK_K):
            w_next = _weight_tile(w_ptr, offs_n, k0, K, BLOCK_K)
            x = input_chunk(x_ptr, x_stride, offs_m, m_mask, k0 - BLOCK_K, BLOCK_K, mean, rstd, g_ptr, b_ptr,
                             w_ptr.dtype.element_ty)
            acc = mac(acc, x, w, USE_DOT, PRECISION)
            w = w_next
        x = input_chunk(x_ptr, x_stride, offs_m, m_mask, K - BLOCK_K, BLOCK_K, mean, rstd, g_ptr, b_ptr,
                         w_ptr.dtype.element_ty)
        acc = mac(acc, x, w, USE_DOT, PRECISION)
    return acc


@triton.jit
def _norm_linear_part(x_ptr, x_stride, mean, rstd, g_ptr, b_ptr, w_ptr, w_first, bias_ptr, offs_n, offs_m, m_mask,
                      K: tl.constexpr, GELU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Output columns offs_n of one weight: matmul, bias, optional GELU."""
    acc = _streamed_matmul(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), x_ptr, x_stride, mean, rstd, g_ptr, b_ptr, w_ptr,
                           w_first, offs_m, m_mask, offs_n, K, BLOCK_K, USE_DOT, PRECISION)
    acc += tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
    if GELU:
        acc = gelu_tanh(acc)
    return acc


TOKEN_BITS = 17  # a greedy key's low bits: 2^17 - 1 - token (vocabularies below 2^17 - 1 tokens)


@triton.jit
def _greedy_epilogue(acc, banned_ptr, best_ptr, offs_m, m_mask, offs_n, BANNED: tl.constexpr,
                     TOKEN_BITS: tl.constexpr):
    """Logits of the LM head: the rows' banned tokens (BANNED per row, -1 for none) become -inf, and
    each row's best (logit, lowest token id) goes into best[row] as one int64 key by atomic max. A key
    is above 0, so zeros is "none yet" (and shares a memset with other zeros): the float's bits, made
    to order like unsigned ints, above 2^TOKEN_BITS - 1 - token. (Spreading the 6,400 programs' atomic
    max over 64 keys per row measured no faster on the H100.)"""
    for j in tl.static_range(BANNED):
        ban = tl.load(banned_ptr + offs_m * BANNED + j, mask=m_mask, other=-1)
        acc = tl.where(offs_n[None, :] == ban[:, None], float("-inf"), acc)
    bits = acc.to(tl.int32, bitcast=True)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648
    key = (ordered << TOKEN_BITS) | ((1 << TOKEN_BITS) - 1 - offs_n.to(tl.int64))[None, :]
    tl.atomic_max(best_ptr + offs_m, tl.max(key, 1), mask=m_mask)
    return acc


@triton.jit
def _columns_and_first_tile(pid, w1_ptr, w2_ptr, N1: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    """Which weight program pid streams (its first N1 / BLOCK_N programs w1, the rest w2), its output
    columns, and its first weight chunk: weights are never written, so this load can be issued before
    waiting for the previous kernel and overlaps that kernel's tail."""
    first = pid < N1 // BLOCK_N
    offs_n = tl.where(first, pid, pid - N1 // BLOCK_N) * BLOCK_N + tl.arange(0, BLOCK_N)
    if first:
        w_first = _weight_tile(w1_ptr, offs_n, 0, K, BLOCK_K)
    else:
        w_first = _weight_tile(w2_ptr, offs_n, 0, K, BLOCK_K)
    return first, offs_n, w_first


@triton.jit
def _norm_linear_kernel(x_ptr, x_stride, g_ptr, b_ptr, w1_ptr, bias1_ptr, out1_ptr, w2_ptr, bias2_ptr, out2_ptr,
                        banned_ptr, best_ptr, M, eps, K: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr,
                        GELU2: tl.constexpr, GREEDY: tl.constexpr, BANNED: tl.constexpr, TOKEN_BITS: tl.constexpr,
                        BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STATS_K: tl.constexpr, USE_DOT: tl.constexpr,
                        PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Programs [0, N1 / BLOCK_N) fill out1 from w1, the rest out2 from w2; all share the normed x.
    GREEDY: out1 are logits; apply the bans and find each row's greedy token (_greedy_epilogue)."""
    first, offs_n, w_first = _columns_and_first_tile(tl.program_id(0), w1_ptr, w2_ptr, N1, K, BLOCK_N, BLOCK_K)
    after_previous_kernel(PDL)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    mean, rstd = row_stats(x_ptr, x_stride, offs_m, m_mask, K, eps, BLOCK_M, STATS_K)
    if first:
        acc = _norm_linear_part(x_ptr, x_stride, mean, rstd, g_ptr, b_ptr, w1_ptr, w_first, bias1_ptr, offs_n, offs_m,
                                m_mask, K, False, BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, PRECISION)
        if GREEDY:
            acc = _greedy_epilogue(acc, banned_ptr, best_ptr, offs_m, m_mask, offs_n, BANNED, TOKEN_BITS)
        store_columns(out1_ptr, acc, offs_m, m_mask, offs_n, N1)
    else:
        acc = _norm_linear_part(x_ptr, x_stride, mean, rstd, g_ptr, b_ptr, w2_ptr, w_first, bias2_ptr, offs_n, offs_m,
                                m_mask, K, GELU2, BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, PRECISION)
        store_columns(out2_ptr, acc, offs_m, m_mask, offs_n, N2)


@triton.jit
def _linear2_residual_kernel(a_ptr, a_stride, w1_ptr, c_ptr, c_stride, w2_ptr, res_ptr, res_stride, bias_ptr, out_ptr,
                             M, K1: tl.constexpr, K2: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                             PRECISION: tl.constexpr, PDL: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w1_first = _weight_tile(w1_ptr, offs_n, 0, K1, BLOCK_K)  # before the wait: see _columns_and_first_tile
    w2_first = _weight_tile(w2_ptr, offs_n, 0, K2, BLOCK_K)
    after_previous_kernel(PDL)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc = _streamed_matmul(acc, a_ptr, a_stride, None, None, None, None, w1_ptr, w1_first, offs_m, m_mask, offs_n, K1,
                           BLOCK_K, USE_DOT, PRECISION)
    acc = _streamed_matmul(acc, c_ptr, c_stride, None, None, None, None, w2_ptr, w2_first, offs_m, m_mask, offs_n, K2,
                           BLOCK_K, USE_DOT, PRECISION)
    res = tl.load(res_ptr + offs_m[:, None] * res_stride + offs_n[None, :], mask=m_mask[:, None], other=0.0)
    acc += res.to(tl.float32) + tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
    store_columns(out_ptr, acc, offs_m, m_mask, offs_n, N)


GEMV_MAX_ROWS = 2  # up to here, streaming the weight through plain loads beats tensor cores (tune_decode_kernels.py)


PDL_ENABLED = True  # programmatic dependent launch where the GPU has it (benchmarks compare without)
ONE_KERNEL_KV_BLOCK = 64  # cached positions per block in the one kernel's attention (decode_variants compares)
ATTENTION_KV_BLOCK = 128  # the same in the attention kernel of its own: its first block, loaded before the PDL wait,
#   then holds a short context whole (H100, benchmarks/ab_code.py against 64, steps of 2 / 64 sequences: 1.293 / 2.149
#   ms against 1.343 / 2.243 at context 64, 1.458 / 5.828 against 1.518 / 5.811 at 800; 8 warps slower; H200, 64 and 2
#   warps: whole steps up to 6% slower, PERFORMANCE.md). The one kernel's stays 64: 128 there takes 167 registers a
#   thread instead of 128 (ptxas), and fewer programs fit on an SM.
# fc1 programs launched between the one kernel's qkv and attention programs: fewer attention programs then
# hold an SM while they wait for their head's qkv (H100, one sequence, 8 splits at 800 tokens, interleaved A/B:
# 0 / 64 / 128 / 192 / 256 -> 1.138 / 1.129 / 1.124 / 1.118 / 1.166 ms; 128 keeps clear of that cliff)
ONE_KERNEL_FC1_FIRST = 128
# int32s between two heads' arrival counters in the one kernel's sync: one 128-byte line each, so the attention
# programs polling one head do not contend with the qkv programs counting in at another. Only together with the
# qkv programs going head by head did it pay (benchmarks/ab_code.py, one sequence; H200, three runs: 0.847 to
# 0.848 against 0.854 to 0.856 ms at context 64, 0.938 to 0.940 against 0.942 to 0.943 at 800, either alone no
# faster; H100: 1.029 against 1.034 ms at 64, 1.118 against 1.127 at 800)
ARRIVAL_STRIDE = 32


def one_kernel_counters(heads: int, rows: int) -> int:
    """How many int32 zeros norm_linear_attention's sync needs: each head's arrival counter
    (ARRIVAL_STRIDE apart), then one merge counter per (row, head)."""
    return heads * ARRIVAL_STRIDE + rows * heads


def pdl_launch(device: torch.device, rows: int) -> dict:
    """Launch arguments: PDL for the kernel's constexpr, launch_pdl for Triton's launcher. Only for the
    GEMV form, where every kernel of the step is ours: among cuBLAS's kernels it measured no faster."""
    on = PDL_ENABLED and rows <= GEMV_MAX_ROWS and _has_pdl(device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


@functools.lru_cache
def _has_pdl(device: torch.device) -> bool:
    """Hopper or later, and a Triton that knows PDL (it came after 3.0)."""
    has_gdc = hasattr(getattr(tl.extra, "cuda", None), "gdc_wait")
    return has_gdc and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def gpu_paths(device: torch.device) -> str:
    """What this GPU gets, chosen at start: PDL (Hopper and later) or not, the small or large kernel tiles."""
    major, minor = torch.cuda.get_device_capability(device)
    pdl = "programmatic dependent launch" if _has_pdl(device) else "no programmatic dependent launch (before Hopper)"
    tiles = "small tiles (about 100 KB of shared memory)" if shared.small_shared_memory(device) else "large tiles"
    return f"{torch.cuda.get_device_name(device)} (sm{major}{minor}): {pdl}, {tiles}"


def _tiles(m: int, n_sizes: tuple[int, ...], k_sizes: tuple[int, ...], dtype: torch.dtype,
           small_shared_memory: bool = False, gemv_programs: int = 1024, gemv_warps: int = 4,
           gemv_max_k: int = 2048):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, use_dot) for M rows, from the H100 tile sweep;
    shallower tensor-core pipelines where shared memory is small. For the GEMV form: at least
    gemv_programs programs (narrow N tiles, so every SM streams weight), K chunks up to gemv_max_k / M."""
    if m <= GEMV_MAX_ROWS:
        block_n = next((b for b in (8, 4, 2)
                        if sum(n_sizes) // b >= gemv_programs and all(n % b == 0 for n in n_sizes)), 1)
        block_k = next(b for b in (gemv_max_k // m, 256, 64, 16) if all(k % b == 0 for k in k_sizes))
        return m, block_n, block_k, gemv_warps, 2, False
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 16 if m <= 64 else 32
    shallow = dtype == torch.float32 or small_shared_memory  # float32 (parity runs) must fit in shared memory
    widest_k = 64 if dtype == torch.float32 else (128 if small_shared_memory else 256)
    block_k = next(b for b in (256, 128, 64, 32, 16) if b <= widest_k and all(k % b == 0 for k in k_sizes))
    return block_m, block_n, block_k, 4, (2 if shallow else 4), True


def norm_linear(x, ln_weight, ln_bias, w1, bias1, w2=None, bias2=None, gelu2: bool = False, out1=None, tiles=None,
                banned=None, best=None):
    """layer_norm(x) @ w1.T + bias1 and, from the same normed x, [gelu](... @ w2.T + bias2).

    x [M, K] with unit column stride; weights [N, K] contiguous -> out1 [M, N1] (x's dtype unless a
    contiguous out1 of any dtype is given) and out2 [M, N2] or None. tiles: _tiles()'s tuple, to tune.
    For an LM head (no w2), banned [M, j] int32 (-1: none) and best (greedy_keys(M)) ask for the bans
    applied to out1 and each row's greedy choice packed into best (greedy_tokens reads it)."""
    m, k = x.shape
    n1, n2 = w1.shape[0], (w2.shape[0] if w2 is not None else 0)
    assert x.stride(1) == 1 and w1.is_contiguous() and (w2 is None or w2.is_contiguous())
    greedy = best is not None
    assert not greedy or (not n2 and banned.shape[0] == m and banned.is_contiguous() and best.shape == (m,)
                          and best.dtype == torch.int64 and n1 < (1 << TOKEN_BITS) - 1)
    block_m, block_n, block_k, warps, stages, use_dot = tiles or _tiles(m, (n1, n2 or n1), (k,), x.dtype,
                                                                        shared.small_shared_memory(x.device))
    if out1 is None:
        out1 = torch.empty(m, n1, device=x.device, dtype=x.dtype)
    assert out1.shape == (m, n1) and out1.is_contiguous()
    out2 = torch.empty(m, n2, device=x.device, dtype=x.dtype) if n2 else out1
    grid = ((n1 + n2) // block_n, triton.cdiv(m, block_m))
    _norm_linear_kernel[grid](x, x.stride(0), ln_weight, ln_bias, w1, bias1, out1, w2 if n2 else w1,
                              bias2 if n2 else bias1, out2, banned if greedy else x, best if greedy else x, m, LN_EPS,
                              K=k, N1=n1, N2=n2, GELU2=gelu2, GREEDY=greedy, BANNED=banned.shape[1] if greedy else 0,
                              TOKEN_BITS=TOKEN_BITS,
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STATS_K=stats_chunk(k, block_m),
                              USE_DOT=use_dot, PRECISION=dot_precision(x), num_warps=warps, num_stages=stages,
                              **pdl_launch(x.device, m))
    return out1, (out2 if n2 else None)


def greedy_keys(m: int, device) -> torch.Tensor:
    """Room for m rows' greedy keys (norm_linear's best): zeros, which no key is."""
    return torch.zeros(m, device=device, dtype=torch.int64)


@triton.jit
def _greedy_tokens_kernel(best_ptr, out_ptr, host_ptr, n, BLOCK: tl.constexpr, TOKEN_BITS: tl.constexpr,
                          TO_HOST: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    mask = rows < n
    low = tl.load(best_ptr + rows, mask=mask) & ((1 << TOKEN_BITS) - 1)  # a key's low bits: 2^TOKEN_BITS - 1 - token
    tokens = ((1 << TOKEN_BITS) - 1 - low).to(tl.int32)
    tl.store(out_ptr + rows, tokens, mask=mask)
    if TO_HOST:
        tl.store(host_ptr + rows, tokens, mask=mask)


def greedy_tokens(best: torch.Tensor, out: torch.Tensor | None = None,
                  host_out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 token ids out of norm_linear's greedy keys (best [M] int64), into out and, if given,
    host_out: pinned host memory that the kernel writes itself (zero-copy), so the tokens reach the host
    without a copy in the stream (about 10 us per step on the H100)."""
    n = best.shape[0]
    out = torch.empty(n, device=best.device, dtype=torch.int32) if out is None else out
    assert out.is_contiguous() and (host_out is None or (host_out.is_contiguous() and host_out.shape[0] >= n))
    _greedy_tokens_kernel[(1,)](best, out, out if host_out is None else host_out, n,
                                BLOCK=triton.next_power_of_2(max(n, 16)), TOKEN_BITS=TOKEN_BITS,
                                TO_HOST=host_out is not None)
    return out


@triton.jit
def _banned_greedy_kernel(logits_ptr, banned_ptr, out_ptr, host_ptr, V, stride, BANNED: tl.constexpr,
                          BLOCK: tl.constexpr, TO_HOST: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    best_val = tl.full((), float("-inf"), tl.float32)
    best = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        vals = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        for j in tl.static_range(BANNED):
            hit = cols == tl.load(banned_ptr + row * BANNED + j)  # (-1: none, matches no column)
            vals = tl.where(hit, float("-inf"), vals)
            tl.store(base + cols, tl.full((BLOCK,), float("-inf"), tl.float32), mask=hit)
        m = tl.max(vals, axis=0)
        i = tl.argmax(vals, axis=0)  # (the first of ties)
        best = tl.where(m > best_val, start + i, best)  # (strictly greater: ties keep the earlier block's)
        best_val = tl.maximum(best_val, m)
    tl.store(out_ptr + row, best)
    if TO_HOST:
        tl.store(host_ptr + row, best)


def banned_greedy(logits: torch.Tensor, banned: torch.Tensor, out: torch.Tensor,
                  host_out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's greedy token of float32 logits [M, V] with its banned tokens (banned [M, k] int32, -1 for none)
    set to -inf in logits and skipped; ties go to the lowest id, as argmax's do. Into out [M] int32 and, if given,
    host_out (pinned host memory the kernel writes itself): the steps of more than GEMV_MAX_ROWS rows, whose LM head
    is cuBLAS's, choose their greedy tokens on the GPU as norm_linear does for the GEMV form."""
    m, v = logits.shape
    assert logits.stride(1) == 1 and banned.is_contiguous() and banned.shape[0] >= m and out.shape[0] >= m
    _banned_greedy_kernel[(m,)](logits, banned, out, out if host_out is None else host_out, v, logits.stride(0),
                                BANNED=banned.shape[1], BLOCK=4096, TO_HOST=host_out is not None, num_warps=8)
    return out


def shape_problems(dim: int, ff_dim: int, head_dim: int, rope_dim: int, vocab_size: int) -> list[str]:
    """What a text model's widths ask that these kernels cannot do ([] if nothing): attention works on whole
    heads, so a head and its rotary and unrotated parts are each a power of two wide; the tile kernels cover a
    weight's rows in tiles of 32 and its columns in chunks of 16 (the widths of any size are chunked)."""
    def power_of_two(n: int) -> bool:
        return n > 0 and n & (n - 1) == 0

    problems = [f"{name} {value} is not a power of two" for name, value in
                (("head dimension", head_dim), ("rotary dimension", rope_dim),
                 ("unrotated head dimension", head_dim - rope_dim)) if not power_of_two(value)]
    problems += [f"{name} {value} is not a multiple of 32" for name, value in
                 (("text dimension", dim), ("feed-forward dimension", ff_dim), ("vocabulary size", vocab_size))
                 if value % 32]
    return problems


def linear2_residual(a, w1, c, w2, residual, bias, tiles=None, out=None):
    """residual + a @ w1.T + c @ w2.T + bias in one pass (rows of a, c, residual may be strided), into out
    (contiguous) if given."""
    m, n = residual.shape
    assert a.stride(1) == c.stride(1) == residual.stride(1) == 1 and w1.is_contiguous() and w2.is_contiguous()
    one_row = dict(gemv_programs=512) if m == 1 else {}  # (the whole-step sweep in PERFORMANCE.md)
    block_m, block_n, block_k, warps, stages, use_dot = tiles or _tiles(m, (n,), (a.shape[1], c.shape[1]), a.dtype,
                                                                        shared.small_shared_memory(a.device), **one_row)
    if out is None:
        out = torch.empty(m, n, device=residual.device, dtype=residual.dtype)
    assert out.shape == (m, n) and out.is_contiguous()
    grid = (n // block_n, triton.cdiv(m, block_m))
    _linear2_residual_kernel[grid](a, a.stride(0), w1, c, c.stride(0), w2, residual, residual.stride(0), bias, out, m,
                                   K1=a.shape[1], K2=c.shape[1], N=n, BLOCK_M=block_m, BLOCK_N=block_n,
                                   BLOCK_K=block_k, USE_DOT=use_dot, PRECISION=dot_precision(a), num_warps=warps,
                                   num_stages=stages, **pdl_launch(a.device, m))
    return out


@triton.jit
def _rotated(head_ptr, c, s, HALF: tl.constexpr):
    """A head's first 2*HALF dims rotated, float32: the input halves are the real and imaginary parts,
    the output interleaves them (the reference's layout). Loads skip L1 (.cg): in the fused kernel
    another program wrote the head moments ago."""
    i = tl.arange(0, HALF)
    re = tl.load(head_ptr + i, cache_modifier=".cg").to(tl.float32)
    im = tl.load(head_ptr + HALF + i, cache_modifier=".cg").to(tl.float32)
    return tl.reshape(tl.join(re * c - im * s, re * s + im * c), [2 * HALF])


@triton.jit
def _kv_block(k_ptr, v_ptr, block_table_ptr, bt_stride, b, kvh, start, hi, offs_rot, offs_pass, offs_d,
              HKV: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Cached keys (rotated part, passed part) and values of positions [start, start + BLOCK_N) below hi."""
    offs_n = start + tl.arange(0, BLOCK_N)
    valid = offs_n < hi
    page = tl.load(block_table_ptr + b * bt_stride + offs_n // PAGE, mask=valid, other=0)
    base = ((page.to(tl.int64) * PAGE + offs_n % PAGE) * HKV + kvh) * D
    kr = tl.load(k_ptr + base[:, None] + offs_rot[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    kp = tl.load(k_ptr + base[:, None] + offs_pass[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    v = tl.load(v_ptr + base[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    return kr, kp, v, valid


@triton.jit
def _softmax_block(q_rot, q_pass, kr, kp, v, valid, m_i, l_i, acc):
    """One online-softmax update with a block that has at least one valid key."""
    scores = tl.where(valid, tl.sum(kr * q_rot[None, :], 1) + tl.sum(kp * q_pass[None, :], 1), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 0))
    p = tl.exp(scores - m_new)
    alpha = tl.exp(m_i - m_new)
    return m_new, l_i * alpha + tl.sum(p, 0), acc * alpha + tl.sum(p[:, None] * v, 0)


@triton.jit
def _context_share(seq_lens_ptr, b, split, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi): the cached positions (the new token's excluded) that this split of sequence b attends to."""
    cached = tl.load(seq_lens_ptr + b) - 1  # step inputs: copied in before any kernel of the step
    chunk = tl.cdiv(tl.cdiv(cached, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    return lo, tl.minimum(cached, lo + chunk)


@triton.jit
def _attend_new_token(row, cos_ptr, sin_ptr, k_ptr, v_ptr, block_table_ptr, bt_stride, slots_ptr, b, h, split, lo, hi,
                      kr, kp, v, valid, scale, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                      HALF: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax of head h of sequence b (its q, k, v in row) over cached positions [lo, hi), whose
    first block (kr, kp, v, valid) is already loaded -> (max, sum, acc). The head's first ROT = 2*HALF
    dims are rotated (input halves are real and imaginary parts, the rotated output interleaves them, as
    in the reference); the rest pass. Split 0 also takes the new token's own k/v, and its first head of
    each kv group stores them (rotated) into the cache."""
    ROT: tl.constexpr = 2 * HALF
    kvh = h // (H // HKV)
    offs_rot = tl.arange(0, ROT)
    offs_pass = ROT + tl.arange(0, D - ROT)
    offs_d = tl.arange(0, D)
    i = tl.arange(0, HALF)
    c = tl.load(cos_ptr + b * HALF + i)
    s = tl.load(sin_ptr + b * HALF + i)
    q_rot = _rotated(row + h * D, c, s, HALF) * scale
    q_pass = tl.load(row + h * D + offs_pass, cache_modifier=".cg").to(tl.float32) * scale
    if split == 0:
        k_row = row + (H + kvh) * D
        k_rot = _rotated(k_row, c, s, HALF).to(k_ptr.dtype.element_ty)
        k_pass = tl.load(k_row + offs_pass, cache_modifier=".cg")
        v_new = tl.load(row + (H + HKV + kvh) * D + offs_d, cache_modifier=".cg")
        if h % (H // HKV) == 0:
            base = (tl.load(slots_ptr + b).to(tl.int64) * HKV + kvh) * D
            tl.store(k_ptr + base + offs_rot, k_rot)
            tl.store(k_ptr + base + offs_pass, k_pass)
            tl.store(v_ptr + base + offs_d, v_new)
        m_i = tl.sum(q_rot * k_rot.to(tl.float32), 0) + tl.sum(q_pass * k_pass.to(tl.float32), 0)
        l_i = m_i * 0 + 1.0
        acc = v_new.to(tl.float32)
    else:
        l_i = tl.sum(q_pass * 0.0, 0)  # a float32 scalar 0, typed like the other branch's
        m_i = l_i - float("inf")
        acc = tl.zeros([D], tl.float32)

    if lo < hi:
        m_i, l_i, acc = _softmax_block(q_rot, q_pass, kr, kp, v, valid, m_i, l_i, acc)
    for start in range(lo + BLOCK_N, hi, BLOCK_N):
        kr, kp, v, valid = _kv_block(k_ptr, v_ptr, block_table_ptr, bt_stride, b, kvh, start, hi, offs_rot,
                                     offs_pass, offs_d, HKV, D, PAGE, BLOCK_N)
        m_i, l_i, acc = _softmax_block(q_rot, q_pass, kr, kp, v, valid, m_i, l_i, acc)
    return m_i, l_i, acc


@triton.jit
def _first_kv_block(k_ptr, v_ptr, block_table_ptr, bt_stride, seq_lens_ptr, b, h, split, H: tl.constexpr,
                    HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    """This split's context share and its first block of cached keys and values. No kernel of the step
    writes them, so this may run before waiting for qkv: their latency hides behind that wait."""
    lo, hi = _context_share(seq_lens_ptr, b, split, SPLITS, BLOCK_N)
    offs_rot = tl.arange(0, 2 * HALF)
    kr, kp, v, valid = _kv_block(k_ptr, v_ptr, block_table_ptr, bt_stride, b, h // (H // HKV), lo, hi, offs_rot,
                                 2 * HALF + tl.arange(0, D - 2 * HALF), tl.arange(0, D), HKV, D, PAGE, BLOCK_N)
    return lo, hi, kr, kp, v, valid


@triton.jit
def _store_attention(out_ptr, part_ml_ptr, part_acc_ptr, bh, split, m_i, l_i, acc, D: tl.constexpr,
                     SPLITS: tl.constexpr):
    """With one split the result is final; with several, each stores its partial (max, sum, acc)."""
    if SPLITS == 1:
        tl.store(out_ptr + bh * D + tl.arange(0, D), (acc / l_i).to(out_ptr.dtype.element_ty))
    else:
        part = bh * SPLITS + split
        tl.store(part_ml_ptr + 2 * part, m_i)
        tl.store(part_ml_ptr + 2 * part + 1, l_i)
        tl.store(part_acc_ptr + part * D + tl.arange(0, D), acc)


@triton.jit
def _combine_splits(part_ml_ptr, part_acc_ptr, out_ptr, bh, D: tl.constexpr, SPLITS: tl.constexpr):
    """Merge the splits' partial softmaxes of one (sequence, head): rescale each to the common max."""
    part = bh * SPLITS + tl.arange(0, SPLITS)
    m = tl.load(part_ml_ptr + 2 * part, cache_modifier=".cg")
    l = tl.load(part_ml_ptr + 2 * part + 1, cache_modifier=".cg")
    weight = tl.exp(m - tl.max(m, 0))  # split 0 holds the new token, so the max is finite
    acc = tl.load(part_acc_ptr + part[:, None] * D + tl.arange(0, D)[None, :], cache_modifier=".cg")
    out = tl.sum(weight[:, None] * acc, 0) / tl.sum(weight * l, 0)
    tl.store(out_ptr + bh * D + tl.arange(0, D), out.to(out_ptr.dtype.element_ty))


@triton.jit
def _rotary_paged_attention_kernel(qkv_ptr, qkv_stride, cos_ptr, sin_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr,
                                   slots_ptr, out_ptr, part_ml_ptr, part_acc_ptr, bt_stride, scale, H: tl.constexpr,
                                   HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
                                   BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    """One program per (sequence, head, split of the context). The first block of cached keys and
    values is loaded before waiting for the previous kernel, which under PDL is still draining."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    lo, hi, kr, kp, v, valid = _first_kv_block(k_ptr, v_ptr, block_table_ptr, bt_stride, seq_lens_ptr, b, h, split,
                                               H, HKV, D, HALF, PAGE, BLOCK_N, SPLITS)
    after_previous_kernel(PDL)
    m_i, l_i, acc = _attend_new_token(qkv_ptr + b * qkv_stride, cos_ptr, sin_ptr, k_ptr, v_ptr, block_table_ptr,
                                      bt_stride, slots_ptr, b, h, split, lo, hi, kr, kp, v, valid, scale, H, HKV, D,
                                      HALF, PAGE, BLOCK_N)
    _store_attention(out_ptr, part_ml_ptr, part_acc_ptr, b * H + h, split, m_i, l_i, acc, D, SPLITS)


@triton.jit
def _combine_splits_kernel(part_ml_ptr, part_acc_ptr, out_ptr, D: tl.constexpr, SPLITS: tl.constexpr,
                           PDL: tl.constexpr):
    after_previous_kernel(PDL)
    _combine_splits(part_ml_ptr, part_acc_ptr, out_ptr, tl.program_id(0), D, SPLITS)


@triton.jit
def _norm_linear_attention_kernel(x_ptr, x_stride, g_ptr, b_ptr, w1_ptr, bias1_ptr, qkv_ptr, w2_ptr, bias2_ptr,
                                  out2_ptr, M, eps, cos_ptr, sin_ptr, k_ptr, v_ptr, block_table_ptr, bt_stride,
                                  seq_lens_ptr, slots_ptr, attn_ptr, part_ml_ptr, part_acc_ptr, sync_ptr, scale,
                                  K: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr, H: tl.constexpr,
                                  D: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr, KV_BLOCK: tl.constexpr,
                                  SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                  BLOCK_K: tl.constexpr, STATS_K: tl.constexpr, FC1_FIRST: tl.constexpr,
                                  ARRIVAL_STRIDE: tl.constexpr, PDL: tl.constexpr):
    """The GEMV form of _norm_linear_kernel (qkv, then fc1 with GELU) with the attention in the same grid.
    Programs, in launch order: [qkv columns, head by head][FC1_FIRST fc1 columns][attention: sequence, head,
    split][the other fc1 columns]. A qkv program counts itself in at its head's arrival counter once its
    columns are stored; an attention program waits until all of its head's have, then runs while fc1's
    weight still streams: the attention leaves the critical path. The programs waited on have lower ids,
    so they were scheduled first and wait on nothing: no deadlock. With several splits, the last split of a
    (sequence, head) to finish (counted at its merge counter) merges them. sync (one_kernel_counters) must
    be zeros; it is left dirty."""
    pid = tl.program_id(0)
    QKV_PROGRAMS: tl.constexpr = N1 // BLOCK_N
    ARRIVALS: tl.constexpr = 3 * D // BLOCK_N  # the qkv programs of one head: its q, k and v columns
    ATTENTION_PROGRAMS = M * H * SPLITS
    attention = pid - QKV_PROGRAMS - FC1_FIRST
    if (attention >= 0) & (attention < ATTENTION_PROGRAMS):
        b = attention // (H * SPLITS)
        h = (attention // SPLITS) % H
        split = attention % SPLITS
        lo, hi, kr, kp, v, valid = _first_kv_block(k_ptr, v_ptr, block_table_ptr, bt_stride, seq_lens_ptr, b, h,
                                                   split, H, H, D, HALF, PAGE, KV_BLOCK, SPLITS)
        after_previous_kernel(PDL)
        arrived = tl.atomic_add(sync_ptr + h * ARRIVAL_STRIDE, 0, sem="acquire")
        while arrived < ARRIVALS:
            arrived = tl.atomic_add(sync_ptr + h * ARRIVAL_STRIDE, 0, sem="acquire")
        m_i, l_i, acc = _attend_new_token(qkv_ptr + b * N1, cos_ptr, sin_ptr, k_ptr, v_ptr, block_table_ptr,
                                          bt_stride, slots_ptr, b, h, split, lo, hi, kr, kp, v, valid, scale, H, H,
                                          D, HALF, PAGE, KV_BLOCK)
        _store_attention(attn_ptr, part_ml_ptr, part_acc_ptr, b * H + h, split, m_i, l_i, acc, D, SPLITS)
        if SPLITS > 1:
            tl.debug_barrier()  # every thread's partial is stored before the count says so
            if tl.atomic_add(sync_ptr + H * ARRIVAL_STRIDE + b * H + h, 1, sem="acq_rel") == SPLITS - 1:
                _combine_splits(part_ml_ptr, part_acc_ptr, attn_ptr, b * H + h, D, SPLITS)
    else:
        # the program's place among the qkv and fc1 column programs (those past the attention's shifted back)
        columns = tl.where(attention < 0, pid, pid - ATTENTION_PROGRAMS)
        # qkv programs go head by head (a head's q, then k, then v columns), so the first heads are complete
        # while the later ones stream: their attention programs find them ready instead of holding an SM
        head = columns // ARRIVALS
        part = columns % ARRIVALS
        per_part: tl.constexpr = D // BLOCK_N
        tile = tl.where(columns < QKV_PROGRAMS, (part // per_part) * H * per_part + head * per_part
                        + part % per_part, columns)
        first, offs_n, w_first = _columns_and_first_tile(tile, w1_ptr, w2_ptr, N1, K, BLOCK_N, BLOCK_K)
        after_previous_kernel(PDL)
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        mean, rstd = row_stats(x_ptr, x_stride, offs_m, m_mask, K, eps, BLOCK_M, STATS_K)
        if first:  # (names differ from the attention branch's: Triton types a name once per function)
            cols = _norm_linear_part(x_ptr, x_stride, mean, rstd, g_ptr, b_ptr, w1_ptr, w_first, bias1_ptr, offs_n,
                                     offs_m, m_mask, K, False, BLOCK_M, BLOCK_N, BLOCK_K, False, "ieee")
            store_columns(qkv_ptr, cols, offs_m, m_mask, offs_n, N1)
            tl.debug_barrier()  # every thread's columns are stored before the count says so
            tl.atomic_add(sync_ptr + head * ARRIVAL_STRIDE, 1, sem="release")
        else:
            cols = _norm_linear_part(x_ptr, x_stride, mean, rstd, g_ptr, b_ptr, w2_ptr, w_first, bias2_ptr, offs_n,
                                     offs_m, m_mask, K, True, BLOCK_M, BLOCK_N, BLOCK_K, False, "ieee")
            store_columns(out2_ptr, cols, offs_m, m_mask, offs_n, N2)


def context_splits(batch: int, n_heads: int, sms: int = 132) -> int:
    """How many programs share one sequence's context: enough (sequence, head) work for every SM when
    the batch is small (flash-decoding); 1 once the batch fills the GPU on its own."""
    splits = 1
    while batch * n_heads * splits < 2 * sms and splits < 16:
        splits *= 2
    return splits


def rotary_paged_attention(qkv, cos, sin, k_cache, v_cache, block_tables, seq_lens, slots, n_heads: int,
                           page_size: int, splits: int | None = None):
    """Decode attention for one new token per sequence.

    qkv [B, (H + 2 Hkv) * D] (unrotated, rows may be strided); cos/sin [B, rope_dim/2] float32;
    caches [rows, Hkv, D]; block_tables [B, P] int32; seq_lens [B] int32 counting the new token, which
    goes to row slots [B] (int32) of the cache -> attention output [B, H * D]. splits: context_splits()."""
    bsz = qkv.shape[0]
    hkv, dim = k_cache.shape[1], k_cache.shape[2]
    half = cos.shape[1]
    assert qkv.stride(1) == 1 and qkv.shape[1] == (n_heads + 2 * hkv) * dim and cos.is_contiguous()
    assert sin.is_contiguous() and dim - 2 * half >= 1 and (dim - 2 * half) & (dim - 2 * half - 1) == 0
    splits = splits or context_splits(bsz, n_heads)
    out, part_ml, part_acc = _attention_buffers(qkv, n_heads, dim, splits)
    _rotary_paged_attention_kernel[(bsz, n_heads, splits)](
        qkv, qkv.stride(0), cos, sin, k_cache, v_cache, block_tables, seq_lens, slots, out, part_ml, part_acc,
        block_tables.stride(0), dim ** -0.5, H=n_heads, HKV=hkv, D=dim, HALF=half, PAGE=page_size,
        BLOCK_N=ATTENTION_KV_BLOCK, SPLITS=splits, num_warps=4, **pdl_launch(qkv.device, bsz))
    if splits > 1:
        _combine_splits_kernel[(bsz * n_heads,)](part_ml, part_acc, out, D=dim, SPLITS=splits, num_warps=1,
                                                 **pdl_launch(qkv.device, bsz))
    return out


def _attention_buffers(qkv, n_heads: int, dim: int, splits: int):
    """The attention output and, with several splits, room for each split's partial softmax."""
    bsz, parts = qkv.shape[0], qkv.shape[0] * n_heads * splits if splits > 1 else 0
    out = torch.empty(bsz, n_heads * dim, device=qkv.device, dtype=qkv.dtype)
    part_ml = torch.empty(max(1, 2 * parts), device=qkv.device, dtype=torch.float32)
    part_acc = torch.empty(max(1, parts * dim), device=qkv.device, dtype=torch.float32)
    return out, part_ml, part_acc


def one_kernel_tiles(m: int, n_sizes: tuple[int, int], k: int, dtype: torch.dtype):
    """norm_linear_attention's tiles (_tiles' tuple): whole weight rows per program, 4 x 2048 for Moondream
    (the whole-step sweep in PERFORMANCE.md)."""
    return _tiles(m, n_sizes, (k,), dtype, gemv_programs=2048)


def norm_linear_attention(x, ln_weight, ln_bias, qkv_weight, qkv_bias, fc1_weight, fc1_bias, cos, sin, k_cache,
                          v_cache, block_tables, seq_lens, slots, page_size: int, sync, splits: int = 1, tiles=None):
    """norm_linear(x, ..., gelu2=True) for qkv and fc1, then rotary_paged_attention(qkv, ...), as one kernel
    in which the attention runs while fc1's weight streams. The GEMV form only (up to GEMV_MAX_ROWS rows)
    and as many kv heads as heads. sync: int32 zeros, one_kernel_counters(heads, rows) of them, left dirty.
    -> (attention output [M, H * D], gelu(fc1) [M, ff])."""
    m, k = x.shape
    n1, n2 = qkv_weight.shape[0], fc1_weight.shape[0]
    n_heads, dim, half = k_cache.shape[1], k_cache.shape[2], cos.shape[1]
    block_m, block_n, block_k, warps, stages, use_dot = tiles or one_kernel_tiles(m, (n1, n2), k, x.dtype)
    assert m <= GEMV_MAX_ROWS and not use_dot and n1 == 3 * n_heads * dim and dim % block_n == 0
    assert x.stride(1) == 1 and qkv_weight.is_contiguous() and fc1_weight.is_contiguous() and cos.is_contiguous()
    assert sin.is_contiguous() and sync.dtype == torch.int32 and sync.numel() >= one_kernel_counters(n_heads, m)
    qkv = torch.empty(m, n1, device=x.device, dtype=x.dtype)
    out2 = torch.empty(m, n2, device=x.device, dtype=x.dtype)
    out, part_ml, part_acc = _attention_buffers(qkv, n_heads, dim, splits)
    grid = (n1 // block_n + m * n_heads * splits + n2 // block_n,)
    _norm_linear_attention_kernel[grid](
        x, x.stride(0), ln_weight, ln_bias, qkv_weight, qkv_bias, qkv, fc1_weight, fc1_bias, out2, m, LN_EPS, cos, sin,
        k_cache, v_cache, block_tables, block_tables.stride(0), seq_lens, slots, out, part_ml, part_acc, sync,
        dim ** -0.5, K=k, N1=n1, N2=n2, H=n_heads, D=dim, HALF=half, PAGE=page_size, KV_BLOCK=ONE_KERNEL_KV_BLOCK,
        SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STATS_K=stats_chunk(k, block_m),
        FC1_FIRST=min(ONE_KERNEL_FC1_FIRST, n2 // block_n), ARRIVAL_STRIDE=ARRIVAL_STRIDE, num_warps=warps,
        num_stages=stages, **pdl_launch(x.device, m))
    return out, out2


FED_BACK = -2  # a token id meaning: the token the previous step chose for this row (embed_rows)


@triton.jit
def _embed_rows_kernel(tokens_ptr, previous_ptr, table_ptr, given_ptr, out_ptr, D: tl.constexpr,
                       BLOCK: tl.constexpr, FED_BACK_ID: tl.constexpr):
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    token = tl.load(tokens_ptr + b)
    if token == FED_BACK_ID:
        token = tl.load(previous_ptr + b)
    if token >= 0:
        row = tl.load(table_ptr + token.to(tl.int64) * D + offs)
    else:
        row = tl.load(given_ptr + b * D + offs)
    tl.store(out_ptr + b * D + offs, row)


def embed_rows(tokens, table, given, previous=None):
    """Input rows of a decode step: row b is the embedding of tokens[b], of previous[b] where tokens[b] is
    FED_BACK (the token the step before chose, still on the GPU), or given[b] where tokens[b] is -1.
    tokens and previous [B] int32, table [V, D] and given [B, D] contiguous -> [B, D]."""
    (b,), d = tokens.shape, table.shape[1]
    block = power_of_two_chunk(d, 1024)
    assert table.is_contiguous() and given.is_contiguous() and given.shape == (b, d) and d % block == 0
    out = torch.empty(b, d, device=table.device, dtype=table.dtype)
    _embed_rows_kernel[(b, d // block)](tokens, tokens if previous is None else previous, table, given, out, D=d,
                                        BLOCK=block, FED_BACK_ID=FED_BACK, num_warps=4)
    return out
