"""The opt-in FP8 paths against bf16 on one GPU: the vision encoder's (KESTREL_VISION_FP8) and the text model's long
steps, image prefills (KESTREL_PREFILL_FP8); each has qkv, fc1 and fc2 in e4m3.
1. speed: the encoder's CUDA graphs on 13 and 52 crops (gpu_bench.vision_bench) and a prefill step of 1 and 4 fresh
   image queries (gpu_bench.prefill_bench: eager and in its CUDA graph), each path off and on, twice in turns, beside
   its bf16 floor (Moondream 2 full-size random weights; Moondream 3's encoder is the same network);
2. accuracy on full-size random weights: the image embeddings of fresh chart images with FP8 vision (cosine
   similarity per image and worst row against bf16), and, for each path and both, the greedy answers that follow
   (16 tokens through the engine: the share equal to bf16's token for token, and of their first tokens);
3. accuracy on the golden fixtures: the bf16 engine on md2-tiny and md3-tiny with each path and both (cases equal to
   the float32 reference's, and outputs equal to the bf16 engine's).

    python benchmarks/fp8_paths.py [--images 32] [--fixtures md2-tiny md3-tiny] [--speed vision prefill] \
        [--out fp8_paths.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.common import ceilings, vision_bench  # noqa: E402
from benchmarks.gpu_bench import prefill_bench  # noqa: E402
from benchmarks.kestrel_method import chart_png  # noqa: E402
from kestrel_backend.engine_config import RuntimeConfig  # noqa: E402
from kestrel_backend.engine import InferenceEngine  # noqa: E402
from kestrel_backend.images import ImageLimits, decode_image  # noqa: E402
from kestrel_backend.model import text, vision  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from kestrel_backend.model.moondream import Moondream  # noqa: E402
from kestrel_backend.model.tokenizer import load_tokenizer  # noqa: E402
from kestrel_backend.model.weights import random_weights  # noqa: E402
from kestrel_backend.parity import result_matches, submit_case  # noqa: E402

QUESTION = "What is the highest value in the chart?"
SETTINGS = {"bf16": {}, "vision": {"vision_fp8": 1}, "prefill": {"prefill_fp8": 1},
            "both": {"vision_fp8": 1, "prefill_fp8": 1}}


def answers(model, images: list[bytes], setting: dict) -> list[list[int]]:
    engine = InferenceEngine(RuntimeConfig(device="cuda", max_batch_size=32, **setting), model)
    try:
        async def ask():
            return await asyncio.gather(*[engine.query(img, QUESTION, settings={"temperature": 0, "max_tokens": 16})
                                          for img in images])
        return [r.token_ids for r in asyncio.run(ask())]
    finally:
        engine.shutdown()


def golden(fixture_name: str) -> dict:
    """The bf16 engine on a golden fixture, in bf16 and with each FP8 path."""
    fixture = ROOT / "tests" / "fixtures" / fixture_name
    cases = [c for c in json.loads((fixture / "cases.json").read_text())["cases"]
             if c["kind"] in ("query", "caption", "point", "detect", "chat")]
    adapters = fixture / "adapters"
    outputs, row = {}, {"fixture": fixture_name, "cases": len(cases)}
    for name, setting in SETTINGS.items():
        engine = InferenceEngine.create(RuntimeConfig(model_path=str(fixture), device="cuda", dtype="bfloat16",
                                                      adapter_dir=str(adapters) if adapters.is_dir() else "",
                                                      **setting))
        try:
            async def run():
                return await asyncio.gather(*[submit_case(engine, fixture, c) for c in cases])
            results = asyncio.run(run())
            row[f"golden_equal_{name}"] = sum(result_matches(engine, c, r) for c, r in zip(cases, results))
            outputs[name] = [r.output for r in results]
        finally:
            engine.shutdown()
    for name in SETTINGS:
        row[f"{name}_equal_to_bf16"] = sum(a == b for a, b in zip(outputs["bf16"], outputs[name]))
    return row


def speed(model, c: dict, paths: list[str]) -> list[dict]:
    """Each path's own benchmark off and on, twice in turns (the spread between runs beside the gain)."""
    rows = []
    for fp8 in (False, True, False, True):
        model.weights.vision.fp8 = model.weights.text.fp8 = None
        if fp8:
            vision.quantize_encoder(model.weights.vision)
            text.quantize_prefill(model.weights.text)
        for n in (13, 52) if "vision" in paths else ():
            rows.append({"path": "vision", "fp8": fp8, **vision_bench(model, c, "graph", n)})
        for n in (1, 4) if "prefill" in paths else ():
            rate = c["bf16_matmul_TFLOPs"] * 1e12
            rows += [{"path": "prefill", "fp8": fp8, **r} for r in prefill_bench(model, rate, n)]
    model.weights.vision.fp8 = model.weights.text.fp8 = None
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=32)
    p.add_argument("--fixtures", nargs="*", default=["md2-tiny", "md3-tiny"])
    p.add_argument("--speed", nargs="*", default=["vision", "prefill"], choices=["vision", "prefill"],
                   help="the paths whose speed is measured")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    config = MoondreamConfig.official("moondream2")
    model = Moondream(config, random_weights(config, dtype=torch.bfloat16, device="cuda"),
                      load_tokenizer(ROOT / "tests" / "fixtures" / "md2-tiny"))
    c = ceilings()
    rows = speed(model, c, args.speed)

    rng = np.random.default_rng(11)
    images = [chart_png(rng) for _ in range(args.images)]
    cropped = [model.crop_image(decode_image(img, ImageLimits(1 << 26, 1 << 26))) for img in images]
    with torch.inference_mode():
        bf16 = model.encode_cropped(cropped)
        vision.quantize_encoder(model.weights.vision)
        fp8 = model.encode_cropped(cropped)
        model.weights.vision.fp8 = None
    cosine = [float(F.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0)) for a, b in zip(bf16, fp8)]
    row_cos = [float(F.cosine_similarity(a.float(), b.float(), dim=1).min()) for a, b in zip(bf16, fp8)]
    greedy = {name: answers(model, images, setting) for name, setting in SETTINGS.items()}
    agreement = {name: {"answers_equal": sum(a == b for a, b in zip(greedy["bf16"], out)) / len(out),
                        "first_tokens_equal": sum(a[:1] == b[:1] for a, b in zip(greedy["bf16"], out)) / len(out)}
                 for name, out in greedy.items() if name != "bf16"}
    out = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "ceilings": c, "speed": rows,
           "embedding_cosine": {"min": min(cosine), "mean": float(np.mean(cosine)), "worst_row_min": min(row_cos)},
           "greedy_agreement": agreement, "images": len(images), "golden": [golden(name) for name in args.fixtures]}
    print("| path | fp8 | shape | ms | floor (bf16) | ratio |\n| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        shape = f"{r['crops']} crops" if r["path"] == "vision" else f"{r['sequences']} seq, {r['attention']}"
        ms, floor = (r["ms_per_crop"], r["floor_ms_per_crop"]) if r["path"] == "vision" else (r["ms"], r["floor_ms"])
        print(f"| {r['path']} | {r['fp8']} | {shape} | {ms:.3f} | {floor or 0:.3f} | {r['ratio'] or 0:.2f}x |")
    print(json.dumps({k: out[k] for k in ("embedding_cosine", "greedy_agreement", "golden")}))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
