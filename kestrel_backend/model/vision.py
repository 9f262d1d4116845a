"""Vision tower: SigLIP-style ViT over 378 px crops, then a projection into the text model's space."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .config import VisionConfig
from .image_crops import overlap_crops, reconstruct
from .layers import layer_norm, linear, mlp
from .weights import VisionWeights


CROPS_PER_BATCH = 64  # bounds the encoder's activation memory when many images arrive at once


def crop_image(image: np.ndarray, config: VisionConfig) -> tuple[np.ndarray, tuple[int, int]]:
    """HxWx3 uint8 -> (crops [N, crop, crop, 3] uint8, tiling): CPU work, fine off the device thread."""
    return overlap_crops(image, config.crop_size, config.enc_patch_size, config.overlap_margin, config.max_crops)


def normalise(crops: np.ndarray, device, dtype) -> torch.Tensor:
    """[N, crop, crop, 3] uint8 -> [N, 3, crop, crop] in [-1, 1]."""
    x = torch.from_numpy(crops).to(device).permute(0, 3, 1, 2).to(dtype)
    return x.div_(255.0).sub_(0.5).div_(0.5)


def patchify(x: torch.Tensor, patch: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/p)*(W/p), C*p*p], patches in row-major order."""
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // patch) * (w // patch), c * patch * patch)


def _self_attention(x: torch.Tensor, qkv, proj, n_heads: int) -> torch.Tensor:
    b, n, d = x.shape
    q, k, v = (t.view(b, n, n_heads, d // n_heads).transpose(1, 2) for t in linear(x, qkv).chunk(3, dim=-1))
    out = F.scaled_dot_product_attention(q, k, v)
    return linear(out.transpose(1, 2).reshape(b, n, d), proj)


def encode_crops(crops: torch.Tensor, w: VisionWeights, config: VisionConfig) -> torch.Tensor:
    """[B, 3, crop, crop] -> patch features [B, grid*grid, enc_dim]; crops of many images may share a batch."""
    x = linear(patchify(crops, config.enc_patch_size), w.patch_emb) + w.pos_emb
    for block in w.blocks:
        x = x + _self_attention(layer_norm(x, block.ln1), block.qkv, block.proj, config.enc_n_heads)
        x = x + mlp(layer_norm(x, block.ln2), block.mlp)
    return layer_norm(x, w.post_ln)


def project(features: torch.Tensor, tiling: tuple[int, int], w: VisionWeights, config: VisionConfig) -> torch.Tensor:
    """Features of one image's crops (global first) -> [grid*grid, text dim] image embedding."""
    g = config.grid
    tiles = features[1:].view(-1, g, g, config.enc_dim)
    stitched = reconstruct(tiles, tiling, config.overlap_margin).permute(2, 0, 1)
    pooled = F.adaptive_avg_pool2d(stitched, (g, g)).permute(1, 2, 0).reshape(g * g, config.enc_dim)
    return mlp(torch.cat([features[0], pooled], dim=-1), w.proj_mlp)


def encode_images(cropped: list[tuple[np.ndarray, tuple[int, int]]], w: VisionWeights,
                  config: VisionConfig) -> list[torch.Tensor]:
    """Several images' crops through the encoder together (batched), then each projected on its own."""
    x = normalise(np.concatenate([crops for crops, _ in cropped]), w.pos_emb.device, w.pos_emb.dtype)
    features = torch.cat([encode_crops(x[i:i + CROPS_PER_BATCH], w, config) for i in range(0, len(x), CROPS_PER_BATCH)])
    out, start = [], 0
    for crops, tiling in cropped:
        out.append(project(features[start:start + len(crops)], tiling, w, config))
        start += len(crops)
    return out


def encode_image(image: np.ndarray, w: VisionWeights, config: VisionConfig) -> torch.Tensor:
    return encode_images([crop_image(image, config)], w, config)[0]
