"""GPU decode fast path: a Triton paged-attention decode kernel, and decode steps replayed as CUDA
graphs, one per batch-size bucket.

Why Triton and not flashinfer: flashinfer's wheel (62 MB, kernels compiled at first use, with
dependencies the GPU image lacks) cannot be carried to our GPU machine beside the project; Triton
ships with PyTorch there. The torch path (attention.py) stays for the CPU and for prefill.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..model.moondream import Moondream
from .kv_cache import PagedKVCache


@triton.jit
def _paged_decode_kernel(q_ptr, k_new_ptr, v_new_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, slots_ptr,
                         out_ptr, q_stride, kv_stride, bt_stride, scale, H: tl.constexpr, HKV: tl.constexpr,
                         D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (sequence, head): online softmax over the sequence's cached pages, then the new
    token's own k/v (passed in; the first head of each kv group also stores them into the cache)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // (H // HKV)
    cached = tl.load(seq_lens_ptr + b) - 1
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + b * q_stride + h * D + offs_d).to(tl.float32) * scale
    k_new = tl.load(k_new_ptr + b * kv_stride + kvh * D + offs_d)
    v_new = tl.load(v_new_ptr + b * kv_stride + kvh * D + offs_d)
    if h % (H // HKV) == 0:
        slot = tl.load(slots_ptr + b)
        tl.store(k_ptr + (slot * HKV + kvh) * D + offs_d, k_new)
        tl.store(v_ptr + (slot * HKV + kvh) * D + offs_d, v_new)
    m_i = tl.sum(q * k_new.to(tl.float32), 0)  # start the online softmax with the new token
    l_i = m_i * 0 + 1.0
    acc = v_new.to(tl.float32)
    for start in range(0, cached, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        valid = offs_n < cached
        page = tl.load(block_table_ptr + b * bt_stride + offs_n // PAGE, mask=valid, other=0)
        rows = page.to(tl.int64) * PAGE + offs_n % PAGE
        offs = (rows[:, None] * HKV + kvh) * D + offs_d[None, :]
        k = tl.load(k_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.where(valid, tl.sum(k * q[None, :], 1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    tl.store(out_ptr + (b * H + h) * D + offs_d, (acc / l_i).to(out_ptr.dtype.element_ty))


def paged_decode_attention(q, k_new, v_new, k_cache, v_cache, block_tables, seq_lens, slots, page_size: int):
    """Decode attention for one new token per sequence, which is also written into the cache.

    q [B, H, D], k_new/v_new [B, Hkv, D] (rows may be strided, heads dense); caches [rows, Hkv, D];
    block_tables [B, P] int32; seq_lens [B] int32 (including the new token); slots [B] int64 -> [B, H, D].
    """
    bsz, heads, dim = q.shape
    assert q.stride(2) == 1 and q.stride(1) == dim and k_new.stride(1) == dim and k_new.stride() == v_new.stride()
    out = torch.empty(bsz, heads, dim, device=q.device, dtype=q.dtype)
    _paged_decode_kernel[(bsz, heads)](q, k_new, v_new, k_cache, v_cache, block_tables, seq_lens, slots, out,
                                       q.stride(0), k_new.stride(0), block_tables.stride(0), dim ** -0.5,
                                       H=heads, HKV=k_cache.shape[1], D=dim, PAGE=page_size, BLOCK_N=64, num_warps=4)
    return out


class TritonDecodeAttention:
    """Attention for a decode step (one new token per sequence), on static device tensors."""

    def __init__(self, cache: PagedKVCache, block_tables, seq_lens, positions):
        self.cache, self.block_tables, self.seq_lens = cache, block_tables, seq_lens
        p = cache.page_size
        rows = torch.arange(positions.shape[0], device=positions.device)
        self.slots = block_tables[rows, positions // p].long() * p + positions % p

    def __call__(self, layer: int, q, k, v):
        return paged_decode_attention(q, k, v, self.cache.k[layer], self.cache.v[layer], self.block_tables,
                                      self.seq_lens, self.slots, self.cache.page_size)


class CudaGraphDecoder:
    """Decode steps for up to max_batch sequences, captured once per batch-size bucket and replayed."""

    def __init__(self, model: Moondream, cache: PagedKVCache, max_batch: int, max_context: int):
        self.model, self.cache = model, cache
        dev, dim = model.device, model.config.text.dim
        self.buckets = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch} | {max_batch})
        n, self.max_pages = max_batch, cache.pages_for(max_context)
        self.x = torch.zeros(n, dim, device=dev, dtype=model.dtype)
        self.positions = torch.zeros(n, device=dev, dtype=torch.long)
        self.seq_lens = torch.ones(n, device=dev, dtype=torch.int32)
        self.block_tables = torch.full((n, self.max_pages), cache.scratch_page, device=dev, dtype=torch.int32)
        self.logits = torch.zeros(n, model.config.text.vocab_size, device=dev, dtype=torch.float32)
        self.hidden = torch.zeros(n, dim, device=dev, dtype=model.dtype)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None

    def _step(self, b: int) -> None:
        pos = self.positions[:b]
        attention = TritonDecodeAttention(self.cache, self.block_tables[:b], self.seq_lens[:b], pos)
        hidden = self.model.forward(self.x[:b], pos, attention)
        self.hidden[:b] = hidden
        self.logits[:b] = self.model.logits(hidden)

    def _graph(self, b: int) -> torch.cuda.CUDAGraph:
        if b not in self.graphs:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton compiles, allocator settles (writes go to the scratch page)
                    self._step(b)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(b)
            self._pool = graph.pool()
            self.graphs[b] = graph
        return self.graphs[b]

    def warmup(self) -> None:
        with torch.inference_mode():
            for b in self.buckets:
                self._graph(b)

    @torch.inference_mode()
    def run(self, inputs: torch.Tensor, seq_ids: list[int], positions: list[int]):
        """inputs [B, dim] at these positions -> (logits [B, V], hidden [B, dim]) views of static buffers."""
        n = len(seq_ids)
        bucket = next(b for b in self.buckets if b >= n)
        tables = torch.full((bucket, self.max_pages), self.cache.scratch_page, dtype=torch.int32)
        for i, sid in enumerate(seq_ids):
            t = self.cache.table_tensors[sid]
            tables[i, :len(t)] = t
        pos = torch.zeros(bucket, dtype=torch.long)
        pos[:n] = torch.tensor(positions)
        self.block_tables[:bucket].copy_(tables, non_blocking=True)
        self.positions[:bucket].copy_(pos, non_blocking=True)
        self.seq_lens[:bucket].copy_(pos + 1, non_blocking=True)
        self.x[:n].copy_(inputs)
        self._graph(bucket).replay()
        return self.logits[:n], self.hidden[:n]
