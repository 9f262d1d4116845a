"""Segment's pixel work on the CPU: the coarse path drawn as a mask (resvg), the crop the refiner looks at, the
refined mask cleaned up (OpenCV) and outlined again as a path. Each step is Kestrel's, so that the masks are the
same; the outline is ours (Kestrel traces with potrace, GPL, which this project does not ship): the boundary of
the refined mask as polygons, in the same box-relative [0, 1] units as the model's paths.
"""

from __future__ import annotations

import threading

import cv2
import numpy as np
import pyvips
from resvg import render, usvg

CROP_MARGIN = 0.25  # the refiner sees the box grown by this fraction of its size on each side
REFINER_SIZE = 378
MIN_AREA_FRACTION = 0.0015  # holes and islands smaller than this fraction of the image are removed
_RENDER_SCALE = 2  # the path is drawn at twice the size and averaged down (anti-aliased coverage)
_local = threading.local()  # resvg's options may only be used by the thread that made them


def _svg_options():
    if not hasattr(_local, "options"):
        _local.options = usvg.Options.default()
    return _local.options


def path_mask(svg_path: str, box: dict, width: int, height: int) -> np.ndarray:
    """The path (in [0, 1] units of box) filled, as a uint8 {0, 1} mask of the image: pixels at least half covered."""
    cx, cy = (box["x_min"] + box["x_max"]) / 2, (box["y_min"] + box["y_max"]) / 2
    bw, bh = box["x_max"] - box["x_min"], box["y_max"] - box["y_min"]
    rw, rh = width * _RENDER_SCALE, height * _RENDER_SCALE
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 1 1" preserveAspectRatio="none" width="{rw}" '
           f'height="{rh}"><path d="{svg_path}" fill="white" transform="translate({cx - bw / 2},{cy - bh / 2}) '
           f'scale({bw},{bh})"/></svg>')
    png = bytes(render(usvg.Tree.from_str(svg, _svg_options()), (1.0, 0.0, 0.0, 0.0, 1.0, 0.0)))
    alpha = pyvips.Image.new_from_buffer(png, "")[3].numpy().astype(np.float32)
    coverage = alpha.reshape(height, _RENDER_SCALE, width, _RENDER_SCALE).mean(axis=(1, 3)) / 255.0
    return (coverage > 0.5).astype(np.uint8)


def crop_box(box: dict, width: int, height: int) -> tuple[int, int, int, int]:
    """(x1, y1, x2, y2) pixels: the box grown by CROP_MARGIN on each side, clipped to the image."""
    x_min, x_max = box["x_min"] * width, box["x_max"] * width
    y_min, y_max = box["y_min"] * height, box["y_max"] * height
    dx, dy = (x_max - x_min) * CROP_MARGIN, (y_max - y_min) * CROP_MARGIN
    return (max(0, int(x_min - dx)), max(0, int(y_min - dy)), min(width, int(x_max + dx)), min(height, int(y_max + dy)))


def refiner_inputs(image: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A crop and its mask resized to the refiner's 378 px square (bilinear pixels, nearest mask)."""
    size = (REFINER_SIZE, REFINER_SIZE)
    return (cv2.resize(image, size, interpolation=cv2.INTER_LINEAR),
            cv2.resize(mask, size, interpolation=cv2.INTER_NEAREST))


def paste_refined(soft: np.ndarray, crop: tuple[int, int, int, int], width: int, height: int) -> np.ndarray:
    """The refiner's float mask (378 px) back at the crop's size and place in an image-sized {0, 1} mask."""
    x1, y1, x2, y2 = crop
    full = np.zeros((height, width), dtype=np.uint8)
    full[y1:y2, x1:x2] = cv2.resize(soft, (x2 - x1, y2 - y1), interpolation=cv2.INTER_LINEAR) > 0.5
    return full


def clean(mask: np.ndarray) -> np.ndarray:
    """Small holes filled, then small islands removed (the largest kept if all are small), then a 3x3 closing."""
    threshold = max(1.0, MIN_AREA_FRACTION * mask.size)
    mask = mask.astype(np.uint8)
    for holes in (True, False):
        n, labels, stats, _ = cv2.connectedComponentsWithStats((mask == 0 if holes else mask).astype(np.uint8), 8)
        areas = stats[1:, cv2.CC_STAT_AREA]
        small = [i + 1 for i, area in enumerate(areas) if area < threshold]
        if not small:
            continue
        if holes:
            keep = [0] + small  # label 0 is the object itself here
        else:
            keep = [i for i in range(1, n) if i not in small] or [int(np.argmax(areas)) + 1]
        mask = np.isin(labels, keep).astype(np.uint8)
    return (cv2.morphologyEx(mask * 255, cv2.MORPH_CLOSE, np.ones((3, 3), np.uint8)) > 0).astype(np.uint8)


def mask_box(mask: np.ndarray) -> dict | None:
    """The tightest box around the mask's pixels (whole pixels), in [0, 1] of the image; None if empty."""
    ys, xs = np.nonzero(mask)
    if not len(xs):
        return None
    h, w = mask.shape
    return {"x_min": xs.min() / w, "y_min": ys.min() / h, "x_max": (xs.max() + 1) / w, "y_max": (ys.max() + 1) / h}


OUTLINE_SCALE = 2  # boundaries traced on the mask at twice its size: a quarter pixel from the true edge, not half


def outline(mask: np.ndarray, box: dict) -> str:
    """The mask's boundaries (outer ones and holes, opposite windings) as an SVG path in [0, 1] units of box, to
    4 decimals. Traced within the box, on the mask enlarged OUTLINE_SCALE times (nearest): the polygons run a
    quarter pixel inside the edges, so that the path drawn back covers the same pixels."""
    h, w = mask.shape
    x1, y1 = int(round(box["x_min"] * w)), int(round(box["y_min"] * h))
    x2, y2 = int(round(box["x_max"] * w)), int(round(box["y_max"] * h))
    k = OUTLINE_SCALE
    part = np.ascontiguousarray(mask[y1:y2, x1:x2], dtype=np.uint8)
    big = cv2.resize(part, ((x2 - x1) * k, (y2 - y1) * k), interpolation=cv2.INTER_NEAREST)
    contours, _ = cv2.findContours(big, cv2.RETR_CCOMP, cv2.CHAIN_APPROX_SIMPLE)
    parts = []
    for contour in contours:
        points = (contour[:, 0, :].astype(np.float64) + 0.5) / k  # pixels from the box's corner
        coords = [f"{x:.4f},{y:.4f}" for x, y in zip(points[:, 0] / (x2 - x1), points[:, 1] / (y2 - y1))]
        parts.append("M" + coords[0] + "".join("L" + c for c in coords[1:]) + "Z")
    return "".join(parts)
