"""GPU decode fast path: decode steps built from fused Triton kernels (decode_kernels.py), replayed
as CUDA graphs, one per batch-size bucket.

Why Triton and not flashinfer: flashinfer's wheel (62 MB, kernels compiled at first use, with
dependencies the GPU image lacks) cannot be carried to our GPU machine beside the project; Triton
ships with PyTorch there. The torch path (text.py, attention.py) stays for the CPU and for prefill.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.decode_kernels import (FED_BACK, GEMV_MAX_ROWS, banned_greedy, embed_rows, gpu_paths, greedy_tokens,
                                      linear2_residual, norm_linear, norm_linear_attention, one_kernel_counters,
                                      rotary_paged_attention)
from ..kernels.grouped_attention import GROUP, group_rows, grouped_attention
from ..kernels.lora_kernels import lora_expand_in, lora_expand_out, lora_shrink, segments
from ..kernels.moe_kernels import moe_mlp_cuda
from ..kernels.packed import PackedWeight
from ..kernels.residual_kernels import residual_norm
from ..kernels.tau_cuda import tau_rows
from ..kernels.w4a16_kernels import w4_linear2_residual, w4_norm_linear
from ..model.layers import layer_norm, linear, mlp, mlp_hidden
from ..model.moondream import Moondream
from ..model.lora import SlotRows
from ..model.text import apply_tau, expert_lora, mlp_with_lora
from .cuda_graphs import CapturedGraphs
from .kv_cache import PagedKVCache


log = logging.getLogger("kestrel.decode")
ATTENTION_IN_NORM_LINEAR = True  # the one-kernel form of norm + qkv/fc1 + attention for one sequence (benchmarks
#                                  compare without)
ONE_KERNEL_SPLITS = 8  # its context splits for long contexts (H100, interleaved A/B: 8 best at 300 and 800 tokens;
#                        16 at 2000 is 3% faster, 4 is 10 to 20% slower). With two sequences the one kernel lost.


def fused_decode_step(model: Moondream, x: torch.Tensor, cache: PagedKVCache, inputs: "StepTensors",
                      logits_out: torch.Tensor, context_splits: int | None = None,
                      greedy_out: torch.Tensor | None = None, greedy_host: torch.Tensor | None = None,
                      hidden_out: torch.Tensor | None = None, lora=None, grouped: bool = False) -> torch.Tensor:
    """One decode step (one new token per sequence) with the fused kernels, then the final norm and LM
    head. Writes float32 logits into logits_out; returns the hidden states (written into hidden_out if
    given). With greedy_out (and no lora), each row's inputs.banned tokens are -inf in the logits and its greedy
    token goes there (and into greedy_host, pinned host memory, if given): chosen by the LM head in the GEMV form,
    by banned_greedy after cuBLAS's LM head past it.

    Up to GEMV_MAX_ROWS sequences every weight is streamed by our kernels (for one sequence the
    attention runs inside the norm + qkv/fc1 kernel); past that, the norm + qkv/fc1 and the LM head go
    to cuBLAS's tensor-core GEMMs. context_splits: programs per sequence and head in the attention
    (default: decode_kernels.context_splits; ONE_KERNEL_SPLITS for the one-kernel form). grouped: the attention
    reads the pages that rows share once for all of them (grouped_attention; inputs.groups), not once a row.

    lora: (LoraPool, the step's rows in segments of one adapter: StepInputs.segments): each row adds its
    adapter's deltas (lora_kernels); qkv and fc1 then come from cuBLAS, whatever the row count. On a GPU two of the
    three adapter kernels run on a side stream beside the base work: the shrink beside qkv and fc1's matmuls, proj's
    and fc2's deltas onto the residual beside the attention. Moondream 3's: (ExpertLoraPool, each row's slot:
    StepInputs.row_slots), the deltas of its dense and expert MLPs (moe_lora).

    4-bit weights (PackedWeight) go to the W4A16 twins of norm_linear and linear2_residual at every row count
    (with lora, qkv and fc1 from transient bf16 weights)."""
    cfg, w, page = model.config.text, model.weights.text, cache.page_size
    packed = isinstance(w.blocks[0].qkv.weight, PackedWeight)
    gemv = x.shape[0] <= GEMV_MAX_ROWS and (lora is None or cfg.tau_attn)  # (Moondream 3's adapters: MLPs only)
    one_kernel = gemv and x.shape[0] == 1 and cfg.n_kv_heads == cfg.n_heads and ATTENTION_IN_NORM_LINEAR and \
        not cfg.tau_attn and not packed  # (Moondream 3's layers: _moondream3_layer)
    sync, best = _step_counters(len(w.blocks), cfg.n_heads, x.shape[0], one_kernel,
                                gemv and greedy_out is not None and lora is None, x.device)
    if lora is not None and not cfg.tau_attn:  # every layer's shrunk values, summed atomically: zeroed once
        pool, segs = lora
        shrunk = torch.zeros(len(w.blocks), x.shape[0], 4 * pool.rank_cap, device=x.device, dtype=torch.float32)
        side = _side_stream(x.device) if x.is_cuda else None
    rows = SlotRows(*lora) if lora is not None and cfg.tau_attn else None  # (Moondream 3's: each row's slot)
    h = None  # Moondream 3's layers: the normed input, from the layer before
    positions = inputs.seq_lens - 1 if cfg.tau_attn else None  # (tau's: one kernel a step, not one a layer)
    for i, block in enumerate(w.blocks):
        last = i == len(w.blocks) - 1  # (straight into hidden_out: no copy node between it and the LM head)
        if block.tau is not None:  # Moondream 3's layers
            h = layer_norm(x, block.ln) if h is None else h
            x, h = _moondream3_layer(x, h, block, None if last else w.blocks[i + 1].ln, cfg, cache, i, inputs,
                                     positions, context_splits, hidden_out if last else None, grouped, gemv, rows)
            continue
        if one_kernel:
            out, g = norm_linear_attention(x, block.ln.weight, block.ln.bias, block.qkv.weight, block.qkv.bias,
                                           block.mlp.fc1.weight, block.mlp.fc1.bias, inputs.cos, inputs.sin,
                                           cache.k[i], cache.v[i], inputs.block_tables, inputs.seq_lens, inputs.slots,
                                           page, sync[i], context_splits or ONE_KERNEL_SPLITS)
        else:
            if packed and lora is None:
                qkv, g = w4_norm_linear(x, block.ln.weight, block.ln.bias, block.qkv.weight, block.qkv.bias,
                                        block.mlp.fc1.weight, block.mlp.fc1.bias)
            elif gemv:
                qkv, g = norm_linear(x, block.ln.weight, block.ln.bias, block.qkv.weight, block.qkv.bias,
                                     block.mlp.fc1.weight, block.mlp.fc1.bias, gelu2=True)
            elif lora is not None:
                h = layer_norm(x, block.ln)
                _fork(side, lora_shrink, h, pool.a_h[i], segs, pool.ranks, shrunk[i])
                qkv, g = linear(h, block.qkv), linear(h, block.mlp.fc1)  # (fc1's GELU after its delta)
                _join(side)
                lora_expand_in(qkv, g, shrunk[i], pool.b["qkv"][i], pool.b["fc1"][i], pool.a_g[i], segs, pool.ranks)
                # proj's and fc2's deltas onto the residual (linear2_residual adds the rest to it)
                _fork(side, lora_expand_out, x, shrunk[i], pool.b["proj"][i], pool.b["fc2"][i], segs, pool.ranks)
            else:
                h = layer_norm(x, block.ln)
                qkv, g = linear(h, block.qkv), mlp_hidden(h, block.mlp)
            out = _decode_attention(qkv, cfg, cache, i, inputs, context_splits, grouped)
            if lora is not None:
                _join(side)
        x = (w4_linear2_residual if packed else linear2_residual)(out, block.proj.weight, g, block.mlp.fc2.weight, x,
                                                                  block.out_bias, out=hidden_out if last else None)
    if gemv:
        norm_linear(x, w.post_ln.weight, w.post_ln.bias, w.lm_head.weight, w.lm_head.bias, out1=logits_out,
                    banned=inputs.banned, best=best)
        if best is not None:
            greedy_tokens(best, out=greedy_out, host_out=greedy_host)
    else:
        logits_out.copy_(model.logits(x))
        if greedy_out is not None and lora is None:
            banned_greedy(logits_out, inputs.banned, greedy_out, greedy_host)
    return x


@functools.lru_cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _fork(side: torch.cuda.Stream | None, work, *args):
    """work(*args) on the side stream, after what the current stream has queued so far (at once without one);
    -> its result (read it on the current stream only after _join)."""
    if side is None:
        return work(*args)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        return work(*args)


def _join(side: torch.cuda.Stream | None) -> None:
    """The current stream waits for the side stream's work."""
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)


