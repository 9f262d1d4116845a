"""The vision encoder as CUDA graphs, one per number of crops in a batch (every count up to CROPS_PER_BATCH), all
captured at start-up (warmup(); a capture under load held up every request in flight for 100 to 200 ms). Batches of
several images used to be padded to a multiple of 4 crops, fewer graphs: up to 3 crops encoded for nothing a batch
(H100, fresh 640x480 images through tritonserver at 64 streams: 59.2 req/s now against 56.4; start-up 7 s longer).

An encode of one 12-tile image is about 330 kernel launches (cuBLAS, cuDNN, Triton) that the engine
thread would otherwise issue one by one while every other request waits for the step; replayed, the
GPU also runs them without gaps for the host. All graphs share one memory pool: they run one at a
time, and what outlives a replay is only the static input and output buffers."""

from __future__ import annotations

import torch

from ..model import vision
from ..model.moondream import Moondream
from .cuda_graphs import CapturedGraphs


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

    def warmup(self) -> None:
        with torch.inference_mode():
            for n in range(1, self.crops.shape[0] + 1):  # (1: what a batch split at CROPS_PER_BATCH may leave)
                self._graph(n)

    def __call__(self, crops: torch.Tensor) -> torch.Tensor:
        n = crops.shape[0]
        self.crops[:n].copy_(crops)
        self._graph(n).replay()
        return self.features[:n]
