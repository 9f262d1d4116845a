"""The Batch API against gRPC, on one server in one call: fresh 640x480 images captioned (short, greedy).

    python benchmarks/batch_bench.py [--images 5000] [--streams 64] [--max-tokens 32] [--out results.json]
    python benchmarks/batch_bench.py --checkpoint tests/fixtures/md2-tiny --images 64 --streams 4  (CPU smoke run)

One tritonserver (full-size Moondream 2 of random bf16 weights unless --checkpoint) and one gateway with the Batch
API (SQLite job store in a temporary folder, --batch-lines-per-replica = streams), then, each on images no request
has brought before:
1. gRPC: every image captioned over `streams` gRPC streams at once (triton_bench.py's client): its request rate;
2. the batch: every image as one line of one job (JSON Lines uploaded in parts), from its upload's completion to the
   job's completion: its line rate;
3. interactive alone: `interactive` streams of streamed queries through the gateway for --interactive-s (in a process
   of their own): their TTFT, of the requests whose first chunk is their first token (Interactive.measure says why);
4. a second job (--images-beside) with the same interactive streams running beside it: their TTFT.
Goals (issue: the Batch API): the batch at least 95% of the gRPC rate; the interactive TTFT p50 beside it at most
1.5x its value alone.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import gather_limited, p95  # noqa: E402
from benchmarks.triton_bench import fresh_images, gateway, one_http_request, served  # noqa: E402
from client import build_inputs, response_body  # noqa: E402
from client.batch import BatchClient  # noqa: E402


async def caption_over_grpc(url: str, images: list[bytes], streams: int, max_tokens: int) -> dict:
    import tritonclient.grpc.aio as grpcaio

    client = grpcaio.InferenceServerClient(url)

    async def one(i: int) -> int:
        async def request():
            yield {"model_name": "moondream", "request_id": str(i), "inputs": build_inputs(
                "caption", image=images[i], length="short", settings={"temperature": 0, "max_tokens": max_tokens})}
        last = None
        async for result, error in client.stream_infer(request()):
            if error is not None:
                raise RuntimeError(f"the server answered with an error: {error}")
            last = response_body(result) or last
        return last["metrics"]["output_tokens"]
    try:
        t0 = time.perf_counter()
        tokens = await gather_limited(one, len(images), streams)
        wall = time.perf_counter() - t0
    finally:
        await client.close()
    return {"requests": len(images), "seconds": wall, "req_per_s": len(images) / wall,
            "output_tokens_per_request": sum(tokens) / len(tokens)}


class Interactive:
    """`streams` streamed queries through the gateway in a closed loop, each on a fresh image, until stopped: their
    TTFTs as the client sees them, and the engine's (from the request's arrival there, its image decode included) and
    its prefill time (the image's encode and the prompt's prefill): what is left of the client's is the gateway's and
    tritonserver's. In a process of its own: the job's upload (JSON of every image) and its results, read in this
    process, would otherwise hold up the measuring client's event loop (one interpreter lock)."""

    def __init__(self, url: str, images: list[bytes], streams: int, max_tokens: int):
        self.url, self.images, self.streams, self.max_tokens = url, images, streams, max_tokens

    def _run(self, stop, answers) -> None:
        collected: list[dict] = []
        asyncio.run(self._loop(stop, collected))
        answers.put(collected)

    async def _loop(self, stop, collected: list[dict]) -> None:
        import httpx

        async with httpx.AsyncClient(timeout=600) as http:
            async def stream(k: int) -> None:
                i = k
                while not stop.is_set():
                    answer = await one_http_request(http, self.url, self.images[i % len(self.images)],
                                                    self.max_tokens)
                    collected.append(answer)
                    i += self.streams
            await asyncio.gather(*[stream(k) for k in range(self.streams)])

    def measure(self, seconds: float | None = None, until=None) -> dict:
        mp = multiprocessing.get_context("fork")  # (the images go to the child without a copy through a pipe)
        stop, answers = mp.Event(), mp.Queue()
        child = mp.Process(target=self._run, args=(stop, answers), daemon=True)
        child.start()
        if until is not None:
            until()
        else:
            time.sleep(seconds)
        stop.set()
        collected = answers.get(timeout=900)
        child.join()
        # With random weights a first token may carry no text (an unfinished character, a special token): the
        # client's first chunk then waits for later decode steps, longer beside a batch. The TTFT the goal reads is
        # of the requests whose first chunk is their first token, as a trained model's nearly always is.
        first = [a for a in collected if a["first_chunk_token"] == 0]
        out = {"requests": len(collected), "first_chunk_at_first_token": len(first)}
        out |= percentiles("ttft", [a["ttft_ms"] for a in first])
        out |= percentiles("ttft_any_first_chunk", [a["ttft_ms"] for a in collected])
        out |= percentiles("engine_ttft", [a["engine_ttft_ms"] for a in first])
        out |= percentiles("engine_prefill", [a["engine_prefill_ms"] for a in first])
        out |= percentiles("outside_engine", [a["ttft_ms"] - a["engine_ttft_ms"] for a in first])
        return out


