"""4-bit weights kept packed (the official 4-bit Moondream 2 checkpoints), for the GPU.

A checkpoint stores a linear's weight W [N, K] as `packed` [G / 2, group] uint8 (G = N * K / group groups of
`group` consecutive values in W's row-major order; a byte holds group r in its high nibble and group r + G / 2 in
its low one, so the first half of W's rows in the high nibbles), with a `scale` and a `zero_point` per group:
W = (q - zero_point) * scale. Here the same 4-bit values are laid out for streaming: byte [n, j] holds q[n, 2j] in
its low nibble and q[n, 2j + 1] in its high one; scale and zero stay [G], in their checkpoint dtype.
Nothing changes value: dequantize() gives exactly the reference's bf16 weight (it rounds to bf16 after the
subtraction and after the product), on the GPU by a Triton kernel (kernels/w4a16_kernels.py), which also has the
decode step's matmuls that read these bytes directly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class PackedWeight:
    data: torch.Tensor  # uint8 [N, K / 2]: q[n, 2j] | q[n, 2j + 1] << 4
    scale: torch.Tensor  # [G]: group g covers W's flat values [g * group, (g + 1) * group)
    zero: torch.Tensor  # [G]
    group: int
    dtype: torch.dtype = torch.bfloat16  # what dequantize() gives (the model's dtype)

    @classmethod
    def from_checkpoint(cls, packed: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                        shape: tuple[int, int]) -> "PackedWeight":
        n, k = shape
        group = packed.shape[1]
        q = torch.cat([packed >> 4, packed & 0b1111]).reshape(n, k)
        return cls((q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), scale.reshape(-1).contiguous(),
                   zero_point.reshape(-1).contiguous(), group)

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], 2 * self.data.shape[1]

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zero))

    def to(self, device=None, dtype: torch.dtype | None = None) -> "PackedWeight":
        """Moved to device; dtype is what it will dequantize to (the bytes stay 4-bit)."""
        return replace(self, data=self.data.to(device), scale=self.scale.to(device), zero=self.zero.to(device),
                       dtype=dtype or self.dtype)

    def contiguous(self) -> "PackedWeight":
        return self

    def dequantize(self) -> torch.Tensor:
        """W [N, K] in self.dtype: the reference's bf16 values, in torch on any device (kernels/dense.py's dense()
        takes the Triton kernel on a GPU)."""
        n, k = self.shape
        q = torch.stack([self.data & 0b1111, self.data >> 4], dim=-1).reshape(-1, self.group)
        w = q.to(torch.bfloat16).sub_(self.zero.float()[:, None]).mul_(self.scale.float()[:, None])
        return w.reshape(n, k).to(self.dtype)