# tau of a step of one or two rows as one kernel (tau_rows) instead of four (GELU, cuBLAS's split-K product and its
# reduction, tau_inplace): H100, FP8 experts, one row at context 64 / 800 1.181 / 1.301 against 1.229 / 1.332 ms, two
# rows 1.605 / 1.723 against 1.613 / 1.739 (benchmarks/ab_code.py; bf16 experts, one row 1.452 / 1.500 against 1.449 /
# 1.562); its loop unrolled since (tau_cuda). Our GEMV for qkv and proj instead of cuBLAS's, and the dense layers as
# Moondream 2's GEMV kernels, were no faster (PERFORMANCE.md, What we tried).
TAU_ONE_KERNEL = True  # (benchmarks compare without)


def _tau(qkv: torch.Tensor, positions: torch.Tensor, tau, cfg, gemv: bool) -> torch.Tensor:
    if gemv and TAU_ONE_KERNEL:
        return tau_rows(qkv, tau.w, tau.alpha, positions, cfg.n_heads, cfg.head_dim)
    return apply_tau(qkv, positions, tau, cfg)


def _moondream3_layer(x: torch.Tensor, h: torch.Tensor, block, next_ln, cfg, cache: PagedKVCache, i: int,
                      inputs: "StepTensors", positions: torch.Tensor, context_splits: int | None,
                      out: torch.Tensor | None, grouped: bool, gemv: bool, lora: SlotRows | None = None):
    """One Moondream 3 layer of a decode step on its normed input h: cuBLAS for qkv and proj, tau from each row's
    position (positions: its length less one; with gemv, one or two rows, in one kernel), the paged attention
    kernel, the dense MLP or the grouped expert kernels, then the residual and the next layer's norm (next_ln; None
    for the last layer) in one kernel. -> (x, next h).
    The MLP (router, experts) runs on a side stream beside the attention's kernels: both read h alone, and
    neither fills the GPU by itself (H100, batch 1: 1.62 against 2.25 ms a step; 64 rows 7.53 against 8.29)."""
    side = _side_stream(x.device) if x.is_cuda else None
    mlp_out, top_k = _fork(side, _moondream3_mlp, h, block, i, lora)
    qkv = _tau(linear(h, block.qkv), positions, block.tau, cfg, gemv)
    attn = _decode_attention(qkv, cfg, cache, i, inputs, context_splits, grouped)
    proj = torch.addmm(block.proj.bias, attn, block.proj.weight.t())
    _join(side)
    return residual_norm(proj, mlp_out, top_k, x, next_ln, out)


