"""Paged attention, torch reference path (CPU and GPU): scatter new k/v, gather each sequence's pages."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.text import attention_mask, masked_attention
from .kv_cache import PagedKVCache


@dataclass
class SeqSlice:
    """One sequence's tokens in a flat step: rows [start, end) of q, at these positions."""

    seq_id: int
    start: int
    end: int
    positions: torch.Tensor
    prefix_len: int  # bidirectional image prefix (0 for text-only)


class TorchPagedAttention:
    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.batch: list[SeqSlice] = []
        self._write_slots: torch.Tensor | None = None
        self._read: list[tuple[torch.Tensor, torch.Tensor]] = []

    def plan(self, batch: list[SeqSlice]) -> None:
        """Precompute cache rows and masks once per step; every layer reuses them."""
        self.batch = batch
        self._write_slots = torch.cat([self.cache.slots(s.seq_id, s.positions) for s in batch])
        self._read = []
        for s in batch:
            keys = torch.arange(int(s.positions[-1]) + 1, device=s.positions.device)
            self._read.append((self.cache.slots(s.seq_id, keys), attention_mask(s.positions, keys, s.prefix_len)))

    def __call__(self, layer: int, q, k, v):
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc[self._write_slots] = k
        vc[self._write_slots] = v
        out = torch.empty_like(q)
        for s, (rows, mask) in zip(self.batch, self._read):
            out[s.start:s.end] = masked_attention(q[s.start:s.end], kc[rows], vc[rows], mask)
        return out
