"""The vision encoder's self-attention as one Triton flash-attention kernel.

The encoder's heads are 72 wide, which no tensor-core tile fits: the kernel splits each head into a
64-wide part and a 16-wide part (8 of it zero padding), so the tensor cores waste 10% instead of the
78% a 128-wide tile would. q, k and v are read from the qkv GEMM's rows [tokens, 3 * dim] and the
output is written as [tokens, dim] rows for the output projection: no transposes around it.
"""

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _head_part(base, rows, row_ok, row_stride, first: tl.constexpr, WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[len(rows), WIDTH] block of a head's columns first..first+WIDTH (zero past the head's width)."""
    cols = first + tl.arange(0, WIDTH)
    mask = row_ok[:, None] & (cols < HEAD_DIM)[None, :]
    return tl.load(base + rows[:, None].to(tl.int64) * row_stride + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _vision_attention_kernel(qkv_ptr, out_ptr, seq_len, scale_log2, N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                             MAIN: tl.constexpr, REST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program: BLOCK_M query rows of one (crop, head), online softmax over all the crop's keys."""
    crop, head = tl.program_id(1) // N_HEADS, tl.program_id(1) % N_HEADS
    dim: tl.constexpr = N_HEADS * HEAD_DIM
    q_base = qkv_ptr + crop.to(tl.int64) * seq_len * 3 * dim + head * HEAD_DIM
    k_base, v_base = q_base + dim, q_base + 2 * dim
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < seq_len
    q_main = _head_part(q_base, rows, row_ok, 3 * dim, 0, MAIN, HEAD_DIM)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc_main = tl.zeros([BLOCK_M, MAIN], tl.float32)
    if REST > 0:
        q_rest = _head_part(q_base, rows, row_ok, 3 * dim, MAIN, REST, HEAD_DIM)
        acc_rest = tl.zeros([BLOCK_M, REST], tl.float32)
    for start in range(0, seq_len, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < seq_len
        s = tl.dot(q_main, tl.trans(_head_part(k_base, keys, key_ok, 3 * dim, 0, MAIN, HEAD_DIM)),
                   input_precision="ieee")
        if REST > 0:
            s += tl.dot(q_rest, tl.trans(_head_part(k_base, keys, key_ok, 3 * dim, MAIN, REST, HEAD_DIM)),
                        input_precision="ieee")
        s = tl.where(key_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        rescale = tl.math.exp2(m - m_new)
        total = total * rescale + tl.sum(p, 1)
        p = p.to(qkv_ptr.dtype.element_ty)
        acc_main = acc_main * rescale[:, None] + tl.dot(p, _head_part(v_base, keys, key_ok, 3 * dim, 0, MAIN, HEAD_DIM),
                                                        input_precision="ieee")
        if REST > 0:
            acc_rest = acc_rest * rescale[:, None] + tl.dot(
                p, _head_part(v_base, keys, key_ok, 3 * dim, MAIN, REST, HEAD_DIM), input_precision="ieee")
        m = m_new
    out_base = out_ptr + crop.to(tl.int64) * seq_len * dim + head * HEAD_DIM
    out_rows = rows[:, None].to(tl.int64) * dim
    cols = tl.arange(0, MAIN)
    tl.store(out_base + out_rows + cols[None, :], (acc_main / total[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols < HEAD_DIM)[None, :])
    if REST > 0:
        cols = MAIN + tl.arange(0, REST)
        tl.store(out_base + out_rows + cols[None, :], (acc_rest / total[:, None]).to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols < HEAD_DIM)[None, :])


def head_split(head_dim: int) -> tuple[int, int]:
    """(main, rest) widths: main the largest power of two in the head (16 at least, a tensor-core tile's
    minimum), rest a power of two covering what is left (0 if nothing is)."""
    main = max(16, 1 << (head_dim.bit_length() - 1))
    rest = head_dim - main
    return main, (max(16, triton.next_power_of_2(rest)) if rest > 0 else 0)


def vision_attention(qkv: torch.Tensor, crops: int, n_heads: int, block_m: int = 128, block_n: int = 64,
                     num_warps: int = 8, num_stages: int = 2) -> torch.Tensor:
    """qkv [crops * tokens, 3 * dim] (the qkv GEMM's output, contiguous) -> softmax(q k^T / sqrt(hd)) v
    of every crop and head, as [crops * tokens, dim]. Every crop attends over its own tokens only."""
    rows, dim3 = qkv.shape
    assert qkv.is_contiguous() and rows % crops == 0 and dim3 % (3 * n_heads) == 0
    seq_len, head_dim = rows // crops, dim3 // (3 * n_heads)
    main, rest = head_split(head_dim)
    out = qkv.new_empty(rows, dim3 // 3)
    grid = (triton.cdiv(seq_len, block_m), crops * n_heads)
    _vision_attention_kernel[grid](qkv, out, seq_len, math.log2(math.e) / math.sqrt(head_dim), N_HEADS=n_heads,
                                   HEAD_DIM=head_dim, MAIN=main, REST=rest, BLOCK_M=block_m, BLOCK_N=block_n,
                                   num_warps=num_warps, num_stages=num_stages)
    return out
