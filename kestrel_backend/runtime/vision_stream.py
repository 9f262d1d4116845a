"""The image path on a CUDA stream of its own, beside the engine's steps (KESTREL_VISION_STREAM).

The vision encoder is bound by its matmuls, a decode step by memory: on one stream each waits for the other (a
chain-of-thought burst's decode steps while images are encoded, the next images while a step decodes). On two, the
GPU may run them together (a probe on an H200: 9 crops' matmuls and 8 decode-like steps of 64 rows, 30.8 ms one
after the other, 24.2 at once). In the engine it measured no faster (H200, Moondream 2, Kestrel's method;
PERFORMANCE.md, What we tried): the steps that admit requests are prefills, bound by their matmuls as the encoder
is. So it is off by default. Every encode runs here (the encoder's CUDA graphs share static buffers: one stream keeps
their replays in order), crops are copied in here, and an image's embedding is ready for the engine's stream after
an event recorded behind its encode: a step that reads it (its prefill, a prefix prefilled ahead) waits for that
event only, not for images encoded further ahead.

Memory crosses the streams one way: embeddings are made here and read on the engine's stream, so each is marked as
used there (record_stream), and the caching allocator gives its block to no new tensor before the engine's stream has
passed the point where it was freed.

Both streams run at the default priority: vision above the steps, or the steps (on a high-priority stream of their
own) above vision, measured no faster on an H200 (PERFORMANCE.md, What we tried).
"""

from __future__ import annotations

import contextlib

import torch

# With a vision stream, the images of this many requests at the head of the queue are encoded ahead (without, as
# many as the next step admits): encodes run beside decode-only steps, and the steps that admit find them done
VISION_AHEAD_REQUESTS = 16
MAX_EVENTS = 256  # events of encodes kept for keys no step has read yet (cancelled requests' images); then pruned


class VisionStream:
    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self._engine = torch.cuda.default_stream(device)  # (the engine thread's steps run on it)
        self._ready: dict[str, torch.cuda.Event] = {}  # image key -> the event behind its encode

    def hand_over(self, embeddings: dict[str, torch.Tensor]) -> None:
        """Embeddings (by image key) just queued here, for the engine's stream to read once their encode is done."""
        event = torch.cuda.Event()
        event.record(self.stream)
        if len(self._ready) >= MAX_EVENTS:
            self._ready = {key: e for key, e in self._ready.items() if not e.query()}
        for key, embedding in embeddings.items():
            embedding.record_stream(self._engine)
            self._ready[key] = event

    def wait_for(self, key: str) -> None:
        """The engine's stream waits for the encode of this image (a no-op once it has waited, or it was done)."""
        event = self._ready.pop(key, None)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)


def on_vision_stream(vision: VisionStream | None):
    """A context whose GPU work (copies, encodes) is queued on the vision stream; nothing to do without one (CPU,
    KESTREL_VISION_STREAM=0)."""
    return torch.cuda.stream(vision.stream) if vision is not None else contextlib.nullcontext()
