"""LoRA deltas inside the GPU decode step, rows of different adapters in one step (segmented, as Punica's SGMV):
the host sorts the step's rows by adapter into segments (`segments`), and for each segment a program reads its
adapter's A or B tile once from the LoraPool and applies it to every row of the segment with tensor-core
dots, in the model's dtype (the shrunk values rounded to it, as the reference's bf16 matmuls do; float32: exact
products). Rows without an adapter form a segment of slot 0.

Per layer three kernels, each program one segment and one block of columns (or of the input dim); programs of
the segments a step leaves empty return at once: `lora_shrink` of the normed input through qkv's, proj's and
fc1's A at once; `lora_expand_in` onto qkv and onto fc1's pre-activation, with the GELU as epilogue (fc1 leaves
cuBLAS without it; rows without an adapter get their GELU there too) and, from the activations it has just made,
its share of fc2's shrink; `lora_expand_out` of proj's and fc2's deltas onto the residual. The shrunk values are
summed atomically into one buffer per step (zeroed once), with relaxed atomics: no kernel reads the sums before
the next kernel, so they need no ordering (H100, 64 rows over 8 adapters of rank 8: the step's overhead +16 to
18% against +26.5% with Triton's default acq_rel). Loads past a slot's own rank are masked off: a pool of rank R
costs a rank-r adapter r's reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from .shared import dot_precision, gelu_tanh



def segments(slots: list[int], n: int | None = None) -> tuple[list[int], list[int], list[int]]:
    """Each row's adapter slot -> (rows sorted by slot, where each slot's run starts (then the end), its slot), for
    the kernels' segment axis of n programs (default: a row each): the segments past the step's are empty (they
    start at the end) and of slot 0."""
    n = len(slots) if n is None else n
    order = sorted(range(len(slots)), key=lambda row: slots[row])
    starts, seg_slots = [], []
    for i, row in enumerate(order):
        if not seg_slots or slots[row] != seg_slots[-1]:
            starts.append(i)
            seg_slots.append(slots[row])
    return order, starts + [len(order)] * (n + 1 - len(starts)), seg_slots + [0] * (n - len(seg_slots))


@triton.jit
def _segment(seg_start_ptr, s):
    """Where segment s's rows start and end in the sorted rows (a step's unused segments are empty: their
    programs read no more than this)."""
    return tl.load(seg_start_ptr + s), tl.load(seg_start_ptr + s + 1)


@triton.jit
def _adapter(seg_slot_ptr, ranks_ptr, s, R: tl.constexpr):
    """Segment s's adapter slot, and the rank columns (offs_r) with the mask of those its adapter fills (none for
    slot 0, whose rank is 0)."""
    slot = tl.load(seg_slot_ptr + s)
    offs_r = tl.arange(0, R)
    return slot, offs_r, offs_r < tl.load(ranks_ptr + slot)


@triton.jit
def _rows(seg_rows_ptr, r0, end):
    """The segment's next 16 rows from r0 (tl.dot's smallest tile), and which of them exist."""
    idx = r0 + tl.arange(0, 16)
    m = idx < end
    return tl.load(seg_rows_ptr + idx, mask=m, other=0), m


@triton.jit
def _lora_shrink_kernel(x_ptr, x_stride, a_ptr, seg_rows_ptr, seg_start_ptr, seg_slot_ptr, ranks_ptr, v_ptr, v_stride,
                        K: tl.constexpr, R: tl.constexpr, GROUPS: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr):
    """v[row, g * R + r] += sum over this program's block of k of A[slot, g * R + r, k] x[row, k], for its
    segment's rows (v zeroed before; the blocks of k are summed atomically)."""
    s, g, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = _segment(seg_start_ptr, s)
    if end <= start:
        return
    slot, offs_r, r_mask = _adapter(seg_slot_ptr, ranks_ptr, s, R)
    if slot == 0:
        return
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + slot.to(tl.int64) * (GROUPS * R * K) + (g * R + offs_r)[:, None] * K + offs_k[None, :],
                mask=r_mask[:, None], other=0.0)
    for r0 in range(start, end, 16):
        rows, m = _rows(seg_rows_ptr, r0, end)
        x = tl.load(x_ptr + rows[:, None] * x_stride + offs_k[None, :], mask=m[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(a.to(x.dtype)), input_precision=PRECISION)
        tl.atomic_add(v_ptr + rows[:, None] * v_stride + g * R + offs_r[None, :], acc,
                      mask=m[:, None] & r_mask[None, :], sem="relaxed")


@triton.jit
def _b_tile(b_ptr, slot, offs_n, n_mask, offs_r, r_mask, N: tl.constexpr, R: tl.constexpr):
    ptrs = b_ptr + slot.to(tl.int64) * (N * R) + offs_n[:, None] * R + offs_r[None, :]
    return tl.load(ptrs, mask=n_mask[:, None] & r_mask[None, :], other=0.0)


@triton.jit
def _lora_expand_in_kernel(qkv_ptr, qkv_stride, f_ptr, f_stride, v_ptr, v_stride, b_qkv_ptr, b_fc1_ptr, a_fc2_ptr,
                           seg_rows_ptr, seg_start_ptr, seg_slot_ptr, ranks_ptr, NQ: tl.constexpr, NF: tl.constexpr,
                           R: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """qkv += B_qkv v_qkv; f = gelu(f + B_fc1 v_fc1) (slot 0's rows: the GELU alone), and fc2's shrink of this
    block of f: v_fc2 += A_fc2[:, block] f[block] (atomically). Programs past qkv's column blocks take fc1's."""
    s, pid = tl.program_id(0), tl.program_id(1)
    start, end = _segment(seg_start_ptr, s)
    if end <= start:
        return
    slot, offs_r, r_mask = _adapter(seg_slot_ptr, ranks_ptr, s, R)
    q_blocks: tl.constexpr = (NQ + BLOCK_N - 1) // BLOCK_N
    if (slot == 0) & (pid < q_blocks):
        return
    if pid < q_blocks:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < NQ
        b = _b_tile(b_qkv_ptr, slot, offs_n, n_mask, offs_r, r_mask, NQ, R)
        for r0 in range(start, end, 16):
            rows, m = _rows(seg_rows_ptr, r0, end)
            ptrs = qkv_ptr + rows[:, None] * qkv_stride + offs_n[None, :]
            mask = m[:, None] & n_mask[None, :]
            v = tl.load(v_ptr + rows[:, None] * v_stride + offs_r[None, :], mask=m[:, None] & r_mask[None, :], other=0.0)
            y = tl.dot(v.to(b.dtype), tl.trans(b), tl.load(ptrs, mask=mask, other=0.0).to(tl.float32),
                       input_precision=PRECISION)
            tl.store(ptrs, y.to(ptrs.dtype.element_ty), mask=mask)
    else:
        offs_n = (pid - q_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < NF
        b = _b_tile(b_fc1_ptr, slot, offs_n, n_mask, offs_r, r_mask, NF, R)
        a2 = tl.load(a_fc2_ptr + slot.to(tl.int64) * (R * NF) + offs_r[:, None] * NF + offs_n[None, :],
                     mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        for r0 in range(start, end, 16):
            rows, m = _rows(seg_rows_ptr, r0, end)
            ptrs = f_ptr + rows[:, None] * f_stride + offs_n[None, :]
            mask = m[:, None] & n_mask[None, :]
            v = tl.load(v_ptr + rows[:, None] * v_stride + 2 * R + offs_r[None, :], mask=m[:, None] & r_mask[None, :],
                        other=0.0)
            y = tl.dot(v.to(b.dtype), tl.trans(b), tl.load(ptrs, mask=mask, other=0.0).to(tl.float32),
                       input_precision=PRECISION)
            y = tl.where(mask, gelu_tanh(y), 0.0).to(ptrs.dtype.element_ty)  # (fc2 and its shrink read it so)
            tl.store(ptrs, y, mask=mask)
            part = tl.dot(y, tl.trans(a2), input_precision=PRECISION)  # [16, R]
            tl.atomic_add(v_ptr + rows[:, None] * v_stride + 3 * R + offs_r[None, :], part,
                          mask=m[:, None] & r_mask[None, :], sem="relaxed")  # (none for slot 0: its rank is 0)


@triton.jit
def _lora_expand_out_kernel(x_ptr, x_stride, v_ptr, v_stride, b_proj_ptr, b_fc2_ptr, seg_rows_ptr, seg_start_ptr,
                            seg_slot_ptr, ranks_ptr, N: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr,
                            PRECISION: tl.constexpr):
    """x += B_proj v_proj + B_fc2 v_fc2 (the residual after out-projection and fc2), for the segment's rows."""
    s, pid = tl.program_id(0), tl.program_id(1)
    start, end = _segment(seg_start_ptr, s)
    if end <= start:
        return
    slot, offs_r, r_mask = _adapter(seg_slot_ptr, ranks_ptr, s, R)
    if slot == 0:
        return
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    proj = _b_tile(b_proj_ptr, slot, offs_n, n_mask, offs_r, r_mask, N, R)
    fc2 = _b_tile(b_fc2_ptr, slot, offs_n, n_mask, offs_r, r_mask, N, R)
    for r0 in range(start, end, 16):
        rows, m = _rows(seg_rows_ptr, r0, end)
        mask = m[:, None] & n_mask[None, :]
        ptrs = x_ptr + rows[:, None] * x_stride + offs_n[None, :]
        y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        v_ptrs = v_ptr + rows[:, None] * v_stride + offs_r[None, :]
        vr_mask = m[:, None] & r_mask[None, :]
        v_proj = tl.load(v_ptrs + R, mask=vr_mask, other=0.0).to(proj.dtype)
        v_fc2 = tl.load(v_ptrs + 3 * R, mask=vr_mask, other=0.0).to(fc2.dtype)
        y = tl.dot(v_proj, tl.trans(proj), y, input_precision=PRECISION)
        y = tl.dot(v_fc2, tl.trans(fc2), y, input_precision=PRECISION)
        tl.store(ptrs, y.to(ptrs.dtype.element_ty), mask=mask)


SHRINK_BLOCK_K = 128  # each program's block of the input dim
EXPAND_IN_BLOCK_N, EXPAND_OUT_BLOCK_N = 128, 64


def _segment_programs(slots: torch.Tensor, ranks: torch.Tensor) -> int:
    """Programs along the segment axis: a step has no more segments than rows, nor than the pool has slots
    (and slot 0)."""
    return min(slots.shape[0], ranks.shape[0])


def lora_shrink(h: torch.Tensor, a_h: torch.Tensor, segs, ranks: torch.Tensor, v: torch.Tensor) -> None:
    """v[:, :3R] += h @ A^T of qkv, proj and fc1 (a_h [slots, 3R, K]), each row through its segment's adapter.
    v: [B, 4R] float32, zeroed by the caller; its last R columns are fc2's (lora_expand_in fills them)."""
    r, k = a_h.shape[1] // 3, a_h.shape[2]
    rows, starts, slots = segs
    assert h.shape[1] == k and k % SHRINK_BLOCK_K == 0 and v.shape[1] == 4 * r
    _lora_shrink_kernel[(_segment_programs(slots, ranks), 3, k // SHRINK_BLOCK_K)](
        h, h.stride(0), a_h, rows, starts, slots, ranks, v, v.stride(0), K=k, R=r, GROUPS=3, BLOCK_K=SHRINK_BLOCK_K,
        PRECISION=dot_precision(h), num_warps=4)


def lora_expand_in(qkv: torch.Tensor, f: torch.Tensor, v: torch.Tensor, b_qkv: torch.Tensor, b_fc1: torch.Tensor,
                   a_fc2: torch.Tensor, segs, ranks: torch.Tensor) -> None:
    """In place: qkv [B, NQ] += its deltas; f [B, NF] (fc1 before its GELU) = gelu(f + its deltas); v[:, 3R:]
    += f @ A_fc2^T (a_fc2 [slots, R, NF]). b_*: [slots, N, R]."""
    nq, nf, r = b_qkv.shape[1], b_fc1.shape[1], b_qkv.shape[2]
    rows, starts, slots = segs
    blocks = triton.cdiv(nq, EXPAND_IN_BLOCK_N) + triton.cdiv(nf, EXPAND_IN_BLOCK_N)
    _lora_expand_in_kernel[(_segment_programs(slots, ranks), blocks)](
        qkv, qkv.stride(0), f, f.stride(0), v, v.stride(0), b_qkv, b_fc1, a_fc2, rows, starts, slots, ranks, NQ=nq,
        NF=nf, R=r, BLOCK_N=EXPAND_IN_BLOCK_N, PRECISION=dot_precision(qkv), num_warps=4)


def lora_expand_out(x: torch.Tensor, v: torch.Tensor, b_proj: torch.Tensor, b_fc2: torch.Tensor, segs,
                    ranks: torch.Tensor) -> None:
    """In place: x [B, N] += proj's deltas (v's second R columns) + fc2's (its last R)."""
    n, r = b_proj.shape[1], b_proj.shape[2]
    rows, starts, slots = segs
    _lora_expand_out_kernel[(_segment_programs(slots, ranks), triton.cdiv(n, EXPAND_OUT_BLOCK_N))](
        x, x.stride(0), v, v.stride(0), b_proj, b_fc2, rows, starts, slots, ranks, N=n, R=r,
        BLOCK_N=EXPAND_OUT_BLOCK_N, PRECISION=dot_precision(x), num_warps=4)
