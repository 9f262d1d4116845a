"""Fused Triton kernels for the decode step, where a few tokens meet all the weights (memory bound).

A decode step is one pass over 2.6 GB of weights; what costs beyond that is the number of kernels
and how well each streams its weight. Per layer we run three kernels instead of eight:

- `norm_linear`: layer norm fused into the matmuls that read it (qkv and fc1 share the normed input
  in Moondream's parallel block, so one launch covers both; fc1 gets its GELU as an epilogue);
- `rotary_paged_attention`: rotary embedding, the KV-cache write and paged attention for one new
  token per sequence;
- `linear2_residual`: out-projection and fc2 summed onto the residual with their bias.

They also run under TRITON_INTERPRET=1 on the CPU, which is how the tests check them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LN_EPS = 1e-5  # torch.nn.functional.layer_norm's default, which the reference uses


@triton.jit
def _gelu_tanh(x):
    # 0.5 * (1 + tanh(u)) == sigmoid(2u): the tanh GELU without a tanh intrinsic
    u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x * tl.sigmoid(2.0 * u)


@triton.jit
def _after_previous_kernel(PDL: tl.constexpr):
    """With programmatic dependent launch (Hopper and later) a kernel is started while the one before it
    drains: wait here until that one has finished and its writes are visible, before touching memory,
    and let the next kernel start the same way. Every kernel calls this first, so completion chains."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _mac(acc, a, w, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """acc [BM, BN] + a [BM, BK] @ w [BN, BK].T, a already in w's dtype. Tensor cores for many rows; for a
    few rows a broadcast multiply-sum, which streams the weight with plain wide loads (a GEMV)."""
    if USE_DOT:
        return tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    return acc + tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)


@triton.jit
def _row_stats(x_ptr, x_stride, offs_m, m_mask, K: tl.constexpr, eps, BLOCK_M: tl.constexpr, STATS_K: tl.constexpr):
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
def _normed_matmul(x_ptr, x_stride, mean, rstd, g_ptr, b_ptr, w_ptr, offs_m, m_mask, offs_n, K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                   PRECISION: tl.constexpr):
    """layer_norm(x[offs_m]) @ w[offs_n].T, the norm applied to each K chunk as it streams past."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * x_stride + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        gamma = tl.load(g_ptr + offs_k).to(tl.float32)
        beta = tl.load(b_ptr + offs_k).to(tl.float32)
        xn = (x.to(tl.float32) - mean[:, None]) * rstd[:, None] * gamma[None, :] + beta[None, :]
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :])
        acc = _mac(acc, xn.to(w.dtype), w, USE_DOT, PRECISION)  # rounded like torch's normed activations
    return acc


@triton.jit
def _norm_linear_part(x_ptr, x_stride, mean, rstd, g_ptr, b_ptr, w_ptr, bias_ptr, out_ptr, block, offs_m, m_mask,
                      K: tl.constexpr, N: tl.constexpr, GELU: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Output columns [block * BLOCK_N, +BLOCK_N) of one weight: matmul, bias, optional GELU, store."""
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _normed_matmul(x_ptr, x_stride, mean, rstd, g_ptr, b_ptr, w_ptr, offs_m, m_mask, offs_n, K,
                         BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, PRECISION)
    acc += tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
    if GELU:
        acc = _gelu_tanh(acc)
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


@triton.jit
def _norm_linear_kernel(x_ptr, x_stride, g_ptr, b_ptr, w1_ptr, bias1_ptr, out1_ptr, w2_ptr, bias2_ptr, out2_ptr,
                        M, eps, K: tl.constexpr, N1: tl.constexpr, N2: tl.constexpr,
                        GELU2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        STATS_K: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
                        PDL: tl.constexpr):
    """Programs [0, N1 / BLOCK_N) fill out1 from w1, the rest out2 from w2; all share the normed x."""
    _after_previous_kernel(PDL)
    pid_n = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    mean, rstd = _row_stats(x_ptr, x_stride, offs_m, m_mask, K, eps, BLOCK_M, STATS_K)
    if pid_n < N1 // BLOCK_N:
        _norm_linear_part(x_ptr, x_stride, mean, rstd, g_ptr, b_ptr, w1_ptr, bias1_ptr, out1_ptr, pid_n, offs_m,
                          m_mask, K, N1, False, BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, PRECISION)
    else:
        _norm_linear_part(x_ptr, x_stride, mean, rstd, g_ptr, b_ptr, w2_ptr, bias2_ptr, out2_ptr,
                          pid_n - N1 // BLOCK_N, offs_m, m_mask, K, N2, GELU2, BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT,
                          PRECISION)


@triton.jit
def _matmul_into(acc, a_ptr, a_stride, w_ptr, offs_m, m_mask, offs_n, K: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a[offs_m] @ w[offs_n].T over all K, a with row stride a_stride, w [N, K] contiguous."""
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + offs_m[:, None] * a_stride + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        acc = _mac(acc, a, tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :]), USE_DOT, PRECISION)
    return acc


