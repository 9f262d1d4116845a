"""Prefill steps as CUDA graphs, one per (padded length, sequence-count bucket), all captured at start-up
(warmup()): a capture under load would hold up every request in flight.

A prefill step is about 240 kernel launches for a few milliseconds of GPU work, so the host's launching set
its pace (H100, one sequence of 742 tokens: 6.2 ms for 3.9 ms of GPU work; a request on a cached image
prefix, 22 rows, is about 2 ms of GPU work). Under load a step prefills one sequence (requests arrive as
others end) or a burst of them. The graph runs the same forward over the step's sequences, their rows packed
one after another and padded to a multiple of BUCKET; the padded rows are computed and dropped (the attention
kernel's work items cover the real rows only: they are neither attended to nor stored). Moondream 3's experts take
the real rows only (moe_kernels.add_moe_mlp's valid): padded rows, holding stale or uninitialised values, chose
experts of their own, and NaN rows all the same ones, whose tiles then ran long (H100, a question of 20 rows on a
cached prefix: 6.2 ms with finite padded rows, 13.8 with NaN ones, 5.3 either way now; question_prefill.py). The LM
head runs over as many last rows as the bucket has sequences; those of absent sequences are dropped.

With Moondream 3's adapters (an ExpertLoraPool) every graph also comes in a form with their deltas, captured beside
it at start-up, that reads each row's adapter slot from a static buffer (model.lora.SlotRows): steps where some
sequence has an adapter replay it. Moondream 2's adapters prefill eagerly."""

from __future__ import annotations

import torch

from ..model.layers import to_device
from ..model.lora import SlotRows
from ..model.moondream import Moondream
from ..kernels import prefill_attention as kernel
from . import prefill_plan as pa
from .attention import SeqSlice
from .cuda_graphs import CapturedGraphs
from .kv_cache import PagedKVCache

BUCKET = 64  # rows: a multiple of the attention kernel's query tile
ROUTE_REAL_ROWS_ONLY = True  # Moondream 3: the padded rows choose no experts (benchmarks compare without)
MAX_ROWS = 2048  # rows of the longest graph (Moondream 2's whole context): longer steps (long Moondream 3 prompts,
#                  compute-bound) run eagerly, where one graph per 64 rows up to 32k would hold tens of GB


class _BucketAttention:
    """The attention of a graph's forward: the kernel over the static slots and work items."""

    def __init__(self, owner: "PrefillGraphs", rows: int, items: int):
        self.owner, self.rows, self.items = owner, rows, items
        self.valid_rows = owner.valid if ROUTE_REAL_ROWS_ONLY else None  # (the step's real rows)

    def __call__(self, layer: int, q, k, v):
        o = self.owner
        kc, vc = o.cache.k[layer], o.cache.v[layer]
        out = kernel.prefill_attention(q, k, v, kc, vc, o.slots[:self.rows], o.work[:kernel.WORK_FIELDS * self.items],
                                   o.context)
        pa.attend_one_rows(q, k, v, kc, vc, o.cache.page_size, o.one_row_views, out)  # (no groups: nothing)
        return out


def _work_items(rows: int, seqs: int) -> int:
    """Work items (query tiles) that `seqs` sequences packed into `rows` rows can need: each may add a
    partial tile."""
    return rows // kernel.BLOCK_M + seqs - 1


