"""Where a batch-1 prefill step's time goes on the GPU: Moondream 3 (FULL-SIZE random weights, FP8 experts beside
widened copies, KESTREL_FP8_EXPERTS=both) in the engine's prefill graphs, for a fresh image's question (742 rows
from position 0) and a question on a cached image prefix (20 rows from position 730). For each: the whole
PrefillGraphs.run (CUDA events: the host's preparation of the graph's inputs, during which the GPU waits, and the
replay), the replay alone, the host's preparation alone (run with the replay left out), and the kernels of ten
replays under torch.profiler (their summed time: the GPU's busy time; the rest of the replay is the gaps between
kernels). GPU only.

    python benchmarks/profile_prefill_graph.py
"""

import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gpu_bench import timed  # noqa: E402
from benchmarks.kestrel_checkpoint import random_moondream3_fp8_both  # noqa: E402
from kestrel_backend.runtime import prefill_graphs  # noqa: E402
from kestrel_backend.runtime.attention import SeqSlice  # noqa: E402
from kestrel_backend.runtime.kv_cache import PagedKVCache  # noqa: E402

CASES = {"fresh 742": (742, 0), "question 20": (20, 730)}  # rows, first position (the image prefix: 730)


class _NoReplay:
    def replay(self) -> None:
        pass


def host_preparation_ms(graphs: prefill_graphs.PrefillGraphs, x, slices) -> float:
    """Median host milliseconds of graphs.run with its replay left out."""
    walls = []
    graphs._graph = lambda rows, seqs: _NoReplay()
    try:
        for _ in range(21):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graphs.run(x, slices)
            walls.append((time.perf_counter() - t0) * 1000)
    finally:
        del graphs._graph  # (the class's method again)
    return sorted(walls)[10]


def kernel_table(fn, n: int = 10, top: int = 20) -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name][0] += e.time_range.elapsed_us()
            by_name[e.name][1] += 1
    print(f"   busy {sum(v[0] for v in by_name.values()) / n / 1000:.3f} ms a run")
    for name, (us, count) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"   {us / n / 1000:7.3f} ms {count // n:4d}x  {name[:110]}")


def main() -> None:
    model = random_moondream3_fp8_both()
    config = model.config
    cache = PagedKVCache(config.text, 256, 16, "cuda", torch.bfloat16)
    cache.allocate(0, 900)
    graphs = prefill_graphs.PrefillGraphs(model, cache, 2048, 1)
    print(torch.cuda.get_device_name())
    with torch.inference_mode():
        for name, (rows, first) in CASES.items():
            x = torch.randn(rows, config.text.dim, device="cuda", dtype=torch.bfloat16)
            slices = [SeqSlice(0, 0, rows, first, 730, torch.arange(first, first + rows, device="cuda"))]
            graphs.run(x, slices)
            print(f"== {name}: {[round(timed(lambda: graphs.run(x, slices)), 3) for _ in range(2)]} ms", flush=True)
            graph = graphs._graph(-(-rows // prefill_graphs.BUCKET) * prefill_graphs.BUCKET, 1)
            print(f"   replay only: {[round(timed(graph.replay), 3) for _ in range(2)]} ms")
            print(f"   host prep (run without replay): median {host_preparation_ms(graphs, x, slices):.3f} ms")
            kernel_table(lambda: graphs.run(x, slices))


if __name__ == "__main__":
    main()
