"""Prefill attention's Triton kernel: one launch per layer for every sequence of a prefill step (runtime/
prefill_attention.py plans its work items). Each sequence attends to the positions already in its cache (the shared
pages of its image prefix), then to its own k/v, straight from the qkv GEMM's rows: its image prefix sees itself
bidirectionally, its text causally. The kernel also writes the step's k/v into the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import shared

# query rows and key rows per tile, warps, pipeline stages (H100, 1 / 4 / 16 prefills of 742 tokens: 27.7 / 90.6 /
# 312 us per layer, 33.6 / 110 / 390 with every key tile masked; 128-row tiles, 8 warps, 128 keys a tile or 2 to 4
# stages were slower or within 4%: benchmarks/results/h100_2026-11-28_image_path.json)
BLOCK_M, BLOCK_N, WARPS, STAGES = 64, 64, 4, 3
# cached positions per tile of the loop over them (H100, 1 / 4 / 8 sequences of 22 rows after 720 cached
# positions: 11.3 / 12.6 / 24.8 us per layer with 128, 13.3 / 14.4 / 28.0 with 64, 16.7 / 17.6 / 33.7 with 32)
CONTEXT_BLOCK_N = 128
# float32 tiles of that size in 3 stages need 116 KB of shared memory: GPUs of about 100 KB a block (sm86, sm89,
# sm120) take 64 cached positions a tile there
SMALL_SHARED_MEMORY_FP32_CONTEXT_BLOCK_N = 64
# a work item, one per query tile: start row, rows, image-prefix rows among them, query tile, positions already
# cached (before the step's rows), where their cache rows start in the step's context slots
WORK_FIELDS = 6


@triton.jit
def _attend_tile(q, k, v, visible, m_i, l_i, acc, scale, PRECISION: tl.constexpr, MASKED: tl.constexpr = True):
    """One key tile of the online softmax (base 2): the running maximum, sum and output of each row. visible: which
    keys each row sees, if MASKED (else all)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefill_attention_kernel(q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, out_ptr, k_cache_ptr, v_cache_ptr,
                              slots_ptr, context_slots_ptr, work_ptr, scale, FIELDS: tl.constexpr, H: tl.constexpr,
                              HKV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              CONTEXT_BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Program (item, head): the query tile q_block of one sequence (work item: start row, rows, image-prefix
    rows among them, q_block, cached positions, their offset in context_slots) against the cached positions,
    all visible, then the key tiles of its own rows it may see. The first head of each kv head group also
    stores the k/v of the tile's own rows (so each row once) into the cache rows slots[row]."""
    item, h = tl.program_id(0), tl.program_id(1)
    start = tl.load(work_ptr + FIELDS * item)
    length = tl.load(work_ptr + FIELDS * item + 1)
    prefix = tl.load(work_ptr + FIELDS * item + 2)
    q_lo = tl.load(work_ptr + FIELDS * item + 3) * BLOCK_M
    cached = tl.load(work_ptr + FIELDS * item + 4)
    context = tl.load(work_ptr + FIELDS * item + 5)
    kvh = h // (H // HKV)
    offs_m = q_lo + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    m_mask = offs_m < length
    q = tl.load(q_ptr + (start + offs_m)[:, None] * q_stride + h * D + offs_d[None, :], mask=m_mask[:, None],
                other=0.0)
    stores = m_mask & ((offs_m * 0 + h) % (H // HKV) == 0)  # (a row mask: Triton's interpreter wants one)
    own_rows = (start + offs_m)[:, None]
    head = kvh * D + offs_d[None, :]
    cache_rows = tl.load(slots_ptr + start + offs_m, mask=stores, other=0).to(tl.int64)[:, None] * (HKV * D) + head
    tl.store(k_cache_ptr + cache_rows, tl.load(k_ptr + own_rows * k_stride + head, mask=stores[:, None]),
             mask=stores[:, None])
    tl.store(v_cache_ptr + cache_rows, tl.load(v_ptr + own_rows * v_stride + head, mask=stores[:, None]),
             mask=stores[:, None])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # position 0 is visible to every row, so no row's maximum stays -inf after the first tile
    for kv_lo in range(0, cached, CONTEXT_BLOCK_N):
        offs_n = kv_lo + tl.arange(0, CONTEXT_BLOCK_N)
        n_mask = offs_n < cached
        rows = tl.load(context_slots_ptr + context + offs_n, mask=n_mask, other=0).to(tl.int64)[:, None] * (HKV * D)
        k = tl.load(k_cache_ptr + rows + head, mask=n_mask[:, None], other=0.0)
        v = tl.load(v_cache_ptr + rows + head, mask=n_mask[:, None], other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, n_mask[None, :], m_i, l_i, acc, scale, PRECISION)
    # key tiles every row of the tile sees whole (below the image prefix's end, or the first row's position if the
    # tile starts past it) need no mask; the rest do
    whole = tl.minimum(tl.where(q_lo < prefix, prefix, q_lo + 1), length) // BLOCK_N * BLOCK_N
    for kv_lo in range(0, whole, BLOCK_N):
        rows = (start + kv_lo + tl.arange(0, BLOCK_N))[:, None]
        k = tl.load(k_ptr + rows * k_stride + head)
        v = tl.load(v_ptr + rows * v_stride + head)
        m_i, l_i, acc = _attend_tile(q, k, v, None, m_i, l_i, acc, scale, PRECISION, MASKED=False)
    in_prefix = offs_m[:, None] < prefix
    for kv_lo in range(whole, tl.minimum(length, tl.maximum(prefix, q_lo + BLOCK_M)), BLOCK_N):
        offs_n = kv_lo + tl.arange(0, BLOCK_N)
        n_mask = offs_n < length
        rows = (start + offs_n)[:, None]
        k = tl.load(k_ptr + rows * k_stride + head, mask=n_mask[:, None], other=0.0)
        v = tl.load(v_ptr + rows * v_stride + head, mask=n_mask[:, None], other=0.0)
        visible = ((offs_n[None, :] <= offs_m[:, None]) | (in_prefix & (offs_n[None, :] < prefix))) & n_mask[None, :]
        m_i, l_i, acc = _attend_tile(q, k, v, visible, m_i, l_i, acc, scale, PRECISION)
    out = acc / l_i[:, None]
    tl.store(out_ptr + (start + offs_m)[:, None] * (H * D) + h * D + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def prefill_attention(q, k, v, k_cache, v_cache, slots, work, context) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] (rows may be strided, e.g. views of the qkv GEMM's output) of the step's
    sequences; caches [rows, Hkv, D]; slots [T] cache rows of the step's tokens; work: work_items() as an
    int32 tensor; context: context_slots(). Stores k/v into the caches -> attention output [T, H, D]."""
    t, h, d = q.shape
    hkv = k.shape[1]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and h % hkv == 0
    assert q.stride(1) == k.stride(1) == v.stride(1) == d and k_cache.is_contiguous() and v_cache.is_contiguous()
    out = torch.empty(t, h, d, device=q.device, dtype=q.dtype)
    context_block = CONTEXT_BLOCK_N
    if q.dtype == torch.float32 and shared.small_shared_memory(q.device):
        context_block = SMALL_SHARED_MEMORY_FP32_CONTEXT_BLOCK_N
    _prefill_attention_kernel[(work.numel() // WORK_FIELDS, h)](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), out, k_cache, v_cache, slots, context, work,
        1.4426950408889634 * d ** -0.5, FIELDS=WORK_FIELDS, H=h, HKV=hkv, D=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        CONTEXT_BLOCK_N=context_block, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=WARPS,
        num_stages=STAGES)
    return out