def _decode_attention(qkv: torch.Tensor, cfg, cache: PagedKVCache, layer: int, inputs: "StepTensors",
                      context_splits: int | None, grouped: bool) -> torch.Tensor:
    """The step's attention of its unrotated qkv rows [B, (H + 2 Hkv) * D] -> [B, H * D]: a program per row and
    head (split over the context as context_splits says), or, grouped, a program per group of rows that share
    pages and head."""
    if not grouped:
        return rotary_paged_attention(qkv, inputs.cos, inputs.sin, cache.k[layer], cache.v[layer],
                                      inputs.block_tables, inputs.seq_lens, inputs.slots, cfg.n_heads,
                                      cache.page_size, splits=context_splits)
    q, k, v = qkv.split([cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim], 1)
    heads = (t.view(len(qkv), -1, cfg.head_dim) for t in (q, k, v))
    return grouped_attention(*heads, cache.k[layer], cache.v[layer], inputs.block_tables, inputs.seq_lens,
                             inputs.slots, inputs.groups, inputs.shared, cache.page_size, inputs.cos,
                             inputs.sin)


def _moondream3_mlp(h: torch.Tensor, block, i: int, lora: SlotRows | None = None) -> tuple[torch.Tensor, int]:
    """-> (the dense MLP's output, 0), or (each token's expert rows unsummed, top_k); lora: with each row's
    adapter's deltas."""
    if block.moe is None:
        return (mlp(h, block.mlp) if lora is None else mlp_with_lora(h, block.mlp, lora, i)), 0
    return moe_mlp_cuda(h, block.moe, summed=False, lora=expert_lora(lora, i, h)), block.moe.top_k


