"""Paged attention, torch reference path (CPU and GPU): scatter new k/v, gather each sequence's pages.

A sequence whose whole context is in this step (a fresh prefill) attends to the step's own k/v and
skips the gather: the same values, without copying its pages back out of the cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.text import attend, attention_mask
from .kv_cache import PagedKVCache


@dataclass
class SeqSlice:
    """One sequence's tokens in a flat step: rows [start, end) of q, at these positions."""

    seq_id: int
    start: int
    end: int
    first_pos: int  # position of row `start` (host int: planning needs no device sync)
    prefix_len: int  # bidirectional image prefix (0 for text-only)
    positions: torch.Tensor  # first_pos .. first_pos + (end - start) - 1, on the device


class TorchPagedAttention:
    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.batch: list[SeqSlice] = []
        self._write_slots: torch.Tensor | None = None
        self._read: list[tuple[torch.Tensor | None, torch.Tensor]] = []

    def plan(self, batch: list[SeqSlice]) -> None:
        """Precompute cache rows and masks once per step; every layer reuses them."""
        self.batch = batch
        self._write_slots = torch.cat([self.cache.slots(s.seq_id, s.positions) for s in batch])
        self._read = []
        for s in batch:
            keys = torch.arange(s.first_pos + s.end - s.start, device=s.positions.device)
            rows = None if s.first_pos == 0 else self.cache.slots(s.seq_id, keys)
            self._read.append((rows, attention_mask(s.positions, keys, s.prefix_len)))

    def __call__(self, layer: int, q, k, v):
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc[self._write_slots] = k
        vc[self._write_slots] = v
        out = torch.empty_like(q)
        for s, (rows, mask) in zip(self.batch, self._read):
            if rows is None:
                out[s.start:s.end] = prefill_attention(q[s.start:s.end], k[s.start:s.end], v[s.start:s.end], s.prefix_len)
            else:
                out[s.start:s.end] = attend(q[s.start:s.end], kc[rows], vc[rows], mask)
        return out


def prefill_attention(q, k, v, prefix_len: int) -> torch.Tensor:
    """A whole fresh sequence: the image prefix attends to itself (no mask: the fused kernels apply), the
    text after it causally to everything before; text-only is plain causal. Same result as the masked
    form, without materialising a [T, T] mask for the long prefix."""
    n = q.shape[0]
    if prefix_len == 0 or n <= prefix_len:
        return attend(q, k, v, is_causal=prefix_len == 0)
    out = torch.empty_like(q)
    out[:prefix_len] = attend(q[:prefix_len], k[:prefix_len], v[:prefix_len])
    rows = torch.arange(prefix_len, n, device=q.device)
    mask = torch.arange(n, device=q.device)[None, :] <= rows[:, None]
    out[prefix_len:] = attend(q[prefix_len:], k, v, mask)
    return out
