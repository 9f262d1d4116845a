"""LoRA deltas inside the GPU decode step, rows of different adapters in one step (segmented, as Punica's SGMV):
the host sorts the step's rows by adapter into segments (`segments`), and each program of a kernel takes one
segment, reads that adapter's A or B tile once from the LoraPool and applies it to every row of the segment
with tensor-core dots. Rows without an adapter form a segment of slot 0.

Per layer four kernels: `lora_shrink` of the normed input through qkv's, proj's and fc1's A at once, an expand
onto qkv and onto fc1's pre-activation (with the GELU as epilogue, so fc1 leaves cuBLAS without it; rows
without an adapter get their GELU there too), `lora_shrink` of the MLP activation through fc2's A, and an
expand of proj's and fc2's deltas onto the residual. Loads past a slot's own rank are masked off: a pool of
rank R costs a rank-r adapter r's reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_kernels import _gelu_tanh

ROWS = 16  # rows of a segment per dot (tl.dot's smallest tile)


def segments(slots: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Each row's adapter slot -> (rows sorted by slot, where each slot's run starts (and the end), its slot)."""
    order = sorted(range(len(slots)), key=lambda row: slots[row])
    starts, seg_slots = [], []
    for i, row in enumerate(order):
        if not seg_slots or slots[row] != seg_slots[-1]:
            starts.append(i)
            seg_slots.append(slots[row])
    return order, starts + [len(order)], seg_slots


@triton.jit
def _segment(seg_start_ptr, seg_slot_ptr, ranks_ptr, s):
    start, end = tl.load(seg_start_ptr + s), tl.load(seg_start_ptr + s + 1)
    slot = tl.load(seg_slot_ptr + s)
    return start, end, slot, tl.load(ranks_ptr + slot)


