"""LoRA deltas inside the GPU decode step, each row its own adapter (a gather over the loaded adapters, as
S-LoRA and Punica do): every row reads its adapter's A and B where they lie in the LoraPool, through its slot
index (0: no adapter). Rows of one adapter read the same weights, which the L2 cache then serves.

Per layer four kernels: `lora_shrink` of the normed input through qkv's, proj's and fc1's A at once, an expand
onto qkv and onto fc1's pre-activation (with the GELU as epilogue, so fc1 leaves cuBLAS without it),
`lora_shrink` of the MLP activation through fc2's A, and an expand of proj's and fc2's deltas onto the residual.
Each loop stops at its slot's own rank: a pool of rank R costs rank-r adapters r's reads, not R's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_kernels import _gelu_tanh


@triton.jit
def _lora_shrink_kernel(x_ptr, x_stride, a_ptr, slots_ptr, ranks_ptr, v_ptr, v_stride, K: tl.constexpr,
                        R: tl.constexpr, GROUPS: tl.constexpr, BLOCK_K: tl.constexpr):
    """v[b, g * R + r] = sum_k A[slot, g * R + r, k] x[b, k] for r < the slot's rank (0 past it), for each of
    GROUPS targets that read the same input (A's rows grouped target by target)."""
    b = tl.program_id(0)
    slot = tl.load(slots_ptr + b)
    if slot == 0:
        return
    rank = tl.load(ranks_ptr + slot)
    offs_g, offs_r = tl.arange(0, 4), tl.arange(0, R)  # (groups padded to 4: a power of two)
    rows = offs_g[:, None] * R + offs_r[None, :]
    mask = (offs_g[:, None] < GROUPS) & (offs_r[None, :] < rank)
    a_rows = a_ptr + slot.to(tl.int64) * (GROUPS * R * K) + rows[:, :, None] * K
    acc = tl.zeros([4, R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + b * x_stride + offs_k).to(tl.float32)
        a = tl.load(a_rows + offs_k[None, None, :], mask=mask[:, :, None], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, None, :], 2)
    tl.store(v_ptr + b * v_stride + rows, acc, mask=offs_g[:, None] < GROUPS)


@triton.jit
def _delta(b_ptr, slot, rank, offs_n, n_mask, N: tl.constexpr, v_ptr, R: tl.constexpr):
    """sum_r B[slot, n, r] v[r] for the block's columns n (v: the row's R shrunk values of this target)."""
    offs_r = tl.arange(0, R)
    r_mask = offs_r < rank
    v = tl.load(v_ptr + offs_r, mask=r_mask, other=0.0)
    w = tl.load(b_ptr + slot.to(tl.int64) * (N * R) + offs_n[:, None] * R + offs_r[None, :],
                mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
    return tl.sum(w * v[None, :], 1)


@triton.jit
def _lora_expand_in_kernel(qkv_ptr, qkv_stride, f_ptr, f_stride, v_ptr, v_stride, b_qkv_ptr, b_fc1_ptr, slots_ptr,
                           ranks_ptr, NQ: tl.constexpr, NF: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr):
    """qkv += B_qkv v_qkv; f = gelu(f + B_fc1 v_fc1) (every row gets its GELU, adapter or not). Programs past
    qkv's column blocks take fc1's."""
    b, pid = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + b)
    rank = tl.load(ranks_ptr + slot)
    q_blocks: tl.constexpr = (NQ + BLOCK_N - 1) // BLOCK_N
    if pid < q_blocks:
        if slot == 0:
            return
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < NQ
        ptrs = qkv_ptr + b * qkv_stride + offs_n
        y = tl.load(ptrs, mask=n_mask).to(tl.float32)
        y += _delta(b_qkv_ptr, slot, rank, offs_n, n_mask, NQ, v_ptr + b * v_stride, R)
    else:
        offs_n = (pid - q_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < NF
        ptrs = f_ptr + b * f_stride + offs_n
        y = tl.load(ptrs, mask=n_mask).to(tl.float32)
        if slot != 0:
            y += _delta(b_fc1_ptr, slot, rank, offs_n, n_mask, NF, v_ptr + b * v_stride + 2 * R, R)
        y = _gelu_tanh(y)
    tl.store(ptrs, y.to(ptrs.dtype.element_ty), mask=n_mask)


@triton.jit
def _lora_expand_out_kernel(x_ptr, x_stride, vh_ptr, vh_stride, vg_ptr, vg_stride, b_proj_ptr, b_fc2_ptr, slots_ptr,
                            ranks_ptr, N: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr):
    """x += B_proj v_proj + B_fc2 v_fc2 (the residual after out-projection and fc2)."""
    b, pid = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + b)
    if slot == 0:
        return
    rank = tl.load(ranks_ptr + slot)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    ptrs = x_ptr + b * x_stride + offs_n
    y = tl.load(ptrs, mask=n_mask).to(tl.float32)
    y += _delta(b_proj_ptr, slot, rank, offs_n, n_mask, N, vh_ptr + b * vh_stride + R, R)
    y += _delta(b_fc2_ptr, slot, rank, offs_n, n_mask, N, vg_ptr + b * vg_stride, R)
    tl.store(ptrs, y.to(ptrs.dtype.element_ty), mask=n_mask)


EXPAND_BLOCK_N = 64


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, ranks: torch.Tensor, out: torch.Tensor,
                groups: int) -> torch.Tensor:
    """x [B, K]; a [slots, groups * R, K] -> out [B, groups * R] float32 (rows of slot 0 left as they were)."""
    r, k = a.shape[1] // groups, a.shape[2]
    block_k = min(k, max(16, 8192 // (4 * r)))  # a [4, R, BLOCK_K] tile of 8K values
    assert x.shape[1] == k and k % block_k == 0 and out.shape[1] == groups * r
    _lora_shrink_kernel[(x.shape[0],)](x, x.stride(0), a, slots, ranks, out, out.stride(0), K=k, R=r, GROUPS=groups,
                                       BLOCK_K=block_k, num_warps=4)
    return out


def lora_expand_in(qkv: torch.Tensor, f: torch.Tensor, v: torch.Tensor, b_qkv: torch.Tensor, b_fc1: torch.Tensor,
                   slots: torch.Tensor, ranks: torch.Tensor) -> None:
    """In place: qkv [B, NQ] += its deltas; f [B, NF] (fc1 before its GELU) = gelu(f + its deltas). v: the
    [B, 3R] shrunk values of qkv, proj, fc1; b_*: [slots, N, R]."""
    nq, nf, r = b_qkv.shape[1], b_fc1.shape[1], b_qkv.shape[2]
    blocks = triton.cdiv(nq, EXPAND_BLOCK_N) + triton.cdiv(nf, EXPAND_BLOCK_N)
    _lora_expand_in_kernel[(qkv.shape[0], blocks)](qkv, qkv.stride(0), f, f.stride(0), v, v.stride(0), b_qkv, b_fc1,
                                                   slots, ranks, NQ=nq, NF=nf, R=r, BLOCK_N=EXPAND_BLOCK_N,
                                                   num_warps=4)


def lora_expand_out(x: torch.Tensor, v_h: torch.Tensor, v_g: torch.Tensor, b_proj: torch.Tensor,
                    b_fc2: torch.Tensor, slots: torch.Tensor, ranks: torch.Tensor) -> None:
    """In place: x [B, N] += proj's deltas (from v_h's second group) + fc2's (from v_g)."""
    n, r = b_proj.shape[1], b_proj.shape[2]
    _lora_expand_out_kernel[(x.shape[0], triton.cdiv(n, EXPAND_BLOCK_N))](
        x, x.stride(0), v_h, v_h.stride(0), v_g, v_g.stride(0), b_proj, b_fc2, slots, ranks, N=n, R=r,
        BLOCK_N=EXPAND_BLOCK_N, num_warps=4)
