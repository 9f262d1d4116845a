"""Prefill attention on the GPU: one Triton kernel per layer for every sequence of a prefill step.

Each sequence attends to the positions already in its cache (the shared pages of its image prefix), then
to its own k/v, straight from the qkv GEMM's rows: its image prefix sees itself bidirectionally, its text
causally. The kernel also writes the step's k/v into the paged cache. It replaces the torch path's cache
scatter, gathers, per-sequence SDPA calls and masks: about ten kernel launches per layer, which made a
one-request prefill wait on the host.

A sequence with one new row after cached positions (a running sequence's decode row in a mixed step) is left to
grouped_attention instead, with the other such rows on the same image prefix: here one query row would be a
whole tile, and each would read the shared pages on its own (H100, 64 such rows at 776 positions, pairs sharing
720: 209 us a layer here against 143 there; benchmarks/decode_attention.py)."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ..model.layers import to_device
from .attention import SeqSlice, TorchPagedAttention
from . import decode_kernels
from .grouped_attention import GROUP, group_rows, grouped_attention
from .kv_cache import PagedKVCache

# query rows and key rows per tile, warps, pipeline stages (H100, 1 / 4 / 16 prefills of 742 tokens: 25 / 90 /
# 315 us per layer, against 82 / 275 / 1064 for the torch path; 128-row tiles and 8 warps were slower)
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
def _attend_tile(q, k, v, visible, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
    """One key tile of the online softmax (base 2): the running maximum, sum and output of each row."""
    s = tl.where(visible, tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale, float("-inf"))
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
    in_prefix = offs_m[:, None] < prefix
    for kv_lo in range(0, tl.minimum(length, tl.maximum(prefix, q_lo + BLOCK_M)), BLOCK_N):
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


def one_new_row(s: SeqSlice) -> bool:
    """A sequence whose single row sees every cached position and itself: grouped_attention's kind."""
    return s.end - s.start == 1 and s.first_pos > 0


def work_items(batch: list[SeqSlice], grouped: bool = False) -> list[int]:
    """The work items of every query tile of every sequence (grouped: but those of one_new_row), flat."""
    items, context = [], 0
    for s in batch:
        if grouped and one_new_row(s):
            continue
        n = s.end - s.start
        for tile in range(triton.cdiv(n, BLOCK_M)):
            items += [s.start, n, max(s.prefix_len - s.first_pos, 0), tile, s.first_pos, context]
        context += s.first_pos
    return items


def context_slots(cache: PagedKVCache, batch: list[SeqSlice], grouped: bool = False) -> torch.Tensor:
    """The cache rows of every sequence's cached positions (those before the step), flat, in batch order (grouped:
    but those of one_new_row)."""
    rows = cache.rows((s.seq_id, 0, s.first_pos) for s in batch if s.first_pos and not (grouped and one_new_row(s)))
    return to_device(rows if len(rows) else [0], torch.long, batch[0].positions.device)


class OneRowGroups:
    """grouped_attention's inputs for a step's one_new_row sequences, packed in one int32 array (one copy to the
    device): for up to `capacity` rows, their rows in the step, lengths, new tokens' cache rows, the groups'
    shared positions, the groups [capacity, GROUP], then page tables [rows, width] (a table's first `width` pages:
    rows past them do not fit)."""

    def __init__(self, capacity: int, width: int):
        self.capacity, self.width = capacity, width

    def size(self, rows: int) -> int:
        return (4 + GROUP) * self.capacity + rows * self.width

    def fits(self, cache: PagedKVCache, batch: list[SeqSlice]) -> bool:
        rows = [s for s in batch if one_new_row(s)]
        return len(rows) <= self.capacity and all(s.first_pos < self.width * cache.page_size for s in rows)

    def pack(self, cache: PagedKVCache, batch: list[SeqSlice]) -> np.ndarray:
        rows = [s for s in batch if one_new_row(s)]
        n, c, page = len(rows), self.capacity, cache.page_size
        packed = np.zeros(self.size(n), dtype=np.int32)
        step_rows, lens, slots, shared = np.split(packed[:4 * c], 4)
        groups = packed[4 * c:(4 + GROUP) * c].reshape(c, GROUP)
        tables = packed[(4 + GROUP) * c:].reshape(n, self.width)
        cache.fill_tables([s.seq_id for s in rows], tables)
        first = np.array([s.first_pos for s in rows], dtype=np.int64)
        step_rows[:n] = [s.start for s in rows]
        lens[:n] = first + 1
        slots[:n] = cache.rows((s.seq_id, s.first_pos, 1) for s in rows)
        groups.fill(-1)
        if n:
            group_rows(tables, first, page, groups[:n], shared[:n])
        return packed

    def views(self, packed: torch.Tensor, rows: int) -> tuple[torch.Tensor, ...]:
        """(step rows, lengths, slots, shared, groups, tables) of a packed array on the device."""
        c = self.capacity
        step_rows, lens, slots, shared = packed[:4 * c].split(c)
        return (step_rows, lens, slots, shared, packed[4 * c:(4 + GROUP) * c].view(c, GROUP),
                packed[(4 + GROUP) * c:self.size(rows)].view(rows, self.width))


def attend_one_rows(q, k, v, k_cache, v_cache, page_size: int, views, out: torch.Tensor) -> None:
    """grouped_attention of the one_new_row sequences of OneRowGroups.views into out [T, H, D]."""
    step_rows, lens, slots, shared, groups, tables = views
    grouped_attention(q, k, v, k_cache, v_cache, tables, lens, slots, groups, shared, page_size, rows=step_rows,
                      out=out.view(out.shape[0], -1))


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
    if q.dtype == torch.float32 and decode_kernels._small_shared_memory(q.device):
        context_block = SMALL_SHARED_MEMORY_FP32_CONTEXT_BLOCK_N
    _prefill_attention_kernel[(work.numel() // WORK_FIELDS, h)](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), out, k_cache, v_cache, slots, context, work,
        1.4426950408889634 * d ** -0.5, FIELDS=WORK_FIELDS, H=h, HKV=hkv, D=d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        CONTEXT_BLOCK_N=context_block, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=WARPS,
        num_stages=STAGES)
    return out


class PrefillAttention(TorchPagedAttention):
    """The engine's attention for flat forwards on a GPU (every one there is a prefill step: decode runs in
    the CUDA-graph decoder): prefill_attention() over the step's sequences, fresh or starting after a
    shared image prefix."""

    def plan(self, batch: list[SeqSlice]) -> None:
        self._plan_writes(batch)
        dev, rows = batch[0].positions.device, sum(one_new_row(s) for s in batch)
        items = work_items(batch, grouped=True)
        self._work = to_device(items, torch.int32, dev) if items else None
        self._context = context_slots(self.cache, batch, grouped=True)
        self._one_rows = None
        if rows:  # (sizes in multiples of 16: the kernel compiled for the prefill graphs' buffers serves here too)
            width = max(len(self.cache.tables[s.seq_id]) for s in batch if one_new_row(s))
            groups = OneRowGroups(-(-rows // 16) * 16, -(-width // 16) * 16)
            self._one_rows = groups.views(to_device(groups.pack(self.cache, batch), torch.int32, dev), rows)

    def __call__(self, layer: int, q, k, v):
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        if self._work is None:
            out = torch.empty_like(q)
        else:
            out = prefill_attention(q, k, v, kc, vc, self._write_slots, self._work, self._context)
        if self._one_rows is not None:
            attend_one_rows(q, k, v, kc, vc, self.cache.page_size, self._one_rows, out)
        return out
