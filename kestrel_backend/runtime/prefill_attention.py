"""Prefill attention on the GPU: one Triton kernel per layer for every fresh sequence of a step.

Each sequence attends to its own k/v, straight from the qkv GEMM's rows: its image prefix sees itself
bidirectionally, its text causally. The kernel also writes the step's k/v into the paged cache. It
replaces the torch path's cache scatter, gathers, per-sequence SDPA calls and masks: about ten
kernel launches per layer, which made a one-request prefill wait on the host."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import SeqSlice, TorchPagedAttention

# query rows and key rows per tile, warps, pipeline stages (H100, 1 / 4 / 16 prefills of 742 tokens: 25 / 90 /
# 315 us per layer, against 82 / 275 / 1064 for the torch path; 128-row tiles and 8 warps were slower)
BLOCK_M, BLOCK_N, WARPS, STAGES = 64, 64, 4, 3


@triton.jit
def _prefill_attention_kernel(q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, out_ptr, k_cache_ptr, v_cache_ptr,
                              slots_ptr, work_ptr, scale, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Program (item, head): the query tile q_block of one sequence (work item: start row, length, image
    prefix length, q_block) against the key tiles it may see, online softmax (base 2). The first head of
    each kv head group also stores the k/v of the tile's own rows (so each row once) into the cache rows
    slots[row]."""
    item, h = tl.program_id(0), tl.program_id(1)
    start = tl.load(work_ptr + 4 * item)
    length = tl.load(work_ptr + 4 * item + 1)
    prefix = tl.load(work_ptr + 4 * item + 2)
    q_lo = tl.load(work_ptr + 4 * item + 3) * BLOCK_M
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
    in_prefix = offs_m[:, None] < prefix
    for kv_lo in range(0, tl.minimum(length, tl.maximum(prefix, q_lo + BLOCK_M)), BLOCK_N):
        offs_n = kv_lo + tl.arange(0, BLOCK_N)
        n_mask = offs_n < length
        rows = (start + offs_n)[:, None]
        k = tl.load(k_ptr + rows * k_stride + head, mask=n_mask[:, None], other=0.0)
        v = tl.load(v_ptr + rows * v_stride + head, mask=n_mask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # scale: log2(e) / sqrt(D)
        # key 0 is visible to every row, so no row's maximum stays -inf after the first tile
        visible = ((offs_n[None, :] <= offs_m[:, None]) | (in_prefix & (offs_n[None, :] < prefix))) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + (start + offs_m)[:, None] * (H * D) + h * D + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def work_items(batch: list[SeqSlice]) -> list[int]:
    """(start row, length, prefix length, query tile) of every query tile of every sequence, flat."""
    items = []
    for s in batch:
        n = s.end - s.start
        for tile in range(triton.cdiv(n, BLOCK_M)):
            items += [s.start, n, s.prefix_len, tile]
    return items


def prefill_attention(q, k, v, k_cache, v_cache, slots, work) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] (rows may be strided, e.g. views of the qkv GEMM's output) of fresh
    sequences; caches [rows, Hkv, D]; slots [T] cache rows of the step's tokens; work: work_items() as an
    int32 tensor. Stores k/v into the caches -> attention output [T, H, D]."""
    t, h, d = q.shape
    hkv = k.shape[1]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and h % hkv == 0
    assert q.stride(1) == k.stride(1) == v.stride(1) == d and k_cache.is_contiguous() and v_cache.is_contiguous()
    out = torch.empty(t, h, d, device=q.device, dtype=q.dtype)
    _prefill_attention_kernel[(work.numel() // 4, h)](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), out, k_cache, v_cache, slots, work,
        1.4426950408889634 * d ** -0.5, H=h, HKV=hkv, D=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=WARPS, num_stages=STAGES)
    return out


class PrefillAttention(TorchPagedAttention):
    """The engine's attention on a GPU: a step of fresh sequences only (every prefill step there, as
    decode runs in the CUDA-graph decoder) takes prefill_attention(); any other step the torch path."""

    _work: torch.Tensor | None = None  # the step's work items while it takes the kernel

    def plan(self, batch: list[SeqSlice]) -> None:
        self._work = None
        if any(s.first_pos != 0 for s in batch):
            return super().plan(batch)
        self._plan_writes(batch)
        self._work = torch.tensor(work_items(batch), dtype=torch.int32).to(batch[0].positions.device)

    def __call__(self, layer: int, q, k, v):
        if self._work is None:
            return super().__call__(layer, q, k, v)
        return prefill_attention(q, k, v, self.cache.k[layer], self.cache.v[layer], self._write_slots, self._work)
