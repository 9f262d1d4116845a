"""Throughput and time to first token through a real tritonserver (gRPC streams), and through the gateway.

    python benchmarks/triton_bench.py [--concurrency 1 4 16 64] [--max-tokens 64] [--out results.json]
    python benchmarks/triton_bench.py --checkpoint tests/fixtures/md2-tiny --concurrency 1 2  (CPU smoke run)
    python benchmarks/triton_bench.py --fresh-images  (every request a new image: no image or prefix cache hits; on a
        GPU each level's floor too, fresh_floor, and Little's law's time per request at it)
    python benchmarks/triton_bench.py --requests-per-stream 8  (longer levels: a closed loop's steady state)
    python benchmarks/triton_bench.py --gpus 1 2 4 --fresh-images --questions-per-image 2 --model moondream3
        (one server after another on 1, 2 and 4 GPUs of this machine, the several-GPU config past one; two
         questions on each fresh image, sent together, as in Kestrel's method: the prefix-cache hit rate shows
         how often Triton gives both to the same engine)
    python benchmarks/triton_bench.py --gpus 2 4 --one-server-per-gpu --fresh-images --questions-per-image 2
        (instead, 2 and then 4 servers of one GPU each behind one gateway, which routes each request by its image)
    python benchmarks/triton_bench.py --fresh-images --concurrency 64 --max-tokens 3 --vision-fp8 0 1
        (a server with each KESTREL_VISION_FP8 setting, one after the other)

Writes a FULL-SIZE Moondream 2 checkpoint of random bf16 weights (with the fixture's tokenizer) to a
temporary folder, starts tritonserver on model_repository/ with it (kestrel_backend.server.local_server),
and sends streaming queries (a 640x480 JPEG, greedy, max_tokens output tokens), each on its own gRPC
stream (ModelStreamInfer, what async_stream_infer uses) over one channel, from one asyncio client
(tritonclient.grpc.aio; a client of threads measured itself at 64 streams), or with --client-processes N
from N such clients, each in its own process with its share of the streams: one Python client receiving
every streamed token can become the bottleneck, which its CPU share (reported) shows. TTFT is measured at the
client: from sending the request to its first streamed chunk. Output tokens come from the final body's
metrics. The server's side comes from its metrics endpoint, averaged over the level's requests: the
engine's time to first token (from the request reaching the engine) and Triton's queue and input
times. Prints a table and writes JSON. Needs a GPU (or patience) and the nvidia-pytriton wheel.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import itertools
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import gather_limited, query_images, throughput_row  # noqa: E402
from client import build_inputs, response_body  # noqa: E402
from client.metrics import metric_sum, scrape  # noqa: E402
from kestrel_backend.engine_config import TINY_CHECKPOINT  # noqa: E402
from kestrel_backend.server.local_server import server_command  # noqa: E402


QUESTION = "Describe this image."


def fresh_floor(family: str, images: list[bytes], concurrency: int, max_tokens: int, ceilings: dict) -> float:
    """The GPU floor of a level of fresh images, req/s: every image's crops through the vision encoder and its
    prefix and question prefilled (a second question on an image only its own tokens), over the bf16 matmul rate,
    plus the decode steps' bytes over the copy rate (common.floor_s, the Kestrel-method bursts' floor)."""
    from benchmarks.common import floor_s
    from kestrel_backend.model.config import MoondreamConfig
    from kestrel_backend.model.tokenizer import load_tokenizer

    question = len(load_tokenizer(TINY_CHECKPOINT).encode(QUESTION).ids)
    pairs = [(image, QUESTION) for image in images]
    return len(pairs) / floor_s(MoondreamConfig.official(family), pairs, [question] * len(pairs), max_tokens,
                                concurrency, ceilings)


def write_checkpoint(folder: Path, family: str = "moondream2") -> None:
    """Full-size random bf16 weights of `family` (made on the GPU when there is one: Moondream 3's 9B parameters
    take minutes on the CPU)."""
    import torch
    from safetensors.torch import save_file

    from kestrel_backend.model.config import MoondreamConfig
    from kestrel_backend.model.weights import random_state

    config = {"model_type": family} if family == "moondream3" else {}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = {k: v.cpu() for k, v in random_state(MoondreamConfig.from_dict(config), torch.bfloat16, device).items()}
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copy(TINY_CHECKPOINT / "tokenizer.json", folder / "tokenizer.json")
    del state
    if device == "cuda":
        torch.cuda.empty_cache()


def start_server(checkpoint: Path, work: Path, max_batch: int, ports: tuple[int, int, int], log,
                 gpus: int | None = None, gpu: int | None = None) -> subprocess.Popen:
    """ports: (http, grpc, metrics). gpus: serve on the first `gpus` GPUs (past one, the several-GPU config: one
    engine per GPU); gpu: serve on that one GPU only; neither: as the environment says."""
    cmd, env = server_command(*ports, work=work)
    env.update(KESTREL_MODEL_PATH=str(checkpoint), KESTREL_MAX_BATCH_SIZE=str(max_batch), KESTREL_MAX_QUEUE="4096")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    elif gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus))
        if gpus > 1:
            cmd.append("--model-config-name=multi_gpu")
    # its own process group: a server that must be killed is killed with its Python-backend stubs (which hold the GPUs)
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(url: str, server: subprocess.Popen, timeout: float, model: str = "moondream") -> float:
    """Seconds until `model` is ready; exits if the server ends or the timeout passes first."""
    import tritonclient.grpc as grpcclient

    t0 = time.perf_counter()
    client = grpcclient.InferenceServerClient(url)
    while time.perf_counter() - t0 < timeout:
        if server.poll() is not None:
            raise SystemExit(f"tritonserver exited with {server.returncode} before the model was ready")
        try:
            if client.is_model_ready(model):
                return time.perf_counter() - t0
        except Exception:  # not listening yet
            pass
        time.sleep(1)
    raise SystemExit(f"the model was not ready within {timeout} s")


@contextlib.contextmanager
def served(max_batch: int, ports: tuple[int, int, int], checkpoint: Path | None = None, log_path: Path | None = None,
           ready_timeout: float = 600, stop_timeout: float = 90, stopped: dict | None = None, gpus: int | None = None,
           family: str = "moondream2", gpu: int | None = None, wait: bool = True):
    """tritonserver serving `checkpoint` (default: full-size random bf16 weights written to a temporary folder)
    -> (the server process, seconds until the model was ready). On leaving, it is told to stop and killed if it
    has not within stop_timeout (wait=False: yields at once, with None for the seconds); `stopped` gets its exit code, how long stopping took, whether it was killed and
    how many fatal errors the Python backend's stub logged (a crash at unload, which the server itself survives)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if checkpoint is None:
            checkpoint = folder / "checkpoint"
            checkpoint.mkdir()
            write_checkpoint(checkpoint, family)
        with open(log_path or folder / "tritonserver.log", "a") as log:
            log_start = log.tell()  # (one log may hold several servers, one after another)
            server = start_server(checkpoint, folder / "runtime", max_batch, ports, log, gpus, gpu)
            try:
                ready_s = None
                if wait:
                    try:
                        ready_s = wait_ready(f"localhost:{ports[1]}", server, ready_timeout)
                    except SystemExit as e:
                        raise SystemExit(f"{e}; the end of its log:\n{Path(log.name).read_text()[-6000:]}") from None
                yield server, ready_s
            finally:
                t0, killed = time.time(), False
                server.terminate()
                try:
                    server.wait(stop_timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(server.pid, signal.SIGKILL)
                    server.wait()
                    killed = True
                if stopped is not None:
                    stopped.update(code=server.returncode, seconds=round(time.time() - t0, 1), killed=killed,
                                   stub_fatal_errors=sum(Path(log.name).read_text()[log_start:].count(crash) for crash
                                                         in ("Fatal Python error", "Signal (6) received")))


SERVER_SUMS = {"kestrel_time_to_first_token_seconds_sum": "engine_ttft_s", "kestrel_time_to_first_token_seconds_count":
               "engine_ttft_count", "nv_inference_queue_duration_us": "triton_queue_us",
               "nv_inference_compute_input_duration_us": "triton_input_us", "nv_inference_request_success": "requests",
               "kestrel_prefix_cache_hits_total": "prefix_hits"}


def server_sums(metrics_urls: list[str]) -> dict[str, float]:
    """The metrics above, summed over their labels and over the servers."""
    texts = [scrape(url) for url in metrics_urls]
    return {key: sum(metric_sum(text, name) for text in texts) for name, key in SERVER_SUMS.items()}


def server_means(before: dict, after: dict) -> dict:
    d = {k: after[k] - before[k] for k in before}
    n = max(d["requests"], 1)
    return {"prefix_cache_hits": d["prefix_hits"],
            "engine_ttft_mean_ms": 1000 * d["engine_ttft_s"] / max(d["engine_ttft_count"], 1),
            "triton_queue_mean_ms": d["triton_queue_us"] / n / 1000,
            "triton_input_mean_ms": d["triton_input_us"] / n / 1000}


async def one_request(client, image: bytes, max_tokens: int) -> dict:
    async def request():
        yield {"model_name": "moondream", "request_id": uuid.uuid4().hex, "inputs": build_inputs(
            "query", image=image, question=QUESTION, stream=True,
            settings={"temperature": 0, "max_tokens": max_tokens})}

    t0 = time.perf_counter()
    ttft = done = None
    responses = client.stream_infer(request())
    try:
        async for result, error in responses:  # until the server ends the stream (after the final response)
            if error is not None:
                raise RuntimeError(f"the server answered with an error: {error}")
            body = response_body(result)
            if ttft is None:
                ttft = time.perf_counter() - t0
            if body.get("completed"):
                done = {"ttft_ms": ttft * 1000, "latency_ms": (time.perf_counter() - t0) * 1000,
                        "output_tokens": body["metrics"]["output_tokens"], "engine_ttft_ms": body["metrics"]["ttft_ms"]}
    except BaseException:
        responses.cancel()
        raise
    if done is None:
        raise RuntimeError("the stream ended without a final body")
    return done


async def one_http_request(http, url: str, image: bytes, max_tokens: int) -> dict:
    """The same query through the gateway (the Moondream API, streamed as server-sent events)."""
    body = {"image_url": "data:image/jpeg;base64," + base64.b64encode(image).decode(), "question":
            QUESTION, "stream": True, "settings": {"temperature": 0, "max_tokens": max_tokens}}
    t0 = time.perf_counter()
    ttft = first_index = None
    async with http.stream("POST", url + "/v1/query", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"the gateway answered {response.status_code}: {await response.aread()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if ttft is None:
                ttft, first_index = time.perf_counter() - t0, event.get("token_index")
            if event.get("completed"):
                metrics = event["metrics"]
                return {"ttft_ms": ttft * 1000, "latency_ms": (time.perf_counter() - t0) * 1000,
                        "output_tokens": metrics["output_tokens"], "engine_ttft_ms": metrics["ttft_ms"],
                        "first_chunk_token": first_index,
                        "engine_prefill_ms": metrics["prefill_time_ms"]}
    raise RuntimeError("the stream ended without a final event")


async def run_requests(url: str, images: list[bytes], concurrency: int, requests: int, max_tokens: int) -> list[dict]:
    """`requests` queries over one channel (an http:// url: through the gateway, one HTTP connection a stream),
    `concurrency` of them in flight: a new one as one ends."""
    if url.startswith("http://"):
        import httpx

        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            return await gather_limited(lambda i: one_http_request(http, url, images[i % len(images)], max_tokens),
                                        requests, concurrency)
    import tritonclient.grpc.aio as grpcaio

    client = grpcaio.InferenceServerClient(url)
    try:
        return await gather_limited(lambda i: one_request(client, images[i % len(images)], max_tokens), requests,
                                    concurrency)
    finally:
        await client.close()


@contextlib.contextmanager
def gateway(grpc_urls: list[str], port: int, log, args: tuple[str, ...] = ()):
    """The gateway (python -m kestrel_backend.gateway) in front of the servers, with args, until the block ends: (its
    url, its process id)."""
    import urllib.request

    replicas = [arg for url in grpc_urls for arg in ("--triton", url)]
    proc = subprocess.Popen([sys.executable, "-m", "kestrel_backend.gateway", *replicas, "--port", str(port),
                             "--host", "127.0.0.1", *args], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                if urllib.request.urlopen(url + "/readyz", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise SystemExit("the gateway did not get ready")
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process of this machine (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client_part(url: str, images: list[bytes], concurrency: int, max_tokens: int, per_stream: int = 2) -> dict:
    """One client process's share of a level (per_stream x concurrency requests): the results, when it started
    and ended (perf_counter: the same clock in every process of the machine), and the CPU time it took."""
    cpu, t0 = time.process_time(), time.perf_counter()
    results = asyncio.run(run_requests(url, images, concurrency, per_stream * concurrency, max_tokens))
    return {"start": t0, "end": time.perf_counter(), "results": results, "cpu_s": time.process_time() - cpu}


def fresh_images(n: int, seed: int) -> list[bytes]:
    """n distinct 640x480 JPEGs that no earlier call made (seed: where this batch starts), photo-like in size
    (smooth colour fields, not noise): for levels where every request brings an image the server has not seen."""
    import numpy as np
    import pyvips

    def one(i: int) -> bytes:
        rng = np.random.default_rng(i)
        small = pyvips.Image.new_from_array(rng.integers(0, 256, (12, 16, 3), dtype=np.uint8))
        return small.resize(40, kernel="linear").jpegsave_buffer(Q=85)
    with ThreadPoolExecutor() as pool:  # (libvips lets go of the GIL: thousands take seconds)
        return list(pool.map(one, range(seed, seed + n)))


def level(url: str, images: list[bytes], concurrency: int, max_tokens: int, pool=None, processes: int = 1,
          one_per_request: bool = False, per_stream: int = 2) -> dict:
    """per_stream x concurrency queries, `concurrency` in flight, from this process or shared over the pool's client
    processes. images: cycled over each client's requests, or with one_per_request, one for each request (each
    client process its own slice). client_cpu_share: the busiest client process's CPU time over the level's
    wall time (near 1, the client, not the server, sets the pace)."""
    n = 1 if pool is None else min(processes, concurrency)
    shares = [concurrency // n + (i < concurrency % n) for i in range(n)]
    starts = [per_stream * sum(shares[:i]) for i in range(n)]
    part_images = [images[s:s + per_stream * c] if one_per_request else images for s, c in zip(starts, shares)]
    if pool is None:
        parts = [client_part(url, part_images[0], concurrency, max_tokens, per_stream)]
    else:
        parts = list(pool.map(client_part, *zip(*[(url, imgs, c, max_tokens, per_stream)
                                                  for imgs, c in zip(part_images, shares)])))
    wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    results = [r for p in parts for r in p["results"]]
    row = throughput_row(concurrency, wall, [r["ttft_ms"] for r in results], sum(r["output_tokens"] for r in results))
    row["client_cpu_share"] = max(p["cpu_s"] / (p["end"] - p["start"]) for p in parts)
    # the engine's TTFT (from the request's arrival in the engine) of each request beside the client's: the
    # difference is the time outside the engine (network, Triton's queue, parsing, sending the first chunk)
    row["engine_ttft_p50_ms"] = statistics.median(r["engine_ttft_ms"] for r in results)
    row["ttft_outside_engine_p50_ms"] = statistics.median(r["ttft_ms"] - r["engine_ttft_ms"] for r in results)
    # Little's law: a closed loop of `concurrency` streams at this rate holds each request this long on average, the
    # bound a TTFT nears when the rest of a request (3 tokens) is short
    row["littles_law_ms"] = 1000 * concurrency / row["req_per_s"]
    return row


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--grpc-port", type=int, default=8101, help="HTTP takes the port below, metrics the one above")
    p.add_argument("--ready-timeout", type=float, default=600)
    p.add_argument("--stop-timeout", type=float, default=60, help="seconds a stopping server gets before it is killed")
    p.add_argument("--checkpoint", type=Path, help="serve this checkpoint instead of random full-size weights")
    p.add_argument("--model", default="moondream2", choices=["moondream2", "moondream3"],
                   help="the family of the random full-size weights")
    p.add_argument("--max-batch", type=int, help="KESTREL_MAX_BATCH_SIZE of each engine (default: the largest "
                   "concurrency)")
    p.add_argument("--gpus", type=int, nargs="+", help="serve on the first N GPUs, one server after another for each "
                   "N (past one, the multi_gpu config: one engine per GPU)")
    p.add_argument("--out", type=Path)
    p.add_argument("--log", type=Path, help="tritonserver's output (default: a temporary file)")
    p.add_argument("--client-processes", type=int, default=1, help="share each level's streams over this many "
                   "client processes (one asyncio client each)")
    p.add_argument("--fresh-images", action="store_true", help="every request brings an image the server has not "
                   "seen (decode, vision encoder and whole prefill each time), instead of 8 images over and over")
    p.add_argument("--questions-per-image", type=int, default=1, help="with --fresh-images: each new image is asked "
                   "this many questions, sent one after another")
    p.add_argument("--requests-per-stream", type=int, default=2, help="each level's requests a stream: more, "
                   "for a closed loop's steady state rather than its first wave")
    p.add_argument("--gateway", action="store_true", help="each level also through the gateway (the Moondream API, "
                   "HTTP and server-sent events), right after it over gRPC")
    p.add_argument("--one-server-per-gpu", action="store_true", help="with --gpus: N servers of one GPU each behind "
                   "one gateway (which routes by image), every level through the gateway, instead of one server on N")
    p.add_argument("--vision-fp8", type=int, nargs="+", choices=[0, 1], help="a server with each KESTREL_VISION_FP8 "
                   "setting, one after the other (default: as the environment says)")
    args = p.parse_args()
    per_stream, repeat = args.requests_per_stream, args.questions_per_image
    cached, seen = (None if args.fresh_images else query_images()), 0
    floors = None  # the GPU's ceilings, for the floor of each level of fresh images (on the served model's family)
    if args.fresh_images and args.checkpoint is None:
        import torch

        if torch.cuda.is_available():
            from benchmarks.common import ceilings

            floors = ceilings()

    def images_for(concurrency: int) -> list[bytes]:
        nonlocal seen
        if cached is not None:
            return cached
        n = -(-per_stream * concurrency // repeat)
        seen += n
        return [image for image in fresh_images(n, seen - n) for _ in range(repeat)]
    ports = (args.grpc_port - 1, args.grpc_port, args.grpc_port + 1)  # http, grpc, metrics (server i: 10 i above)
    pool = None
    if args.client_processes > 1:
        pool = ProcessPoolExecutor(args.client_processes, mp_context=multiprocessing.get_context("spawn"))
    runs = []
    with pool or contextlib.nullcontext(), tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:  # written once for every server of the run
            checkpoint = Path(tmp)
            write_checkpoint(checkpoint, args.model)
        for gpus, vision_fp8 in itertools.product(args.gpus or [None], args.vision_fp8 or [None]):
            if vision_fp8 is not None:  # (the servers' environment is this process's)
                os.environ["KESTREL_VISION_FP8"] = str(vision_fp8)
            # one server on `gpus` GPUs, or with --one-server-per-gpu, `gpus` servers of one GPU each behind the gateway
            n_servers = gpus if args.one_server_per_gpu else 1
            all_ports = [tuple(port + 10 * i for port in ports) for i in range(n_servers)]
            urls = [f"localhost:{p[1]}" for p in all_ports]
            metrics_urls = [f"http://localhost:{p[2]}/metrics" for p in all_ports]
            stopped = [{} for _ in all_ports]
            with contextlib.ExitStack() as stack:
                servers = [stack.enter_context(served(  # started together, then waited for
                    args.max_batch or max(args.concurrency), p, checkpoint, args.log, args.ready_timeout,
                    stop_timeout=args.stop_timeout, stopped=stop, gpus=None if args.one_server_per_gpu else gpus,
                    gpu=i if args.one_server_per_gpu else None, wait=False))[0]
                    for i, (p, stop) in enumerate(zip(all_ports, stopped))]
                t0 = time.perf_counter()
                for server, server_url in zip(servers, urls):
                    wait_ready(server_url, server, args.ready_timeout)
                ready_s = time.perf_counter() - t0
                print(f"model ready after {ready_s:.1f} s ({gpus or 'default'} GPUs, {n_servers} servers)", flush=True)
                procs = args.client_processes
                fresh = args.fresh_images
                gateway_url, gateway_pid = (stack.enter_context(gateway(
                    urls, ports[2] + 1 + 10 * n_servers, args.log.open("a") if args.log else subprocess.DEVNULL))
                    if args.gateway or args.one_server_per_gpu else (None, None))
                paths = [("gateway", gateway_url)] if args.one_server_per_gpu else (
                    [("grpc", urls[0])] + ([("gateway", gateway_url)] if gateway_url else []))
                # warm-up (every path): graphs, and unless fresh images are asked for, the image and prefix caches
                for _, target in paths:
                    level(target, images_for(max(args.concurrency)), max(args.concurrency), args.max_tokens, pool,
                          procs, fresh, per_stream)
                rows = []
                for c in args.concurrency:
                    for path, target in paths:
                        images = images_for(c)
                        before = server_sums(metrics_urls)
                        gateway_cpu = cpu_seconds(gateway_pid) if gateway_pid else 0.0
                        rows.append(level(target, images, c, args.max_tokens, pool, procs, fresh, per_stream))
                        if floors is not None:  # (Little's law at the floor's rate: the TTFT the GPUs allow)
                            engines = gpus or 1
                            floor = engines * fresh_floor(args.model, images, c // engines, args.max_tokens, floors)
                            rows[-1].update(floor_req_per_s=floor, littles_law_at_floor_ms=1000 * c / floor)
                        if path == "gateway":  # the gateway is one process: its CPU share says whether it sets the pace
                            rows[-1]["gateway_cpu_share"] = ((cpu_seconds(gateway_pid) - gateway_cpu)
                                                             / (rows[-1]["requests"] / rows[-1]["req_per_s"]))
                        time.sleep(1.5)  # (Triton refreshes its metrics about every second)
                        rows[-1].update(server_means(before, server_sums(metrics_urls)), gpus=gpus, path=path,
                                        servers=n_servers)
                        rows[-1]["prefix_hit_rate"] = rows[-1]["prefix_cache_hits"] / rows[-1]["requests"]
            stopped = stopped[0] if n_servers == 1 else stopped
            runs.append({"gpus": gpus, "vision_fp8": vision_fp8, "ready_s": ready_s, "levels": rows,
                         "stopped": stopped})
            if args.out:  # (after every server: a later one failing keeps what was measured)
                args.out.write_text(json.dumps({"model": args.model, "max_tokens": args.max_tokens,
                                                "fresh_images": args.fresh_images, "questions_per_image": repeat,
                                                "client_processes": args.client_processes,
                                                "requests_per_stream": per_stream, "runs": runs}, indent=1))
    print("| GPUs | FP8 vision | path | concurrency | requests | req/s | floor req/s | output tok/s | TTFT p50 ms | "
          "TTFT p95 ms | Little's law ms (at the floor) | engine TTFT p50 ms | outside the engine p50 ms | "
          "prefix hits / request | Triton queue ms | client CPU share |\n" + "| --- " * 16 + "|")
    for run in runs:
        for r in run["levels"]:
            fp8 = "" if run["vision_fp8"] is None else run["vision_fp8"]
            print(f"| {run['gpus'] or ''} | {fp8} | {r['path']} | {r['concurrency']} | {r['requests']} | "
                  f"{r['req_per_s']:.1f} | {r.get('floor_req_per_s', float('nan')):.0f} | "
                  f"{r['output_tok_per_s']:.0f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} | "
                  f"{r['littles_law_ms']:.0f} ({r.get('littles_law_at_floor_ms', float('nan')):.0f}) | "
                  f"{r['engine_ttft_p50_ms']:.0f} | "
                  f"{r['ttft_outside_engine_p50_ms']:.1f} | "
                  f"{r['prefix_hit_rate']:.2f} | {r['triton_queue_mean_ms']:.1f} | {r['client_cpu_share']:.2f} |")
    if any(stop["stub_fatal_errors"] or stop["killed"] for run in runs
           for stop in (run["stopped"] if isinstance(run["stopped"], list) else [run["stopped"]])):
        raise SystemExit(f"a server did not stop cleanly ({[run['stopped'] for run in runs]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
