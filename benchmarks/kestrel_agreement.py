"""Kestrel as a second oracle on a full-size checkpoint (GPU; Kestrel installed apart, never one of our
dependencies): the same greedy requests through Kestrel and through our engine, one engine after the other in one
process, on one random Moondream 3 checkpoint in Kestrel's layout (benchmarks/kestrel_checkpoint.py) and one random
adapter in Kestrel's checkpoint format (what its fine-tuning service writes):

- queries on fresh chart images (kestrel_method.workload), without an adapter and with it;
- chat conversations (one image; a system message and an answered turn; two images in two turns; an image arriving
  in the second turn; text only), without an adapter and with it;
- the control: our engine against itself with the experts widened to bf16 (KESTREL_FP8_EXPERTS=widen), which shows
  how far other roundings alone move greedy answers on random weights.

Both engines keep the experts in FP8 as the file holds them (ours: KESTREL_FP8_EXPERTS=fp8); outputs are capped at
max_tokens, reasoning off, temperature 0. Reports per group the share of requests whose answers' token ids are equal,
of equal first tokens, and the mean share of leading tokens they agree on (random weights rarely stop, so answers run
to the cap; their text, of byte tokens, cannot tell tokens apart). Kestrel is given the adapter through its
AdapterProvider interface, read from the file as its cloud provider reads a download.

    python benchmarks/kestrel_checkpoint.py /tmp/md3k
    python benchmarks/kestrel_agreement.py --checkpoint /tmp/md3k --out agreement.json
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kestrel_method import workload  # noqa: E402
from benchmarks.lora_bench import write_adapters  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402

ADAPTER = "agree@1"


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def conversations(pairs: list[tuple[bytes, str]]) -> list[list[dict]]:
    """Chat conversations over the workload's images, as OpenAI-style messages (images as data URLs)."""
    out = []
    for i in range(0, len(pairs) - 3, 4):
        (a, q1), (_, q2), (b, q3), _ = pairs[i:i + 4]
        img = lambda im: {"type": "image_url", "image_url": {"url": data_url(im)}}  # noqa: E731
        text = lambda t: {"type": "text", "text": t}  # noqa: E731
        out += [
            [{"role": "user", "content": [img(a), text(q1)]}],
            [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": [img(a), text(q1)]},
             {"role": "assistant", "content": "It is a chart."}, {"role": "user", "content": q2}],
            [{"role": "user", "content": [img(a), text(q1)]}, {"role": "assistant", "content": "A chart."},
             {"role": "user", "content": [img(b), text(q3)]}],
            [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."},
             {"role": "user", "content": [img(b), text(q3)]}],
            [{"role": "user", "content": q2}],
        ]
    return out


def kestrel_tokens(result) -> list[int]:
    return [t.token_id for t in result.tokens if hasattr(t, "token_id")]


async def run_kestrel(args, pairs, chats, settings, tuned) -> dict[str, list[list[int]]]:
    from kestrel.config import RuntimeConfig
    from kestrel.engine import InferenceEngine
    from kestrel.models.moondream.config import load_config
    from kestrel.models.moondream.lora import LoRA, TextLoRA, TextLoRAConfig

    text_config = load_config().text

    class FileAdapters:  # Kestrel's AdapterProvider over local checkpoint files
        def config(self) -> dict:
            return {"max_lora_rank": 32}

        def get(self, adapter: str):
            state = torch.load(args.checkpoint / "adapters" / adapter / "final.pt", weights_only=True)
            state = state["lora_state_dict"]
            rank = next(t.shape[0] for k, t in state.items() if ".dense." in k and k.endswith("up_a"))
            lora = LoRA(text=TextLoRA(text_config, TextLoRAConfig(rank=rank), dtype=torch.bfloat16), vision=None)
            lora.load_state_dict(state, strict=False)
            return lora.to("cuda")

    config = RuntimeConfig(model=args.model, model_path=str(args.checkpoint / "model_fp8.pt"),
                           tokenizer_path=str(args.checkpoint), max_batch_size=32)
    engine = await InferenceEngine.create(config, adapter_provider=FileAdapters())
    try:
        return await ask_all(engine, pairs, chats, settings, tuned, lambda m: m, kestrel_tokens)
    finally:
        await engine.shutdown()


