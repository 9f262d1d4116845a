"""A/B of decode-step variants for one or two sequences (GPU only): the attention split over the
context or one program per sequence and head; with programmatic dependent launch or without; the
attention as a kernel of its own or inside the norm + qkv/fc1 kernel (one kernel), with its context
splits, cached positions per block and fc1 programs launched before its attention programs; or, with
--tiles, the GEMV tiles of one sequence around the defaults (the sweep behind them); or, with --around, what
the engine's step graph holds around the layers and LM head: the greedy choice, the step inputs' copy and
the token embedding. The variants' CUDA graphs are replayed in interleaved rounds, so clock drift hits them
alike (separate runs differ by 5 to 10%).

    python benchmarks/experiments/decode_variants.py [--batch 1] [--contexts 64,800] [--rounds 20] [--tiles | --around]
"""

import argparse
import statistics
import sys
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import captured, timed  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from kestrel_backend.model.moondream import Moondream  # noqa: E402
from kestrel_backend.model.weights import random_weights  # noqa: E402
from kestrel_backend.runtime import cuda_decode
from kestrel_backend.kernels import decode_kernels as dk  # noqa: E402
from kestrel_backend.runtime.cuda_decode import StepInputs, fused_decode_step  # noqa: E402
from kestrel_backend.runtime.kv_cache import PagedKVCache  # noqa: E402


DEFAULT_TILES = dk._tiles
TILE_VARIANTS = {"default": {}, "norm+qkv/fc1+attention 8 x 1024": {"front": (8, 1024, 4)},
                 "norm+qkv/fc1+attention 8 x 2048": {"front": (8, 2048, 4)},
                 "norm+qkv/fc1+attention 4 x 1024": {"front": (4, 1024, 4)},
                 "norm+qkv/fc1+attention 2 x 2048": {"front": (2, 2048, 4)},
                 "norm+qkv/fc1+attention 4 x 2048, 8 warps": {"front": (4, 2048, 8)},
                 "out-proj+fc2 4 columns, 8 warps": {"back": (4, 2048, 8)},
                 "out-proj+fc2 2 columns, 4 warps": {"back": (2, 2048, 4)},
                 "out-proj+fc2 8 columns, 4 warps": {"back": (8, 2048, 4)},
                 "out-proj+fc2 4 x 1024, 4 warps": {"back": (4, 1024, 4)},
                 "LM head 8 columns, 8 warps": {"lm": (8, 2048, 8)},
                 "LM head 4 columns": {"lm": (4, 2048, 4)}}


class Variant(NamedTuple):
    splits: int | str | None  # None: context_splits(); "as the engine": what fused_decode_step picks
    pdl: bool = True
    one_kernel: bool = True
    tiles: dict = {}
    kv_block: int = dk.ONE_KERNEL_KV_BLOCK
    fc1_first: int = dk.ONE_KERNEL_FC1_FIRST
    around: tuple = ()  # what the step does besides layers and LM head: "greedy", "inputs" (copy + embedding)


def _with_tiles(overrides: dict):
    """decode_kernels._tiles with one sequence's tiles replaced: "front" the norm + qkv/fc1 (+ attention)
    kernel, "back" out-projection + fc2, "lm" the LM head; each (columns, K chunk, warps) per program."""
    def tiles(m, n_sizes, k_sizes, dtype, small_shared_memory=False, **gemv):
        t = DEFAULT_TILES(m, n_sizes, k_sizes, dtype, small_shared_memory, **gemv)
        kind = "lm" if n_sizes[0] > 10000 else ("front" if len(n_sizes) == 2 else "back")
        if m != 1 or kind not in overrides:
            return t
        block_n, block_k, warps = overrides[kind]
        return 1, block_n, block_k, warps, t[4], t[5]
    return tiles


