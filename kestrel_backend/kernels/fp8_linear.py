"""Linear layers in FP8 (e4m3) on GPUs with FP8 tensor cores (sm89 on): the weight quantised once per output channel,
the activations per row as they come (one Triton pass that may first add a bias and apply tanh-GELU), one scaled
matmul (cuBLASLt through torch._scaled_mm) with bf16 output. The vision encoder's opt-in path (KESTREL_VISION_FP8:
model/vision.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0


@dataclass
class Fp8Weight:
    weight: torch.Tensor  # [out, in] float8_e4m3fn
    scale: torch.Tensor  # [1, out] float32: weight = fp8 * scale, per output channel

    @classmethod
    def of(cls, weight: torch.Tensor) -> "Fp8Weight":
        scale = weight.float().abs().amax(dim=1).clamp(min=1e-12) / E4M3_MAX
        return cls((weight.float() / scale[:, None]).to(torch.float8_e4m3fn), scale[None, :].contiguous())


@triton.jit
def _quantize_rows_kernel(x_ptr, bias_ptr, q_ptr, scale_ptr, K: tl.constexpr, BLOCK_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, GELU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    ok = cols < K
    x = tl.load(x_ptr + row * K + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if GELU:  # (tanh form: 0.5 x (1 + tanh(u)), tanh(u) = 2 sigmoid(2u) - 1)
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        x = x * tl.sigmoid(2.0 * u)
    scale = tl.maximum(tl.max(tl.where(ok, tl.abs(x), 0.0), 0) / 448.0, 1e-12)
    tl.store(q_ptr + row * K + cols, (x / scale).to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row, scale)


def quantize_rows(x: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False):
    """[M, K] (+ bias, then tanh-GELU if asked) -> (e4m3 [M, K], float32 scale [M, 1]) with value = fp8 * scale
    row by row."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(m,)](x, x if bias is None else bias, q, scale, K=k, BLOCK_K=triton.next_power_of_2(k),
                                HAS_BIAS=bias is not None, GELU=gelu, num_warps=8)
    return q, scale


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, gelu: bool = False,
               out_dtype=torch.bfloat16) -> torch.Tensor:
    """act(x + bias) @ w^T -> [M, out] in out_dtype (the bias and GELU are the input's, applied as it is quantised)."""
    q, scale = quantize_rows(x, bias, gelu)
    return torch._scaled_mm(q, w.weight.t(), scale_a=scale, scale_b=w.scale, out_dtype=out_dtype)