@triton.jit
def _lora_shrink_kernel(x_ptr, x_stride, a_ptr, seg_rows_ptr, seg_start_ptr, seg_slot_ptr, ranks_ptr, v_ptr, v_stride,
                        K: tl.constexpr, R: tl.constexpr, GROUPS: tl.constexpr, K_PER_PROGRAM: tl.constexpr,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """v[row, g * R + r] += sum over this program's share of k of A[slot, g * R + r, k] x[row, k] (v zeroed before;
    the shares of k are summed atomically)."""
    s, g, share = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end, slot, rank = _segment(seg_start_ptr, seg_slot_ptr, ranks_ptr, s)
    if end <= start or slot == 0:
        return
    offs_r = tl.arange(0, R)
    r_mask = offs_r < rank
    a_rows = a_ptr + slot.to(tl.int64) * (GROUPS * R * K) + (g * R + offs_r)[:, None] * K
    for r0 in range(start, end, 16):
        idx = r0 + tl.arange(0, 16)
        m = idx < end
        rows = tl.load(seg_rows_ptr + idx, mask=m, other=0)
        acc = tl.zeros([16, R], tl.float32)
        for k0 in range(share * K_PER_PROGRAM, (share + 1) * K_PER_PROGRAM, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * x_stride + offs_k[None, :], mask=m[:, None], other=0.0)
            a = tl.load(a_rows + offs_k[None, :], mask=r_mask[:, None], other=0.0)
            acc = tl.dot(x, tl.trans(a.to(x.dtype)), acc, input_precision=PRECISION)
        tl.atomic_add(v_ptr + rows[:, None] * v_stride + g * R + offs_r[None, :], acc,
                      mask=m[:, None] & r_mask[None, :])


@triton.jit
def _expand_rows(y_ptr, y_stride, v_ptr, v_stride, v_offset, b_tile, offs_n, n_mask, offs_r, r_mask, seg_rows_ptr,
                 start, end, R: tl.constexpr, GELU: tl.constexpr, PRECISION: tl.constexpr):
    """y[rows, block] (+)= v[rows, v_offset:+R] @ b_tile^T for the segment's rows (then GELU if asked)."""
    for r0 in range(start, end, 16):
        idx = r0 + tl.arange(0, 16)
        m = idx < end
        rows = tl.load(seg_rows_ptr + idx, mask=m, other=0)
        ptrs = y_ptr + rows[:, None] * y_stride + offs_n[None, :]
        y = tl.load(ptrs, mask=m[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + rows[:, None] * v_stride + v_offset + offs_r[None, :], mask=m[:, None] & r_mask[None, :],
                    other=0.0)
        y = tl.dot(v, tl.trans(b_tile), y, input_precision=PRECISION)
        if GELU:
            y = _gelu_tanh(y)
        tl.store(ptrs, y.to(ptrs.dtype.element_ty), mask=m[:, None] & n_mask[None, :])


@triton.jit
def _b_tile(b_ptr, slot, offs_n, n_mask, offs_r, r_mask, N: tl.constexpr, R: tl.constexpr):
    ptrs = b_ptr + slot.to(tl.int64) * (N * R) + offs_n[:, None] * R + offs_r[None, :]
    return tl.load(ptrs, mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _lora_expand_in_kernel(qkv_ptr, qkv_stride, f_ptr, f_stride, v_ptr, v_stride, b_qkv_ptr, b_fc1_ptr, seg_rows_ptr,
                           seg_start_ptr, seg_slot_ptr, ranks_ptr, NQ: tl.constexpr, NF: tl.constexpr,
                           R: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """qkv += B_qkv v_qkv; f = gelu(f + B_fc1 v_fc1), segment by segment (slot 0's rows: the GELU alone).
    Programs past qkv's column blocks take fc1's."""
    s, pid = tl.program_id(0), tl.program_id(1)
    start, end, slot, rank = _segment(seg_start_ptr, seg_slot_ptr, ranks_ptr, s)
    q_blocks: tl.constexpr = (NQ + BLOCK_N - 1) // BLOCK_N
    if end <= start or (slot == 0 and pid < q_blocks):
        return
    offs_r = tl.arange(0, R)
    r_mask = offs_r < rank  # (slot 0 has rank 0: no delta)
    if pid < q_blocks:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < NQ
        tile = _b_tile(b_qkv_ptr, slot, offs_n, n_mask, offs_r, r_mask, NQ, R)
        _expand_rows(qkv_ptr, qkv_stride, v_ptr, v_stride, 0, tile, offs_n, n_mask, offs_r, r_mask, seg_rows_ptr,
                     start, end, R, False, PRECISION)
    else:
        offs_n = (pid - q_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < NF
        tile = _b_tile(b_fc1_ptr, slot, offs_n, n_mask, offs_r, r_mask, NF, R)
        _expand_rows(f_ptr, f_stride, v_ptr, v_stride, 2 * R, tile, offs_n, n_mask, offs_r, r_mask, seg_rows_ptr,
                     start, end, R, True, PRECISION)


@triton.jit
def _lora_expand_out_kernel(x_ptr, x_stride, vh_ptr, vh_stride, vg_ptr, vg_stride, b_proj_ptr, b_fc2_ptr, seg_rows_ptr,
                            seg_start_ptr, seg_slot_ptr, ranks_ptr, N: tl.constexpr, R: tl.constexpr,
                            BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """x += B_proj v_proj + B_fc2 v_fc2 (the residual after out-projection and fc2), segment by segment."""
    s, pid = tl.program_id(0), tl.program_id(1)
    start, end, slot, rank = _segment(seg_start_ptr, seg_slot_ptr, ranks_ptr, s)
    if end <= start or slot == 0:
        return
    offs_r = tl.arange(0, R)
    r_mask = offs_r < rank
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    proj = _b_tile(b_proj_ptr, slot, offs_n, n_mask, offs_r, r_mask, N, R)
    _expand_rows(x_ptr, x_stride, vh_ptr, vh_stride, R, proj, offs_n, n_mask, offs_r, r_mask, seg_rows_ptr,
                 start, end, R, False, PRECISION)
    fc2 = _b_tile(b_fc2_ptr, slot, offs_n, n_mask, offs_r, r_mask, N, R)
    _expand_rows(x_ptr, x_stride, vg_ptr, vg_stride, 0, fc2, offs_n, n_mask, offs_r, r_mask, seg_rows_ptr,
                 start, end, R, False, PRECISION)


EXPAND_BLOCK_N = 64
SHRINK_BLOCK_K = 128
SHRINK_K_PER_PROGRAM = 512  # each program's share of the input dim (more programs than segments x groups)


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"  # (float32: exact products, as the torch path)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, segs, ranks: torch.Tensor, out: torch.Tensor,
                groups: int) -> torch.Tensor:
    """x [B, K]; a [slots, groups * R, K]; segs (rows, starts, slots) of segments(); -> out [B, groups * R]
    float32, zeroed here (rows of slot 0 stay zero)."""
    r, k = a.shape[1] // groups, a.shape[2]
    share = min(k, SHRINK_K_PER_PROGRAM)
    assert x.shape[1] == k and k % share == 0 and share % SHRINK_BLOCK_K == 0 and out.shape[1] == groups * r
    out.zero_()
    rows, starts, slots = segs
    _lora_shrink_kernel[(slots.shape[0], groups, k // share)](
        x, x.stride(0), a, rows, starts, slots, ranks, out, out.stride(0), K=k, R=r, GROUPS=groups,
        K_PER_PROGRAM=share, BLOCK_K=SHRINK_BLOCK_K, PRECISION=_precision(x), num_warps=4)
    return out


def lora_expand_in(qkv: torch.Tensor, f: torch.Tensor, v: torch.Tensor, b_qkv: torch.Tensor, b_fc1: torch.Tensor,
                   segs, ranks: torch.Tensor) -> None:
    """In place: qkv [B, NQ] += its deltas; f [B, NF] (fc1 before its GELU) = gelu(f + its deltas). v: the
    [B, 3R] shrunk values of qkv, proj, fc1; b_*: [slots, N, R]."""
    nq, nf, r = b_qkv.shape[1], b_fc1.shape[1], b_qkv.shape[2]
    rows, starts, slots = segs
    blocks = triton.cdiv(nq, EXPAND_BLOCK_N) + triton.cdiv(nf, EXPAND_BLOCK_N)
    _lora_expand_in_kernel[(slots.shape[0], blocks)](
        qkv, qkv.stride(0), f, f.stride(0), v, v.stride(0), b_qkv, b_fc1, rows, starts, slots, ranks, NQ=nq, NF=nf,
        R=r, BLOCK_N=EXPAND_BLOCK_N, PRECISION=_precision(qkv), num_warps=4)


def lora_expand_out(x: torch.Tensor, v_h: torch.Tensor, v_g: torch.Tensor, b_proj: torch.Tensor,
                    b_fc2: torch.Tensor, segs, ranks: torch.Tensor) -> None:
    """In place: x [B, N] += proj's deltas (from v_h's second group) + fc2's (from v_g)."""
    n, r = b_proj.shape[1], b_proj.shape[2]
    rows, starts, slots = segs
    _lora_expand_out_kernel[(slots.shape[0], triton.cdiv(n, EXPAND_BLOCK_N))](
        x, x.stride(0), v_h, v_h.stride(0), v_g, v_g.stride(0), b_proj, b_fc2, rows, starts, slots, ranks, N=n, R=r,
        BLOCK_N=EXPAND_BLOCK_N, PRECISION=_precision(x), num_warps=4)
