"""Moondream 3 on the GPU: the float32 GPU engine against md3-tiny's golden outputs and, with md3-tiny's experts in
FP8 (Kestrel's layout), against the CPU engine on the same file; then decode steps of FULL-SIZE random bf16 weights
against their floor (the dense weights, the routed experts and the KV bytes, over the copy ceiling measured in the
same run), again with the experts in FP8 (as Kestrel's checkpoints hold them: half the experts' bytes), the
weights' device memory, and segment's refinement latency (full-size head).

    python benchmarks/moondream3_bench.py [--out md3.json]

Kestrel's method on Moondream 3: benchmarks/kestrel_method.py --model moondream3.
"""

import argparse
import asyncio
import functools
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (ROOT, ceilings, decode_steps, engine_golden_check, table,  # noqa: E402
                                  text_weight_bytes)
from kestrel_backend.model.legacy_layout import fp8_experts, to_kestrel_layout  # noqa: E402
from kestrel_backend.engine_config import RuntimeConfig  # noqa: E402
from kestrel_backend.engine import InferenceEngine  # noqa: E402
from kestrel_backend.parity import json_close, submit_case  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from kestrel_backend.model.moondream import Moondream  # noqa: E402
from kestrel_backend.model.seg_refiner import RefinerHead  # noqa: E402
from kestrel_backend.model.weights import random_weights  # noqa: E402
from kestrel_backend.runtime import segment_refiner  # noqa: E402


