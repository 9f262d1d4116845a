"""FP8 (e4m3) copies of a block's qkv, fc1 and fc2 for the opt-in FP8 paths: the vision encoder's
(KESTREL_VISION_FP8, vision.quantize_encoder) and the text model's long steps (KESTREL_PREFILL_FP8,
text.quantize_prefill). Both run the same kernels: a layer norm that quantises its output per row
(kernels/layer_norm_cuda.py) feeds qkv and fc1, fc1 writes its GELU output in e4m3 for fc2 (kernels/fp8_linear.py).
The bf16 weights stay beside them (the other steps and the CPU path use them)."""

from __future__ import annotations

import torch.nn.functional as F

from .weights import Fp8Blocks

FP8_FF_STEP = 128  # the MLP's inner width in e4m3 is padded with zeros to a multiple of this: fc2's K step


def fp8_block(block) -> Fp8Blocks:
    """A block with qkv and an MLP (fc1, fc2; the tanh GELU between) -> its matmuls in e4m3, per output channel."""
    from ..kernels.fp8_linear import Fp8Weight

    pad = -block.mlp.fc1.weight.shape[0] % FP8_FF_STEP  # (zero rows of fc1 give gelu(0) = 0: fc2 adds nothing)
    fc1 = Fp8Weight.of(F.pad(block.mlp.fc1.weight, (0, 0, 0, pad)))
    fc1_bias = F.pad(block.mlp.fc1.bias, (0, pad))
    longest_row = (fc1.weight.float() * fc1.scale[:, None]).norm(dim=1).max()
    return Fp8Blocks(Fp8Weight.of(block.qkv.weight), fc1, fc1_bias, Fp8Weight.of(F.pad(block.mlp.fc2.weight, (0, pad))),
                     (float(longest_row), float(fc1_bias.float().abs().max())))
