"""The decode step's matmuls for 4-bit weights (kernels/packed.py's PackedWeight), reading the packed bytes: W4A16.

The two kernels of a layer that hold its weights have 4-bit twins: `w4_norm_linear` (layer norm, qkv and fc1 with
its GELU, on the shared normed input) and `w4_linear2_residual` (proj and fc2 onto the residual). Each program
streams its columns' bytes, scales and zero points, unpacks and dequantizes them in registers with the reference's
bf16 roundings, and multiplies in the input's dtype: as a broadcast multiply-sum for one or two rows (a GEMV), on
tensor cores for more. A GEMV in bf16 or fp16 instead sums x times the 4-bit values group by group and applies
each group's scale and zero point to those sums (`_w4_gemv`): a few instructions a value, where the roundings
take about ten and bound the kernel by its arithmetic, not its bytes. `dequantize_packed` writes a whole bf16
weight (prefill and the other eager paths, one layer's weights at a time).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .packed import PackedWeight
from .decode_kernels import GEMV_MAX_ROWS, pdl_launch
from .shared import LN_EPS, after_previous_kernel, dot_precision, gelu_tanh, input_chunk, mac, row_stats, stats_chunk, store_columns


# Triton's interpreter (the CPU tests) truncates float32 to bf16 where the GPU rounds to nearest even, as torch
# does: there the rounding is done on the bits, so that the tests see the GPU's values.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _bf16(x, INTERPRETED: tl.constexpr = INTERPRETED):
    """float32 -> bfloat16, rounded to nearest even."""
    if INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _packed_load(p_ptr, s_ptr, z_ptr, offs_n, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                 WHOLE: tl.constexpr):
    """The bytes, scales and zero points of W[offs_n, k0:k0 + BLOCK_K]. WHOLE: the tile holds whole groups
    (BLOCK_K and K multiples of GROUP), one scale and zero each; else one per value (groups may span rows)."""
    b = tl.load(p_ptr + offs_n[:, None] * (K // 2) + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :])
    if WHOLE:
        groups = offs_n[:, None] * (K // GROUP) + (k0 // GROUP + tl.arange(0, BLOCK_K // GROUP))[None, :]
    else:
        groups = (offs_n[:, None] * K + (k0 + tl.arange(0, BLOCK_K))[None, :]) // GROUP
    return b, tl.load(s_ptr + groups), tl.load(z_ptr + groups)


@triton.jit
def _dequantized(b, s, z, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, WHOLE: tl.constexpr):
    """_packed_load's tile as bf16, dequantized as the reference does: bf16(bf16(q - zero) * scale)."""
    q = tl.interleave(b & 0xF, b >> 4).to(tl.float32)  # [BLOCK_N, BLOCK_K]: k even from the low nibble
    s, z = s.to(tl.float32), z.to(tl.float32)
    if WHOLE:
        q3 = tl.reshape(q, [b.shape[0], BLOCK_K // GROUP, GROUP])
        w = tl.reshape(_bf16(_bf16(q3 - z[:, :, None]).to(tl.float32) * s[:, :, None]), [b.shape[0], BLOCK_K])
    else:
        w = _bf16(_bf16(q - z).to(tl.float32) * s)
    return w


@triton.jit
def _w4_matmul(acc, x_ptr, x_stride, mean, rstd, g_ptr, b_ptr, p_ptr, s_ptr, z_ptr, offs_m, m_mask, offs_n,
               K: tl.constexpr, GROUP: tl.constexpr, WHOLE: tl.constexpr, BLOCK_K: tl.constexpr,
               USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """acc + x[offs_m] @ W[offs_n].T over all K (x layer-normed chunk by chunk if given the norm). Each chunk's
    bytes are loaded before the chunk ahead of it is dequantized and used: two in flight."""
    dtype = x_ptr.dtype.element_ty
    b, s, z = _packed_load(p_ptr, s_ptr, z_ptr, offs_n, 0, K, BLOCK_K, GROUP, WHOLE)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        b_next, s_next, z_next = _packed_load(p_ptr, s_ptr, z_ptr, offs_n, k0, K, BLOCK_K, GROUP, WHOLE)
        x = input_chunk(x_ptr, x_stride, offs_m, m_mask, k0 - BLOCK_K, BLOCK_K, mean, rstd, g_ptr, b_ptr, dtype)
        acc = mac(acc, x, _dequantized(b, s, z, BLOCK_K, GROUP, WHOLE).to(dtype), USE_DOT, PRECISION)
        b, s, z = b_next, s_next, z_next
    x = input_chunk(x_ptr, x_stride, offs_m, m_mask, K - BLOCK_K, BLOCK_K, mean, rstd, g_ptr, b_ptr, dtype)
    return mac(acc, x, _dequantized(b, s, z, BLOCK_K, GROUP, WHOLE).to(dtype), USE_DOT, PRECISION)


@triton.jit
def _nibble_subnormal(words, p: tl.constexpr):
    """Nibble p (bits 4p to 4p + 3, p <= 4) of each int32 word left where it is and read as a float32: the
    subnormal q 16^p 2^-149, exact (one AND: no shift, no integer-to-float conversion)."""
    return (words & (0xF << (4 * p))).to(tl.float32, bitcast=True)


@triton.jit
def _split8(x, WORDS: tl.constexpr):
    """x [8 WORDS] -> x[8j + i] for i = 0..7, each [WORDS] (the values of nibble i of words j)."""
    even, odd = tl.split(tl.reshape(x, [WORDS, 2, 2, 2]))
    e0, e2 = tl.split(even)
    o1, o3 = tl.split(odd)
    x0, x4 = tl.split(e0)
    x2, x6 = tl.split(e2)
    x1, x5 = tl.split(o1)
    x3, x7 = tl.split(o3)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _word_sums(words, x, a, b, WORDS: tl.constexpr):
    """[BN, WORDS]: a sum_i x q 2^-49 - b sum_i x over each word's eight values (x: the chunk, float32).

    x scaled by 2^100 / 16^p times the subnormal q 16^p 2^-149 is x q 2^-49, a normal float32 made exactly by one
    FMA (the GPU's FMA takes subnormals at full speed; Triton does not flush them): one AND and one FMA a value.
    Nibbles 5 to 7 would reach the exponent's bits, so they are moved down 12 bits first, one shift for the three.
    (x times 2^100 stays finite for |x| below 2^28, far past any activation's size.)"""
    x0, x1, x2, x3, x4, x5, x6, x7 = _split8(x, WORDS)
    high = words >> 12
    xq = (x0 * 1.2676506002282294e30)[None, :] * _nibble_subnormal(words, 0)  # 2^100
    xq += (x1 * 7.922816251426434e28)[None, :] * _nibble_subnormal(words, 1)  # 2^96
    xq += (x2 * 4.951760157141521e27)[None, :] * _nibble_subnormal(words, 2)  # 2^92
    xq += (x3 * 3.094850098213451e26)[None, :] * _nibble_subnormal(words, 3)  # 2^88
    xq += (x4 * 1.9342813113834067e25)[None, :] * _nibble_subnormal(words, 4)  # 2^84
    xq += (x5 * 4.951760157141521e27)[None, :] * _nibble_subnormal(high, 2)
    xq += (x6 * 3.094850098213451e26)[None, :] * _nibble_subnormal(high, 3)
    xq += (x7 * 1.9342813113834067e25)[None, :] * _nibble_subnormal(high, 4)
    return a * xq - b * (((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)))[None, :]


@triton.jit
def _row_chunk(x_ptr, x_stride, offs_m, m_mask, r: tl.constexpr, k0, BLOCK_K: tl.constexpr, mean, rstd, g_ptr, b_ptr,
               dtype: tl.constexpr):
    """Row r of the tile's rows, columns [k0, k0 + BLOCK_K), layer-normed if given the statistics, as float32."""
    pick = tl.arange(0, offs_m.shape[0]) == r
    row, valid = tl.sum(tl.where(pick, offs_m, 0)), tl.sum(tl.where(pick & m_mask, 1, 0))
    offs_k = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + row * x_stride + offs_k, mask=tl.full([BLOCK_K], 0, tl.int32) + valid > 0, other=0.0)
    if mean is not None:
        gamma = tl.load(g_ptr + offs_k).to(tl.float32)
        beta = tl.load(b_ptr + offs_k).to(tl.float32)
        mu, rs = tl.sum(tl.where(pick, mean, 0.0)), tl.sum(tl.where(pick, rstd, 0.0))
        x = ((x.to(tl.float32) - mu) * rs * gamma + beta).to(dtype)
    return x.to(tl.float32)


@triton.jit
def _w4_gemv(acc, x_ptr, x_stride, mean, rstd, g_ptr, b_ptr, p_ptr, s_ptr, z_ptr, offs_m, m_mask, offs_n,
             K: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + x[offs_m] @ W[offs_n].T for one or two rows of half-precision x, reading W's 4-bit values as int32
    words (p_ptr: the bytes viewed as int32 [N, K / 8]; word j's nibble i is k = 8j + i).

    Factored by group instead of dequantizing each value: sum_k x_k (q_k - z) s = s (sum_k x_k q_k - z sum_k x_k),
    the products x q made from the bits (_word_sums): two instructions a value, against the bf16 roundings' ten
    (the reference's weight is bf16(bf16(q - z) s);
    here it is (q - z) s unrounded, within bf16's rounding of it: the float32 path keeps the exact roundings).
    Sums are kept a word at a time and added up at the end; whole groups a chunk (BLOCK_K % GROUP == 0); each
    chunk's words are loaded before the chunk ahead of them is used: two in flight."""
    WORDS: tl.constexpr = BLOCK_K // 8
    G: tl.constexpr = BLOCK_K // GROUP
    BN: tl.constexpr = offs_n.shape[0]
    dtype = x_ptr.dtype.element_ty
    offs_w = tl.arange(0, WORDS)
    row_words = p_ptr + offs_n[:, None] * (K // 8)
    groups = offs_n[:, None] * (K // GROUP) + tl.arange(0, G)[None, :]
    sums0 = tl.zeros([BN, WORDS], tl.float32)
    sums1 = tl.zeros([BN, WORDS], tl.float32)
    words = tl.load(row_words + offs_w[None, :])
    for k0 in range(0, K, BLOCK_K):
        if k0 + BLOCK_K < K:
            words_next = tl.load(row_words + ((k0 + BLOCK_K) // 8 + offs_w)[None, :])
        else:
            words_next = words
        s = tl.load(s_ptr + groups + k0 // GROUP).to(tl.float32)
        z = tl.load(z_ptr + groups + k0 // GROUP).to(tl.float32)
        a = tl.reshape(tl.broadcast_to((s * 562949953421312.0)[:, :, None], [BN, G, GROUP // 8]), [BN, WORDS])  # 2^49
        b = tl.reshape(tl.broadcast_to((s * z)[:, :, None], [BN, G, GROUP // 8]), [BN, WORDS])
        x = _row_chunk(x_ptr, x_stride, offs_m, m_mask, 0, k0, BLOCK_K, mean, rstd, g_ptr, b_ptr, dtype)
        sums0 += _word_sums(words, x, a, b, WORDS)
        if offs_m.shape[0] > 1:
            x = _row_chunk(x_ptr, x_stride, offs_m, m_mask, 1, k0, BLOCK_K, mean, rstd, g_ptr, b_ptr, dtype)
            sums1 += _word_sums(words, x, a, b, WORDS)
        words = words_next
    first = (tl.arange(0, offs_m.shape[0]) == 0)[:, None]
    return acc + tl.where(first, tl.sum(sums0, 1)[None, :], tl.sum(sums1, 1)[None, :])


@triton.jit
def _w4_product(acc, x_ptr, x_stride, mean, rstd, g_ptr, b_ptr, p_ptr, s_ptr, z_ptr, offs_m, m_mask, offs_n,
                K: tl.constexpr, GROUP: tl.constexpr, WHOLE: tl.constexpr, BLOCK_K: tl.constexpr,
                USE_DOT: tl.constexpr, PRECISION: tl.constexpr, FACTORED: tl.constexpr):
    if FACTORED:
        return _w4_gemv(acc, x_ptr, x_stride, mean, rstd, g_ptr, b_ptr, p_ptr, s_ptr, z_ptr, offs_m, m_mask, offs_n,
                        K, GROUP, BLOCK_K)
    return _w4_matmul(acc, x_ptr, x_stride, mean, rstd, g_ptr, b_ptr, p_ptr, s_ptr, z_ptr, offs_m, m_mask, offs_n,
                      K, GROUP, WHOLE, BLOCK_K, USE_DOT, PRECISION)


@triton.jit
def _w4_norm_linear_kernel(x_ptr, x_stride, g_ptr, b_ptr, p1_ptr, s1_ptr, z1_ptr, bias1_ptr, out1_ptr,
                           p2_ptr, s2_ptr, z2_ptr, bias2_ptr, out2_ptr, M, eps, K: tl.constexpr, N1: tl.constexpr,
                           N2: tl.constexpr, GROUP: tl.constexpr, WHOLE: tl.constexpr, GELU2: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STATS_K: tl.constexpr,
                           USE_DOT: tl.constexpr, PRECISION: tl.constexpr, FACTORED: tl.constexpr,
                           PDL: tl.constexpr):
    """Programs [0, N1 / BLOCK_N) fill out1 from W1, the rest out2 from W2 (GELU if GELU2); one normed x."""
    pid = tl.program_id(0)
    first = pid < N1 // BLOCK_N
    offs_n = tl.where(first, pid, pid - N1 // BLOCK_N) * BLOCK_N + tl.arange(0, BLOCK_N)
    after_previous_kernel(PDL)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    mean, rstd = row_stats(x_ptr, x_stride, offs_m, m_mask, K, eps, BLOCK_M, STATS_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if first:
        acc = _w4_product(acc, x_ptr, x_stride, mean, rstd, g_ptr, b_ptr, p1_ptr, s1_ptr, z1_ptr, offs_m, m_mask,
                          offs_n, K, GROUP, WHOLE, BLOCK_K, USE_DOT, PRECISION, FACTORED)
        acc += tl.load(bias1_ptr + offs_n).to(tl.float32)[None, :]
        store_columns(out1_ptr, acc, offs_m, m_mask, offs_n, N1)
    else:
        acc = _w4_product(acc, x_ptr, x_stride, mean, rstd, g_ptr, b_ptr, p2_ptr, s2_ptr, z2_ptr, offs_m, m_mask,
                          offs_n, K, GROUP, WHOLE, BLOCK_K, USE_DOT, PRECISION, FACTORED)
        acc += tl.load(bias2_ptr + offs_n).to(tl.float32)[None, :]
        if GELU2:
            acc = gelu_tanh(acc)
        store_columns(out2_ptr, acc, offs_m, m_mask, offs_n, N2)


@triton.jit
def _w4_linear2_residual_kernel(a_ptr, a_stride, p1_ptr, s1_ptr, z1_ptr, c_ptr, c_stride, p2_ptr, s2_ptr, z2_ptr,
                                res_ptr, res_stride, bias_ptr, out_ptr, M, K1: tl.constexpr, K2: tl.constexpr,
                                N: tl.constexpr, GROUP: tl.constexpr, WHOLE: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr,
                                PRECISION: tl.constexpr, FACTORED: tl.constexpr, PDL: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    after_previous_kernel(PDL)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc = _w4_product(acc, a_ptr, a_stride, None, None, None, None, p1_ptr, s1_ptr, z1_ptr, offs_m, m_mask, offs_n,
                      K1, GROUP, WHOLE, BLOCK_K, USE_DOT, PRECISION, FACTORED)
    acc = _w4_product(acc, c_ptr, c_stride, None, None, None, None, p2_ptr, s2_ptr, z2_ptr, offs_m, m_mask, offs_n,
                      K2, GROUP, WHOLE, BLOCK_K, USE_DOT, PRECISION, FACTORED)
    res = tl.load(res_ptr + offs_m[:, None] * res_stride + offs_n[None, :], mask=m_mask[:, None], other=0.0)
    acc += res.to(tl.float32) + tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
    store_columns(out_ptr, acc, offs_m, m_mask, offs_n, N)


@triton.jit
def _dequantize_kernel(p_ptr, s_ptr, z_ptr, out_ptr, K: tl.constexpr, GROUP: tl.constexpr, WHOLE: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = _dequantized(*_packed_load(p_ptr, s_ptr, z_ptr, offs_n, k0, K, BLOCK_K, GROUP, WHOLE), BLOCK_K, GROUP, WHOLE)
    tl.store(out_ptr + offs_n[:, None] * K + (k0 + tl.arange(0, BLOCK_K))[None, :], w.to(out_ptr.dtype.element_ty))


def _whole_groups(block_k: int, group: int, *ks: int) -> bool:
    return block_k % group == 0 and all(k % group == 0 for k in ks)


GROUP_SUMS = True  # the half-precision GEMV by group sums (_w4_gemv); benchmarks compare the roundings


def _factored(use_dot: bool, dtype: torch.dtype, block_k: int, group: int, *ks: int) -> bool:
    """The GEMV by group sums (_w4_gemv) for one or two half-precision rows, whole groups a chunk."""
    return (GROUP_SUMS and not use_dot and dtype in (torch.bfloat16, torch.float16) and group % 8 == 0
            and _whole_groups(block_k, group, *ks))


def _weight_bytes(w: PackedWeight, factored: bool) -> torch.Tensor:
    return w.data.view(torch.int32) if factored else w.data


def w4_tiles(m: int, n: int, k: int, dtype: torch.dtype, wide: bool) -> tuple[int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, use_dot) for M rows over weights of n columns in all,
    depth k, from the H100 sweep (benchmarks/experiments/tune_w4a16.py); wide: norm_linear's many columns (qkv and fc1)."""
    if m <= GEMV_MAX_ROWS and GROUP_SUMS and dtype != torch.float32:  # (_w4_gemv)
        if wide and n % 32 == 0:
            return m, 32, min(k, 512 if m == 1 else 256), 2, 1, False
        return m, next(b for b in (8, 4, 2, 1) if n % b == 0), min(k, 2048), 2 if m == 1 else 4, 1, False
    if m <= GEMV_MAX_ROWS:
        block_n = next((b for b in ((8, 4, 2) if wide else (4, 2)) if n % b == 0), 1)
        return m, block_n, min(k, 2048), 4, 1, False
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_k = min(k, 64 if dtype == torch.float32 else 128)
    return (block_m, 64, block_k, 4, 2, True) if wide else (block_m, 32, block_k, 4, 3, True)


def w4_norm_linear(x: torch.Tensor, ln_weight, ln_bias, w1: PackedWeight, bias1, w2: PackedWeight, bias2,
                   gelu2: bool = True, tiles=None) -> tuple[torch.Tensor, torch.Tensor]:
    """layer_norm(x) @ W1.T + bias1 and [gelu](layer_norm(x) @ W2.T + bias2), the weights 4-bit."""
    m, k = x.shape
    (n1, k1), (n2, k2) = w1.shape, w2.shape
    assert x.stride(1) == 1 and k1 == k2 == k and w1.group == w2.group
    block_m, block_n, block_k, warps, stages, use_dot = tiles or w4_tiles(m, n1 + n2, k, x.dtype, wide=True)
    assert n1 % block_n == 0 and n2 % block_n == 0 and k % block_k == 0
    out1 = torch.empty(m, n1, device=x.device, dtype=x.dtype)
    out2 = torch.empty(m, n2, device=x.device, dtype=x.dtype)
    grid = ((n1 + n2) // block_n, triton.cdiv(m, block_m))
    factored = _factored(use_dot, x.dtype, block_k, w1.group, k)
    _w4_norm_linear_kernel[grid](x, x.stride(0), ln_weight, ln_bias, _weight_bytes(w1, factored), w1.scale, w1.zero,
                                 bias1, out1, _weight_bytes(w2, factored), w2.scale, w2.zero, bias2, out2, m, LN_EPS,
                                 K=k, N1=n1, N2=n2, GROUP=w1.group, WHOLE=_whole_groups(block_k, w1.group, k),
                                 GELU2=gelu2, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                 STATS_K=stats_chunk(k, block_m), USE_DOT=use_dot, PRECISION=dot_precision(x),
                                 FACTORED=factored, num_warps=warps, num_stages=stages, **pdl_launch(x.device, m))
    return out1, out2


def w4_linear2_residual(a: torch.Tensor, w1: PackedWeight, c: torch.Tensor, w2: PackedWeight,
                        residual: torch.Tensor, bias, out: torch.Tensor | None = None, tiles=None) -> torch.Tensor:
    """residual + a @ W1.T + c @ W2.T + bias, the weights 4-bit, into out (contiguous) if given."""
    m, n = residual.shape
    assert a.stride(1) == c.stride(1) == residual.stride(1) == 1 and w1.shape[0] == w2.shape[0] == n and \
        w1.group == w2.group
    block_m, block_n, block_k, warps, stages, use_dot = tiles or w4_tiles(m, n, min(w1.shape[1], w2.shape[1]),
                                                                          a.dtype, wide=False)
    out = torch.empty(m, n, device=residual.device, dtype=residual.dtype) if out is None else out
    assert out.shape == (m, n) and out.is_contiguous()
    grid = (n // block_n, triton.cdiv(m, block_m))
    factored = _factored(use_dot, a.dtype, block_k, w1.group, w1.shape[1], w2.shape[1])
    _w4_linear2_residual_kernel[grid](a, a.stride(0), _weight_bytes(w1, factored), w1.scale, w1.zero, c, c.stride(0),
                                      _weight_bytes(w2, factored), w2.scale, w2.zero, residual, residual.stride(0),
                                      bias, out, m, K1=w1.shape[1], K2=w2.shape[1], N=n, GROUP=w1.group,
                                      WHOLE=_whole_groups(block_k, w1.group, w1.shape[1], w2.shape[1]),
                                      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot,
                                      PRECISION=dot_precision(a), FACTORED=factored, num_warps=warps,
                                      num_stages=stages, **pdl_launch(a.device, m))
    return out


def dequantize_packed(w: PackedWeight) -> torch.Tensor:
    """The whole weight [N, K] in w.dtype (the reference's bf16 values)."""
    n, k = w.shape
    out = torch.empty(n, k, device=w.device, dtype=w.dtype)
    block_n, block_k = 16, min(k, 256)
    assert n % block_n == 0 and k % block_k == 0
    _dequantize_kernel[(triton.cdiv(n, block_n), k // block_k)](w.data, w.scale, w.zero, out, K=k, GROUP=w.group,
                                                                WHOLE=_whole_groups(block_k, w.group, k),
                                                                BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out
