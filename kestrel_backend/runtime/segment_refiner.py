"""Refining a finished segment: CPU stages on the image workers, the refiner head on the engine thread.

A segment's request has left the batch (its KV pages are free) when this starts: its coarse path is drawn as a mask,
the box grown by a margin is cropped and resized (a worker thread), the vision encoder and the refiner head run on
that crop (the engine thread, which owns the device, between two steps), and the refined mask is cleaned and
outlined (a worker thread). A segment that cannot be refined (no box, a path that does not parse or draws nothing)
keeps its coarse path and box, as Kestrel does.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import numpy as np
import torch

from ..model.seg_refiner import EARLY_LAYER, RefinerHead
from ..model.vision import encode_crops

log = logging.getLogger("kestrel.segment")


@dataclass
class _Crop:
    box: tuple[int, int, int, int]
    pixels: np.ndarray  # 378 x 378 x 3 uint8
    mask: np.ndarray  # 378 x 378 uint8
    width: int
    height: int


class SegmentRefiner:
    def __init__(self, model, head: RefinerHead, executor):
        self.model, self.head, self.executor = model, head, executor

    async def refine(self, segment: dict, image: np.ndarray) -> dict:
        """The segment with svg_path, bbox and refined updated where refinement succeeds."""
        if not segment.get("svg_path") or "bbox" not in segment:
            return segment
        loop = asyncio.get_running_loop()
        crop = await loop.run_in_executor(self.executor, _crop, image, segment["svg_path"], segment["bbox"])
        if crop is None:
            return segment
        soft = self._run_head(crop)
        refined = await loop.run_in_executor(self.executor, _outline, soft, crop)
        if refined is None:
            return segment
        path, box = refined
        return {**segment, "svg_path": path, "bbox": box, "refined": True}

    def refined_mask(self, image: np.ndarray, svg_path: str, box: dict) -> tuple[np.ndarray, np.ndarray] | None:
        """The whole pipeline at once on the calling thread (parity checks): -> (the head's last 378 px float mask,
        the cleaned refined mask of the image), or None where nothing is refined."""
        crop = _crop(image, svg_path, box)
        if crop is None:
            return None
        soft = self._run_head(crop)
        return soft, _refined(soft, crop)

    @torch.inference_mode()
    def _run_head(self, crop: _Crop) -> np.ndarray:
        """Vision features of the crop (final and block EARLY_LAYER's), then the head's rounds: -> 378 px float mask."""
        m = self.model
        pixels = torch.from_numpy(crop.pixels).to(m.device).permute(2, 0, 1)[None].float()
        pixels = ((pixels / 255.0 - 0.5) / 0.5).to(m.dtype)
        early = {EARLY_LAYER: None}
        final = encode_crops(pixels, m.weights.vision, m.config.vision, early=early)
        mask = torch.from_numpy(crop.mask).to(m.device, m.dtype)[None, None]
        return self.head.refine(final, early[EARLY_LAYER], mask)[0].float().cpu().numpy()


def _masks():
    """skills.segment_masks, imported on the first segment: OpenCV and resvg load only where segment is used."""
    from ..skills import segment_masks

    return segment_masks


def _crop(image: np.ndarray, svg_path: str, box: dict) -> _Crop | None:
    masks = _masks()
    h, w = image.shape[:2]
    coarse = masks.path_mask(svg_path, box, w, h)
    x1, y1, x2, y2 = crop = masks.crop_box(box, w, h)
    if not coarse[y1:y2, x1:x2].any():
        return None
    pixels, mask = masks.refiner_inputs(np.ascontiguousarray(image[y1:y2, x1:x2]), coarse[y1:y2, x1:x2])
    return _Crop(crop, pixels, mask, w, h)


def _refined(soft: np.ndarray, crop: _Crop) -> np.ndarray:
    masks = _masks()
    return masks.clean(masks.paste_refined(soft, crop.box, crop.width, crop.height))


def _outline(soft: np.ndarray, crop: _Crop) -> tuple[str, dict] | None:
    masks = _masks()
    mask = _refined(soft, crop)
    box = masks.mask_box(mask)
    if box is None:
        return None
    return masks.outline(mask, box), box
