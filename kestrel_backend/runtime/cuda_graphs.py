"""Capturing the engine's CUDA graphs (decode steps, one-sequence prefill steps, the vision encoder)."""

from __future__ import annotations

import torch


def capture(fn, pool=None, warmups: int = 2) -> torch.cuda.CUDAGraph:
    """fn() as a CUDA graph in memory pool `pool` (one pool serves graphs that run one at a time), after
    warm-up calls on a side stream: Triton compiles, cuBLAS and cuDNN choose their plans, the allocator
    settles."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph


class CapturedGraphs(dict):
    """CUDA graphs by key, each captured on first use; all share one memory pool (they run one at a time)."""

    def __init__(self):
        super().__init__()
        self._pool = None

    def get_or_capture(self, key, fn) -> torch.cuda.CUDAGraph:
        if key not in self:
            self[key] = capture(fn, self._pool)
            self._pool = self[key].pool()
        return self[key]
