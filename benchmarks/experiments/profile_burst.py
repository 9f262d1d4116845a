"""Where a Kestrel-method burst's time goes: the GPU's busy and idle time, and what the engine thread was doing
while the GPU was idle.

    python benchmarks/experiments/profile_burst.py [--model moondream2] [--batch 64] [--mode direct] [--images 256] [--out p.json]
        [--checkpoint DIR [--fp8-experts widen|fp8|both]]  # a checkpoint's weights (Kestrel's: kestrel_checkpoint.py)
        [--vision-stream 1]  # the image path on a CUDA stream of its own (gpu_ops_at_once_ms: ops side by side)
    python benchmarks/experiments/profile_burst.py --images 4 --batch 4   (without a GPU: a smoke run on tests/fixtures/md2-tiny)

After a warm-up burst, one burst of kestrel_method.py's workload (fresh charts, two questions an image, every
question at once) runs under torch.profiler, the scheduler's phases marked with record_function. The GPU's kernels
and copies give its busy time; each idle stretch is charged to the innermost phase the engine thread was in at
that moment ("outside a step": the engine loop's rounds between steps, the requests' coroutines). Also: the GPU
time of the encodes, prefills and decode steps (CUDA events around their launches; each prefill with its rows), the
top kernels, the engine thread's CPU time against the wall time (time spent waiting: for the GPU, the GIL or a CPU),
and with --timeline-ms the burst's first operations one by one (which showed the engine thread starved of CPU
time by the image decode pool).

--light runs the burst without the profiler (whose cost per op and per graph launch, CUPTI's included, changes a
batch-1 burst, whose pace the engine thread sets between steps) and times the engine thread's main functions with
perf_counter; --gaps records the GPU's operations only and charges each idle stretch to the pair of operations
around it (CUPTI still slows the launches of CUDA graphs: under it a decode step's replay took 0.45 ms of host time).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import crop_count  # noqa: E402
from benchmarks.kestrel_method import OUTPUT_TOKENS, workload  # noqa: E402
from kestrel_backend.engine_config import FP8_EXPERT_MODES, RuntimeConfig  # noqa: E402
from kestrel_backend.engine import InferenceEngine  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from kestrel_backend.model.moondream import Moondream  # noqa: E402
from kestrel_backend.model.tokenizer import load_tokenizer  # noqa: E402
from kestrel_backend.model.weights import random_weights  # noqa: E402
from kestrel_backend.model import moondream as moondream_module  # noqa: E402
from kestrel_backend.runtime import prefill_plan as pa, prefill_graphs  # noqa: E402
from kestrel_backend.runtime import scheduler as scheduler_module, step_runner as step_runner_module  # noqa: E402
from kestrel_backend.runtime.kv_cache import PagedKVCache  # noqa: E402
from kestrel_backend.runtime.cuda_decode import CudaGraphDecoder, HostTokens  # noqa: E402
from kestrel_backend.runtime.prefill_graphs import PrefillGraphs  # noqa: E402
from kestrel_backend.runtime.scheduler import Scheduler  # noqa: E402
from kestrel_backend.skills import sampling  # noqa: E402

PHASES = {  # marked methods -> their names in the profile
    (Scheduler, "step"): "step",
    (Scheduler, "admit"): "admit",
    (Scheduler, "_encode"): "encode (launch)",
    (Scheduler, "forward_flat"): "prefill (launch)",
    (Scheduler, "_decode"): "decode (launch)",
    (Scheduler, "_prepare_next_step"): "prepare next step",
    (Scheduler, "_advance"): "advance (stream, finish)",
    (sampling.TokensToHost, "tolist"): "read tokens (wait)",
    (HostTokens, "tolist"): "read tokens (wait)",  # (the tokens a decode step's graph chose)
}
HOST_TIMED = [  # (owner, attribute) -> the engine thread's seconds in each (--light; nested ones counted in each)
    (Scheduler, "admit"), (Scheduler, "attach_images"), (Scheduler, "_prefixes_ahead"),
    (Scheduler, "forward_flat"), (Scheduler, "_decode"), (Scheduler, "_prepare_next_step"), (Scheduler, "_advance"),
    (Scheduler, "keep_prefixes"), (Scheduler, "_end"), (Moondream, "embed_prompt"), (Moondream, "image_prefix"),
    (PrefillGraphs, "run"), (CudaGraphDecoder, "run"), (CudaGraphDecoder, "prepare"),
    (sampling.TokensToHost, "tolist"), (HostTokens, "tolist"), (torch.cuda.CUDAGraph, "replay"),
    (PagedKVCache, "rows"), (pa.OneRowGroups, "pack"), (pa, "context_slots"), (pa, "work_items"),
    (prefill_graphs, "to_device"), (moondream_module, "to_device"), (step_runner_module, "to_device"),
    (scheduler_module, "launch_choice"),
]
PREFIX = "kestrel:"
TIMED_ON_GPU = {"encode (launch)", "prefill (launch)", "decode (launch)"}  # their GPU time by CUDA events too


def _rows(label: str, args, kwargs) -> int:
    """The rows a prefill launch computes (its sequences' prompts, less what the prefix cache holds), or a decode
    step's (its sequences)."""
    if label == "decode (launch)":
        return len(args[1])
    if label != "prefill (launch)" or not kwargs.get("prefill", args[2] if len(args) > 2 else False):
        return 0
    return sum(seq.prefix_len + len(seq.token_ids) - seq.length for seq in args[1])


def mark_phases(gpu_spans: dict) -> None:
    """Wrap the phases' methods in record_function marks; those in TIMED_ON_GPU also between two CUDA events (the
    GPU's time from the first of their kernels to the last, into gpu_spans[label])."""
    for (cls, name), label in PHASES.items():
        method = getattr(cls, name)

        @functools.wraps(method)
        def marked(*args, _method=method, _label=label, **kwargs):
            timed = _label in TIMED_ON_GPU and torch.cuda.is_available()
            if timed:
                rows = _rows(_label, args, kwargs)  # (before the call, which moves the sequences on)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            with torch.profiler.record_function(PREFIX + _label):
                out = _method(*args, **kwargs)
            if timed:
                end.record()
                gpu_spans.setdefault(_label, []).append((start, end, rows))
            return out
        setattr(cls, name, marked)


def time_on_host(totals: collections.Counter) -> None:
    """Wrap HOST_TIMED to add their wall seconds and calls into totals."""
    def timed(fn, label):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - t
                totals[label + " (calls)"] += 1
        return wrapper
    for owner, name in HOST_TIMED:
        setattr(owner, name, timed(getattr(owner, name), f"{owner.__name__.split('.')[-1]}.{name}"))


def gaps_by_neighbours(events, min_us: float = 5.0, n: int = 20) -> dict[str, list]:
    """The GPU's idle stretches of min_us or more, summed by the operations before and after them: name -> [ms,
    count]."""
    ops = sorted((e.time_range.start, e.time_range.end, e.name[:48]) for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA)
    total: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    end, before = None, None
    for s, e, name in ops:
        if end is not None and s - end >= min_us:
            total[f"{before} -> {name}"][0] += (s - end) / 1000
            total[f"{before} -> {name}"][1] += 1
        if end is None or e >= end:
            end, before = e, name
    return {k: [round(v[0], 2), v[1]] for k, v in sorted(total.items(), key=lambda kv: -kv[1][0])[:n]}


def busy_intervals(events) -> list[tuple[float, float]]:
    """The union of the GPU's kernels and copies, as sorted disjoint (start, end) in microseconds."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    merged: list[list[float]] = []
    for s, e in spans:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def _innermost(marks, starts, t):
    """The shortest of the marks (sorted by start) covering moment t, or None (marks of one kind do not overlap
    but nest: a few recent ones suffice)."""
    i = bisect.bisect_right(starts, t)
    covering = [m for m in marks[max(0, i - 8):i] if m[1] > t]
    return min(covering, key=lambda m: m[1] - m[0]) if covering else None


def charge_idle(busy, marks, step_us: float = 20.0) -> dict[str, float]:
    """Idle GPU milliseconds by the innermost mark covering each moment (sampled every step_us); the steps apart,
    as one step holds many inner marks."""
    steps = [m for m in marks if m[2] == "step"]
    inner = [m for m in marks if m[2] != "step"]
    step_starts, inner_starts = [m[0] for m in steps], [m[0] for m in inner]
    out: collections.Counter = collections.Counter()
    for (_, idle_from), (idle_to, _) in zip(busy, busy[1:]):
        t = idle_from
        while t < idle_to:
            m = _innermost(inner, inner_starts, t) or _innermost(steps, step_starts, t)
            out[m[2] if m else "outside a step"] += min(step_us, idle_to - t) / 1000
            t += step_us
    return dict(out.most_common())


def timeline(events, busy, ms: float) -> list[tuple[float, float, str]]:
    """GPU operations (names cut short), engine-thread marks and its operations of over a millisecond, of the burst's
    first ms milliseconds, from its first GPU operation on."""
    t0 = busy[0][0]
    keep = []
    for e in events:
        on_gpu = e.device_type == torch.autograd.DeviceType.CUDA
        long_on_cpu = e.time_range.end - e.time_range.start > 1000  # (the engine thread's ops of over 1 ms)
        if (on_gpu or long_on_cpu or e.name.startswith(PREFIX)) and e.time_range.start - t0 < ms * 1000:
            keep.append((round(e.time_range.start - t0, 1), round(e.time_range.end - t0, 1),
                         ("gpu " if on_gpu else "") + e.name[:40]))
    return sorted(keep)


def top_kernels(events, n: int = 20) -> dict[str, float]:
    total: collections.Counter = collections.Counter()
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name[:90]] += (e.time_range.end - e.time_range.start) / 1000
    return {name: round(ms, 1) for name, ms in total.most_common(n)}


def on_engine_thread(engine: InferenceEngine, fn) -> None:
    async def call():
        fn()
    asyncio.run_coroutine_threadsafe(call(), engine.loop).result()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="moondream2", choices=["moondream2", "moondream3"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--mode", default="direct", choices=sorted(OUTPUT_TOKENS))
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--max-step-tokens", type=int, default=RuntimeConfig.max_step_tokens)
    p.add_argument("--timeline-ms", type=float, default=0.0,
                   help="also keep the burst's first milliseconds: every GPU operation and engine-thread mark")
    p.add_argument("--checkpoint", type=Path, help="a checkpoint folder (default: full-size random bf16 weights)")
    p.add_argument("--fp8-experts", default="widen", choices=FP8_EXPERT_MODES)
    p.add_argument("--light", action="store_true", help="no profiler: host time by perf_counter (above)")
    p.add_argument("--gaps", action="store_true", help="GPU operations only, idle time by its neighbours (above)")
    p.add_argument("--vision-stream", type=int, default=RuntimeConfig.vision_stream, choices=[0, 1],
                   help="KESTREL_VISION_STREAM: the image path on a CUDA stream of its own")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    tiny = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "md2-tiny"
    if args.checkpoint:  # (e.g. Kestrel's layout with FP8 experts: kestrel_checkpoint.py)
        model = Moondream.from_checkpoint(args.checkpoint, dtype=torch.bfloat16, device="cuda",
                                          fp8_experts=args.fp8_experts)
    elif torch.cuda.is_available():
        config = MoondreamConfig.official(args.model)
        model = Moondream(config, random_weights(config, dtype=torch.bfloat16, device="cuda"), load_tokenizer(tiny))
    else:  # (a smoke run of this script)
        model = Moondream.from_checkpoint(tiny, dtype=torch.float32, device="cpu")
    engine = InferenceEngine(RuntimeConfig(device=str(model.device), max_batch_size=args.batch, max_queue=1 << 16,
                                           max_step_tokens=args.max_step_tokens, vision_stream=args.vision_stream),
                             model)
    settings = {"temperature": 0, "max_tokens": OUTPUT_TOKENS[args.mode]}
    seed = time.time_ns() % (1 << 32)

    def burst(pairs):
        async def all_at_once():
            return await asyncio.gather(*[engine.query(image, q, settings=settings) for image, q in pairs])
        return asyncio.run(all_at_once())

    burst(workload(args.images, seed))  # warm-up: every graph and kernel in use once
    pairs = workload(args.images, seed + 1)
    gpu_spans: dict = {}
    host_s: collections.Counter = collections.Counter()
    if args.light:
        time_on_host(host_s)
    elif not args.gaps:
        mark_phases(gpu_spans)
    steps_before = engine.scheduler.steps
    cpu_clock = time.pthread_getcpuclockid(engine._thread.ident)
    activities = [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    if not (args.gaps and activities):
        activities.append(torch.profiler.ProfilerActivity.CPU)
    prof = torch.profiler.profile(activities=activities)
    if not args.light:
        on_engine_thread(engine, prof.start)  # (the profiler records the CPU ops of the thread that starts it)
    t0, cpu0 = time.perf_counter(), time.clock_gettime(cpu_clock)
    results = burst(pairs)
    wall, cpu = time.perf_counter() - t0, time.clock_gettime(cpu_clock) - cpu0
    if not args.light:
        on_engine_thread(engine, prof.stop)
    engine.shutdown()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    gpu_ms = {label: sum(a.elapsed_time(b) for a, b, _ in spans) for label, spans in gpu_spans.items()}
    prefills = [(rows, round(a.elapsed_time(b), 3)) for a, b, rows in gpu_spans.get("prefill (launch)", [])]
    decodes = collections.defaultdict(list)  # rows -> GPU ms of each decode step of that many rows
    for a, b, rows in gpu_spans.get("decode (launch)", []):
        decodes[rows].append(a.elapsed_time(b))
    events = prof.events() if not args.light else []
    busy = busy_intervals(events)
    marks = sorted((e.time_range.start, e.time_range.end, e.name[len(PREFIX):]) for e in events
                   if e.name.startswith(PREFIX) and e.device_type == torch.autograd.DeviceType.CPU)
    span_us = busy[-1][1] - busy[0][0] if busy else 0.0
    busy_ms = sum(e - s for s, e in busy) / 1000
    # the GPU's operations' own times summed; less the busy time, how long operations ran beside another one
    ops_ms = sum(e.time_range.end - e.time_range.start for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA) / 1000
    in_marks = collections.Counter()
    for s, e, name in marks:
        in_marks[name] += (e - s) / 1000
    report = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "model": args.model,
        "checkpoint": str(args.checkpoint or ""), "fp8_experts": args.fp8_experts,
        "batch": args.batch, "mode": args.mode, "questions": len(pairs),
        "crops": sum(crop_count(image, model.config) for image in {image for image, _ in pairs}),
        "max_step_tokens": args.max_step_tokens, "vision_stream": args.vision_stream, "wall_s": wall,
        "req_per_s": len(pairs) / wall, "steps": engine.scheduler.steps - steps_before,
        "engine_thread_cpu_s": cpu, "gpu_span_ms": span_us / 1000, "gpu_busy_ms": busy_ms,
        "gpu_idle_ms": span_us / 1000 - busy_ms, "gpu_ops_ms": ops_ms, "gpu_ops_at_once_ms": ops_ms - busy_ms,
        "idle_by_phase_ms": charge_idle(busy, marks) if marks else {},
        "engine_thread_ms_by_phase (nested phases counted in each)": dict(in_marks.most_common()),
        "engine thread ms a request by function, calls a request (--light; nested ones counted in each)": {
            k: round(v * (1 if k.endswith("(calls)") else 1000) / len(pairs), 3) for k, v in host_s.most_common()},
        "idle ms by the GPU operations around it (--gaps)": gaps_by_neighbours(events),
        "gpu_ms_by_phase (CUDA events around the launches)": gpu_ms,
        "top_kernels_ms": top_kernels(events),
        "prefill_steps (rows, GPU ms)": prefills,
        "decode_steps (rows: count, mean GPU ms)": {rows: (len(ms), round(sum(ms) / len(ms), 3))
                                                    for rows, ms in sorted(decodes.items())},
        "timeline (start us, end us, name)": timeline(events, busy, args.timeline_ms) if busy else [],
        "prefill_ms_p50": sorted(r.metrics["prefill_time_ms"] for r in results)[len(results) // 2],
    }
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
