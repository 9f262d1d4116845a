"""GPU decode fast path: decode steps built from fused Triton kernels (decode_kernels.py), replayed
as CUDA graphs, one per batch-size bucket.

Why Triton and not flashinfer: flashinfer's wheel (62 MB, kernels compiled at first use, with
dependencies the GPU image lacks) cannot be carried to our GPU machine beside the project; Triton
ships with PyTorch there. The torch path (text.py, attention.py) stays for the CPU and for prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..model.moondream import Moondream
from ..model.layers import layer_norm, linear, mlp_hidden
from .decode_kernels import GEMV_MAX_ROWS, linear2_residual, norm_linear, rotary_paged_attention
from .kv_cache import PagedKVCache


def fused_decode_step(model: Moondream, x: torch.Tensor, cache: PagedKVCache, inputs: "StepTensors",
                      logits_out: torch.Tensor, context_splits: int | None = None) -> torch.Tensor:
    """One decode step (one new token per sequence) with the fused kernels, then the final norm and LM
    head. Writes float32 logits into logits_out; returns the hidden states.

    Up to GEMV_MAX_ROWS sequences every weight is streamed by our kernels; past that, the norm + qkv/fc1
    and the LM head go to cuBLAS's tensor-core GEMMs. context_splits: programs per sequence and head in
    the attention (default: decode_kernels.context_splits)."""
    cfg, w, page = model.config.text, model.weights.text, cache.page_size
    gemv = x.shape[0] <= GEMV_MAX_ROWS
    for i, block in enumerate(w.blocks):
        if gemv:
            qkv, g = norm_linear(x, block.ln.weight, block.ln.bias, block.qkv.weight, block.qkv.bias,
                                 block.mlp.fc1.weight, block.mlp.fc1.bias, gelu2=True)
        else:
            h = layer_norm(x, block.ln)
            qkv, g = linear(h, block.qkv), mlp_hidden(h, block.mlp)
        out = rotary_paged_attention(qkv, inputs.cos, inputs.sin, cache.k[i], cache.v[i], inputs.block_tables,
                                     inputs.seq_lens, inputs.slots, cfg.n_heads, page, splits=context_splits)
        x = linear2_residual(out, block.proj.weight, g, block.mlp.fc2.weight, x, block.out_bias)
    if gemv:
        norm_linear(x, w.post_ln.weight, w.post_ln.bias, w.lm_head.weight, w.lm_head.bias, out1=logits_out)
    else:
        logits_out.copy_(model.logits(x))
    return x


@dataclass
class StepTensors:
    """What a decode step reads besides the activations, per sequence: its page table, its length
    counting the new token, the cache row of the new token, and the rotary cos/sin of its position."""

    block_tables: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32
    slots: torch.Tensor  # [B] int32
    cos: torch.Tensor  # [B, rope_dim / 2] float32
    sin: torch.Tensor


class StepInputs:
    """StepTensors for up to n sequences, computed on the host and packed in one pinned buffer, so a
    step needs one host-to-device copy and no small index kernels. float32 fields are stored bit for
    bit in the int32 buffer. The host side is filled through numpy: per-step host time is step time."""

    def __init__(self, n: int, max_pages: int, cache: PagedKVCache, rope: torch.Tensor, device):
        self.cache, self.n, self.max_pages = cache, n, max_pages
        self.rope = rope.cpu().numpy()  # [max_context, rope_dim / 2, 2] float32
        half = self.rope.shape[1]
        self._sizes = [n * max_pages, n, n, n * half, n * half]
        cuda = torch.device(device).type == "cuda"  # (the CPU form is for the tests)
        self.host = torch.zeros(sum(self._sizes), dtype=torch.int32, pin_memory=cuda)
        self.device = torch.zeros_like(self.host, device=device)
        self._copied = torch.cuda.Event() if cuda else None
        tables, self._lens, self._slots, cos, sin = np.split(self.host.numpy(), np.cumsum(self._sizes)[:-1])
        self._tables = tables.reshape(n, max_pages)
        self._cos, self._sin = cos.view(np.float32).reshape(n, half), sin.view(np.float32).reshape(n, half)

    def rows(self, b: int) -> StepTensors:
        """Device views for the first b sequences (static addresses: graph inputs)."""
        tables, lens, slots, cos, sin = self.device.split(self._sizes)
        return StepTensors(tables.view(self.n, self.max_pages)[:b], lens[:b], slots[:b],
                           cos.view(torch.float32).view(self.n, -1)[:b], sin.view(torch.float32).view(self.n, -1)[:b])

    def upload(self, seq_ids: list[int], positions: list[int], bucket: int) -> None:
        """Fill rows for these sequences; padding rows up to the bucket write to the scratch page."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host buffer
        page, tables = self.cache.page_size, self._tables[:bucket]
        tables.fill(self.cache.scratch_page)
        for i, sid in enumerate(seq_ids):
            table = self.cache.table_tensors[sid].numpy()
            tables[i, :len(table)] = table
        pos = np.zeros(bucket, dtype=np.int64)
        pos[:len(positions)] = positions
        self._slots[:bucket] = tables[np.arange(bucket), pos // page] * page + pos % page
        self._lens[:bucket] = pos + 1
        self._cos[:bucket], self._sin[:bucket] = self.rope[pos, :, 0], self.rope[pos, :, 1]
        self.device.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()


LONG_CONTEXT = 128  # from here splitting the attention over the context pays (H100, one sequence, interleaved
#                    A/B: at context 64 one program per head is 2% faster, at 300 the split is 18% faster)


class CudaGraphDecoder:
    """Decode steps for up to max_batch sequences, captured once per batch-size bucket and replayed.
    Buckets of the GEMV form get two graphs: for short contexts the attention is one program per
    sequence and head; for long ones it is split over the context."""

    def __init__(self, model: Moondream, cache: PagedKVCache, max_batch: int, max_context: int):
        self.model, self.cache = model, cache
        dev, dim = model.device, model.config.text.dim
        self.buckets = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch} | {max_batch})
        self.inputs = StepInputs(max_batch, cache.pages_for(max_context), cache, model.rope, dev)
        self.x = torch.zeros(max_batch, dim, device=dev, dtype=model.dtype)
        self.logits = torch.zeros(max_batch, model.config.text.vocab_size, device=dev, dtype=torch.float32)
        self.hidden = torch.zeros(max_batch, dim, device=dev, dtype=model.dtype)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._pool = None

    def _step(self, b: int, long_context: bool) -> None:
        splits = 1 if b <= GEMV_MAX_ROWS and not long_context else None
        self.hidden[:b] = fused_decode_step(self.model, self.x[:b], self.cache, self.inputs.rows(b), self.logits[:b],
                                            splits)

    def _graph(self, b: int, long_context: bool) -> torch.cuda.CUDAGraph:
        if (b, long_context) not in self.graphs:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton compiles, allocator settles (writes go to the scratch page)
                    self._step(b, long_context)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._step(b, long_context)
            self._pool = graph.pool()
            self.graphs[b, long_context] = graph
        return self.graphs[b, long_context]

    @staticmethod
    def _variants(bucket: int) -> list[bool]:
        return [False, True] if bucket <= GEMV_MAX_ROWS else [False]

    def warmup(self) -> None:
        self.inputs.upload([], [], max(self.buckets))  # every row padding: all writes go to the scratch page
        with torch.inference_mode():
            for b in self.buckets:
                for long_context in self._variants(b):
                    self._graph(b, long_context)

    @torch.inference_mode()
    def run(self, inputs: torch.Tensor, seq_ids: list[int], positions: list[int]):
        """inputs [B, dim] at these positions -> (logits [B, V], hidden [B, dim]) views of static buffers."""
        n = len(seq_ids)
        bucket = next(b for b in self.buckets if b >= n)
        long_context = self._variants(bucket)[-1] and max(positions) >= LONG_CONTEXT
        self.inputs.upload(seq_ids, positions, bucket)
        self.x[:n].copy_(inputs)
        self._graph(bucket, long_context).replay()
        return self.logits[:n], self.hidden[:n]
