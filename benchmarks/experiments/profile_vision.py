"""Where the vision encoder's time goes on the GPU (full-size weights, 13 crops = one 12-tile image).

    python benchmarks/experiments/profile_vision.py

Prints SDPA time per backend for the encoder's attention shape and other head widths (CUDA graphs, so without
the launch cost), the encode time eager, as a CUDA graph (what launch gaps cost) and split over several streams,
then the top kernels of one encode.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import graph_timed, timed  # noqa: E402
from kestrel_backend.model import vision  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from kestrel_backend.model.weights import random_weights  # noqa: E402


def _over_streams(x, w, v, parts: int) -> torch.Tensor:
    main, outs = torch.cuda.current_stream(), []
    for chunk in x.tensor_split(parts):
        stream = torch.cuda.Stream()
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            outs.append(vision.encode_crops(chunk, w, v))
        main.wait_stream(stream)
    return torch.cat(outs)


def main(crops: int = 13) -> None:
    v = MoondreamConfig().vision
    tokens, heads = v.grid * v.grid, v.enc_n_heads
    head_dim = v.enc_dim // heads
    flops = 4 * crops * heads * tokens * tokens * head_dim
    for dim in sorted({head_dim, 64, 80, 128}):  # how the kernels fare at the encoder's head width and around it
        q, k, val = (torch.randn(crops, heads, tokens, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            try:
                with sdpa_kernel(backend):
                    ms = graph_timed(lambda: F.scaled_dot_product_attention(q, k, val))
                print(f"sdpa {backend.name}, head dim {dim}: {ms:.3f} ms per layer "
                      f"({flops / ms / 1e9:.0f} TFLOP/s counted at head dim {head_dim})", flush=True)
            except RuntimeError as e:
                print(f"sdpa {backend.name}, head dim {dim}: not available ({str(e)[:100]})", flush=True)

    w = random_weights(MoondreamConfig(), dtype=torch.bfloat16, device="cuda").vision
    x = torch.randn(crops, 3, v.crop_size, v.crop_size, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        for n in (crops, 4 * crops):
            xs = torch.randn(n, 3, v.crop_size, v.crop_size, device="cuda", dtype=torch.bfloat16)
            eager = timed(lambda: vision.encode_crops(xs, w, v), iters=10)
            graph = graph_timed(lambda: vision.encode_crops(xs, w, v), calls=1)
            print(f"encode {n} crops: eager {eager:.2f} ms, as a CUDA graph {graph:.2f} ms", flush=True)
        for parts in (2, 3, 4):  # the crops split over CUDA streams, to fill each other's kernel-boundary bubbles
            ms = timed(lambda: _over_streams(x, w, v, parts), iters=10)
            print(f"encode {crops} crops over {parts} streams: {ms:.2f} ms", flush=True)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            print(f"encode {crops} crops, flash attention: {timed(lambda: vision.encode_crops(x, w, v), iters=10):.2f} ms")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            vision.encode_crops(x, w, v)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=70))
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, spans[0][0]
    for a, b in spans:  # union of the GPU's busy intervals
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    print(f"GPU timeline: {len(spans)} operations over {(end - spans[0][0]) / 1000:.2f} ms, busy {busy / 1000:.2f} ms, "
          f"idle between them {(end - spans[0][0] - busy) / 1000:.2f} ms")


if __name__ == "__main__":
    main()
