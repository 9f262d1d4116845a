"""Where the vision encoder's time goes on the GPU (full-size weights, 13 crops = one 12-tile image).

    python benchmarks/profile_vision.py

Prints SDPA time per backend for the encoder's attention shape, the Triton attention kernel's tiles
against SDPA on the same qkv rows, the encode with either (interleaved), the encode time eager, as a CUDA
graph (what launch gaps cost) and split over several streams, then the top kernels of one encode.
"""

import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gpu_bench import graph_timed, timed  # noqa: E402
from kestrel_backend.model import vision, vision_attention_cuda  # noqa: E402
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


def sdpa_attention(qkv: torch.Tensor, crops: int, heads: int) -> torch.Tensor:
    """What the encoder ran before its Triton kernel: views of the qkv rows into SDPA (cuDNN), back to rows."""
    rows, dim = qkv.shape[0], qkv.shape[1] // 3
    q, k, v = (t.view(crops, rows // crops, heads, dim // heads).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(rows, dim)


@contextmanager
def attention_swapped(fn):
    kept = vision_attention_cuda.vision_attention
    vision_attention_cuda.vision_attention = fn
    try:
        yield
    finally:
        vision_attention_cuda.vision_attention = kept


def attention_tiles(crops: int, v) -> None:
    """Each tile set of the Triton kernel against SDPA on the same qkv rows, bf16: time and difference."""
    heads, tokens = v.enc_n_heads, v.grid * v.grid
    qkv = torch.randn(crops * tokens, 3 * v.enc_dim, device="cuda", dtype=torch.bfloat16)
    ref = sdpa_attention(qkv, crops, heads)
    flops = 4 * crops * tokens * tokens * v.enc_dim
    ms = timed(lambda: sdpa_attention(qkv, crops, heads), iters=30)
    print(f"attention per layer, SDPA on the qkv rows: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
    for bm in (64, 128):
        for bn in (32, 64, 128):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    run = lambda: vision_attention_cuda.vision_attention(qkv, crops, heads, bm, bn, warps, stages)
                    try:
                        err = float((run().float() - ref.float()).norm() / ref.float().norm())
                        ms = timed(run, iters=30)
                    except Exception as e:  # a tile set that does not fit (shared memory, registers)
                        print(f"  triton {bm}x{bn} warps {warps} stages {stages}: {type(e).__name__}", flush=True)
                        continue
                    print(f"  triton {bm}x{bn} warps {warps} stages {stages}: {ms:.3f} ms "
                          f"({flops / ms / 1e9:.0f} TFLOP/s), differs from SDPA by {err:.1e}", flush=True)


def encode_attention_ab(x, w, v, rounds: int = 7) -> None:
    """The whole encode with the Triton attention and with SDPA, in alternating rounds (clock drift cancels)."""
    times = {"triton": [], "sdpa": []}
    for _ in range(rounds):
        times["triton"].append(timed(lambda: vision.encode_crops(x, w, v), iters=5))
        with attention_swapped(sdpa_attention):
            times["sdpa"].append(timed(lambda: vision.encode_crops(x, w, v), iters=5))
    print(f"encode {len(x)} crops, interleaved: " + ", ".join(
        f"{name} attention {statistics.median(t):.2f} ms" for name, t in times.items()), flush=True)


def main(crops: int = 13) -> None:
    v = MoondreamConfig().vision
    tokens, heads = v.grid * v.grid, v.enc_n_heads
    q, k, val = (torch.randn(crops, heads, tokens, v.enc_dim // heads, device="cuda", dtype=torch.bfloat16)
                 for _ in range(3))
    flops = 4 * crops * heads * tokens * tokens * (v.enc_dim // heads)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel(backend):
                ms = timed(lambda: F.scaled_dot_product_attention(q, k, val), iters=20)
            print(f"sdpa {backend.name}: {ms:.3f} ms per layer ({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
        except RuntimeError as e:
            print(f"sdpa {backend.name}: not available ({str(e)[:100]})", flush=True)

    w = random_weights(MoondreamConfig(), dtype=torch.bfloat16, device="cuda").vision
    x = torch.randn(crops, 3, v.crop_size, v.crop_size, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        attention_tiles(crops, v)
        encode_attention_ab(x, w, v)
        for n in (crops, 4 * crops):
            xs = torch.randn(n, 3, v.crop_size, v.crop_size, device="cuda", dtype=torch.bfloat16)
            eager = timed(lambda: vision.encode_crops(xs, w, v), iters=10)
            graph = graph_timed(lambda: vision.encode_crops(xs, w, v), calls=1)
            print(f"encode {n} crops: eager {eager:.2f} ms, as a CUDA graph {graph:.2f} ms", flush=True)
        for parts in (2, 3, 4):  # the crops split over CUDA streams, to fill each other's kernel-boundary bubbles
            ms = timed(lambda: _over_streams(x, w, v, parts), iters=10)
            print(f"encode {crops} crops over {parts} streams: {ms:.2f} ms", flush=True)
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