async def run_ours(args, pairs, chats, settings, tuned, fp8_experts: str = "fp8") -> dict[str, list[list[int]]]:
    from kestrel_backend.engine_config import RuntimeConfig
    from kestrel_backend.engine import InferenceEngine
    from kestrel_backend.skills.chat import parse_messages

    engine = InferenceEngine.create(RuntimeConfig(model_path=str(args.checkpoint), device="cuda", max_batch_size=32,
                                                  fp8_experts=fp8_experts,
                                                  adapter_dir=str(args.checkpoint / "adapters")))
    try:
        return await ask_all(engine, pairs, chats, settings, tuned, lambda m: parse_messages(m, []),
                             lambda r: r.token_ids)
    finally:
        engine.shutdown()


async def ask_all(engine, pairs, chats, settings, tuned, messages, tokens) -> dict[str, list[list[int]]]:
    out = {}
    for name, s in (("base", settings), ("adapter", tuned)):
        results = await asyncio.gather(*[engine.query(image, q, reasoning=False, settings=s) for image, q in pairs])
        out[f"query_{name}"] = [tokens(r) for r in results]
        results = await asyncio.gather(*[engine.chat(messages(m), reasoning=False, settings=s) for m in chats])
        out[f"chat_{name}"] = [tokens(r) for r in results]
    return out


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    def lead(a: list[int], b: list[int]) -> float:
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return n / max(len(a), len(b), 1)

    pairs = list(zip(ours, theirs))
    return {"requests": len(ours), "equal": sum(a == b for a, b in pairs) / len(pairs),
            "first_token_equal": sum(a[:1] == b[:1] for a, b in pairs) / len(pairs),
            "leading_tokens_agreed": statistics.mean(lead(a, b) for a, b in pairs), "examples": pairs[:3]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", type=Path, required=True, help="kestrel_checkpoint.py's folder")
    p.add_argument("--model", default="moondream3-preview", help="Kestrel's model name (its registry)")
    p.add_argument("--images", type=int, default=32)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    folder = args.checkpoint / "adapters"
    if not (folder / ADAPTER).is_dir():
        folder.mkdir(exist_ok=True)
        written = write_adapters(folder, MoondreamConfig.official("moondream3"), args.rank, count=1)[0]
        (folder / written).rename(folder / ADAPTER)
    pairs = workload(args.images // 2, seed=20261128)
    chats = conversations(pairs)
    settings = {"temperature": 0.0, "max_tokens": args.max_tokens}
    tuned = {**settings, "adapter": ADAPTER}
    t0 = time.perf_counter()
    theirs = asyncio.run(run_kestrel(args, pairs, chats, settings, tuned))
    t1 = time.perf_counter()
    ours = asyncio.run(run_ours(args, pairs, chats, settings, tuned))
    t2 = time.perf_counter()
    widened = asyncio.run(run_ours(args, pairs, chats, settings, tuned, "widen"))  # (the control: ours, another path)
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "kestrel_s": t1 - t0,
           "ours_s": t2 - t1, "max_tokens": args.max_tokens, "adapter_rank": args.rank,
           "agreement": {k: agreement(ours[k], theirs[k]) for k in ours},
           "ours_fp8_against_ours_widened_experts": {k: agreement(ours[k], widened[k]) for k in ours},
           "adapter_moves": {kind: 1 - agreement(ours[f"{kind}_adapter"], ours[f"{kind}_base"])["equal"]
                             for kind in ("query", "chat")}}
    args.out.write_text(json.dumps(res, indent=1))
    for what in ("agreement", "ours_fp8_against_ours_widened_experts"):
        for k, v in res[what].items():
            print(f"{what} {k}: {v['requests']} requests, equal {v['equal']:.2f}, first token "
                  f"{v['first_token_equal']:.2f}, leading tokens {v['leading_tokens_agreed']:.2f}")
    print("the adapter changes our answers:", res["adapter_moves"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