def percentiles(name: str, values: list[float]) -> dict:
    values = sorted(values)
    return {f"{name}_p50_ms": statistics.median(values) if values else None,
            f"{name}_p95_ms": p95(values) if values else None}


def batch_job(url: str, images: list[bytes], max_tokens: int) -> dict:
    client = BatchClient(url)
    lines = (json.dumps({"id": i, "skill": "caption", "image": base64.b64encode(image).decode(), "length": "short",
                         "settings": {"temperature": 0, "max_tokens": max_tokens}}).encode()
             for i, image in enumerate(images))
    t_upload = time.perf_counter()
    batch_id = client.submit(lines)
    t0 = time.perf_counter()
    status = client.wait(batch_id, poll_s=0.1)
    wall = time.perf_counter() - t0
    results = list(client.results(batch_id))
    assert status["status"] == "completed" and len(results) == len(images), status
    failed = [r for r in results if r["status"] != "ok"]
    return {"lines": len(images), "failed": len(failed), "upload_s": t0 - t_upload, "seconds": wall,
            "lines_per_s": len(images) / wall, "first_error": failed[0]["error"] if failed else None,
            "output_tokens_per_line": sum(r["usage"]["output_tokens"] for r in results) / len(results)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=5000)
    p.add_argument("--images-beside", type=int, default=2000, help="the second job's, with interactive streams beside")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--interactive", type=int, default=4, help="interactive streams beside the batch")
    p.add_argument("--interactive-s", type=float, default=30, help="seconds of interactive streams alone")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--checkpoint", type=Path)
    p.add_argument("--grpc-port", type=int, default=8101)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    ports = (a.grpc_port - 1, a.grpc_port, a.grpc_port + 1)
    grpc_images = fresh_images(a.images, 0)
    batch_images = fresh_images(a.images, a.images)
    beside_images = fresh_images(a.images_beside, 2 * a.images)
    people = fresh_images(4000, 2 * a.images + a.images_beside)  # (the interactive streams' own, never repeated)
    out = {"images": a.images, "streams": a.streams, "interactive_streams": a.interactive, "max_tokens": a.max_tokens}
    # room for the batch's lines and the interactive streams at once: a person's request waits for no slot
    max_batch = a.streams + a.interactive
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        stack.enter_context(served(max_batch, ports, a.checkpoint))
        log = stack.enter_context(open(Path(tmp) / "gateway.log", "a"))
        url, _ = stack.enter_context(gateway([f"localhost:{ports[1]}"], ports[2] + 1, log, (
            "--batch-data", str(Path(tmp) / "batch"), "--batch-lines-per-replica", str(a.streams))))
        asyncio.run(caption_over_grpc(f"localhost:{ports[1]}", fresh_images(2 * a.streams, 10**6), a.streams,
                                      a.max_tokens))  # warm-up: graphs at every batch size
        out["grpc"] = asyncio.run(caption_over_grpc(f"localhost:{ports[1]}", grpc_images, a.streams, a.max_tokens))
        print("gRPC", out["grpc"], flush=True)
        out["batch"] = batch_job(url, batch_images, a.max_tokens)
        print("batch", out["batch"], flush=True)
        out["interactive_alone"] = Interactive(url, people[:2000], a.interactive, a.max_tokens).measure(
            a.interactive_s)
        print("interactive alone", out["interactive_alone"], flush=True)
        job = {}
        beside = Interactive(url, people[2000:], a.interactive, a.max_tokens)
        out["interactive_beside_batch"] = beside.measure(until=lambda: job.update(batch_job(url, beside_images,
                                                                                            a.max_tokens)))
        out["batch_beside_interactive"] = job
        print("interactive beside a batch", out["interactive_beside_batch"], job, flush=True)
    out["batch_over_grpc"] = out["batch"]["lines_per_s"] / out["grpc"]["req_per_s"]
    out["interactive_ttft_p50_ratio"] = (out["interactive_beside_batch"]["ttft_p50_ms"] /
                                         out["interactive_alone"]["ttft_p50_ms"])
    out["interactive_any_first_chunk_p50_ratio"] = (out["interactive_beside_batch"]["ttft_any_first_chunk_p50_ms"] /
                                                    out["interactive_alone"]["ttft_any_first_chunk_p50_ms"])
    print(f"batch {out['batch']['lines_per_s']:.1f} lines/s = {out['batch_over_grpc']:.3f} x gRPC "
          f"{out['grpc']['req_per_s']:.1f} req/s (goal >= 0.95); interactive TTFT p50 "
          f"{out['interactive_beside_batch']['ttft_p50_ms']:.0f} ms beside a batch, "
          f"{out['interactive_alone']['ttft_p50_ms']:.0f} ms alone: {out['interactive_ttft_p50_ratio']:.2f}x "
          f"(goal <= 1.5); of every request, the first chunk's {out['interactive_any_first_chunk_p50_ratio']:.2f}x")
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
