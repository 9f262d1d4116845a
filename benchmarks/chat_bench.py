"""Multi-turn chat in the engine, with the prefix cache on and off: what a conversation's next turn costs.

1. Next-turn time to first token: conversations whose turn 1 brings a new image; each one's turn 2 (the history and
   a new question) is sent alone once turn 1 has answered, beside a text-only query of as many new tokens (turn 2's
   prompt positions that were not cached; a prompt of its own, so none of it is cached), also alone. Reported: the
   engine's TTFT p50 of each, their ratio, and the p50 of the step that gave the first token.
2. Conversations in a burst: `--conversations` at once, `--turns` turns each (one new image on turn 1, a short
   question a turn, answers forced to `--max-tokens`), each conversation's next turn sent as soon as its answer is
   back; the engine's request rate over all turns, with the prefix cache on and off (KESTREL_PREFIX_CACHE_SIZE=0).

    python benchmarks/chat_bench.py [--model moondream3] [--conversations 64] [--turns 4] [--out chat.json]
    python benchmarks/chat_bench.py --checkpoint tests/fixtures/md2-tiny --conversations 3 --turns 2  (CPU smoke)

Full-size random bf16 weights on a GPU (the tiny fixture's tokenizer), or a checkpoint. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.kestrel_method import burst_counters, chart_png  # noqa: E402
from kestrel_backend.engine_config import RuntimeConfig  # noqa: E402
from kestrel_backend.engine import InferenceEngine  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from kestrel_backend.skills.chat import parse_messages  # noqa: E402

QUESTIONS = ["What does the chart show?", "Which bar is the tallest?", "What is the trend?", "Any outliers?",
             "Summarise it in a sentence.", "What are the axes?"]


def first_turn(image_index: int, question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "index": image_index}, {"type": "text", "text": question}]}]


def next_turn(messages: list[dict], answer, question: str) -> list[dict]:
    """The conversation after `answer` (a chat result) and the user's next question."""
    return messages + [{"role": "assistant", "content": answer.output["message"]["content"]},
                       {"role": "user", "content": question}]


async def converse(engine, image: bytes, turns: int, settings: dict) -> list:
    """One conversation, turn after turn: -> each turn's result."""
    messages, results = first_turn(0, QUESTIONS[0]), []
    for turn in range(turns):
        result = await engine.chat(parse_messages(messages, [image]), False, False, settings)
        results.append(result)
        messages = next_turn(messages, result, QUESTIONS[(turn + 1) % len(QUESTIONS)])
    return results


def next_turn_ttft(engine, images: list[bytes], settings: dict) -> dict:
    """Turn 2 of each conversation alone, after its turn 1, beside a text-only query of turn 2's new positions."""
    turn_2, text_only, new_positions, steps = [], [], [], []
    tokenizer = engine.model.tokenizer
    for sample, image in enumerate(images):
        first = asyncio.run(engine.chat(parse_messages(first_turn(0, QUESTIONS[0]), [image]), False, False, settings))
        messages = next_turn(first_turn(0, QUESTIONS[0]), first, QUESTIONS[1])
        second = asyncio.run(engine.chat(parse_messages(messages, [image]), False, False, settings))
        new = second.metrics["input_tokens"] - second.metrics["cached_tokens"]
        words = " ".join(f"s{sample}w{i}" for i in range(new))  # a text prompt of about as many tokens, new to the
        ids = tokenizer.encode(words).ids[:max(new - 6, 1)]  # prefix cache (each sample's its own)
        query = asyncio.run(engine.query(None, tokenizer.decode(ids), False, False, settings))
        assert query.metrics["cached_tokens"] == 0, query.metrics
        turn_2.append(second.metrics["ttft_ms"])
        text_only.append(query.metrics["ttft_ms"])
        steps.append((second.metrics["prefill_time_ms"], query.metrics["prefill_time_ms"]))
        new_positions.append((new, query.metrics["input_tokens"]))  # (turn 2's uncached, the query's)
    p50_turn, p50_text = statistics.median(turn_2), statistics.median(text_only)
    return {"turn_2_ttft_p50_ms": p50_turn, "text_only_ttft_p50_ms": p50_text, "ratio": p50_turn / p50_text,
            "new_positions_turn_2_and_text_only": new_positions[:8],
            # (the step that gave the first token, engine thread's wall time; TTFT adds the wait before it)
            "prefill_step_p50_ms_turn_2_and_text_only": [statistics.median(s[i] for s in steps) for i in (0, 1)]}