def refiner_shapes(enc: int, d: int, masks: int = 4, blocks: int = 2) -> dict:
    """The published refiner head's tensor shapes (moondream/SegHeadRefiner: enc 1152, dim 256)."""
    s = {"image_pe": (1, d, 27, 27), "mask_tokens": (masks, d), "iou_token": (1, d), "output_pe": (masks + 1, d)}
    wb = lambda n, w, b: s.update({f"{n}.weight": w, f"{n}.bias": (b,)})  # noqa: E731
    attn = lambda n, e: s.update({f"{n}.in_proj_weight": (3 * e, e), f"{n}.in_proj_bias": (3 * e,),  # noqa: E731
                                  f"{n}.out_proj.weight": (e, e), f"{n}.out_proj.bias": (e,)})
    wb("image_proj", (d, enc, 1, 1), d)
    wb("hq_fusion.early_proj.0", (d, enc), d), wb("hq_fusion.early_proj.1", (d,), d)
    wb("hq_fusion.fusion.0", (d, 2 * d, 1, 1), d), wb("hq_fusion.fusion.1", (d,), d)
    wb("hq_fusion.fusion.3", (d, d, 3, 3), d), wb("hq_fusion.fusion.4", (d,), d)
    for i, (cin, cout) in enumerate(((1, d // 16), (d // 16, d // 8), (d // 8, d // 4), (d // 4, d)), start=1):
        wb(f"mask_encoder.conv{i}.0", (cout, cin, 3, 3), cout), wb(f"mask_encoder.conv{i}.1", (cout,), cout)
    for b in range(blocks):
        n = f"transformer_blocks.{b}"
        for a in ("output_self_attn", "cross_attn_token_to_image", "cross_attn_image_to_token"):
            attn(f"{n}.{a}", d)
        wb(f"{n}.mlp.0", (8 * d, d), 8 * d), wb(f"{n}.mlp.2", (d, 8 * d), d)
        for k in range(1, 5):
            wb(f"{n}.norm{k}", (d,), d)
    attn("final_token_to_image", d), wb("final_norm", (d,), d)
    for i, (cin, cout) in zip((0, 6, 12), ((d, d // 2), (d // 2, d // 4), (d // 4, d // 8))):
        wb(f"upsample.{i}", (cin, cout, 2, 2), cout), wb(f"upsample.{i + 1}.norm", (cout,), cout)
        wb(f"upsample.{i + 3}", (cout, cout, 3, 3), cout), wb(f"upsample.{i + 4}.norm", (cout,), cout)
    wb("final_q_proj", (d // 8, d), d // 8), attn("final_attn_up", d // 8), wb("final_norm_up", (d // 8,), d // 8)
    for m in range(masks):
        for k in (0, 2, 4):
            wb(f"mask_mlps.{m}.{k}", (d // 8, d // 8), d // 8)
    wb("iou_head.0", (d, d), d), wb("iou_head.2", (d, d), d), wb("iou_head.4", (masks, d), masks)
    return s


def refine_latency(model: Moondream) -> dict:
    """Segment's refinement on the GPU at full size: the vision encoder on one 378 px crop with its early features,
    then five rounds of the head (the CPU stages: benchmarks/experiments/segment_cpu_stages.py)."""
    import time

    import numpy as np

    head = RefinerHead({k: torch.randn(v, device="cuda", dtype=model.dtype) * 0.05
                        for k, v in refiner_shapes(model.config.vision.enc_dim, 256).items()})
    refiner = segment_refiner.SegmentRefiner(model, head, executor=None)
    rng = np.random.default_rng(0)
    crop = segment_refiner._Crop((0, 0, 378, 378), rng.integers(0, 256, (378, 378, 3), dtype=np.uint8),
                                 (rng.random((378, 378)) > 0.5).astype(np.uint8), 378, 378)
    times = []
    for i in range(23):
        t = time.perf_counter()
        refiner._run_head(crop)  # (ends with the mask's copy to the host: synchronised)
        times.append((time.perf_counter() - t) * 1000)
    return {"gpu_encoder_and_head_ms_median": round(sorted(times[3:])[10], 2)}


def fp8_agreement(one_at_a_time: bool = False) -> dict:
    """md3-tiny with its experts in FP8 (Kestrel's layout): the float32 GPU engine, which keeps them FP8 (its expert
    kernels scale after the dot; with KESTREL_FP8_EXPERTS=both beside widened copies), against the CPU engine, which
    dequantises them at load: every text, point and detect case (32 at once on the GPU; one_at_a_time: each alone,
    its decode steps of one row on the one-token expert GEMVs) with the same outputs."""
    from safetensors.torch import load_file

    fixture = ROOT / "tests" / "fixtures" / "md3-tiny"
    config = MoondreamConfig.from_file(fixture / "config.json")
    cases = [c for c in json.loads((fixture / "cases.json").read_text())["cases"]
             if c["kind"] in ("query", "caption", "point", "detect") and not c.get("adapter")][:32]
    outputs, dtypes = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(to_kestrel_layout(load_file(str(fixture / "model.safetensors")), config.text.n_layers),
                   Path(tmp) / "model_fp8.pt")
        for name in ("config.json", "tokenizer.json"):
            shutil.copy(fixture / name, tmp)
        for device, mode in (("cpu", "fp8"), ("cuda", "fp8"), ("cuda", "both")):
            engine = InferenceEngine.create(RuntimeConfig(model_path=tmp, device=device, dtype="float32",
                                                          max_batch_size=32, fp8_experts=mode))
            try:
                async def run():
                    if one_at_a_time:
                        return [await submit_case(engine, fixture, c) for c in cases]
                    return await asyncio.gather(*[submit_case(engine, fixture, c) for c in cases])

                outputs[device, mode] = [r.output for r in asyncio.run(run())]
                moe = next(b.moe for b in engine.model.weights.text.blocks if b.moe is not None)
                dtypes[f"{device} {mode}"] = str(moe.fc1.dtype) + (" and widened" if moe.fc1_wide is not None else "")
            finally:
                engine.shutdown()
    res = {}
    for mode in ("fp8", "both"):
        same = sum(json_close(a, b) for a, b in zip(outputs["cpu", "fp8"], outputs["cuda", mode]))
        res[f"fp8_experts_{mode}_gpu_equal_cpu"] = f"{same}/{len(cases)}"
    return res | {"expert_dtypes": dtypes}


def experts_to_fp8(model: Moondream) -> None:
    """The model's experts in FP8 with a float32 scale a row, in place, layer by layer."""
    for block in model.weights.text.blocks:
        if block.moe is not None:
            block.moe = fp8_experts(block.moe)
    torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    res = {"device": torch.cuda.get_device_name(), "golden": engine_golden_check("md3-tiny")}
    print(json.dumps(res["golden"]), flush=True)
    res["ceilings"] = ceilings()
    bandwidth = res["ceilings"]["copy_bandwidth_GBps"] * 1e9
    torch.manual_seed(0)
    config = MoondreamConfig.official("moondream3")
    before = torch.cuda.memory_allocated()
    model = Moondream(config, random_weights(config, dtype=torch.bfloat16, device="cuda"))
    res["weights_GB"] = (torch.cuda.memory_allocated() - before) / 1e9
    res["segment_refine"] = refine_latency(model)
    print(json.dumps(res["segment_refine"]), flush=True)
    rows = []
    with torch.inference_mode():
        for context in (64, 800):
            rows += decode_steps(model, [1], context, bandwidth, "graph-ahead")
            rows += decode_steps(model, [16, 64], context, bandwidth, "graph")
            print(table(rows[-3:]), flush=True)
    res["decode"] = rows
    res["peak_GB"] = torch.cuda.max_memory_allocated() / 1e9
    res["fp8_check"] = fp8_agreement() | {"one at a time": fp8_agreement(one_at_a_time=True)}
    print(json.dumps(res["fp8_check"]), flush=True)
    before = torch.cuda.memory_allocated()
    experts_to_fp8(model)
    res["fp8_weights_GB"] = res["weights_GB"] - (before - torch.cuda.memory_allocated()) / 1e9
    rows, fp8_bytes = [], functools.partial(text_weight_bytes, fp8_experts=True)
    with torch.inference_mode():
        for context in (64, 800):
            rows += decode_steps(model, [1], context, bandwidth, "graph-ahead", weight_bytes=fp8_bytes)
            rows += decode_steps(model, [16, 64], context, bandwidth, "graph", weight_bytes=fp8_bytes)
            print("FP8 experts\n" + table(rows[-3:]), flush=True)
    res["decode_fp8_experts"] = rows
    print(json.dumps({k: v for k, v in res.items() if k != "decode"}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
