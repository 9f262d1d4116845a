"""The vision encoder's self-attention as one Triton kernel (an online softmax over key tiles) on its qkv rows.

Its heads are 72 wide, which no library kernel tiles: cuDNN's kernel pads them to 128, FlashAttention's to 96
(`benchmarks/vision_attention.py`). Here a head is a power-of-two part and a 16-wide tail that ends with the head
(columns 0-63 and 56-71, the overlap zeroed in q and not stored), so the dots do 80 columns' work. The kernel
reads q, k and v straight from the qkv GEMM's output and writes the heads side by side as the output projection
reads them (no transposes, no copies)."""

import math

import torch
import triton
import triton.language as tl

# query rows, key rows a tile, warps, pipeline stages: bf16 / fp16, and float32 (the checks against the reference;
# its tiles fit the GPUs of about 100 KB of shared memory a block)
TILES = {2: (128, 64, 8, 3), 4: (64, 32, 4, 2)}
TAIL = 16  # the narrowest dot


@triton.jit
def _key_tile(q, q_tail, k_rows, v_rows, dims, tail_dims, n_ok, m_i, l_i, acc, acc_tail, scale,
              HAS_TAIL: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile of the online softmax (base 2): the running maximum, sum and output of each query row.
    MASKED: the last tile, whose rows past the crop's tokens read as zeros and are left out of the softmax."""
    if MASKED:
        k = tl.load(k_rows + dims[None, :], mask=n_ok[:, None], other=0.0)
    else:
        k = tl.load(k_rows + dims[None, :])
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if HAS_TAIL:
        if MASKED:
            k_tail = tl.load(k_rows + tail_dims[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_tail = tl.load(k_rows + tail_dims[None, :])
        s += tl.dot(q_tail, tl.trans(k_tail), input_precision=PRECISION)
    s = s * scale
    if MASKED:
        s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(k.dtype)
    if MASKED:
        v = tl.load(v_rows + dims[None, :], mask=n_ok[:, None], other=0.0)
    else:
        v = tl.load(v_rows + dims[None, :])
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    if HAS_TAIL:
        if MASKED:
            v_tail = tl.load(v_rows + tail_dims[None, :], mask=n_ok[:, None], other=0.0)
        else:
            v_tail = tl.load(v_rows + tail_dims[None, :])
        # as (v_tail^T p^T)^T: Triton 3.6's p @ v_tail (16 columns) gave wrong sums on an H100 at 64 keys a tile
        # (and, beside the q tail's dot, illegal addresses)
        tail = tl.dot(tl.trans(v_tail), tl.trans(p), input_precision=PRECISION)
        acc_tail = acc_tail * alpha[:, None] + tl.trans(tail)
    return m_new, l_i, acc, acc_tail


@triton.jit
def _vision_attention_kernel(qkv_ptr, out_ptr, scale, TOKENS: tl.constexpr, HEADS: tl.constexpr,
                             HEAD_DIM: tl.constexpr, MAIN: tl.constexpr, TAIL: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Program (query tile, crop x head): qkv [crops * TOKENS, 3 * HEADS * HEAD_DIM] (q, k, v heads side by side)
    -> out [crops * TOKENS, HEADS * HEAD_DIM]. A head's first MAIN columns take one dot, the rest (if any) a
    TAIL-wide one over its last TAIL columns."""
    crop, h = tl.program_id(1) // HEADS, tl.program_id(1) % HEADS
    width: tl.constexpr = HEADS * HEAD_DIM
    first = crop.to(tl.int64) * TOKENS
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < TOKENS
    dims = tl.arange(0, MAIN)
    has_tail: tl.constexpr = HEAD_DIM > MAIN
    tail_dims = HEAD_DIM - TAIL + tl.arange(0, TAIL)
    tail_new = tail_dims >= MAIN  # (the columns the main dot leaves)
    q_rows = qkv_ptr + (first + offs_m)[:, None] * (3 * width) + h * HEAD_DIM
    q = tl.load(q_rows + dims[None, :], mask=m_ok[:, None], other=0.0)
    q_tail = tl.load(q_rows + tail_dims[None, :], mask=m_ok[:, None], other=0.0)
    q_tail = tl.where(tail_new[None, :], q_tail, 0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, MAIN], tl.float32)
    acc_tail = tl.zeros([BLOCK_M, TAIL], tl.float32)
    whole: tl.constexpr = TOKENS // BLOCK_N * BLOCK_N
    for n0 in tl.range(0, whole, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k_rows = qkv_ptr + (first + offs_n)[:, None] * (3 * width) + width + h * HEAD_DIM
        m_i, l_i, acc, acc_tail = _key_tile(q, q_tail, k_rows, k_rows + width, dims, tail_dims, offs_n < TOKENS,
                                            m_i, l_i, acc, acc_tail, scale, has_tail, False, PRECISION)
    if whole < TOKENS:
        offs_n = whole + tl.arange(0, BLOCK_N)
        n_ok = offs_n < TOKENS
        k_rows = qkv_ptr + (first + offs_n)[:, None] * (3 * width) + width + h * HEAD_DIM
        m_i, l_i, acc, acc_tail = _key_tile(q, q_tail, k_rows, k_rows + width, dims, tail_dims, n_ok, m_i, l_i,
                                            acc, acc_tail, scale, has_tail, True, PRECISION)
    out_rows = out_ptr + (first + offs_m)[:, None] * width + h * HEAD_DIM
    tl.store(out_rows + dims[None, :], (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
    if has_tail:
        tl.store(out_rows + tail_dims[None, :], (acc_tail / l_i[:, None]).to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & tail_new[None, :])


def split_head(head_dim: int) -> tuple[int, int]:
    """A head's columns as (the largest power of two in it, the rest rounded up to a power of two, at least TAIL)."""
    main = 1 << (head_dim.bit_length() - 1)
    return main, max(TAIL, triton.next_power_of_2(head_dim - main)) if head_dim > main else TAIL


def vision_attention(qkv: torch.Tensor, crops: int, heads: int, tiles: tuple[int, int, int, int] | None = None
                     ) -> torch.Tensor:
    """qkv [crops * tokens, 3 * dim] contiguous (each crop's rows together) -> softmax(q k^T / sqrt(head_dim)) v
    of every crop and head, [crops * tokens, dim]. tiles: (BLOCK_M, BLOCK_N, warps, stages), TILES' by default."""
    rows, width = qkv.shape[0], qkv.shape[1] // 3
    assert qkv.is_contiguous() and rows % crops == 0 and width % heads == 0
    head_dim = width // heads
    assert head_dim >= TAIL
    main, tail = split_head(head_dim)
    block_m, block_n, warps, stages = tiles or TILES[min(qkv.element_size(), 4)]
    out = qkv.new_empty(rows, width)
    grid = (triton.cdiv(rows // crops, block_m), crops * heads)
    _vision_attention_kernel[grid](qkv, out, math.log2(math.e) / math.sqrt(head_dim), TOKENS=rows // crops,
                                   HEADS=heads, HEAD_DIM=head_dim, MAIN=main, TAIL=tail, BLOCK_M=block_m,
                                   BLOCK_N=block_n, PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32",
                                   num_warps=warps, num_stages=stages)
    return out