def step(model, x, cache, inputs: StepInputs, logits, splits, greedy, greedy_host, hidden, around: tuple):
    """The decode step of one variant: with "inputs" in `around`, the step's inputs are copied in first and
    its rows embedded (x is then only the buffer for rows that are not tokens), as the engine's graph does."""
    b = x.shape[0]
    if "inputs" in around:
        inputs.copy_to_device()
        x = dk.embed_rows(inputs.tokens(b), model.weights.text.wte, x, greedy)
    with_greedy = "greedy" in around
    fused_decode_step(model, x, cache, inputs.rows(b), logits, splits, greedy if with_greedy else None,
                      greedy_host if with_greedy else None, hidden)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tiles", action="store_true", help="compare GEMV tiles of one sequence instead")
    p.add_argument("--around", action="store_true", help="compare what the engine's graph adds instead")
    p.add_argument("--contexts", default="64,800")
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    config = MoondreamConfig()
    model = Moondream(config, random_weights(config, dtype=torch.bfloat16, device="cuda"))
    variants = {"1 split": Variant(1, one_kernel=False), "split": Variant(None, one_kernel=False),
                "1 split, no PDL": Variant(1, pdl=False, one_kernel=False),
                "split, no PDL": Variant(None, pdl=False, one_kernel=False), "one kernel, 1 split": Variant(1)}
    variants.update({f"one kernel, {s} splits": Variant(s) for s in (4, 8, 16)})
    variants.update({f"one kernel, {s} splits, KV block {kv}": Variant(s, kv_block=kv)
                     for s, kv in ((4, 128), (8, 128), (16, 32)) if kv != dk.ONE_KERNEL_KV_BLOCK})
    variants.update({f"one kernel, {s} splits, {n} fc1 programs first": Variant(s, fc1_first=n)
                     for s in (8, 16) for n in (0, 64, 192, 256, 384) if n != dk.ONE_KERNEL_FC1_FIRST})
    if args.tiles:  # GEMV tiles of one sequence: (columns, K chunk, warps) per program
        variants = {name: Variant("as the engine", tiles=tiles) for name, tiles in TILE_VARIANTS.items()}
    if args.around:
        variants = {"layers + LM head": Variant("as the engine"),
                    "+ greedy choice": Variant("as the engine", around=("greedy",)),
                    "+ greedy, input copy, embedding (the engine's graph)": Variant("as the engine",
                                                                                    around=("greedy", "inputs"))}
    for context in (int(c) for c in args.contexts.split(",")):
        cache = PagedKVCache(config.text, args.batch * (context // 16 + 1), 16, "cuda", torch.bfloat16)
        for i in range(args.batch):
            cache.allocate(i, context + 1)
        inputs = StepInputs(args.batch, cache.pages_for(context + 1), cache, model.rope, "cuda")
        inputs.upload([0] * args.batch, list(range(args.batch)), [context] * args.batch, args.batch)
        inputs.copy_to_device()
        x = torch.randn(args.batch, config.text.dim, device="cuda", dtype=torch.bfloat16)
        logits = torch.empty(args.batch, config.text.vocab_size, device="cuda")
        greedy = torch.empty(args.batch, device="cuda", dtype=torch.int32)
        greedy_host = torch.empty(args.batch, dtype=torch.int32, pin_memory=True)
        hidden = torch.empty_like(x)
        graphs = {}
        with torch.inference_mode():
            for name, variant in variants.items():
                splits = variant.splits
                if splits == "as the engine":
                    splits = 1 if context < cuda_decode.LONG_CONTEXT else None
                dk.PDL_ENABLED = variant.pdl  # read at launch, so while capturing
                cuda_decode.ATTENTION_IN_NORM_LINEAR = variant.one_kernel
                dk._tiles = _with_tiles(variant.tiles)
                dk.ONE_KERNEL_KV_BLOCK, dk.ONE_KERNEL_FC1_FIRST = variant.kv_block, variant.fc1_first
                graphs[name] = captured(lambda: step(model, x, cache, inputs, logits, splits, greedy, greedy_host,
                                                     hidden, variant.around), warmups=2)
            default = Variant(None)
            dk.PDL_ENABLED = cuda_decode.ATTENTION_IN_NORM_LINEAR = True
            dk._tiles = DEFAULT_TILES
            dk.ONE_KERNEL_KV_BLOCK, dk.ONE_KERNEL_FC1_FIRST = default.kv_block, default.fc1_first
            times = {name: [] for name in variants}
            for _ in range(args.rounds):
                for name, graph in graphs.items():
                    times[name].append(timed(graph.replay, warmup=1, iters=5))
        for name, t in times.items():
            print(f"batch {args.batch}, context {context}, {name}: {statistics.median(t):.3f} ms "
                  f"(quartiles {statistics.quantiles(t, n=4)[0]:.3f} to {statistics.quantiles(t, n=4)[2]:.3f})",
                  flush=True)
        del cache, graphs


if __name__ == "__main__":
    main()
