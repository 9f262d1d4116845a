"""Prefill attention on the GPU: one Triton kernel per layer for every sequence of a prefill step
(kernels/prefill_attention.py); this module plans its work.

Each sequence attends to the positions already in its cache (the shared pages of its image prefix), then
to its own k/v, straight from the qkv GEMM's rows: its image prefix sees itself bidirectionally, its text
causally. The kernel also writes the step's k/v into the paged cache. It replaces the torch path's cache
scatter, gathers, per-sequence SDPA calls and masks: about ten kernel launches per layer, which made a
one-request prefill wait on the host.

A sequence with one new row after cached positions (a running sequence's decode row in a mixed step) is left to
grouped_attention instead, with the other such rows on the same image prefix: here one query row would be a
whole tile, and each would read the shared pages on its own (H100, 64 such rows at 776 positions, pairs sharing
720: 209 us a layer here against 143 there; benchmarks/experiments/decode_attention.py)."""

from __future__ import annotations

import numpy as np
import torch
import triton

from ..kernels.grouped_attention import GROUP, group_rows, grouped_attention
from ..kernels import prefill_attention as kernel
from ..model.layers import to_device
from .attention import SeqSlice, TorchPagedAttention
from .kv_cache import PagedKVCache


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
        for tile in range(triton.cdiv(n, kernel.BLOCK_M)):
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
            out = kernel.prefill_attention(q, k, v, kc, vc, self._write_slots, self._work, self._context)
        if self._one_rows is not None:
            attend_one_rows(q, k, v, kc, vc, self.cache.page_size, self._one_rows, out)
        return out
