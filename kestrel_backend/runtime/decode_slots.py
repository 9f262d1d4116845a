"""Batch lines' share of the image-decode threads: every thread while nobody is about, all but one while people's
requests are (Admission.people_about), so that a person's image finds a thread free rather than a queue of batch
images. (On an H200, 3,000 fresh images over 64 gRPC streams: sent as batch lines held to five of the six threads at
all times, 43.5 req/s; as interactive requests, on all six, 48.5: PERFORMANCE.md, What we tried.)"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Callable


class BatchDecodeSlots:
    def __init__(self, threads: int, people_about: Callable[[], bool]):
        self.threads, self.people_about = threads, people_about
        self.running = 0  # batch lines' decodes in the pool now
        self._freed = asyncio.Event()

    def _limit(self) -> int:
        return self.threads - 1 if self.people_about() else self.threads

    @contextlib.asynccontextmanager
    async def slot(self):
        """Held while one batch line's image is decoded; call on the engine loop."""
        while self.running >= self._limit():
            self._freed.clear()
            await self._freed.wait()
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._freed.set()
