"""Profile one engine prefill step (fresh image queries) on the GPU: where does the time go?

    python benchmarks/experiments/profile_prefill.py [sequences, default 16] [moondream2|moondream3] [fp8]

Prints the step's wall time with the torch attention path and with the engine's (the Triton prefill kernel),
then the engine's GPU busy time (the host's launch work shows in the difference to the wall time). fp8 (Moondream 3):
the experts in FP8 beside widened copies (KESTREL_FP8_EXPERTS=both), the engine's step timed with the widened
experts and W8A8 (moe_kernels.W8A8_PREFILL), the profile with W8A8.
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import fresh_queries, text_weight_bytes  # noqa: E402
from kestrel_backend.model.legacy_layout import fp8_experts_beside_widened  # noqa: E402
from kestrel_backend.kernels import moe_kernels  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from kestrel_backend.model.moondream import Moondream  # noqa: E402
from kestrel_backend.model.weights import random_weights  # noqa: E402
from kestrel_backend.runtime.attention import TorchPagedAttention  # noqa: E402
from kestrel_backend.runtime.kv_cache import PagedKVCache  # noqa: E402
from kestrel_backend.runtime.gpu_parts import make_attention  # noqa: E402


def main(n: int = 16, family: str = "moondream2", experts: str = "bf16", prompt: int = 12) -> None:
    config = MoondreamConfig.official(family)
    active_params = text_weight_bytes(config) / 2  # (the weights one token computes with)
    weights = random_weights(config, dtype=torch.bfloat16, device="cuda")
    if experts == "fp8":
        for block in weights.text.blocks:
            if block.moe is not None:
                block.moe = fp8_experts_beside_widened(block.moe)
    model = Moondream(config, weights)
    cache = PagedKVCache(config.text, n * 64, 16, "cuda", torch.bfloat16)
    length = 730 + prompt
    for i in range(n):
        cache.allocate(i, length + 64)
    x = torch.randn(n * length, config.text.dim, device="cuda", dtype=torch.bfloat16)

    def step(attention):
        slices = fresh_queries(n, length, 730)
        attention.plan(slices)
        hidden = model.forward(x, torch.cat([s.positions for s in slices]), attention)
        return model.logits(hidden[[s.end - 1 for s in slices]])

    variants = [("torch attention", TorchPagedAttention(cache), True), ("engine", make_attention(cache), True)]
    if experts == "fp8":  # (in turns: the GPU's clock drifts)
        variants = [("engine, widened experts", make_attention(cache), False),
                    ("engine, W8A8 experts", make_attention(cache), True)] * 2
    with torch.inference_mode():
        for name, attention, w8a8 in variants:
            moe_kernels.W8A8_PREFILL = w8a8
            for _ in range(2):
                step(attention)
            walls = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(attention)
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t0) * 1000)
            print(f"{name}: prefill of {n} x {length} tokens: {sorted(walls)[2]:.1f} ms (median of 5; compute floor "
                  f"at 780 TFLOP/s: {n * length * 2 * active_params / 780e12 * 1000:.1f} ms)", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(attention)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"engine: {len(kernels)} GPU operations, busy {sum(e.time_range.elapsed_us() for e in kernels) / 1000:.1f} ms")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=10, max_name_column_width=60))


if __name__ == "__main__":
    main(*[int(a) for a in sys.argv[1:2]], *sys.argv[2:4])