def _step_counters(layers: int, heads: int, rows: int, one_kernel: bool, greedy: bool, device):
    """Zeros for the one kernel's counters (sync: [layers, one_kernel_counters(heads, rows)] int32) and the LM head's
    greedy keys (best: greedy_keys(rows)), or None where unused: one allocation, so one memset node in
    the step's graph. Made here, not just before the LM head: that would hold up its start under PDL."""
    sync_n = layers * one_kernel_counters(heads, rows) if one_kernel else 0
    keys_at = sync_n + sync_n % 2  # the keys' int64 start 8-byte aligned
    keys_n = 2 * rows if greedy else 0
    if not keys_at + keys_n:
        return None, None
    zeros = torch.zeros(keys_at + keys_n, device=device, dtype=torch.int32)
    sync = zeros[:sync_n].view(layers, -1) if one_kernel else None
    best = zeros[keys_at:].view(torch.int64) if greedy else None
    return sync, best


@dataclass
class StepTensors:
    """What a decode step reads besides the activations, per sequence: its page table, its length
    counting the new token, the cache row of the new token, the rotary cos/sin of its position, and the
    tokens its greedy choice may not take; for the grouped attention, the rows grouped by shared pages."""

    block_tables: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32
    slots: torch.Tensor  # [B] int32
    cos: torch.Tensor  # [B, rope_dim / 2] float32
    sin: torch.Tensor
    banned: torch.Tensor  # [B, MAX_BANNED] int32 token ids the greedy choice skips, -1 for none
    groups: torch.Tensor | None = None  # [B, GROUP] int32, and
    shared: torch.Tensor | None = None  # [B] int32: the rows grouped by the pages they share (group_rows)


MAX_BANNED = 2  # per sequence and step (a generation bans at most two tokens)


