"""Region heads: coordinates and sizes in and out of the text model's hidden space (point/detect)."""

from __future__ import annotations

import math

import torch

from .layers import layer_norm, linear, mlp
from .weights import MLP, RegionWeights


def _fourier(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    f = 2 * math.pi * x @ freqs
    return torch.cat([f.cos(), f.sin()], dim=-1)


def encode_coordinate(coord: torch.Tensor, w: RegionWeights) -> torch.Tensor:
    """[..., 1] coordinate in [0, 1] -> [..., dim] embedding."""
    return linear(_fourier(coord, w.coord_features), w.coord_encoder)


def _decode(hidden: torch.Tensor, decoder, w: RegionWeights) -> torch.Tensor:
    """Moondream 2: an MLP on the hidden state; Moondream 3: one Linear after the region's LayerNorm."""
    if isinstance(decoder, MLP):
        return mlp(hidden, decoder)
    return linear(layer_norm(hidden, w.ln), decoder)


def decode_coordinate(hidden: torch.Tensor, w: RegionWeights) -> torch.Tensor:
    """[..., dim] -> [..., bins] logits over the coordinate bins."""
    return _decode(hidden, w.coord_decoder, w)


def encode_size(size: torch.Tensor, w: RegionWeights) -> torch.Tensor:
    """[..., 2] (width, height) -> [..., dim] embedding."""
    return linear(_fourier(size, w.size_features), w.size_encoder)


def decode_size(hidden: torch.Tensor, w: RegionWeights) -> torch.Tensor:
    """[..., dim] -> [..., 2, bins] logits for width and height on a log2 scale."""
    out = _decode(hidden, w.size_decoder, w)
    return out.view(*out.shape[:-1], 2, -1)


def coordinate_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Bin b of n maps to b / n, in float32 (bf16 cannot hold every bin index)."""
    return logits.argmax(dim=-1).float() / logits.shape[-1]


def size_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Bin b of n maps to 2^(10 b / (n - 1) - 10): sizes from 1/1024 to 1 of the image side."""
    bins = logits.argmax(dim=-1).float()
    return torch.pow(2.0, bins / (logits.shape[-1] - 1) * 10.0 - 10.0)


def spatial_ref_embeddings(refs, w: RegionWeights) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Points (x, y) and boxes (x_min, y_min, x_max, y_max) -> the embeddings of their coordinate tokens (x
    then y of each, a box by its centre) [2N, dim] and of the boxes' size tokens (width, height) [boxes, dim]."""
    coords, sizes = [], []
    for ref in refs:
        if len(ref) == 2:
            coords += [ref[0], ref[1]]
        else:
            coords += [(ref[0] + ref[2]) / 2, (ref[1] + ref[3]) / 2]
            sizes.append([ref[2] - ref[0], ref[3] - ref[1]])
    f = w.coord_features
    coord_emb = encode_coordinate(torch.tensor(coords, device=f.device, dtype=f.dtype).view(-1, 1), w)
    size_emb = None
    if sizes:
        size_emb = encode_size(torch.tensor(sizes, device=f.device, dtype=w.size_features.dtype), w)
    return coord_emb, size_emb
