"""Paged attention, torch reference path (CPU and GPU): scatter new k/v, gather each sequence's pages.

A sequence whose whole context is in this step (a fresh prefill) attends to the step's own k/v and
skips the gather: the same values, without copying its pages back out of the cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.layers import to_device
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
    blocks: tuple[tuple[int, int], ...] = ()  # later image blocks [start, end): each sees itself bidirectionally


class TorchPagedAttention:
    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.batch: list[SeqSlice] = []
        self._write_slots: torch.Tensor | None = None
        self._read: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
        self._prefixes: dict[int, torch.Tensor] = {}

    def plan(self, batch: list[SeqSlice]) -> None:
        """Precompute cache rows, masks and prefix groups once per step; every layer reuses them.

        A fresh sequence (its whole context in this step) attends to the step's own k/v: its image
        prefix attends to itself without a mask, batched with every other fresh prefix of that length
        (one fused-kernel call), and only its text tail needs a mask. Text-only fresh sequences are
        plainly causal. Continuing sequences, and those with later image blocks, read their pages back with the
        general mask."""
        self._plan_writes(batch)
        dev = batch[0].positions.device
        self._read, prefix_rows = [], {}
        for s in batch:
            n = s.end - s.start
            if s.first_pos == 0 and s.prefix_len and not s.blocks:
                prefix_rows.setdefault(s.prefix_len, []).append(torch.arange(s.start, s.start + s.prefix_len))
                tail = torch.arange(s.prefix_len, n, device=dev)
                self._read.append((None, torch.arange(n, device=dev)[None, :] <= tail[:, None]))
            elif s.first_pos == 0 and not s.blocks:
                self._read.append((None, None))
            else:
                keys = torch.arange(s.first_pos + n, device=dev)
                key_rows = to_device(self.cache.rows([(s.seq_id, 0, s.first_pos + n)]), torch.long, dev)
                self._read.append((key_rows, attention_mask(s.positions, keys, s.prefix_len, s.blocks)))
        self._prefixes = {p: torch.cat(rows).to(dev) for p, rows in prefix_rows.items()}

    def _plan_writes(self, batch: list[SeqSlice]) -> None:
        """The step's sequences and the cache rows their new k/v go to."""
        self.batch = batch
        self._write_slots = to_device(self.cache.rows((s.seq_id, s.first_pos, s.end - s.start) for s in batch),
                                      torch.long, batch[0].positions.device)

    def __call__(self, layer: int, q, k, v):
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        n = self._write_slots.shape[0]  # (rows after the step's sequences are padding: neither stored nor attended)
        kc[self._write_slots] = k[:n]
        vc[self._write_slots] = v[:n]
        out = torch.zeros_like(q)
        for p, rows in self._prefixes.items():
            shape = (rows.shape[0] // p, p)
            out[rows] = attend(*(t[rows].view(*shape, *t.shape[1:]) for t in (q, k, v))).flatten(0, 1)
        for s, (rows, mask) in zip(self.batch, self._read):
            seq = slice(s.start, s.end)
            if rows is not None:
                out[seq] = attend(q[seq], kc[rows], vc[rows], mask)
            elif s.prefix_len == 0:
                out[seq] = attend(q[seq], k[seq], v[seq], is_causal=True)
            elif s.end - s.start > s.prefix_len:
                tail = slice(s.start + s.prefix_len, s.end)
                out[tail] = attend(q[tail], k[seq], v[seq], mask)
        return out
