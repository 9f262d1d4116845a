"""Slots whose number may change while they are held: a waiter looks again whenever a holder leaves (and every
recheck_s, for a limit that grows with nothing leaving: a replica turning ready). The Batch API's lines upstream (its
limit follows the ready replicas) and batch lines' image decodes (all but one thread while people are about)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Callable


class Slots:
    def __init__(self, limit: Callable[[], int], recheck_s: float | None = None):
        self.limit, self.recheck_s = limit, recheck_s
        self.held = 0
        self._freed = asyncio.Event()

    @contextlib.asynccontextmanager
    async def slot(self):
        """Held for one piece of work; call on one event loop."""
        while self.held >= self.limit():
            self._freed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._freed.wait(), self.recheck_s)
        self.held += 1
        try:
            yield
        finally:
            self.held -= 1
            self._freed.set()
