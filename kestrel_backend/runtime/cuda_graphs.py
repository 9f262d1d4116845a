"""Capturing the engine's CUDA graphs (decode steps, one-sequence prefill steps, the vision encoder)."""

from __future__ import annotations

import torch


def capture(fn, pool=None, stream: torch.cuda.Stream | None = None, warmups: int = 2) -> torch.cuda.CUDAGraph:
    """fn() as a CUDA graph in memory pool `pool` (one pool serves graphs that run one at a time), captured on
    `stream` (a new one if None), after warm-up calls there: Triton compiles, cuBLAS and cuDNN choose their plans,
    the allocator settles."""
    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        fn()
    return graph


class CapturedGraphs(dict):
    """CUDA graphs by key, each captured on first use; all share one memory pool (they run one at a time) and one
    capture stream, their own. The capture stream picks the cuBLAS workspace that a graph's matmuls use: on torch's
    default capture stream, one for every graph, the vision encoder's graphs shared the decode graphs' workspace,
    and with both replayed at once on two streams (runtime.vision_stream) a burst failed with an illegal instruction
    (H200); with a stream for each set of graphs, 11 bursts ran without one."""

    def __init__(self):
        super().__init__()
        self._pool = None
        self._stream = None

    def get_or_capture(self, key, fn) -> torch.cuda.CUDAGraph:
        if key not in self:
            self._stream = self._stream or torch.cuda.Stream()
            self[key] = capture(fn, self._pool, self._stream)
            self._pool = self[key].pool()
        return self[key]
