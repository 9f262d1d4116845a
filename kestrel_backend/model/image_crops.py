"""Overlapping crops: one global 378 px view plus a grid of high-resolution tiles.

Each tile is a 378 px crop whose outer `overlap_margin` patches overlap its neighbours; after
encoding, the tiles' inner patches are stitched back into one feature map (`reconstruct`).
"""

from __future__ import annotations

import math

import numpy as np
import pyvips
import torch


def select_tiling(height: int, width: int, window: int, max_crops: int) -> tuple[int, int]:
    """Rows and columns of tiles for an image of this size (sizes exclude the outer margins)."""
    if height <= window or width <= window:
        return 1, 1
    min_rows, min_cols = math.ceil(height / window), math.ceil(width / window)
    if min_rows * min_cols > max_crops:
        shrink = math.sqrt(max_crops / (min_rows * min_cols))
        return max(1, math.floor(min_rows * shrink)), max(1, math.floor(min_cols * shrink))
    rows = max(math.floor(math.sqrt(max_crops * height / width)), min_rows)
    cols = max(math.floor(math.sqrt(max_crops * width / height)), min_cols)
    if rows * cols > max_crops:
        if cols > rows:
            cols = math.floor(max_crops / rows)
        else:
            rows = math.floor(max_crops / cols)
    return max(1, rows), max(1, cols)


def overlap_crops(image: np.ndarray, crop_size: int, patch_size: int, overlap_margin: int,
                  max_crops: int) -> tuple[np.ndarray, tuple[int, int]]:
    """HxWx3 uint8 -> (crops [1 + rows*cols, crop, crop, 3] uint8, (rows, cols))."""
    height, width = image.shape[:2]
    margin = patch_size * overlap_margin
    window = crop_size - 2 * margin
    rows, cols = select_tiling(height - 2 * margin, width - 2 * margin, window, max_crops)

    source = pyvips.Image.new_from_array(image)
    target_h, target_w = rows * window + 2 * margin, cols * window + 2 * margin
    resized = source.resize(target_w / width, vscale=target_h / height).numpy()

    crops = np.zeros((1 + rows * cols, crop_size, crop_size, image.shape[2]), dtype=np.uint8)
    crops[0] = source.resize(crop_size / width, vscale=crop_size / height).numpy()
    for r in range(rows):
        for c in range(cols):
            tile = resized[r * window:r * window + crop_size, c * window:c * window + crop_size]
            crops[1 + r * cols + c, :tile.shape[0], :tile.shape[1]] = tile
    return crops, (rows, cols)


def reconstruct(tiles: torch.Tensor, tiling: tuple[int, int], margin: int) -> torch.Tensor:
    """Stitch [rows*cols, g, g, C] tile features into one map, keeping each overlap once."""
    rows, cols = tiling
    g = tiles.shape[1]
    inner = g - 2 * margin
    out = tiles.new_zeros(rows * inner + 2 * margin, cols * inner + 2 * margin, tiles.shape[-1])
    for i in range(rows * cols):
        r, c = divmod(i, cols)
        y0 = 0 if r == 0 else margin
        y1 = g if r == rows - 1 else g - margin
        x0 = 0 if c == 0 else margin
        x1 = g if c == cols - 1 else g - margin
        out[r * inner + y0:r * inner + y1, c * inner + x0:c * inner + x1] = tiles[i, y0:y1, x0:x1]
    return out
