"""Segment's pieces on their own: the model's SVG tokens to a path, the mask clean-up, the outline of a mask, the
refiner's weights. (Their agreement with Kestrel's pipeline is in the parity cases of tests/fixtures/md3-tiny.)"""

import numpy as np
import pytest
import torch

from kestrel_backend.model.seg_refiner import RefinerHead
from kestrel_backend.skills import segment_masks
from kestrel_backend.skills.segment import box_from, parse_path, scaled_path


def test_path_tokens_parse_with_negatives_and_scale_to_the_box():
    parsed = parse_path(["M", "-", "96", "480", "L", "960", "0", "5", "Z"])
    assert parsed == ["M", (-96, 480), "L", (960, 0), "Z"]  # a number without its pair is dropped
    assert scaled_path(parsed) == "M -0.1 0.5 L 1 0 Z"
    for bad in (["12", "M"], ["M", "x"], ["M", "1.5"]):
        with pytest.raises(ValueError):
            parse_path(bad)


def test_the_box_is_centre_and_size_clipped_to_the_image():
    assert box_from([0.9, 0.5], [(0.4, 0.2)]) == {"x_min": 0.7, "x_max": 1.0, "y_min": 0.4, "y_max": 0.6}
    assert box_from([0.5], [(0.1, 0.1)]) is None and box_from([0.5, 0.5], []) is None


def test_clean_fills_small_holes_and_drops_small_islands():
    mask = np.zeros((100, 100), np.uint8)
    mask[20:80, 20:80] = 1
    mask[50, 50] = 0  # a hole of one pixel
    mask[5:7, 90:92] = 1  # an island of four pixels (under 0.15% of the image)
    cleaned = segment_masks.clean(mask)
    assert cleaned[50, 50] == 1 and cleaned[5:7, 90:92].sum() == 0 and cleaned[20:80, 20:80].all()
    lone = np.zeros((100, 100), np.uint8)
    lone[1:3, 1:3] = 1  # every island small: the largest stays
    assert segment_masks.clean(lone)[1:3, 1:3].all()


def test_outline_drawn_back_covers_the_same_pixels_holes_included():
    mask = np.zeros((120, 200), np.uint8)
    yy, xx = np.mgrid[:120, :200]
    mask[(yy - 60) ** 2 / 50 ** 2 + (xx - 90) ** 2 / 70 ** 2 <= 1] = 1
    mask[40:70, 70:110] = 0  # a hole
    mask[10:30, 170:190] = 1  # a second part
    box = segment_masks.mask_box(mask)
    drawn = segment_masks.path_mask(segment_masks.outline(mask, box), box, 200, 120)
    assert drawn[50, 90] == 0 and drawn[20, 180] == 1
    assert np.count_nonzero(drawn != mask) <= 0.002 * mask.size


def test_refiner_weights_missing_a_tensor_fail_with_its_name(tmp_path, tiny_dir):
    folder = tiny_dir.parent / "md3-tiny" / "seg_refiner"
    head = RefinerHead.load(folder, "cpu", torch.float32)
    assert (head.num_masks, head.dim, head.enc_dim, head.blocks) == (4, 64, 64, [0, 1])
    tensors = dict(head.t)
    del tensors["mask_mlps.2.4.bias"]
    torch.save({"head": tensors}, tmp_path / "model.pt")
    with pytest.raises(ValueError, match="missing tensor mask_mlps.2.4.bias"):
        RefinerHead.load(tmp_path, "cpu", torch.float32)
    torch.save([1, 2], tmp_path / "model.pt")
    with pytest.raises(ValueError, match="not a segment refiner checkpoint"):
        RefinerHead.load(tmp_path / "model.pt", "cpu", torch.float32)
    with pytest.raises(ValueError, match="no model.pt or model.safetensors"):
        RefinerHead.load(tmp_path / "..", "cpu", torch.float32)
