"""Linear layers in FP8 (e4m3) for the vision encoder's opt-in path (KESTREL_VISION_FP8, model/vision.py).

The activations come quantised per row (the layer norm before the matmul writes them so: layer_norm_cuda), the
weight is quantised once per output channel, and one Triton GEMM multiplies them, applies both scales, adds the bias
and, for fc1, the tanh GELU. fc1 writes its output in e4m3 too, at a row scale known before it runs (out_scale), so
fc2 takes FP8 as well and adds its product onto the residual stream (accumulate). The quantising is fused into
passes that run anyway: a separate pass over the activations cost more than FP8 saved (PERFORMANCE.md, What we
tried). On Hopper the tiles come in by the tensor memory accelerator (TMA); sm89 (L4, L40S) loads them by pointer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import shared

E4M3_MAX = 448.0


@dataclass
class Fp8Weight:
    weight: torch.Tensor  # [out, in] float8_e4m3fn
    scale: torch.Tensor  # [out] float32: weight = fp8 * scale, per output channel

    @classmethod
    def of(cls, weight: torch.Tensor) -> "Fp8Weight":
        scale = weight.float().abs().amax(dim=1).clamp(min=1e-12) / E4M3_MAX
        return cls((weight.float() / scale[:, None]).to(torch.float8_e4m3fn).contiguous(), scale.contiguous())


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The program's output tile, in groups of GROUP_M row tiles so that neighbouring programs share weight tiles in
    L2."""
    pid = tl.program_id(0)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    size_m = min(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _epilogue(acc, pid_m, pid_n, M, N, x_scale_ptr, w_scale_ptr, bias_ptr, out_scale_ptr, out_ptr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GELU: tl.constexpr, BIAS: tl.constexpr,
              QUANTIZE: tl.constexpr, ACCUMULATE: tl.constexpr):
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc *= tl.load(x_scale_ptr + rm, mask=rm < M, other=0.0)[:, None]
    acc *= tl.load(w_scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if GELU:  # (tanh form: 0.5 x (1 + tanh(u)) = x sigmoid(2u))
        acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc))
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    out_ptrs = out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
    if QUANTIZE:  # e4m3 at the row's given scale (clamped: a scale that bounds the row never needs it)
        acc = acc / tl.load(out_scale_ptr + rm, mask=rm < M, other=1.0)[:, None]
        acc = tl.minimum(tl.maximum(acc, -448.0), 448.0)  # (E4M3_MAX)
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_linear_tma_kernel(x_desc, x_scale_ptr, w_desc, w_scale_ptr, bias_ptr, out_scale_ptr, out_ptr, M, N, K,
                           GELU: tl.constexpr, BIAS: tl.constexpr, QUANTIZE: tl.constexpr, ACCUMULATE: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):  # (rows past M and N come in as zeros)
        acc = tl.dot(x_desc.load([pid_m * BLOCK_M, k]), w_desc.load([pid_n * BLOCK_N, k]).T, acc)
    _epilogue(acc, pid_m, pid_n, M, N, x_scale_ptr, w_scale_ptr, bias_ptr, out_scale_ptr, out_ptr, BLOCK_M, BLOCK_N,
              GELU, BIAS, QUANTIZE, ACCUMULATE)


@triton.jit
def _fp8_linear_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_scale_ptr, out_ptr, M, N, K,
                       GELU: tl.constexpr, BIAS: tl.constexpr, QUANTIZE: tl.constexpr, ACCUMULATE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tl.where(rm < M, rm, 0)[:, None].to(tl.int64) * K + rk[None, :]  # (edge rows read row 0;
    w_ptrs = w_ptr + tl.where(rn < N, rn, 0)[None, :].to(tl.int64) * K + rk[:, None]  # their outputs are not stored)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        acc = tl.dot(tl.load(x_ptrs), tl.load(w_ptrs), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _epilogue(acc, pid_m, pid_n, M, N, x_scale_ptr, w_scale_ptr, bias_ptr, out_scale_ptr, out_ptr, BLOCK_M, BLOCK_N,
              GELU, BIAS, QUANTIZE, ACCUMULATE)


def _blocks(n: int, small_shared_memory: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages): measured on an H100 at the encoder's shapes (qkv 3456 and fc1 4352 wide:
    128 x 256; fc2 1152: 128 x 128); GPUs of about 100 KB of shared memory a block (L4, L40S, RTX cards) take 128 x
    128 tiles, 2 deep."""
    if small_shared_memory:
        return 128, 128, 4, 2
    return (128, 256, 8, 3) if n >= 2048 else (128, 128, 8, 3)


def fp8_linear(x: torch.Tensor, x_scale: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None, gelu: bool = False,
               out_dtype=torch.bfloat16, tma: bool | None = None, out_scale: torch.Tensor | None = None,
               accumulate: torch.Tensor | None = None) -> torch.Tensor:
    """act((x * x_scale) @ (w.weight * w.scale)^T + bias) -> [M, out] in out_dtype: x [M, K] e4m3 with x_scale [M]
    float32, act the tanh GELU if asked, bias None for none. out_scale [M] float32: the output in e4m3 instead, row r
    at out_scale[r]. accumulate: a [M, out] tensor the product is added onto (in place, returned). tma: None picks by
    the GPU (Hopper and later)."""
    m, k = x.shape
    n = w.weight.shape[0]
    assert x.dtype == torch.float8_e4m3fn and k == w.weight.shape[1] and k % 32 == 0
    assert out_scale is None or accumulate is None
    block_k = 128 if k % 128 == 0 else 64 if k % 64 == 0 else 32  # (the full-size encoder's 1152: 128)
    if tma is None:
        tma = x.is_cuda and torch.cuda.get_device_capability(x.device) >= (9, 0)
    block_m, block_n, warps, stages = _blocks(n, shared.small_shared_memory(x.device))
    if accumulate is not None:
        assert accumulate.shape == (m, n) and accumulate.is_contiguous()
        out = accumulate
    else:
        out = torch.empty(m, n, dtype=torch.float8_e4m3fn if out_scale is not None else out_dtype, device=x.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    bias_ptr = w.scale if bias is None else bias  # (a pointer the kernel never reads when it has no use for it)
    scale_ptr = x_scale if out_scale is None else out_scale
    shape = dict(GELU=gelu, BIAS=bias is not None, QUANTIZE=out_scale is not None, ACCUMULATE=accumulate is not None,
                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=warps,
                 num_stages=stages)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        _fp8_linear_tma_kernel[grid](TensorDescriptor.from_tensor(x, [block_m, block_k]), x_scale,
                                     TensorDescriptor.from_tensor(w.weight, [block_n, block_k]), w.scale, bias_ptr,
                                     scale_ptr, out, m, n, k, **shape)
    else:
        _fp8_linear_kernel[grid](x, x_scale, w.weight, w.scale, bias_ptr, scale_ptr, out, m, n, k, **shape)
    return out