class StepInputs:
    """StepTensors and each row's input token for up to n sequences, computed on the host and packed in
    one pinned buffer, so a step needs no small index kernels and its one host-to-device copy is a node
    of the step's graph (copy_to_device). float32 fields are stored bit for bit in the int32 buffer.
    The rows are filled through numpy into a staging array, which prepare() can do for the next step
    while the GPU runs this one: host time between steps is time the GPU waits."""

    def __init__(self, n: int, max_pages: int, cache: PagedKVCache, rope: torch.Tensor, device):
        self.cache, self.n, self.max_pages = cache, n, max_pages
        self.rope = rope.cpu().numpy()  # [max_context, rope_dim / 2, 2] float32
        half = self.rope.shape[1]
        # tables, lengths, slots, cos, sin, banned tokens, groups of rows sharing pages and their shared positions,
        # input tokens, and the rows in segments of one adapter: rows sorted by adapter, where each segment starts
        # (then the end), its adapter's LoraPool slot; then each row's slot (Moondream 3's pool reads that)
        self._sizes = [n * max_pages, n, n, n * half, n * half, n * MAX_BANNED, n * GROUP, n, n, n, n + 1, n, n]
        cuda = torch.device(device).type == "cuda"  # (the CPU form is for the tests)
        # two pinned buffers: one step's may be filled while the GPU has yet to copy the other's
        self.host = [torch.zeros(sum(self._sizes), dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        self.device = torch.zeros_like(self.host[0], device=device)
        self._copied = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._staged, self._staged_for = np.zeros(sum(self._sizes), dtype=np.int32), None
        tables, self._lens, self._slots, cos, sin, banned, groups, self._shared = self._fields(self._staged)[:8]
        banned[:] = -1  # (no bans unless upload sets some)
        self._tables, self._groups = tables.reshape(n, max_pages), groups.reshape(n, GROUP)
        self._cos, self._sin = cos.view(np.float32).reshape(n, half), sin.view(np.float32).reshape(n, half)
        self._host = [self._fields(h.numpy()) for h in self.host]  # views of each pinned buffer's fields

    def _fields(self, buffer: np.ndarray) -> list[np.ndarray]:
        """Views of one packed buffer: tables, lengths, slots, cos, sin, banned tokens, groups, shared positions,
        input tokens, segments."""
        return np.split(buffer, np.cumsum(self._sizes)[:-1])

    def rows(self, b: int) -> StepTensors:
        """Device views for the first b sequences (static addresses: graph inputs)."""
        tables, lens, slots, cos, sin, banned, groups, shared = self.device.split(self._sizes)[:8]
        return StepTensors(tables.view(self.n, self.max_pages)[:b], lens[:b], slots[:b],
                           cos.view(torch.float32).view(self.n, -1)[:b], sin.view(torch.float32).view(self.n, -1)[:b],
                           banned.view(self.n, MAX_BANNED)[:b], groups.view(self.n, GROUP)[:b], shared[:b])

    def tokens(self, b: int) -> torch.Tensor:
        """Device view of the first b rows' input tokens (-1 where the input is an embedding)."""
        return self.device.split(self._sizes)[8][:b]

    def segments(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Device views of a step of b rows' segments: rows by adapter, segment starts (b + 1), their slots."""
        rows, starts, slots = self.device.split(self._sizes)[9:12]
        return rows[:b], starts[:b + 1], slots[:b]

    def row_slots(self, b: int) -> torch.Tensor:
        """Device view of a step of b rows' adapter slots, in row order."""
        return self.device.split(self._sizes)[12][:b]

    def prepare(self, seq_ids: list[int], positions: list[int], bucket: int, grouped: bool = False) -> None:
        """Stage the rows of a step over these sequences at these positions; padding rows up to the
        bucket write to the scratch page; grouped: the rows' groups for grouped_attention too. Nothing is done if
        they are staged already (a sequence's id is never reused and its pages are allocated when it is admitted,
        so its staged rows stay true)."""
        if self._staged_for == (seq_ids, positions, bucket, grouped):
            return
        page, tables = self.cache.page_size, self._tables[:bucket]
        self.cache.fill_tables(seq_ids, tables)
        pos = np.zeros(bucket, dtype=np.int64)
        pos[:len(positions)] = positions
        self._slots[:bucket] = tables[np.arange(bucket), pos // page] * page + pos % page
        self._lens[:bucket] = pos + 1
        self._cos[:bucket], self._sin[:bucket] = self.rope[pos, :, 0], self.rope[pos, :, 1]
        if grouped:
            group_rows(tables, pos, page, self._groups[:bucket], self._shared[:bucket])
        self._staged_for = (list(seq_ids), list(positions), bucket, grouped)

    def upload(self, tokens: list[int], seq_ids: list[int], positions: list[int], bucket: int,
               banned: list[tuple[int, ...]] = (), buffer: int = 0, adapter_slots: list[int] = (),
               grouped: bool = False) -> None:
        """This step's rows (staged now unless prepare() did), input tokens, banned tokens (at most
        MAX_BANNED per sequence) and the rows' segments by adapter slot into pinned buffer 0 or 1."""
        self.prepare(seq_ids, positions, bucket, grouped)
        if self._copied[buffer] is not None:
            self._copied[buffer].synchronize()  # the last step from this buffer has copied it
        fields = self._host[buffer]
        np.copyto(self.host[buffer].numpy(), self._staged)  # (banned rows: -1, from the staging array)
        fields[8][:len(tokens)] = tokens
        if adapter_slots:
            rows, fields[10][:], fields[11][:] = segments(adapter_slots, self.n)
            fields[9][:len(rows)] = rows
            fields[12][:len(adapter_slots)] = adapter_slots
        bans = fields[5].reshape(self.n, MAX_BANNED)
        for row, tokens_out in enumerate(banned):
            bans[row, :len(tokens_out)] = tokens_out

    def copy_to_device(self, buffer: int = 0) -> None:
        """The host-to-device copy, issued inside the step (a node of its graph)."""
        self.device.copy_(self.host[buffer], non_blocking=True)

    def step_launched(self, buffer: int = 0) -> None:
        if self._copied[buffer] is not None:
            self._copied[buffer].record()


class HostTokens:
    """Token ids that a step's last kernel writes into pinned host memory (`pinned`): tolist() waits for
    that step only, not for steps launched after it."""

    def __init__(self, n: int):
        self.pinned = torch.zeros(n, dtype=torch.int32, pin_memory=True)
        self._written = torch.cuda.Event()
        self._n = 0

    def after_step(self, n: int) -> "HostTokens":
        """Mark the step just launched as the one whose first n tokens tolist() returns."""
        self._n = n
        self._written.record()
        return self

    def tolist(self) -> list[int]:
        self._written.synchronize()
        return self.pinned[:self._n].tolist()


LONG_CONTEXT = 128  # from here splitting the attention over the context pays (H100, one sequence, interleaved
#                    A/B: at context 64 one program per head is 2% faster, at 300 the split is 18% faster)
# Buckets of MANY_ROWS sequences and more split the attention in MANY_ROWS_SPLITS from MANY_ROWS_LONG_CONTEXT on
# (H100, decode steps of 32 / 64 / 128 sequences against one program per sequence and head, two rounds: at
# context 800 7 / 7 / 2% faster, at 1500 5 / 8 / 3%, at 512 within 3%, at 256 up to 5% slower; 16 sequences
# gained nothing at 800). Image queries have 730 positions or more.
MANY_ROWS, MANY_ROWS_LONG_CONTEXT, MANY_ROWS_SPLITS = 32, 640, 4
# Long-context steps of GROUPED_MIN_ROWS rows and more read the pages that rows share (questions on one image)
# once for all of them instead (grouped_attention; benchmarks compare without). At 16 rows it has too few programs
# (H100: 117 against 89 us a layer with no rows sharing, 82 against 87 with pairs; bursts at batch 16 alike)
GROUPED_ATTENTION, GROUPED_MIN_ROWS = True, 32


class CudaGraphDecoder:
    """Decode steps for up to max_batch sequences, captured once per batch-size bucket and replayed.
    Buckets of the GEMV form and of MANY_ROWS sequences or more get two graphs: for short contexts the
    attention is one program per sequence and head (GEMV form) or as context_splits has it; for long ones it
    is split over the context, or grouped (from GROUPED_MIN_ROWS). Every bucket comes in two parities that
    alternate from step to step (inputs from pinned buffer p, greedy tokens into greedy[p] and pinned
    host buffer p): a step can then be launched while the one before is still running, taking that
    step's tokens as its inputs on the GPU (FED_BACK) before the host has read them. Steps where some row has
    a LoRA adapter replay graphs of their own (the `lora` form of fused_decode_step, one parity), captured
    once the adapters' pool exists."""

    def __init__(self, model: Moondream, cache: PagedKVCache, max_batch: int, max_context: int, adapters=None):
        self.model, self.cache, self.adapters = model, cache, adapters  # adapters: the AdapterRegistry
        log.info("decode kernels on %s", gpu_paths(model.device))
        dev, dim = model.device, model.config.text.dim
        self.buckets = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_batch} | {max_batch})
        self.inputs = StepInputs(max_batch, cache.pages_for(max_context), cache, model.rope, dev)
        self.given = torch.zeros(max_batch, dim, device=dev, dtype=model.dtype)  # inputs that are not tokens
        self.logits = torch.zeros(max_batch, model.config.text.vocab_size, device=dev, dtype=torch.float32)
        self.hidden = torch.zeros(max_batch, dim, device=dev, dtype=model.dtype)
        self.greedy = torch.zeros(2, max_batch, device=dev, dtype=torch.int32)
        self._greedy_host = [HostTokens(max_batch) for _ in range(2)]
        self.graphs = CapturedGraphs()  # by (bucket, long context, parity, with adapters)
        self._parity = 1

    FED_BACK = FED_BACK  # (for the scheduler, which does not import the kernels)

    def _step(self, b: int, long_context: bool, parity: int, lora: bool = False) -> None:
        self.inputs.copy_to_device(parity)
        previous = self.greedy[1 - parity, :b]  # the tokens of the step before, for FED_BACK inputs
        x = embed_rows(self.inputs.tokens(b), self.model.weights.text.wte, self.given[:b], previous)
        if b <= GEMV_MAX_ROWS:
            splits = None if long_context else 1
        else:
            splits = MANY_ROWS_SPLITS if long_context else None
        fused_decode_step(self.model, x, self.cache, self.inputs.rows(b), self.logits[:b], splits,
                          self.greedy[parity, :b], self._greedy_host[parity].pinned[:b], self.hidden[:b],
                          (self.adapters.pool, self._adapter_rows(b)) if lora else None,
                          grouped=self._grouped(b, long_context))

    def _adapter_rows(self, b: int):
        """How the adapters' kernels find a row's adapter: Moondream 3's by its slot, Moondream 2's by segments."""
        return self.inputs.row_slots(b) if self.model.config.text.tau_attn else self.inputs.segments(b)

    def _graph(self, b: int, long_context: bool, parity: int, lora: bool = False) -> torch.cuda.CUDAGraph:
        # (the warm-up steps write to the scratch page)
        return self.graphs.get_or_capture((b, long_context, parity, lora),
                                          lambda: self._step(b, long_context, parity, lora))

    @staticmethod
    def _variants(bucket: int) -> list[bool]:
        long_from = GROUPED_MIN_ROWS if GROUPED_ATTENTION else MANY_ROWS
        return [False, True] if bucket <= GEMV_MAX_ROWS or bucket >= min(long_from, MANY_ROWS) else [False]

    @staticmethod
    def _long_context(bucket: int) -> int:
        return LONG_CONTEXT if bucket <= GEMV_MAX_ROWS else MANY_ROWS_LONG_CONTEXT

    def _is_long(self, bucket: int, positions: list[int]) -> bool:
        return self._variants(bucket)[-1] and max(positions) >= self._long_context(bucket)

    @staticmethod
    def _grouped(bucket: int, long_context: bool) -> bool:
        """Whether the step's attention reads shared pages once for the rows that share them."""
        return GROUPED_ATTENTION and long_context and bucket >= GROUPED_MIN_ROWS

    def warmup(self) -> None:
        for buffer in (0, 1):  # every row padding: all writes go to the scratch page
            self.inputs.upload([], [], [], max(self.buckets), buffer=buffer)
        with_adapters = self.adapters is not None and self.adapters.pool is not None
        with torch.inference_mode():
            for b in self.buckets:
                for long_context in self._variants(b):
                    for parity in (0, 1):
                        self._graph(b, long_context, parity)
                    if with_adapters:
                        self._graph(b, long_context, 0, lora=True)

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    @torch.inference_mode()
    def run(self, inputs: list, seq_ids: list[int], positions: list[int], banned: list[tuple[int, ...]] | None = None,
            adapter_slots: list[int] | None = None):
        """One step. inputs: per sequence a token id, FED_BACK (the token the previous step chose for
        that row, which must have been a step of these sequences), or an input embedding [dim] (a region
        head's), at these positions; banned: per sequence the tokens its greedy choice may not take.
        -> (logits [B, V], hidden [B, dim], greedy HostTokens or None): logits and hidden are views of
        static buffers, not yet computed when this returns (the GPU runs the step), and overwritten by
        the next step; greedy, each row's argmax with its bans applied (which are -inf in logits then),
        is on its way to the host ahead of any later step. It comes when every row bans at most MAX_BANNED
        and no row has an adapter (adapter_slots: each row's LoraPool slot, 0 for none)."""
        n = len(seq_ids)
        bucket = self._bucket(n)
        long_context = self._is_long(bucket, positions)
        lora = bool(adapter_slots) and any(adapter_slots)
        parity = 1 - self._parity if not lora else 0
        tokens = [t if isinstance(t, int) else -1 for t in inputs]
        for i, given in enumerate(inputs):
            if not isinstance(given, int):
                self.given[i].copy_(given.reshape(-1))
        fits = banned is not None and all(len(b) <= MAX_BANNED for b in banned)
        self.inputs.upload(tokens, seq_ids, positions, bucket, banned if fits else (), buffer=parity,
                           adapter_slots=adapter_slots if lora else (), grouped=self._grouped(bucket, long_context))
        self._graph(bucket, long_context, parity, lora).replay()
        self.inputs.step_launched(parity)
        greedy = None
        if not lora:
            self._parity = parity
            if fits:
                greedy = self._greedy_host[parity].after_step(n)
        return self.logits[:n], self.hidden[:n], greedy

    def feed_back(self, tokens: torch.Tensor) -> None:
        """Make tokens [n] (on the device: a prefill's choice) the ones the next run's FED_BACK inputs take, as if
        the last step had chosen them (its graph reads the buffer of the last step's parity)."""
        self.greedy[self._parity, :tokens.numel()].copy_(tokens)

    def prepare(self, seq_ids: list[int], positions: list[int]) -> None:
        """Stage a likely next step (these sequences at these positions) while the GPU runs this one."""
        bucket = self._bucket(len(seq_ids))
        self.inputs.prepare(seq_ids, positions, bucket, self._grouped(bucket, self._is_long(bucket, positions)))
