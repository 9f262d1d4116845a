"""The crops of waiting requests' new images, copied to the GPU while the running step's work is on it.

Encoding a step's new images began with copying their crops in (about 4 MB an image): joined on the CPU and copied
from pageable memory, which waits for the copy to end, while the GPU had nothing to do. Staged here after the step's
work is launched (through one pinned buffer, the copy on the engine's stream), the next step's encode finds them on
the GPU already.
"""

from __future__ import annotations

import torch

from ..model import vision
from ..model.moondream import Moondream

MAX_STAGED_CROPS = 2 * vision.CROPS_PER_BATCH  # about 55 MB of 378 px crops


class CropStaging:
    def __init__(self, model: Moondream):
        v = model.config.vision
        self.device = model.device
        self._pinned = torch.empty(MAX_STAGED_CROPS, v.crop_size, v.crop_size, 3, dtype=torch.uint8, pin_memory=True)
        self._copied: torch.cuda.Event | None = None  # the last copy out of the pinned buffer
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
        if self._copied is not None:
            self._copied.synchronize()  # (the pinned buffer's last copy, queued behind the last step's encode ahead)
        torch.cat([torch.from_numpy(crops) for crops in picked.values()], out=self._pinned[:n])
        on_gpu = self._pinned[:n].to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        self._staged.update(zip(picked, on_gpu.split([len(crops) for crops in picked.values()])))

    def take(self, key: str) -> torch.Tensor | None:
        """The image's crops on the GPU if staged (once), else None."""
        return self._staged.pop(key, None)
