"""The opt-in FP8 vision path (KESTREL_VISION_FP8: qkv, fc1 and fc2 in e4m3) against bf16, on one GPU:
1. speed: the encoder's CUDA graphs on 13 and 52 crops (gpu_bench.vision_bench), both ways, beside the bf16 floor
   (Moondream 2 full-size random weights; Moondream 3's encoder is the same network);
2. accuracy on full-size random weights: the image embeddings of fresh chart images (cosine similarity per image and
   worst row, fp8 against bf16), and the greedy answers that follow (16 tokens through the engine: the share equal
   token for token, and of their first tokens);
3. accuracy on the golden fixtures: the bf16 engine on md2-tiny and md3-tiny with and without it (cases equal to the
   float32 reference's, and outputs equal between the two).

    python benchmarks/vision_fp8.py [--images 32] [--fixtures md2-tiny md3-tiny] [--out vision_fp8.json]
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
from benchmarks.kestrel_method import chart_png  # noqa: E402
from kestrel_backend.engine_config import RuntimeConfig  # noqa: E402
from kestrel_backend.engine import InferenceEngine  # noqa: E402
from kestrel_backend.images import ImageLimits, decode_image  # noqa: E402
from kestrel_backend.model import vision  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from kestrel_backend.model.moondream import Moondream  # noqa: E402
from kestrel_backend.model.tokenizer import load_tokenizer  # noqa: E402
from kestrel_backend.model.weights import random_weights  # noqa: E402
from kestrel_backend.parity import result_matches, submit_case  # noqa: E402

QUESTION = "What is the highest value in the chart?"


def answers(model, images: list[bytes], fp8: bool) -> list[list[int]]:
    engine = InferenceEngine(RuntimeConfig(device="cuda", max_batch_size=32, vision_fp8=int(fp8)), model)
    try:
        async def ask():
            return await asyncio.gather(*[engine.query(img, QUESTION, settings={"temperature": 0, "max_tokens": 16})
                                          for img in images])
        return [r.token_ids for r in asyncio.run(ask())]
    finally:
        engine.shutdown()


def golden(fixture_name: str) -> dict:
    """The bf16 engine on a golden fixture, the vision encoder in bf16 and in FP8."""
    fixture = ROOT / "tests" / "fixtures" / fixture_name
    cases = [c for c in json.loads((fixture / "cases.json").read_text())["cases"]
             if c["kind"] in ("query", "caption", "point", "detect", "chat")]
    adapters = fixture / "adapters"
    outputs, row = {}, {"fixture": fixture_name, "cases": len(cases)}
    for fp8 in (0, 1):
        engine = InferenceEngine.create(RuntimeConfig(model_path=str(fixture), device="cuda", dtype="bfloat16",
                                                      vision_fp8=fp8, adapter_dir=str(adapters)
                                                      if adapters.is_dir() else ""))
        try:
            async def run():
                return await asyncio.gather(*[submit_case(engine, fixture, c) for c in cases])
            results = asyncio.run(run())
            row[f"golden_equal_{'fp8' if fp8 else 'bf16'}"] = sum(result_matches(engine, c, r)
                                                                   for c, r in zip(cases, results))
            outputs[fp8] = [r.output for r in results]
        finally:
            engine.shutdown()
    row["fp8_equal_to_bf16"] = sum(a == b for a, b in zip(outputs[0], outputs[1]))
    return row


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=32)
    p.add_argument("--fixtures", nargs="*", default=["md2-tiny", "md3-tiny"])
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    config = MoondreamConfig.official("moondream2")
    model = Moondream(config, random_weights(config, dtype=torch.bfloat16, device="cuda"),
                      load_tokenizer(ROOT / "tests" / "fixtures" / "md2-tiny"))
    c = ceilings()
    rows = []
    for fp8 in (False, True, False, True):  # (twice each, alternating: the spread between runs beside the gain)
        model.weights.vision.fp8 = None
        if fp8:
            vision.quantize_encoder(model.weights.vision)
        for n in (13, 52):
            rows.append({"fp8": fp8, **vision_bench(model, c, "graph", n)})
    model.weights.vision.fp8 = None

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
    base, quant = answers(model, images, False), answers(model, images, True)
    out = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "ceilings": c, "speed": rows,
           "embedding_cosine": {"min": min(cosine), "mean": float(np.mean(cosine)), "worst_row_min": min(row_cos)},
           "answers_equal": sum(a == b for a, b in zip(base, quant)) / len(base),
           "first_tokens_equal": sum(a[:1] == b[:1] for a, b in zip(base, quant)) / len(base),
           "images": len(images), "golden": [golden(name) for name in args.fixtures]}
    print("| path | crops | ms a crop | floor (bf16) | ratio |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {'fp8' if r['fp8'] else 'bf16'} | {r['crops']} | {r['ms_per_crop']:.3f} | "
              f"{r['floor_ms_per_crop']:.3f} | {r['ratio']:.2f}x |")
    print(json.dumps({k: out[k] for k in ("embedding_cosine", "answers_equal", "first_tokens_equal", "golden")}))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
