"""Moondream 3's tau scaling of q and v as one Triton kernel on the GPU, in place on the fused qkv rows (the torch
version in text.py takes about a dozen small kernels per layer); for a decode step's few rows, tau_rows also works
out the token part (gelu(qkv) @ w.T) inside, so tau is one kernel instead of four."""

import torch
import triton
import triton.language as tl

from .moe_kernels import exact_gelu

TOKENS_PER_PROGRAM = 4


@triton.jit
def _by_position(alpha, pos):
    """The position part of tau's scales, 0.5 + sigmoid(alpha * log(pos + 1)), in float32."""
    return 0.5 + tl.sigmoid(alpha.to(tl.float32) * tl.log(pos.to(tl.float32) + 1.0))


@triton.jit
def _scale(lin, by_position, dtype: tl.constexpr):
    """tanh(lin) + by_position, rounded to the activations' dtype first as the torch path does, in float32
    (tanh(x) = 2 sigmoid(2x) - 1)."""
    return (2.0 * tl.sigmoid(2.0 * lin) - 1.0 + by_position).to(dtype).to(tl.float32)


@triton.jit
def _tau_kernel(qkv_ptr, lin_ptr, alpha_ptr, pos_ptr, T, row_stride, lin_stride, N_HEADS: tl.constexpr,
                HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]  # [BLOCK_T, 1]
    h = tl.arange(0, HEADS)[None, :]  # HEADS: N_HEADS rounded up to a power of two
    mask = (t < T) & (h < N_HEADS)
    by_position = _by_position(tl.load(alpha_ptr + h, mask=h < N_HEADS, other=0.0),
                               tl.load(pos_ptr + t, mask=t < T, other=0))
    lin_q = tl.load(lin_ptr + t * lin_stride + h, mask=mask, other=0.0).to(tl.float32)
    lin_v = tl.load(lin_ptr + t * lin_stride + N_HEADS + h, mask=mask, other=0.0).to(tl.float32)
    scale_q = _scale(lin_q, by_position, qkv_ptr.dtype.element_ty)
    scale_v = _scale(lin_v, by_position, qkv_ptr.dtype.element_ty)
    d = tl.arange(0, HEAD_DIM)[None, None, :]
    q = qkv_ptr + t[:, :, None] * row_stride + h[:, :, None] * HEAD_DIM + d
    v = q + 2 * N_HEADS * HEAD_DIM
    m3 = mask[:, :, None]
    tl.store(q, (tl.load(q, mask=m3, other=0.0).to(tl.float32) * scale_q[:, :, None]).to(qkv_ptr.dtype.element_ty),
             mask=m3)
    tl.store(v, (tl.load(v, mask=m3, other=0.0).to(tl.float32) * scale_v[:, :, None]).to(qkv_ptr.dtype.element_ty),
             mask=m3)


def tau_inplace(qkv: torch.Tensor, lin: torch.Tensor, alpha: torch.Tensor, positions: torch.Tensor, n_heads: int,
                head_dim: int) -> None:
    """qkv [T, 3 * n_heads * head_dim]: q and v heads scaled in place; lin [T, 2 * n_heads], the token part before
    its tanh (q's heads, then v's); positions [T] integers."""
    t = qkv.shape[0]
    _tau_kernel[(triton.cdiv(t, TOKENS_PER_PROGRAM),)](
        qkv, lin, alpha, positions.contiguous(), t, qkv.stride(0), lin.stride(0), N_HEADS=n_heads,
        HEADS=triton.next_power_of_2(n_heads), HEAD_DIM=head_dim, BLOCK_T=TOKENS_PER_PROGRAM, num_warps=4)


@triton.jit
def _tau_rows_kernel(qkv_ptr, w_ptr, alpha_ptr, pos_ptr, out_ptr, row_stride, N_HEADS: tl.constexpr,
                     HEAD_DIM: tl.constexpr, QKV_DIM: tl.constexpr, BLOCK_K: tl.constexpr):
    """A program a (row, head of q, k or v) of a few rows: its head of qkv into out, q and v heads scaled by tau,
    the token part (gelu(qkv) @ w.T, one row of w) worked out in the program, rounded as the torch path rounds."""
    t, j = tl.program_id(0).to(tl.int64), tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    head = tl.load(qkv_ptr + t * row_stride + j * HEAD_DIM + d)
    dtype = head.dtype
    if (j >= N_HEADS) & (j < 2 * N_HEADS):  # a k head: as it is
        tl.store(out_ptr + t * QKV_DIM + j * HEAD_DIM + d, head)
    else:
        h = j % N_HEADS
        w_row = w_ptr + tl.where(j < N_HEADS, j, j - N_HEADS) * QKV_DIM  # (w: q's heads, then v's)
        acc = tl.zeros([BLOCK_K], dtype=tl.float32)
        # unrolled, every chunk's loads issued at once (H100, one row at context 800: 1.234 against 1.299 ms a step
        # with a loop over chunks of 1,024; at 64, 1.200 against 1.186)
        for k0 in tl.static_range(0, QKV_DIM, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(qkv_ptr + t * row_stride + offs).to(tl.float32)
            g = exact_gelu(x).to(dtype).to(tl.float32)
            acc += g * tl.load(w_row + offs).to(tl.float32)
        lin = tl.sum(acc, 0).to(dtype).to(tl.float32)
        scale = _scale(lin, _by_position(tl.load(alpha_ptr + h), tl.load(pos_ptr + t)), dtype)
        tl.store(out_ptr + t * QKV_DIM + j * HEAD_DIM + d, (head.to(tl.float32) * scale).to(dtype))


def tau_rows(qkv: torch.Tensor, w: torch.Tensor, alpha: torch.Tensor, positions: torch.Tensor, n_heads: int,
             head_dim: int) -> torch.Tensor:
    """apply_tau of a decode step's few rows in one kernel (the token part's GELU and product included) -> a new
    [T, 3 * n_heads * head_dim] (the kernel reads every row whole while it scales heads: not in place)."""
    t, qkv_dim = qkv.shape
    assert qkv.stride(1) == 1 and w.is_contiguous() and w.shape == (2 * n_heads, qkv_dim)
    out = torch.empty(t, qkv_dim, device=qkv.device, dtype=qkv.dtype)
    block_k = next(b for b in (2048, 1024, 512, 256, 128, 64, 32, 16) if qkv_dim % b == 0)
    _tau_rows_kernel[(t, 3 * n_heads)](qkv, w, alpha, positions.contiguous(), out, qkv.stride(0), N_HEADS=n_heads,
                                       HEAD_DIM=head_dim, QKV_DIM=qkv_dim, BLOCK_K=block_k, num_warps=8)
    return out