def burst(model, args, prefix_cache: bool, seed: int) -> dict:
    engine = InferenceEngine(RuntimeConfig(device=str(model.device), max_batch_size=args.max_batch,
                                           max_queue=1 << 16, prefix_cache_size=64 if prefix_cache else 0), model)
    settings = {"temperature": 0, "max_tokens": args.max_tokens}
    rng = np.random.default_rng(seed)
    try:
        async def conversations(images, turns):
            return await asyncio.gather(*[converse(engine, image, turns, settings) for image in images])
        asyncio.run(conversations([chart_png(rng) for _ in range(2)], 2))  # (warm-up)
        images = [chart_png(rng) for _ in range(args.conversations)]
        before = burst_counters(engine)
        t0 = time.perf_counter()
        results = [r for conversation in asyncio.run(conversations(images, args.turns)) for r in conversation]
        wall = time.perf_counter() - t0
        spent = {k: round(v - before.get(k, 0), 3) for k, v in burst_counters(engine).items()
                 if not k.startswith("triton_variants:")}
        row = {"prefix_cache": prefix_cache, "conversations": args.conversations, "turns": args.turns,
               "requests": len(results), "wall_s": wall, "req_per_s": len(results) / wall,
               "ttft_p50_ms": statistics.median(r.metrics["ttft_ms"] for r in results),
               "cached_share": sum(r.metrics["cached_tokens"] for r in results) /
               sum(r.metrics["input_tokens"] for r in results),
               "images_encoded": engine.scheduler.images_encoded, "burst": spent}
        if prefix_cache:
            row["next_turn"] = next_turn_ttft(engine, [chart_png(rng) for _ in range(args.ttft_samples)], settings)
        return row
    finally:
        engine.shutdown()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="moondream3", choices=["moondream2", "moondream3"])
    p.add_argument("--checkpoint", type=Path, help="a checkpoint folder (default: full-size random bf16 weights)")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=3)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--ttft-samples", type=int, default=16)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    import torch

    from kestrel_backend.model.moondream import Moondream
    from kestrel_backend.model.tokenizer import load_tokenizer
    from kestrel_backend.model.weights import random_weights

    cuda = torch.cuda.is_available()
    if args.checkpoint:
        model = Moondream.from_checkpoint(args.checkpoint, dtype=torch.bfloat16 if cuda else torch.float32,
                                          device="cuda" if cuda else "cpu")
    else:
        config = MoondreamConfig.official(args.model)
        model = Moondream(config, random_weights(config, dtype=torch.bfloat16, device="cuda"),
                          load_tokenizer(Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "md2-tiny"))
    rows = [burst(model, args, on, seed=7) for on in (True, False)]
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "model": model.name,
           "date": time.strftime("%Y-%m-%d"), "rows": rows, "cache_on_over_off": rows[0]["req_per_s"] / rows[1]["req_per_s"]}
    print("| prefix cache | requests | req/s | TTFT p50 ms | cached share of prompt positions |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {'on' if r['prefix_cache'] else 'off'} | {r['requests']} | {r['req_per_s']:.1f} | "
              f"{r['ttft_p50_ms']:.0f} | {r['cached_share']:.2f} |")
    nt = rows[0]["next_turn"]
    print(f"cache on / off: {out['cache_on_over_off']:.2f}x; next turn TTFT p50 {nt['turn_2_ttft_p50_ms']:.1f} ms "
          f"against a text-only query of as many new tokens {nt['text_only_ttft_p50_ms']:.1f} ms ({nt['ratio']:.2f}x)")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