class PrefillGraphs:
    """run(x, slices) -> (logits [sequences, vocab] float32, last hidden [sequences, dim]): views of static
    buffers, valid until the next run. For steps of up to max_seqs sequences and max_context rows in all
    (fits()). On a CPU (tests) the same padded forward runs eagerly."""

    def __init__(self, model: Moondream, cache: PagedKVCache, max_context: int, max_seqs: int = 1, adapters=None):
        assert BUCKET % kernel.BLOCK_M == 0
        self.model, self.cache = model, cache
        self.adapters = adapters  # the AdapterRegistry, whose pool the adapter forms read (see takes_adapters)
        # sequences per graph (the LM head's rows): one, or up to max_seqs (spare attention programs exit at once)
        self.seq_buckets = sorted({1, max_seqs})
        dev, rows, seqs = model.device, -(-min(max_context, MAX_ROWS) // BUCKET) * BUCKET, max_seqs
        self.max_rows = rows
        self.x = torch.zeros(rows, model.config.text.dim, device=dev, dtype=model.dtype)
        self.positions = torch.zeros(rows, device=dev, dtype=torch.long)
        self.slots = torch.zeros(rows, device=dev, dtype=torch.long)  # (the kernel reads those of real rows only)
        self.context = torch.zeros(seqs * max_context, device=dev, dtype=torch.long)  # cache rows of cached positions
        self.work = torch.zeros(kernel.WORK_FIELDS * _work_items(rows, seqs), device=dev, dtype=torch.int32)
        # a mixed step's decode rows (pa.one_new_row) as grouped_attention's groups, while their pages fit the tables
        self.one_rows = pa.OneRowGroups(seqs, cache.pages_for(rows))
        self.one_rows_packed = torch.full((self.one_rows.size(seqs),), -1, device=dev, dtype=torch.int32)
        self.one_row_views = self.one_rows.views(self.one_rows_packed, seqs)
        self.last = torch.zeros(seqs, device=dev, dtype=torch.long)
        self.valid = torch.zeros(1, device=dev, dtype=torch.int32)  # the step's real rows (see run)
        self.row_slots = torch.zeros(rows, device=dev, dtype=torch.int32)  # each row's adapter slot (0: none)
        self.logits = torch.zeros(seqs, model.config.text.vocab_size, device=dev, dtype=torch.float32)
        self.hidden = torch.zeros(seqs, model.config.text.dim, device=dev, dtype=model.dtype)
        self.graphs = CapturedGraphs()  # by (rows, sequence bucket, with adapters)

    def fits(self, lengths: list[int]) -> bool:
        """Whether a step of sequences with these row counts runs as a graph."""
        return len(lengths) <= self.seq_buckets[-1] and sum(lengths) <= self.max_rows

    @property
    def takes_adapters(self) -> bool:
        """Whether steps with adapters run as graphs too: Moondream 3's, once their pool exists."""
        return self.model.config.is_moondream3 and self.adapters is not None and self.adapters.pool is not None

    def _forward(self, rows: int, seqs: int, lora: bool = False) -> None:
        attention = _BucketAttention(self, rows, _work_items(rows, seqs))
        rows_lora = SlotRows(self.adapters.pool, self.row_slots[:rows]) if lora else None
        hidden = self.model.forward(self.x[:rows], self.positions[:rows], attention, rows_lora)
        self.hidden[:seqs].copy_(hidden.index_select(0, self.last[:seqs]))
        self.logits[:seqs].copy_(self.model.logits(self.hidden[:seqs]))

    def _graph(self, rows: int, seqs: int, lora: bool = False) -> torch.cuda.CUDAGraph:
        return self.graphs.get_or_capture((rows, seqs, lora), lambda: self._forward(rows, seqs, lora))

    def warmup(self) -> None:
        """Capture every graph now, not under the first requests that need it."""
        with torch.inference_mode():
            for seqs in self.seq_buckets:
                for rows in range(BUCKET, self.max_rows + 1, BUCKET):
                    for lora in (False, True) if self.takes_adapters else (False,):
                        self._graph(rows, seqs, lora)  # (work items all empty here: nothing attended, nothing stored)

    def run(self, x: torch.Tensor, slices: list[SeqSlice], adapter_slots: list[int] | None = None):
        """x [T, dim]: the step's inputs, sequence after sequence as slices have them (as for a flat step's
        attention.plan): each sequence's rows from position first_pos on (the positions before it are in its
        pages already; prefix_len positions from 0 are its image's), whose k/v go to its pages. adapter_slots: each
        sequence's adapter slot in the pool (0: none), when some has one (takes_adapters)."""
        used = slices[-1].end  # real rows; those after, up to a multiple of BUCKET, are padding
        assert self.fits([s.end - s.start for s in slices]) and x.shape[0] == used
        rows = -(-used // BUCKET) * BUCKET
        seqs = next(b for b in self.seq_buckets if b >= len(slices))
        self.x[:used].copy_(x)
        self.positions[:used].copy_(torch.cat([s.positions for s in slices]))
        self.positions[used:rows].zero_()  # (padded rows: a position the rotary table has)
        spans = ((s.seq_id, s.first_pos, s.end - s.start) for s in slices)
        self.slots[:used].copy_(to_device(self.cache.rows(spans), torch.long, self.slots.device))
        grouped = self.one_rows.fits(self.cache, slices)
        packed = self.one_rows.pack(self.cache, slices if grouped else [])
        self.one_rows_packed[:len(packed)].copy_(to_device(packed, torch.int32, self.x.device))
        context = pa.context_slots(self.cache, slices, grouped)
        self.context[:context.numel()].copy_(context)
        work = torch.zeros(kernel.WORK_FIELDS * _work_items(rows, seqs), dtype=torch.int32)  # zeros: empty items
        items = pa.work_items(slices, grouped)
        work[:len(items)] = torch.tensor(items, dtype=torch.int32)
        self.work[:work.numel()].copy_(to_device(work, torch.int32, self.work.device))
        self.last[:len(slices)].copy_(to_device([s.end - 1 for s in slices], self.last.dtype, self.last.device))
        self.last[len(slices):seqs].zero_()
        self.valid.fill_(used)
        lora = bool(adapter_slots) and any(adapter_slots)
        if lora:
            per_row = torch.zeros(rows, dtype=torch.int32)  # (padded rows: none)
            for s, slot in zip(slices, adapter_slots):
                per_row[s.start:s.end] = slot
            self.row_slots[:rows].copy_(to_device(per_row, torch.int32, self.row_slots.device))
        if self.x.is_cuda:
            self._graph(rows, seqs, lora).replay()
        else:
            self._forward(rows, seqs, lora)
        return self.logits[:len(slices)], self.hidden[:len(slices)]
