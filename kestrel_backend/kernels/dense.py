"""A weight as a plain tensor for one use (prefill and eager paths): 4-bit ones dequantized, on a GPU by the Triton
kernel (imported only there: CPU installs have no Triton compiler)."""

from __future__ import annotations

import torch

from .packed import PackedWeight


def dense(weight: torch.Tensor | PackedWeight) -> torch.Tensor:
    if not isinstance(weight, PackedWeight):
        return weight
    if weight.data.is_cuda:
        from .w4a16_kernels import dequantize_packed

        return dequantize_packed(weight)
    return weight.dequantize()
