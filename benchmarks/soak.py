"""Soak a running server: concurrent streaming requests with random cancellations, for a bounded time.

    python benchmarks/soak.py --url localhost:8001 --metrics http://localhost:8002/metrics \\
        --image tests/fixtures/md2-tiny/images/small.png --duration 600 --concurrency 16 [--pid PID]
    python benchmarks/soak.py --serve-random-weights --image query.jpg ...   (starts tritonserver itself, as
        triton_bench does, on full-size random bf16 weights; stops it at the end and reports how it exited)

Reports requests, outcomes and errors by kind, p50/p95 latency, and memory over time (RSS of --pid and
its children, and the engine's KV pages in use from the metrics endpoint); writes the report as JSON.
Loopback targets only: this is a load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from client import AsyncMoondreamClient, MoondreamError  # noqa: E402
from client.metrics import metric_sum, scrape  # noqa: E402


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    pids = [str(pid)] + subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    total = 0
    for p in pids:
        try:
            total += next(int(line.split()[1]) for line in open(f"/proc/{p}/status") if line.startswith("VmRSS:"))
        except (FileNotFoundError, StopIteration):
            pass
    return round(total / 1024, 1)


def kv_pages_used(metrics_url: str | None) -> float | None:
    if not metrics_url:
        return None
    return metric_sum(scrape(metrics_url, timeout=5), "kestrel_engine_state", state="kv_pages_used")


async def worker(client, image, stop_at, rng, cancel_p, latencies, outcomes, errors):
    while time.time() < stop_at:
        t0 = time.perf_counter()
        skill = rng.choice(["query", "caption", "detect", "point"])
        try:
            if skill in ("query", "caption"):
                cancel_after = rng.randint(1, 4) if rng.random() < cancel_p else None
                n = 0
                async for _ in client.stream(skill, image=image, question="What is in the image?",
                                             settings={"max_tokens": 64, "temperature": 0.7}):
                    n += 1
                    if cancel_after and n >= cancel_after:
                        outcomes["cancelled"] += 1
                        break
                else:
                    outcomes["success"] += 1
                    latencies.append(time.perf_counter() - t0)
            else:
                await getattr(client, skill)(image, "object", settings={"max_objects": 10})
                outcomes["success"] += 1
                latencies.append(time.perf_counter() - t0)
        except MoondreamError as e:
            kind = "overloaded" if "overloaded" in str(e) else str(e)[:80]
            outcomes["error"] += 1
            errors[kind] += 1
            if kind == "overloaded":
                await asyncio.sleep(0.05)


async def soak(args) -> dict:
    client = AsyncMoondreamClient(args.url, timeout=120)
    image = Path(args.image).read_bytes()
    rng = random.Random(args.seed)
    latencies, outcomes, errors, samples = [], Counter(), Counter(), []
    start = time.time()
    stop_at = start + args.duration
    tasks = [asyncio.create_task(worker(client, image, stop_at, random.Random(rng.random()), args.cancel,
                                        latencies, outcomes, errors)) for _ in range(args.concurrency)]
    while not all(t.done() for t in tasks):
        samples.append({"t_s": round(time.time() - start, 1), "rss_mib": rss_mib(args.pid),
                        "kv_pages_used": kv_pages_used(args.metrics), "completed": outcomes["success"]})
        await asyncio.sleep(args.sample_every)
    await asyncio.gather(*tasks)
    q = statistics.quantiles(latencies, n=20) if len(latencies) >= 20 else None
    return {
        "duration_s": round(time.time() - start, 1), "concurrency": args.concurrency,
        "requests": sum(outcomes.values()), "outcomes": dict(outcomes), "errors_by_kind": dict(errors),
        "latency_p50_s": round(statistics.median(latencies), 3) if latencies else None,
        "latency_p95_s": round(q[18], 3) if q else None,
        "memory": samples, "kv_pages_used_at_end": kv_pages_used(args.metrics),
    }


def soak_own_server(args) -> dict:
    """The soak against a tritonserver started here on random full-size weights (triton_bench's way)."""
    from benchmarks.triton_bench import served

    stopped = {}
    with served(max(args.concurrency, 64), (8100, 8101, 8102), stopped=stopped) as (server, _):
        args.url, args.metrics, args.pid = "localhost:8101", "http://localhost:8102/metrics", server.pid
        report = asyncio.run(soak(args))
    report["server_exit"] = stopped
    return report


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="localhost:8001")
    p.add_argument("--metrics", default="http://localhost:8002/metrics")
    p.add_argument("--image", required=True)
    p.add_argument("--duration", type=float, default=60)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--cancel", type=float, default=0.2, help="share of streams cancelled midway")
    p.add_argument("--pid", type=int, help="tritonserver pid, for RSS over time")
    p.add_argument("--sample-every", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="soak_report.json")
    p.add_argument("--serve-random-weights", action="store_true", help="start (and stop) tritonserver here")
    args = p.parse_args()
    if args.serve_random_weights:
        report = soak_own_server(args)
    else:
        report = asyncio.run(soak(args))
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"requests {report['requests']}  outcomes {report['outcomes']}  errors {report['errors_by_kind']}")
    print(f"latency p50 {report['latency_p50_s']} s  p95 {report['latency_p95_s']} s  kv pages used at end {report['kv_pages_used_at_end']}")
    if "server_exit" in report:
        print(f"server exit {report['server_exit']}")
    print("t_s  rss_mib  kv_pages_used  completed")
    for s in report["memory"]:
        print(f"{s['t_s']:>5} {s['rss_mib']} {s['kv_pages_used']} {s['completed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
