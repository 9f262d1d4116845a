"""The end of a Moondream 3 decode layer as one kernel: the expert rows' sum, the out-projection, the residual, and
the next layer's layer norm of the result (instead of torch's sum, cast, two adds and layer norm: five kernels a
layer, each a few microseconds at batch 1).

The roundings are torch's: the sum of a token's expert rows in float32 rounded to the model's dtype, then
proj + mlp and + x each rounded to it; the norm in float32 over the rounded row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _residual_norm_kernel(proj_ptr, mlp_ptr, x_ptr, out_ptr, ln_w_ptr, ln_b_ptr, h_ptr, eps, N: tl.constexpr,
                          TOP_K: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr):
    """One program a row: out = (proj + mlp) + x, where mlp is the row's TOP_K expert rows summed (float32, [rows,
    TOP_K, N]) or, with TOP_K 0, the dense MLP's output; h = layer_norm(out) if NORM."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dtype = out_ptr.dtype.element_ty
    if TOP_K > 0:
        mlp = tl.zeros([BLOCK], tl.float32)
        for k in tl.static_range(TOP_K):
            mlp += tl.load(mlp_ptr + (row * TOP_K + k) * N + offs, mask=mask, other=0.0)
        mlp = mlp.to(dtype).to(tl.float32)
    else:
        mlp = tl.load(mlp_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)
    y = (tl.load(proj_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32) + mlp).to(dtype).to(tl.float32)
    y = (y + tl.load(x_ptr + row * N + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * N + offs, y, mask=mask)
    if NORM:
        y = y.to(tl.float32)
        mean = tl.sum(y, 0) / N
        centred = tl.where(mask, y - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, 0) / N + eps)
        h = centred * rstd * tl.load(ln_w_ptr + offs, mask=mask).to(tl.float32) \
            + tl.load(ln_b_ptr + offs, mask=mask).to(tl.float32)
        tl.store(h_ptr + row * N + offs, h.to(dtype), mask=mask)


def residual_norm(proj: torch.Tensor, mlp: torch.Tensor, top_k: int, x: torch.Tensor, ln=None,
                  out: torch.Tensor | None = None, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor | None]:
    """-> (proj + mlp + x [T, N] (into out if given), layer_norm of it with ln (a LayerNorm) or None without).
    mlp: the expert rows [T * top_k, N] float32 (moe_mlp_cuda(..., summed=False)), or with top_k 0 [T, N]. A row's
    program has 16 warps for one or two rows, where it is on the decode step's critical path (H100, Moondream 3's
    step of one row 1.446 against 1.467 ms with 4, of two 2.031 against 2.058; 64 rows alike)."""
    t, n = x.shape
    out = torch.empty_like(x) if out is None else out
    h = torch.empty_like(x) if ln is not None else None
    assert proj.is_contiguous() and mlp.is_contiguous() and x.is_contiguous() and out.is_contiguous()
    _residual_norm_kernel[(t,)](proj, mlp, x, out, ln.weight if ln is not None else x, ln.bias if ln is not None else x,
                                h if h is not None else out, eps, N=n, TOP_K=top_k, BLOCK=triton.next_power_of_2(n),
                                NORM=ln is not None, num_warps=16 if t <= 2 else 4)
    return out, h
