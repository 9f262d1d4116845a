"""LoRA adapters on the GPU (GPU only; FULL-SIZE random bf16 Moondream 2 weights and random adapters):

- a decode step of 64 sequences spread over 8 adapters against the same step without adapters, at rank 8 and 32,
  contexts 64 and 800 (the engine's CUDA graphs, as the scheduler runs them);
- the adapter step's logits against the eager torch step with the same adapters (bf16: argmax agreement);
- the time to load an adapter (its final.pt read, checked and copied into a pool slot) and the device memory
  a slot takes.

    python benchmarks/lora_bench.py [--out lora.json] [--four-bit]   # (--four-bit: the text blocks 4-bit, as a
                                                                     # 4-bit checkpoint loads on a GPU; rank 8 only)
"""

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_bench import timed  # noqa: E402
from kestrel_backend.config import RuntimeConfig  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from kestrel_backend.model.lora import LoraRows, target_shapes  # noqa: E402
from kestrel_backend.model.moondream import Moondream  # noqa: E402
from kestrel_backend.model.weights import random_weights  # noqa: E402
from kestrel_backend.runtime.adapters import AdapterRegistry  # noqa: E402
from kestrel_backend.runtime.attention import SeqSlice  # noqa: E402
from kestrel_backend.runtime.cuda_decode import CudaGraphDecoder  # noqa: E402
from kestrel_backend.runtime.kv_cache import PagedKVCache  # noqa: E402
from kestrel_backend.runtime.scheduler import make_attention  # noqa: E402

BATCH, ADAPTERS = 64, 8
PATHS = {"qkv": "mixer.Wqkv", "proj": "mixer.out_proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}


def write_adapters(folder: Path, config, rank: int) -> list[str]:
    """ADAPTERS random adapters of this rank as the reference stores them (<id>/final.pt, training-time names)."""
    shapes, names = target_shapes(config.text), []
    for n in range(ADAPTERS):
        state = {}
        for i in range(config.text.n_layers):
            for target, path in PATHS.items():
                n_in, n_out = shapes[target]
                key = f"text_model.transformer.h.{i}.{path}.parametrizations.weight.0"
                state[f"{key}.A"] = torch.randn(rank, n_in) / n_in ** 0.5
                state[f"{key}.B"] = torch.randn(n_out, rank) / rank ** 0.5 * 0.1
        name = f"r{rank}-{n}@100"
        (folder / name).mkdir()
        torch.save(state, folder / name / "final.pt")
        names.append(name)
    return names


def load_adapters(registry: AdapterRegistry, names: list[str]) -> list[dict]:
    """Each adapter loaded as the engine does (read and checked, then placed in the pool), timed."""
    rows = []
    for name in names:
        t0 = time.perf_counter()
        adapter = registry._load(name)
        t1 = time.perf_counter()
        registry._insert(adapter)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        rows.append({"read_and_check_ms": (t1 - t0) * 1000, "to_device_ms": (t2 - t1) * 1000})
    return rows


def decode_rows(model: Moondream, registry: AdapterRegistry, names: list[str], context: int) -> dict:
    cfg = model.config.text
    cache = PagedKVCache(cfg, BATCH * (-(-(context + 9) // 16)), 16, "cuda", torch.bfloat16)
    for i in range(BATCH):
        cache.allocate(i, context + 9)
    cache.k.normal_()
    cache.v.normal_()
    decoder = CudaGraphDecoder(model, cache, BATCH, context + 9, registry)
    loaded = [registry._loaded[n] for n in names]
    per_row = [loaded[i % ADAPTERS] for i in range(BATCH)]
    ids, tokens, steps = list(range(BATCH)), [11] * BATCH, itertools.count()

    def step(slots):
        def run():
            positions = [context + next(steps) % 8] * BATCH
            logits = decoder.run(tokens, ids, positions, [()] * BATCH, slots)[0]
            decoder.prepare(ids, [p + 1 for p in positions])
            return logits.argmax(-1)
        return run

    with torch.inference_mode():
        rounds = {"base": [], "lora": []}
        for _ in range(5):  # interleaved, so that the GPU's clock drift hits both alike
            rounds["base"].append(timed(step(None), iters=30))
            rounds["lora"].append(timed(step([a.slot for a in per_row]), iters=30))
        base, lora = statistics.median(rounds["base"]), statistics.median(rounds["lora"])
        # the adapter step against the eager torch step with the same adapters, one position
        logits = decoder.run(tokens, ids, [context] * BATCH, [()] * BATCH, [a.slot for a in per_row])[0].clone()
        attention = make_attention(cache)
        positions = torch.full((1,), context, device="cuda")
        attention.plan([SeqSlice(i, i, i + 1, context, 0, positions) for i in range(BATCH)])
        x = model.embed_tokens(tokens)
        ref = model.logits(model.forward(x, torch.full((BATCH,), context, device="cuda"), attention,
                                         LoraRows.of(per_row, [1] * BATCH)))
        plain = model.logits(model.forward(x, torch.full((BATCH,), context, device="cuda"), attention))
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    moved = (plain.argmax(-1) != ref.argmax(-1)).float().mean().item()
    return {"context": context, "batch": BATCH, "adapters": ADAPTERS, "step_ms_without": base, "step_ms_with": lora,
            "overhead": lora / base - 1, "argmax_agreement_with_eager": agree,
            "rows_whose_argmax_the_adapter_moves": moved}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    p.add_argument("--four-bit", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    config = MoondreamConfig()
    model = Moondream(config, random_weights(config, dtype=torch.bfloat16, device="cuda"))
    if args.four_bit:
        from benchmarks.w4a16_bench import four_bit

        model = four_bit(model)
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "four_bit": args.four_bit,
           "ranks": []}
    for rank in (8,) if args.four_bit else (8, 32):
        with tempfile.TemporaryDirectory() as tmp:
            names = write_adapters(Path(tmp), config, rank)
            defaults = RuntimeConfig()  # the pool of a default server: 32 slots of rank 32
            registry = AdapterRegistry(tmp, defaults.max_adapters, defaults.max_adapter_rank, config.text, "cuda",
                                       torch.bfloat16, None)
            before = torch.cuda.memory_allocated()
            registry.ensure_pool()
            pool_bytes = torch.cuda.memory_allocated() - before
            loads = load_adapters(registry, names)
            row = {"rank": rank, "pool_rank_cap": registry.pool.rank_cap, "pool_MB": pool_bytes / 1e6,
                   "slot_MB": registry.pool.nbytes_per_slot / 1e6,
                   "adapter_MB_at_its_rank": registry._loaded[names[0]].nbytes / 1e6,
                   "file_MB": (Path(tmp) / names[0] / "final.pt").stat().st_size / 1e6,
                   "load_ms_median": statistics.median(r["read_and_check_ms"] + r["to_device_ms"] for r in loads),
                   "loads": loads, "decode": [decode_rows(model, registry, names, ctx) for ctx in (64, 800)]}
        res["ranks"].append(row)
        for d in row["decode"]:
            print(f"rank {rank} context {d['context']}: {d['step_ms_without']:.3f} ms without, {d['step_ms_with']:.3f} "
                  f"with 8 adapters: +{d['overhead'] * 100:.1f}%; argmax agreement with eager "
                  f"{d['argmax_agreement_with_eager']:.3f} (the adapters move {d['rows_whose_argmax_the_adapter_moves']:.2f})",
                  flush=True)
        print(f"rank {rank}: load {row['load_ms_median']:.0f} ms median, slot {row['slot_MB']:.1f} MB", flush=True)
        del registry
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
