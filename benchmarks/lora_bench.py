"""LoRA adapters on the GPU (GPU only; FULL-SIZE random bf16 Moondream 2 or 3 weights and random adapters):

- a decode step of 64 sequences spread over 8 adapters against the same step without adapters, at rank 8 and 32,
  contexts 64 and 800 (the engine's CUDA graphs, as the scheduler runs them); on Moondream 3 also one sequence with
  an adapter (its adapters in Kestrel's layout: the dense layers at the rank, each expert at rank / 8);
- the adapter step's logits against the eager torch step with the same adapters (bf16: argmax agreement);
- the time to load an adapter (its final.pt read, checked and copied into a pool slot) and the device memory
  a slot takes.

    python benchmarks/lora_bench.py [--out lora.json] [--four-bit]   # (--four-bit: the text blocks 4-bit, as a
                                                                     # 4-bit checkpoint loads on a GPU; rank 8 only)
    python benchmarks/lora_bench.py --model moondream3 [--out lora_md3.json]
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

from benchmarks.common import timed  # noqa: E402
from kestrel_backend.engine_config import RuntimeConfig  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from kestrel_backend.model.lora import LoraRows, target_shapes  # noqa: E402
from kestrel_backend.model.moondream import Moondream  # noqa: E402
from kestrel_backend.model.weights import random_weights  # noqa: E402
from kestrel_backend.runtime.lora_registry import AdapterRegistry  # noqa: E402
from kestrel_backend.runtime.attention import SeqSlice  # noqa: E402
from kestrel_backend.runtime.cuda_decode import CudaGraphDecoder  # noqa: E402
from kestrel_backend.runtime.kv_cache import PagedKVCache  # noqa: E402
from kestrel_backend.runtime.gpu_parts import make_attention  # noqa: E402

BATCH, ADAPTERS = 64, 8
PATHS = {"qkv": "mixer.Wqkv", "proj": "mixer.out_proj", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}


def write_adapters(folder: Path, config, rank: int, count: int = ADAPTERS) -> list[str]:
    """`count` random adapters of this rank as the reference stores them (<id>/final.pt, training-time names); for
    Moondream 3 as Kestrel does (its checkpoints' lora_state_dict: the dense layers' MLP at the rank, every expert
    at the rank over the experts a token takes)."""
    shapes, names, text = target_shapes(config.text), [], config.text

    def ab(n_in, n_out, r, *lead):
        return (torch.randn(*lead, r, n_in) / n_in ** 0.5).bfloat16(), \
            (torch.randn(*lead, n_out, r) / r ** 0.5 * 0.1).bfloat16()

    for n in range(count):
        state = {}
        if text.moe is None:
            for i in range(text.n_layers):
                for target, path in PATHS.items():
                    key = f"text_model.transformer.h.{i}.{path}.parametrizations.weight.0"
                    state[f"{key}.A"], state[f"{key}.B"] = ab(*shapes[target], rank)
        else:
            lora = {}
            for i in range(text.moe.start_layer):
                lora[f"text_lora.dense.{i}.up_a"], lora[f"text_lora.dense.{i}.up_b"] = ab(*shapes["fc1"], rank)
                lora[f"text_lora.dense.{i}.down_a"], lora[f"text_lora.dense.{i}.down_b"] = ab(*shapes["fc2"], rank)
            per_expert = rank // text.moe.n_experts_per_tok
            for j in range(text.n_layers - text.moe.start_layer):
                e = text.moe.n_experts
                lora[f"text_lora.moe.{j}.up_a"], lora[f"text_lora.moe.{j}.up_b"] = \
                    ab(*shapes["experts_up"], per_expert, e)
                lora[f"text_lora.moe.{j}.down_a"], lora[f"text_lora.moe.{j}.down_b"] = \
                    ab(*shapes["experts_down"], per_expert, e)
            state = {"lora_state_dict": lora}
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


def decode_rows(model: Moondream, registry: AdapterRegistry, names: list[str], context: int,
                batch: int = BATCH) -> dict:
    cfg = model.config.text
    cache = PagedKVCache(cfg, batch * (-(-(context + 9) // 16)), 16, "cuda", torch.bfloat16)
    for i in range(batch):
        cache.allocate(i, context + 9)
    cache.k.normal_()
    cache.v.normal_()
    decoder = CudaGraphDecoder(model, cache, batch, context + 9, registry)
    loaded = [registry._loaded[n] for n in names]
    per_row = [loaded[i % ADAPTERS] for i in range(batch)]
    ids, tokens, steps = list(range(batch)), [11] * batch, itertools.count()

    def step(slots):
        def run():
            positions = [context + next(steps) % 8] * batch
            logits = decoder.run(tokens, ids, positions, [()] * batch, slots)[0]
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
        logits = decoder.run(tokens, ids, [context] * batch, [()] * batch, [a.slot for a in per_row])[0].clone()
        logits_plain = decoder.run(tokens, ids, [context] * batch, [()] * batch, None)[0].clone()
        attention = make_attention(cache)
        positions = torch.full((1,), context, device="cuda")
        attention.plan([SeqSlice(i, i, i + 1, context, 0, positions) for i in range(batch)])
        x = model.embed_tokens(tokens)
        ref = model.logits(model.forward(x, torch.full((batch,), context, device="cuda"), attention,
                                         LoraRows.of(per_row, [1] * batch)))
        plain = model.logits(model.forward(x, torch.full((batch,), context, device="cuda"), attention))
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    agree_plain = (logits_plain.argmax(-1) == plain.argmax(-1)).float().mean().item()  # (bf16's own spread)
    moved = (plain.argmax(-1) != ref.argmax(-1)).float().mean().item()
    return {"context": context, "batch": batch, "adapters": min(ADAPTERS, batch), "step_ms_without": base,
            "step_ms_with": lora, "argmax_agreement_with_eager_without_adapters": agree_plain,
            "overhead": lora / base - 1, "argmax_agreement_with_eager": agree,
            "rows_whose_argmax_the_adapter_moves": moved}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    p.add_argument("--four-bit", action="store_true")
    p.add_argument("--model", choices=["moondream2", "moondream3"], default="moondream2")
    args = p.parse_args()
    torch.manual_seed(0)
    config = MoondreamConfig.official(args.model)
    md3 = config.text.moe is not None
    model = Moondream(config, random_weights(config, dtype=torch.bfloat16, device="cuda"))
    if args.four_bit:
        from benchmarks.w4a16_bench import four_bit

        model = four_bit(model)
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "model": args.model,
           "four_bit": args.four_bit, "model_GB": torch.cuda.memory_allocated() / 1e9, "ranks": []}
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
            contexts = [(64, BATCH), (800, BATCH)] + ([(64, 1)] if md3 else [])
            row = {"rank": rank, "pool_slots": defaults.max_adapters, "pool_max_rank": defaults.max_adapter_rank,
                   "pool_MB": pool_bytes / 1e6,
                   "slot_MB": registry.pool.nbytes_per_slot / 1e6,
                   "adapter_MB_at_its_rank": registry._loaded[names[0]].nbytes / 1e6,
                   "file_MB": (Path(tmp) / names[0] / "final.pt").stat().st_size / 1e6,
                   "load_ms_median": statistics.median(r["read_and_check_ms"] + r["to_device_ms"] for r in loads),
                   "loads": loads, "decode": [decode_rows(model, registry, names, ctx, b) for ctx, b in contexts]}
        res["ranks"].append(row)
        for d in row["decode"]:
            print(f"rank {rank} context {d['context']}, {d['batch']} rows: {d['step_ms_without']:.3f} ms without, "
                  f"{d['step_ms_with']:.3f} with {d['adapters']} adapters: +{d['overhead'] * 100:.1f}%; argmax "
                  f"agreement with eager {d['argmax_agreement_with_eager']:.3f}, without adapters "
                  f"{d['argmax_agreement_with_eager_without_adapters']:.3f} (the adapters move "
                  f"{d['rows_whose_argmax_the_adapter_moves']:.2f})", flush=True)
        print(f"rank {rank}: load {row['load_ms_median']:.0f} ms median, slot {row['slot_MB']:.1f} MB", flush=True)
        del registry
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
