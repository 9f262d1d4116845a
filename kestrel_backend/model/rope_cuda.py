"""Rotary embedding as one Triton kernel on the GPU: rotates every q and k head of a fused qkv
row in place (the torch version in text.py takes about a dozen small kernels per layer)."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, row_stride, HALF: tl.constexpr, HEAD_DIM: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    base = x_ptr + t * row_stride + h * HEAD_DIM
    i = tl.arange(0, HALF)
    real = tl.load(base + i).to(tl.float32)
    imag = tl.load(base + HALF + i).to(tl.float32)
    c = tl.load(cos_ptr + t * HALF + i)
    s = tl.load(sin_ptr + t * HALF + i)
    dtype = x_ptr.dtype.element_ty
    tl.store(base + 2 * i, (real * c - imag * s).to(dtype))
    tl.store(base + 2 * i + 1, (real * s + imag * c).to(dtype))


def rope_qk_inplace(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int, head_dim: int) -> None:
    """qkv [T, >= n_heads*head_dim] (q heads then k heads first); cos/sin [T, rope_dim/2] float32."""
    _rope_kernel[(qkv.shape[0], n_heads)](qkv, cos.contiguous(), sin.contiguous(), qkv.stride(0),
                                          HALF=cos.shape[1], HEAD_DIM=head_dim, num_warps=1)
