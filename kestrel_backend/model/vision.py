"""Vision tower: SigLIP-style ViT over 378 px crops, then a projection into the text model's space."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .config import VisionConfig
from .fp8 import fp8_block
from .image_crops import overlap_crops, reconstruct
from .layers import arrays_to_device, layer_norm, linear, mlp, mlp_hidden
from .weights import VisionWeights


CROPS_PER_BATCH = 64  # bounds the encoder's activation memory when many images arrive at once


def crop_image(image: np.ndarray, config: VisionConfig) -> tuple[np.ndarray, tuple[int, int]]:
    """HxWx3 uint8 -> (crops [N, crop, crop, 3] uint8, tiling): CPU work, fine off the device thread."""
    return overlap_crops(image, config.crop_size, config.enc_patch_size, config.overlap_margin, config.max_crops)


def normalise(crops: torch.Tensor, dtype) -> torch.Tensor:
    """[N, crop, crop, 3] uint8 (on the device) -> [N, 3, crop, crop] in [-1, 1]."""
    x = crops.permute(0, 3, 1, 2).to(dtype)
    return x.div_(255.0).sub_(0.5).div_(0.5)


def upload(crops: list, device) -> torch.Tensor:
    """Several images' crops (uint8 arrays, or tensors on the device already: runtime.crop_staging) as one uint8
    tensor on the device, copied through pinned memory (a copy from pageable memory first waits for every step and
    encode queued on its stream: the GPU then idled while the engine thread caught up)."""
    if not any(isinstance(c, torch.Tensor) for c in crops):
        return arrays_to_device(crops, device)
    return torch.cat([c if isinstance(c, torch.Tensor) else arrays_to_device([c], device) for c in crops])


def patchify(x: torch.Tensor, patch: int, width: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/p)*(W/p), width]: patches in row-major order, each C*p*p values then zeros."""
    b, c, h, w = x.shape
    out = x.new_empty(b, (h // patch) * (w // patch), width)
    out[..., c * patch * patch:].zero_()
    patches = x.unflatten(3, (w // patch, patch)).unflatten(2, (h // patch, patch))  # a view at any strides
    out[..., :c * patch * patch].view(b, h // patch, w // patch, c, patch, patch).copy_(
        patches.permute(0, 2, 4, 1, 3, 5))
    return out


def embed_patches(crops: torch.Tensor, w: VisionWeights, config: VisionConfig) -> torch.Tensor:
    """[B, 3, crop, crop] -> [B, grid*grid, enc_dim] patch embeddings plus positions. Patch rows are padded
    to the weight's width, a multiple of 8 (588 -> 592): 16-byte rows let cuBLAS use its Hopper kernels
    (H100, 13 crops: 93 against 138 us)."""
    return linear(patchify(crops, config.enc_patch_size, w.patch_emb.weight.shape[1]), w.patch_emb) + w.pos_emb


def _attend_heads(x: torch.Tensor, qkv, n_heads: int) -> torch.Tensor:
    """Multi-head self-attention before the output projection: [B, N, D] -> [B, N, D]."""
    return _attend(linear(x, qkv), n_heads)


def _attend(qkv: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, N, 3D] q, k, v -> the heads' attention [B, N, D]."""
    b, n, d = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
    q, k, v = (t.view(b, n, n_heads, d // n_heads).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)


def quantize_encoder(w: VisionWeights) -> None:
    """KESTREL_VISION_FP8: the blocks' qkv, fc1 and fc2 weights in e4m3 too (model/fp8.py). proj's input (attention)
    would need a quantising pass of its own, which costs more than FP8 saves (PERFORMANCE.md)."""
    w.fp8 = [fp8_block(b) for b in w.blocks]


def encode_crops(crops: torch.Tensor, w: VisionWeights, config: VisionConfig,
                 out: torch.Tensor | None = None, early: dict | None = None) -> torch.Tensor:
    """[B, 3, crop, crop] -> patch features [B, grid*grid, enc_dim]; crops of many images may share a batch.
    On a GPU the features are written into out if given (a CUDA graph's static buffer). early: {layer: None}
    asks for the residual stream after that block too (the segment refiner's), filled in as {layer: tensor}."""
    x = embed_patches(crops, w, config)
    if x.is_cuda:
        return _encode_blocks_cuda(x, w, config, out, early)
    for i, block in enumerate(w.blocks):
        x = x + linear(_attend_heads(layer_norm(x, block.ln1), block.qkv, config.enc_n_heads), block.proj)
        x = x + mlp(layer_norm(x, block.ln2), block.mlp)
        if early is not None and i in early:
            early[i] = x
    return layer_norm(x, w.post_ln)


def _encode_blocks_cuda(x: torch.Tensor, w: VisionWeights, config: VisionConfig,
                        out: torch.Tensor | None = None, early: dict | None = None) -> torch.Tensor:
    """The same blocks with the residual adds done by the output GEMMs (in place, beta = 1). Their biases
    are left out of the stream and added back by the next norm: w.bias_sums[i] sums all biases before it."""
    from ..kernels.fp8_linear import fp8_linear
    from ..kernels.layer_norm_cuda import shifted_layer_norm, shifted_layer_norm_fp8

    b, n, d = x.shape
    x = x.view(b * n, d)
    for i, block in enumerate(w.blocks):
        shift1, shift2 = w.bias_sums[2 * i], w.bias_sums[2 * i + 1]
        if w.fp8 is None:
            qkv = linear(shifted_layer_norm(x, shift1, block.ln1.weight, block.ln1.bias), block.qkv)
        else:
            h8, scale = shifted_layer_norm_fp8(x, shift1, block.ln1.weight, block.ln1.bias)
            qkv = fp8_linear(h8, scale, w.fp8[i].qkv, block.qkv.bias, out_dtype=x.dtype)
        x.addmm_(_attend(qkv.view(b, n, 3 * d), config.enc_n_heads).view(b * n, d), block.proj.weight.t())
        if w.fp8 is None:
            hidden = mlp_hidden(shifted_layer_norm(x, shift2, block.ln2.weight, block.ln2.bias), block.mlp)
            x.addmm_(hidden, block.mlp.fc2.weight.t())
        else:
            f = w.fp8[i]
            h8, scale, hidden_scale = shifted_layer_norm_fp8(x, shift2, block.ln2.weight, block.ln2.bias,
                                                             gelu_bound=f.gelu_bound)
            hidden8 = fp8_linear(h8, scale, f.fc1, f.fc1_bias, gelu=True, out_scale=hidden_scale)
            fp8_linear(hidden8, hidden_scale, f.fc2, None, accumulate=x)
        if early is not None and i in early:  # (a copy, with the biases the stream leaves out)
            early[i] = (x.float() + w.bias_sums[2 * i + 2]).to(x.dtype).view(b, n, d)
    return shifted_layer_norm(x, w.bias_sums[-1], w.post_ln.weight, w.post_ln.bias,
                              out=None if out is None else out.view(b * n, d)).view(b, n, d)


def project(features: torch.Tensor, tiling: tuple[int, int], w: VisionWeights, config: VisionConfig) -> torch.Tensor:
    """Features of one image's crops (global first) -> [grid*grid, text dim] image embedding."""
    g = config.grid
    tiles = features[1:].view(-1, g, g, config.enc_dim)
    stitched = reconstruct(tiles, tiling, config.overlap_margin).permute(2, 0, 1)
    pooled = F.adaptive_avg_pool2d(stitched, (g, g)).permute(1, 2, 0).reshape(g * g, config.enc_dim)
    return mlp(torch.cat([features[0], pooled], dim=-1), w.proj_mlp)


def encode_images(cropped: list[tuple[np.ndarray, tuple[int, int]]], w: VisionWeights, config: VisionConfig,
                  encode=None) -> list[torch.Tensor]:
    """Several images' crops through the encoder together (batched), then each projected on its own.
    encode(crops) -> features: encode_crops unless given (the engine's CUDA graphs, whose output is a
    static buffer: each batch's is copied out before the next one runs)."""
    encode = encode or (lambda crops: encode_crops(crops, w, config))
    x = normalise(upload([crops for crops, _ in cropped], w.pos_emb.device), w.pos_emb.dtype)
    features = x.new_empty(len(x), config.grid * config.grid, config.enc_dim)
    for i in range(0, len(x), CROPS_PER_BATCH):
        features[i:i + CROPS_PER_BATCH] = encode(x[i:i + CROPS_PER_BATCH])
    out, start = [], 0
    for crops, tiling in cropped:
        out.append(project(features[start:start + len(crops)], tiling, w, config))
        start += len(crops)
    return out


def encode_image(image: np.ndarray, w: VisionWeights, config: VisionConfig) -> torch.Tensor:
    return encode_images([crop_image(image, config)], w, config)[0]
