"""Paged KV cache: fixed-size pages, a free list, and a page table per sequence.

Pages are reference-counted: a sequence's table may start with pages it shares (the image prefix of
another request on the same image, held by the prefix cache); a page goes back to the free list when its
last holder lets go."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from ..model.config import TextConfig


class OutOfPages(RuntimeError):
    pass


class PagedKVCache:
    def __init__(self, config: TextConfig, num_pages: int, page_size: int, device, dtype):
        self.page_size = page_size
        self.num_pages = num_pages
        self.scratch_page = num_pages  # one extra page outside the free list: padding rows of a graph write here
        shape = (config.n_layers, (num_pages + 1) * page_size, config.n_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._holders = [0] * num_pages
        self.tables: dict[int, list[int]] = {}
        self.table_tensors: dict[int, torch.Tensor] = {}  # the same, as int32 CPU tensors (graph inputs)

    @property
    def pages_free(self) -> int:
        return len(self._free)

    @property
    def pages_used(self) -> int:
        """Pages with a holder: a sequence or the prefix cache."""
        return self.num_pages - len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def holders(self, page: int) -> int:
        return self._holders[page]

    def allocate(self, seq_id: int, tokens: int, shared: Sequence[int] = ()) -> None:
        """Give seq_id enough pages for `tokens` positions (all at once: no preemption later), starting with
        the `shared` pages, which hold its first positions already."""
        need = self.pages_for(tokens) - len(shared)
        if need > len(self._free):
            raise OutOfPages(f"need {need} KV pages, {len(self._free)} free")
        pages = list(shared) + [self._free.pop() for _ in range(need)]
        self.retain(pages)
        self.tables[seq_id] = pages
        self.table_tensors[seq_id] = torch.tensor(pages, dtype=torch.int32)

    def free(self, seq_id: int) -> None:
        self.release(self.tables.pop(seq_id, []))
        self.table_tensors.pop(seq_id, None)

    def retain(self, pages: Sequence[int]) -> None:
        for page in pages:
            self._holders[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        for page in reversed(pages):
            self._holders[page] -= 1
            if self._holders[page] == 0:
                self._free.append(page)

    def fill_tables(self, seq_ids: Sequence[int], tables: np.ndarray) -> None:
        """Page tables of these sequences into the rows of tables [n, width] (a table's first `width` pages), the
        scratch page after each and in the rows past them (a CUDA graph's padding rows write there)."""
        tables.fill(self.scratch_page)
        for row, seq_id in enumerate(seq_ids):
            pages = self.table_tensors[seq_id].numpy()[:tables.shape[1]]
            tables[row, :len(pages)] = pages

    def rows(self, spans: Iterable[tuple[int, int, int]]) -> np.ndarray:
        """Flat cache rows of positions [first, first + n) of each (seq_id, first, n), span after span, worked out
        on the host: one copy to the device for a step's sequences, not a few device operations each."""
        parts = []
        for seq_id, first, n in spans:
            positions = np.arange(first, first + n)
            pages = self.table_tensors[seq_id].numpy()[positions // self.page_size].astype(np.int64)
            parts.append(pages * self.page_size + positions % self.page_size)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
