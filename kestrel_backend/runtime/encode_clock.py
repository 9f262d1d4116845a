"""How long an image encode launched ahead of its sequences' admission took, read once it has run.

A sequence's prefill time counts its image's encode. Encoded in the step that admits it, the encode falls inside
that step's time; encoded ahead, behind an earlier step's work (scheduler.encode_ahead), it is timed here: by a
pair of CUDA events on a GPU (read after a later step has waited for the stream, so reading never waits), by the
host's clock on a CPU, where the encode runs as it is called.
"""

from __future__ import annotations

import time

import torch


class EncodeClock:
    def __init__(self, device: torch.device):
        self._events = None
        if torch.device(device).type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._start = time.perf_counter()
        self._ms = 0.0
        self._images = 1

    def stop(self, images: int) -> None:
        """The encode of `images` images (sharing its time) has been launched."""
        self._images = images
        if self._events is not None:
            self._events[1].record()
        else:
            self._ms = (time.perf_counter() - self._start) * 1000

    def ms(self) -> float:
        """One image's share of the encode's time."""
        if self._events is not None:
            self._events[1].synchronize()
            self._ms = self._events[0].elapsed_time(self._events[1])
        return self._ms / self._images
