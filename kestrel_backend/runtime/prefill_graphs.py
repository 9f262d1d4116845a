"""Prefill steps of one sequence as CUDA graphs, one per length bucket (the common ones captured at
start-up, warmup(); the others on first use).

A step that prefills one sequence is about 240 kernel launches for a few milliseconds of GPU work, so
the host's launching set its pace (H100, 742 tokens: 6.2 ms for 3.9 ms of GPU work). Under load that is
the common prefill step: requests arrive one at a time as others finish. The graph runs the same forward
over the sequence's rows padded to a multiple of BUCKET; the padded rows are computed and dropped (the
attention kernel neither attends to them nor stores their k/v)."""

from __future__ import annotations

import torch

from ..model.moondream import Moondream
from . import prefill_attention as pa
from .cuda_graphs import CapturedGraphs
from .kv_cache import PagedKVCache

BUCKET = 64  # rows: a multiple of the attention kernel's query tile


class _BucketAttention:
    """The attention of a graph's forward: the kernel over the static slots and work items."""

    def __init__(self, owner: "OneSequencePrefill", rows: int):
        self.owner, self.rows = owner, rows

    def __call__(self, layer: int, q, k, v):
        o = self.owner
        return pa.prefill_attention(q, k, v, o.cache.k[layer], o.cache.v[layer], o.slots[:self.rows],
                                    o.work[:pa.WORK_FIELDS * (self.rows // pa.BLOCK_M)], o.context)


class OneSequencePrefill:
    """run(x, seq_id, prefix_len, first_pos) -> (logits [1, vocab] float32, last hidden [1, dim]): views of static
    buffers, valid until the next run. On a CPU (tests) the same padded forward runs eagerly."""

    def __init__(self, model: Moondream, cache: PagedKVCache, max_context: int):
        assert BUCKET % pa.BLOCK_M == 0
        self.model, self.cache = model, cache
        dev, rows = model.device, -(-max_context // BUCKET) * BUCKET
        self.x = torch.zeros(rows, model.config.text.dim, device=dev, dtype=model.dtype)
        self.positions = torch.zeros(rows, device=dev, dtype=torch.long)
        self.slots = torch.zeros(rows, device=dev, dtype=torch.long)  # (the kernel reads those of real rows only)
        self.context = torch.zeros(rows, device=dev, dtype=torch.long)  # cache rows of the positions before x
        self.work = torch.zeros(pa.WORK_FIELDS * (rows // pa.BLOCK_M), device=dev, dtype=torch.int32)
        self.last = torch.zeros(1, device=dev, dtype=torch.long)
        self.logits = torch.zeros(1, model.config.text.vocab_size, device=dev, dtype=torch.float32)
        self.hidden = torch.zeros(1, model.config.text.dim, device=dev, dtype=model.dtype)
        self.graphs = CapturedGraphs()  # by rows

    def _forward(self, rows: int) -> None:
        hidden = self.model.forward(self.x[:rows], self.positions[:rows], _BucketAttention(self, rows))
        self.hidden.copy_(hidden.index_select(0, self.last))
        self.logits.copy_(self.model.logits(self.hidden))

    def _graph(self, rows: int) -> torch.cuda.CUDAGraph:
        return self.graphs.get_or_capture(rows, lambda: self._forward(rows))

    def warmup(self) -> None:
        """Capture the lengths most requests have now, not under the first of them: a short text prompt, and
        an image with a prompt of up to 102 tokens."""
        prefix = self.model.config.text.prefix_attn
        with torch.inference_mode():
            for n in (1, prefix + 1, prefix + 102):
                rows = -(-n // BUCKET) * BUCKET
                if rows <= self.x.shape[0]:
                    self._graph(rows)  # (work items all empty here: nothing attended, nothing stored)

    def run(self, x: torch.Tensor, seq_id: int, prefix_len: int, first_pos: int = 0):
        """x [n, dim]: the inputs of a sequence from position first_pos on (the positions before it are in its
        pages already; prefix_len positions from 0 are its image's), whose k/v go to its pages."""
        n = x.shape[0]
        rows = -(-n // BUCKET) * BUCKET
        self.x[:n].copy_(x)
        # (padded rows repeat the last position: one the rotary table has)
        positions = torch.arange(first_pos, first_pos + rows, device=x.device).clamp_(max=first_pos + n - 1)
        self.positions[:rows].copy_(positions)
        self.slots[:n].copy_(self.cache.slots(seq_id, positions[:n]))
        if first_pos:
            self.context[:first_pos].copy_(self.cache.slots(seq_id, torch.arange(first_pos, device=x.device)))
        # every query tile of the padded rows: those past n store nothing (their rows are masked)
        prefix = max(prefix_len - first_pos, 0)
        items = [v for tile in range(rows // pa.BLOCK_M) for v in (0, n, prefix, tile, first_pos, 0)]
        self.work[:len(items)].copy_(torch.tensor(items, dtype=torch.int32))
        self.last.fill_(n - 1)
        if self.x.is_cuda:
            self._graph(rows).replay()
        else:
            self._forward(rows)
        return self.logits, self.hidden
