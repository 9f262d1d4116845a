"""What several kernel files share: the Triton helpers their kernels call (the tanh GELU, the programmatic
dependent launch wait, a multiply-accumulate as a GEMV or on tensor cores, a norm's row statistics, a normed input
chunk, a column store, rows to FP8) and the host's choices they make alike (a dot's precision, the chunk a width
tiles into, whether the GPU has the small shared memory)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LN_EPS = 1e-5  # torch.nn.functional.layer_norm's default, which the reference uses


@triton.jit
def gelu_tanh(x):
    # 0.5 * (1 + tanh(u)) == sigmoid(2u): the tanh GELU without a tanh intrinsic
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x * tl.sigmoid(2.0 * u)


@triton.jit
def after_previous_kernel(PDL: tl.constexpr):
    """With programmatic dependent launch (Hopper and later) a kernel is started while the one before it
    drains: wait here until that one has finished and its writes are visible, before touching memory,
    and let the next kernel start the same way. Every kernel calls this first, so completion chains."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def mac(acc, a, w, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """acc [BM, BN] + a [BM, BK] @ w [BN, BK].T, a already in w's dtype. Tensor cores for many rows; for a
    few rows a broadcast multiply-sum, which streams the weight with plain wide loads (a GEMV)."""
    if USE_DOT:
        return tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    return acc + tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)


@triton.jit
def row_stats(x_ptr, x_stride, offs_m, m_mask, K: tl.constexpr, eps, BLOCK_M: tl.constexpr, STATS_K: tl.constexpr):
    """Mean and 1/std of BLOCK_M rows (two passes, like torch: the rows are tiny and cached)."""
    total = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, STATS_K):
        offs_k = k0 + tl.arange(0, STATS_K)
        total += tl.sum(tl.load(x_ptr + offs_m[:, None] * x_stride + offs_k[None, :], mask=m_mask[:, None],
                                other=0.0).to(tl.float32), 1)
    mean = total / K
    sq = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, STATS_K):
        offs_k = k0 + tl.arange(0, STATS_K)
        x = tl.load(x_ptr + offs_m[:, None] * x_stride + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        d = tl.where(m_mask[:, None], x.to(tl.float32) - mean[:, None], 0.0)
        sq += tl.sum(d * d, 1)
    return mean, 1.0 / tl.sqrt(sq / K + eps)


@triton.jit
def input_chunk(x_ptr, x_stride, offs_m, m_mask, k0, BLOCK_K: tl.constexpr, mean, rstd, g_ptr, b_ptr,
                 dtype: tl.constexpr):
    """x[offs_m, k0:k0 + BLOCK_K], layer-normed if given the rows' statistics (mean, rstd) and the norm's
    weight and bias (else mean is None): then rounded to dtype, like torch's normed activations."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + offs_m[:, None] * x_stride + offs_k[None, :], mask=m_mask[:, None], other=0.0)
    if mean is not None:
        gamma = tl.load(g_ptr + offs_k).to(tl.float32)
        beta = tl.load(b_ptr + offs_k).to(tl.float32)
        x = ((x.to(tl.float32) - mean[:, None]) * rstd[:, None] * gamma[None, :] + beta[None, :]).to(dtype)
    return x


@triton.jit
def store_columns(out_ptr, acc, offs_m, m_mask, offs_n, N: tl.constexpr):
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


@functools.lru_cache
def small_shared_memory(device: torch.device) -> bool:
    """About 100 KB of shared memory per block (L4, A10, consumer cards) instead of the H100's 227 KB."""
    if device.type != "cuda":
        return False
    props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
    return props["max_shared_mem"] < 200 * 1024


def dot_precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 stays exact (parity); bf16 ignores it


def power_of_two_chunk(n: int, most: int) -> int:
    """The largest power of two that divides n and is at most `most`: a chunk tl.arange can take (powers of two
    only) that tiles a width of any size (192, 1152) exactly."""
    chunk = n & -n
    while chunk > most:
        chunk //= 2
    return chunk


def stats_chunk(k: int, block_m: int) -> int:
    """Row chunk for the norm's statistics: bounded registers."""
    return power_of_two_chunk(k, max(16, 4096 // block_m))


@triton.jit
def fp8_rows(x):
    """Rows of x [R, C] (float32) as FP8 (e4m3) values and a float32 scale a row: the row's largest
    magnitude over 448, e4m3's largest value."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
    return (x / scale[:, None]).to(tl.float8e4nv), scale
