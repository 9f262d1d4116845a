"""Layer norm of (x + shift) as one Triton kernel, shift being a float32 vector added on the fly.

The vision encoder on the GPU lets its GEMMs add their output straight onto the residual stream
(beta = 1, in place) and leaves their biases out; the sum of the biases so far is the shift that the
next norm adds back. That saves the two elementwise residual adds of every layer. With KESTREL_VISION_FP8 the norm
also quantises its output to e4m3 row by row (the row is in registers: no pass of its own) for the FP8 GEMM after it
(kernels/fp8_linear.py), and before fc1 it also bounds each row of fc1's GELU output, the scale at which fc1 writes
that output in e4m3: |gelu(h . w_j + b_j)| <= max(|h| |w_j| + |b_j|, 0.17) (Cauchy-Schwarz; the tanh GELU is at least
-0.17). The bound is loose by a factor (11 to 16 on the tests' random weights), which a floating-point format
absorbs: values keep their 3 mantissa bits down to 2^-6 of the scale's 448."""

import torch
import triton
import triton.language as tl
from .shared import fp8_rows



@triton.jit
def _shifted_layer_norm_kernel(x_ptr, shift_ptr, w_ptr, b_ptr, out_ptr, scale_ptr, bound_ptr, bound_w, bound_b,
                               rows_total, eps, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                               QUANTIZE: tl.constexpr, BOUND: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    mask = (rows < rows_total)[:, None] & col_ok[None, :]
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(shift_ptr + cols, mask=col_ok, other=0.0)[None, :]
    mean = tl.sum(x, 1) / D
    d = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(d * d, 1) / D + eps)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = d * rstd[:, None] * w[None, :] + b[None, :]
    if BOUND:  # (the row's length once in e4m3 is at most 1 + 2^-4 times its length: e4m3 rounds to 4 bits)
        length = 1.0625 * tl.sqrt(tl.sum(tl.where(mask, y * y, 0.0), 1))
        tl.store(bound_ptr + rows, tl.maximum(bound_w * length + bound_b, 0.17) / 448.0, mask=rows < rows_total)
    if QUANTIZE:  # (per row: y = e4m3 * scale)
        y, scale = fp8_rows(tl.where(mask, y, 0.0))
        tl.store(scale_ptr + rows, scale, mask=rows < rows_total)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def shifted_layer_norm(x: torch.Tensor, shift: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                       eps: float = 1e-5, out: torch.Tensor | None = None) -> torch.Tensor:
    """layer_norm(x + shift) over the last dim into out (new unless given); x [R, D] contiguous, shift [D]
    float32."""
    rows, dim = x.shape
    assert x.is_contiguous() and shift.dtype == torch.float32
    out = torch.empty_like(x) if out is None else out
    assert out.shape == x.shape and out.is_contiguous()
    _launch(x, shift, weight, bias, eps, out, out)  # (no scales written: out stands in for their pointer)
    return out


def shifted_layer_norm_fp8(x: torch.Tensor, shift: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                           eps: float = 1e-5, gelu_bound: tuple[float, float] | None = None) -> tuple:
    """The same norm as (e4m3 [R, D], float32 scale [R]): row r is e4m3[r] * scale[r]. gelu_bound: (the largest
    length of fc1's weight rows, the largest magnitude of its bias), for a third output: the scale [R] that bounds
    each row of gelu(fc1(norm)) at e4m3's largest value."""
    assert x.is_contiguous() and shift.dtype == torch.float32
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    bound = None if gelu_bound is None else torch.empty_like(scale)
    _launch(x, shift, weight, bias, eps, out, scale, quantize=True, bound=bound, gelu_bound=gelu_bound or (0.0, 0.0))
    return (out, scale) if bound is None else (out, scale, bound)


def _launch(x, shift, weight, bias, eps, out, scale, quantize: bool = False, bound=None, gelu_bound=(0.0, 0.0)):
    rows, dim = x.shape
    block_d = triton.next_power_of_2(dim)
    per_program = max(1, 4096 // block_d)
    _shifted_layer_norm_kernel[(triton.cdiv(rows, per_program),)](
        x, shift, weight, bias, out, scale, scale if bound is None else bound, float(gelu_bound[0]),
        float(gelu_bound[1]), rows, eps, D=dim, BLOCK_D=block_d, ROWS=per_program, QUANTIZE=quantize,
        BOUND=bound is not None, num_warps=4)
