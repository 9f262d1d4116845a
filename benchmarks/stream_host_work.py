"""The engine thread's host work per decode step while many requests stream, by how the stream is taken.

    python benchmarks/stream_host_work.py [--streams 64] [--rounds 4] [--device cpu]

Requests are submitted and read on the engine loop, as the Triton adapter does, with the tiny checkpoint, and
each chunk handled as the adapter does (its response body built and queued for the outbox's thread): each
stream read by `async for` (a coroutine woken per chunk) or handed to a sink with `forward_to` (called inside
the step). Interleaved rounds; per decode step: the scheduler's "advance" phase (choosing the next input,
detokenizing, delivering chunks) and the engine loop's time outside steps (the coroutines, admission). From
three sequences up that host work runs while the GPU waits.
"""

from __future__ import annotations

import argparse
import asyncio
import queue
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kestrel_backend.config import RuntimeConfig  # noqa: E402
from kestrel_backend.engine import InferenceEngine  # noqa: E402
from kestrel_backend.triton.protocol import chunk_body  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    engine = InferenceEngine.create(RuntimeConfig(model_path=str(ROOT / "tests" / "fixtures" / "md2-tiny"),
                                                  device=args.device, dtype="float32",
                                                  max_batch_size=args.streams, max_queue=4 * args.streams))
    outbox = queue.SimpleQueue()

    def handle(chunk):
        outbox.put(chunk_body(chunk, chunk.token_index))

    async def one(i: int, forward: bool):
        stream = await engine.query(None, f"question number {i} about things", stream=True,
                                    settings={"temperature": 0, "max_tokens": 64})
        if forward:
            stream.forward_to(handle)
        else:
            async for chunk in stream:
                handle(chunk)
        return await stream.result()

    async def burst(forward: bool):
        return await asyncio.gather(*[one(i, forward) for i in range(args.streams)])

    def level(forward: bool) -> tuple[float, float]:
        s = engine.scheduler
        phases, steps, t0 = dict(s.phase_s), s.steps, time.perf_counter()
        asyncio.run_coroutine_threadsafe(burst(forward), engine.loop).result()
        wall, steps = time.perf_counter() - t0, s.steps - steps
        spent = {k: s.phase_s[k] - phases[k] for k in phases}
        return spent["advance"] / steps * 1000, (wall - sum(spent.values())) / steps * 1000

    try:
        level(True), level(False)  # warm-up
        rounds = {"async for": [], "forward_to": []}
        for _ in range(args.rounds):
            for name in rounds:
                rounds[name].append(level(name == "forward_to"))
    finally:
        engine.shutdown()
    print(f"| {args.streams} streams, {args.device} | advance ms / step (median, range) | outside steps ms / step |\n"
          "| --- | --- | --- |")
    for name, rows in rounds.items():
        cols = []
        for values in zip(*rows):
            cols.append(f"{statistics.median(values):.3f} ({min(values):.3f} to {max(values):.3f})")
        print(f"| {name} | {cols[0]} | {cols[1]} |")


if __name__ == "__main__":
    main()
