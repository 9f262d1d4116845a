"""Rotary embedding as one Triton kernel on the GPU: rotates every q and k head of a fused qkv
row in place (the torch version in text.py takes about a dozen small kernels per layer)."""

import torch
import triton
import triton.language as tl

TOKENS_PER_PROGRAM = 4  # x every head of each token: one program per token and head was launch-bound (H100,
# prefill of 4 x 742 tokens: 115 us per layer)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, T, row_stride, N_HEADS: tl.constexpr, HEADS: tl.constexpr,
                 HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None, None]
    h = tl.arange(0, HEADS)[None, :, None]  # HEADS: N_HEADS rounded up to a power of two
    i = tl.arange(0, HALF)[None, None, :]
    mask = (t < T) & (h < N_HEADS)
    base = x_ptr + t * row_stride + h * HEAD_DIM
    real = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
    imag = tl.load(base + HALF + i, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * HALF + i, mask=t < T, other=0.0)
    s = tl.load(sin_ptr + t * HALF + i, mask=t < T, other=0.0)
    # the rotated pairs interleave: (real, imag) of frequency j go to 2j and 2j + 1
    out = tl.reshape(tl.join(real * c - imag * s, real * s + imag * c), [BLOCK_T, HEADS, 2 * HALF])
    j = tl.arange(0, 2 * HALF)[None, None, :]
    tl.store(base + j, out.to(x_ptr.dtype.element_ty), mask=mask)


def rope_qk_inplace(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, head_dim: int) -> None:
    """qkv [T, >= n_heads*head_dim] (q heads then k heads first); cos/sin [T, rope_dim/2] float32."""
    t = qkv.shape[0]
    _rope_kernel[(triton.cdiv(t, TOKENS_PER_PROGRAM),)](
        qkv, cos.contiguous(), sin.contiguous(), t, qkv.stride(0), N_HEADS=n_heads,
        HEADS=triton.next_power_of_2(n_heads), HALF=cos.shape[1], HEAD_DIM=head_dim, BLOCK_T=TOKENS_PER_PROGRAM,
        num_warps=4)
