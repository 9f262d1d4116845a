"""The vision encoder as CUDA graphs, one per number of crops in a batch, all captured at start-up
(warmup()): one image's counts as they are, larger batches of several images padded to a multiple of
PADDED_STEP crops (a capture under load held up every request in flight for 100 to 200 ms).

An encode of one 12-tile image is about 330 kernel launches (cuBLAS, cuDNN, Triton) that the engine
thread would otherwise issue one by one while every other request waits for the step; replayed, the
GPU also runs them without gaps for the host. All graphs share one memory pool: they run one at a
time, and what outlives a replay is only the static input and output buffers."""

from __future__ import annotations

import torch

from ..model import vision
from ..model.moondream import Moondream
from .cuda_graphs import CapturedGraphs


PADDED_STEP = 4  # crops: a batch of 4 whole images (52) is not padded


class CropEncoderGraphs:
    """__call__(crops [n, 3, crop, crop]) -> features [n, grid*grid, enc_dim]: a view of a static buffer,
    valid until the next call."""

    def __init__(self, model: Moondream, max_crops: int = vision.CROPS_PER_BATCH):
        v = model.config.vision
        self.weights, self.config = model.weights.vision, v
        self.crops = torch.zeros(max_crops, 3, v.crop_size, v.crop_size, device=model.device, dtype=model.dtype)
        self.features = torch.zeros(max_crops, v.grid * v.grid, v.enc_dim, device=model.device, dtype=model.dtype)
        self.graphs = CapturedGraphs()  # by crop count

    def _encode(self, n: int) -> None:
        vision.encode_crops(self.crops[:n], self.weights, self.config, out=self.features[:n])

    def _graph(self, n: int) -> torch.cuda.CUDAGraph:
        return self.graphs.get_or_capture(n, lambda: self._encode(n))

    def _padded(self, n: int) -> int:
        """The graph for n crops: n up to one image's count (its global view plus max_crops tiles), else
        the next multiple of PADDED_STEP (the padded crops are encoded and dropped)."""
        if n <= self.config.max_crops + 1:
            return n
        return min(-(-n // PADDED_STEP) * PADDED_STEP, self.crops.shape[0])

    def warmup(self) -> None:
        with torch.inference_mode():
            for n in sorted({self._padded(n) for n in range(2, self.crops.shape[0] + 1)}):
                self._graph(n)

    def __call__(self, crops: torch.Tensor) -> torch.Tensor:
        n = crops.shape[0]
        self.crops[:n].copy_(crops)
        self._graph(self._padded(n)).replay()
        return self.features[:n]