@triton.jit
def _linear2_residual_kernel(a_ptr, a_stride, w1_ptr, c_ptr, c_stride, w2_ptr, res_ptr, res_stride, bias_ptr, out_ptr,
                             M, K1: tl.constexpr, K2: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                             PRECISION: tl.constexpr, PDL: tl.constexpr):
    _after_previous_kernel(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc = _matmul_into(acc, a_ptr, a_stride, w1_ptr, offs_m, m_mask, offs_n, K1, BLOCK_K, USE_DOT, PRECISION)
    acc = _matmul_into(acc, c_ptr, c_stride, w2_ptr, offs_m, m_mask, offs_n, K2, BLOCK_K, USE_DOT, PRECISION)
    res = tl.load(res_ptr + offs_m[:, None] * res_stride + offs_n[None, :], mask=m_mask[:, None], other=0.0)
    acc += res.to(tl.float32) + tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


GEMV_MAX_ROWS = 2  # up to here, streaming the weight through plain loads beats tensor cores (tune_decode_kernels.py)


PDL_ENABLED = True  # programmatic dependent launch where the GPU has it (benchmarks compare without)


def _pdl(device: torch.device, rows: int) -> dict:
    """Launch arguments: PDL for the kernel's constexpr, launch_pdl for Triton's launcher. Only for the
    GEMV form, where every kernel of the step is ours: among cuBLAS's kernels it measured no faster."""
    on = PDL_ENABLED and rows <= GEMV_MAX_ROWS and _has_pdl(device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


@functools.lru_cache
def _has_pdl(device: torch.device) -> bool:
    """Hopper or later, and a Triton that knows PDL (it came after 3.0)."""
    has_gdc = hasattr(getattr(tl.extra, "cuda", None), "gdc_wait")
    return has_gdc and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.lru_cache
def _small_shared_memory(device: torch.device) -> bool:
    """About 100 KB of shared memory per block (L4, A10, consumer cards) instead of the H100's 227 KB."""
    if device.type != "cuda":
        return False
    props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
    return props["max_shared_mem"] < 200 * 1024


def _tiles(m: int, n_sizes: tuple[int, ...], k_sizes: tuple[int, ...], dtype: torch.dtype,
           small_shared_memory: bool = False):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, use_dot) for M rows, from the H100 tile sweep;
    shallower tensor-core pipelines where shared memory is small."""
    if m <= GEMV_MAX_ROWS:  # narrow N tiles: about a thousand programs or more, so every SM streams weight
        block_n = next(b for b in (8, 4, 2, 1) if sum(n_sizes) // b >= 1024 and all(n % b == 0 for n in n_sizes)) \
            if sum(n_sizes) >= 1024 else 1
        block_k = next(b for b in (2048 // m, 256, 64, 16) if all(k % b == 0 for k in k_sizes))
        return m, block_n, block_k, 4, 2, False
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 16 if m <= 64 else 32
    shallow = dtype == torch.float32 or small_shared_memory  # float32 (parity runs) must fit in shared memory
    widest_k = 64 if dtype == torch.float32 else (128 if small_shared_memory else 256)
    block_k = next(b for b in (256, 128, 64, 32, 16) if b <= widest_k and all(k % b == 0 for k in k_sizes))
    return block_m, block_n, block_k, 4, (2 if shallow else 4), True


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 stays exact (parity); bf16 ignores it


def norm_linear(x, ln_weight, ln_bias, w1, bias1, w2=None, bias2=None, gelu2: bool = False, out1=None, tiles=None):
    """layer_norm(x) @ w1.T + bias1 and, from the same normed x, [gelu](... @ w2.T + bias2).

    x [M, K] with unit column stride; weights [N, K] contiguous -> out1 [M, N1] (x's dtype unless a
    contiguous out1 of any dtype is given) and out2 [M, N2] or None. tiles: _tiles()'s tuple, to tune."""
    m, k = x.shape
    n1, n2 = w1.shape[0], (w2.shape[0] if w2 is not None else 0)
    assert x.stride(1) == 1 and w1.is_contiguous() and (w2 is None or w2.is_contiguous())
    block_m, block_n, block_k, warps, stages, use_dot = tiles or _tiles(m, (n1, n2 or n1), (k,), x.dtype,
                                                                        _small_shared_memory(x.device))
    if out1 is None:
        out1 = torch.empty(m, n1, device=x.device, dtype=x.dtype)
    assert out1.shape == (m, n1) and out1.is_contiguous()
    out2 = torch.empty(m, n2, device=x.device, dtype=x.dtype) if n2 else out1
    grid = ((n1 + n2) // block_n, triton.cdiv(m, block_m))
    stats_k = min(k, max(16, 4096 // block_m))  # row chunk for the norm's statistics: bounded registers
    _norm_linear_kernel[grid](x, x.stride(0), ln_weight, ln_bias, w1, bias1, out1, w2 if n2 else w1,
                              bias2 if n2 else bias1, out2, m, LN_EPS, K=k, N1=n1, N2=n2, GELU2=gelu2,
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, STATS_K=stats_k, USE_DOT=use_dot,
                              PRECISION=_precision(x), num_warps=warps, num_stages=stages, **_pdl(x.device, m))
    return out1, (out2 if n2 else None)


def linear2_residual(a, w1, c, w2, residual, bias, tiles=None):
    """residual + a @ w1.T + c @ w2.T + bias in one pass (rows of a, c, residual may be strided)."""
    m, n = residual.shape
    assert a.stride(1) == c.stride(1) == residual.stride(1) == 1 and w1.is_contiguous() and w2.is_contiguous()
    block_m, block_n, block_k, warps, stages, use_dot = tiles or _tiles(m, (n,), (a.shape[1], c.shape[1]), a.dtype,
                                                                        _small_shared_memory(a.device))
    out = torch.empty(m, n, device=residual.device, dtype=residual.dtype)
    grid = (n // block_n, triton.cdiv(m, block_m))
    _linear2_residual_kernel[grid](a, a.stride(0), w1, c, c.stride(0), w2, residual, residual.stride(0), bias, out, m,
                                   K1=a.shape[1], K2=c.shape[1], N=n, BLOCK_M=block_m, BLOCK_N=block_n,
                                   BLOCK_K=block_k, USE_DOT=use_dot, PRECISION=_precision(a), num_warps=warps,
                                   num_stages=stages, **_pdl(a.device, m))
    return out


@triton.jit
def _rotated(head_ptr, c, s, HALF: tl.constexpr):
    """A head's first 2*HALF dims rotated, float32: the input halves are the real and imaginary parts,
    the output interleaves them (the reference's layout)."""
    i = tl.arange(0, HALF)
    re = tl.load(head_ptr + i).to(tl.float32)
    im = tl.load(head_ptr + HALF + i).to(tl.float32)
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
def _rotary_paged_attention_kernel(qkv_ptr, qkv_stride, cos_ptr, sin_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr,
                                   slots_ptr, out_ptr, part_ml_ptr, part_acc_ptr, bt_stride, scale, H: tl.constexpr,
                                   HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
                                   BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    """One program per (sequence, head, split of the context). The head's first ROT = 2*HALF dims are
    rotated (input halves are real and imaginary parts, the rotated output interleaves them, as in the
    reference); the rest pass. Online softmax over this split's share of the cached pages; split 0 also
    takes the new token's own k/v, and its first head of each kv group stores them (rotated) into the
    cache. With one split the result is final; with several, each writes its partial (max, sum, acc).
    The first block of cached keys and values is loaded before waiting for the previous kernel: no
    kernel of this step writes them, so under PDL their latency hides behind that kernel's tail."""
    ROT: tl.constexpr = 2 * HALF
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    kvh = h // (H // HKV)
    offs_rot = tl.arange(0, ROT)
    offs_pass = ROT + tl.arange(0, D - ROT)
    offs_d = tl.arange(0, D)
    cached = tl.load(seq_lens_ptr + b) - 1  # step inputs come from the host copy before the graph
    chunk = tl.cdiv(tl.cdiv(cached, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(cached, lo + chunk)
    kr, kp, v, valid = _kv_block(k_ptr, v_ptr, block_table_ptr, bt_stride, b, kvh, lo, hi, offs_rot, offs_pass,
                                 offs_d, HKV, D, PAGE, BLOCK_N)
    _after_previous_kernel(PDL)

    row = qkv_ptr + b * qkv_stride
    i = tl.arange(0, HALF)
    c = tl.load(cos_ptr + b * HALF + i)
    s = tl.load(sin_ptr + b * HALF + i)
    q_rot = _rotated(row + h * D, c, s, HALF) * scale
    q_pass = tl.load(row + h * D + offs_pass).to(tl.float32) * scale
    if split == 0:
        k_row = row + (H + kvh) * D
        k_rot = _rotated(k_row, c, s, HALF).to(k_ptr.dtype.element_ty)
        k_pass = tl.load(k_row + offs_pass)
        v_new = tl.load(row + (H + HKV + kvh) * D + offs_d)
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
    if SPLITS == 1:
        tl.store(out_ptr + (b * H + h) * D + offs_d, (acc / l_i).to(out_ptr.dtype.element_ty))
    else:
        part = (b * H + h) * SPLITS + split
        tl.store(part_ml_ptr + 2 * part, m_i)
        tl.store(part_ml_ptr + 2 * part + 1, l_i)
        tl.store(part_acc_ptr + part * D + offs_d, acc)


@triton.jit
def _combine_splits_kernel(part_ml_ptr, part_acc_ptr, out_ptr, D: tl.constexpr, SPLITS: tl.constexpr,
                           PDL: tl.constexpr):
    """Merge the splits' partial softmaxes of one (sequence, head): rescale each to the common max."""
    _after_previous_kernel(PDL)
    part = tl.program_id(0) * SPLITS + tl.arange(0, SPLITS)
    m = tl.load(part_ml_ptr + 2 * part)
    l = tl.load(part_ml_ptr + 2 * part + 1)
    weight = tl.exp(m - tl.max(m, 0))  # split 0 holds the new token, so the max is finite
    acc = tl.load(part_acc_ptr + part[:, None] * D + tl.arange(0, D)[None, :])
    out = tl.sum(weight[:, None] * acc, 0) / tl.sum(weight * l, 0)
    tl.store(out_ptr + tl.program_id(0) * D + tl.arange(0, D), out.to(out_ptr.dtype.element_ty))


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
    out = torch.empty(bsz, n_heads * dim, device=qkv.device, dtype=qkv.dtype)
    part_ml = torch.empty(bsz * n_heads * splits * 2 if splits > 1 else 1, device=qkv.device, dtype=torch.float32)
    part_acc = torch.empty(bsz * n_heads * splits * dim if splits > 1 else 1, device=qkv.device, dtype=torch.float32)
    _rotary_paged_attention_kernel[(bsz, n_heads, splits)](
        qkv, qkv.stride(0), cos, sin, k_cache, v_cache, block_tables, seq_lens, slots, out, part_ml, part_acc,
        block_tables.stride(0), dim ** -0.5, H=n_heads, HKV=hkv, D=dim, HALF=half, PAGE=page_size, BLOCK_N=64,
        SPLITS=splits, num_warps=4, **_pdl(qkv.device, bsz))
    if splits > 1:
        _combine_splits_kernel[(bsz * n_heads,)](part_ml, part_acc, out, D=dim, SPLITS=splits, num_warps=1,
                                                 **_pdl(qkv.device, bsz))
    return out
