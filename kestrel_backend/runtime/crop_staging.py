"""The crops of waiting requests' new images, copied to the GPU while the running step's work is on it.

Encoding a step's new images began with copying their crops in (about 4 MB an image), while the GPU had nothing to
do. Staged here after the step's work is launched (joined into pinned memory, the copy queued on the stream of the
encodes), the next step's encode finds them on the GPU already. Nothing here waits for the GPU: each staging takes
pinned memory of its own from torch's caching host allocator, which reuses a block once its copy is done (one
buffer, waited for before each refill, held the engine thread until every encode queued before that copy was done:
with the image path on a stream of its own, the next 16 requests' encodes).
"""

from __future__ import annotations

import torch

from ..model import vision
from ..model.layers import arrays_to_device
from ..model.moondream import Moondream

MAX_STAGED_CROPS = 2 * vision.CROPS_PER_BATCH  # about 55 MB of 378 px crops


class CropStaging:
    def __init__(self, model: Moondream):
        self.device = model.device
        self._staged: dict[str, torch.Tensor] = {}  # image key -> its crops on the GPU

    def stage(self, waiting, encoded) -> None:
        """Copy the crops of the first waiting sequences' images that are not encoded (nor in `encoded`, the
        image cache), up to MAX_STAGED_CROPS in all; forget those no waiting sequence needs any more."""
        keys = {seq.image_key for seq in waiting}
        self._staged = {key: crops for key, crops in self._staged.items() if key in keys}
        room = MAX_STAGED_CROPS - sum(len(crops) for crops in self._staged.values())
        picked, n = {}, 0
        for seq in waiting:
            key = seq.image_key
            if key is None or key in encoded or key in self._staged or key in picked or seq.cropped is None:
                continue
            if n + len(seq.cropped[0]) > room:
                break
            picked[key] = seq.cropped[0]
            n += len(seq.cropped[0])
        if not picked:
            return
        on_gpu = arrays_to_device(list(picked.values()), self.device)
        self._staged.update(zip(picked, on_gpu.split([len(crops) for crops in picked.values()])))

    def take(self, key: str) -> torch.Tensor | None:
        """The image's crops on the GPU if staged (once), else None."""
        return self._staged.pop(key, None)
