"""4-bit decode on the GPU (W4A16): FULL-SIZE Moondream 2 with random 4-bit text weights in the official
checkpoints' format (groups of 128, bf16 scales and zero points), kept packed as the engine keeps them.

    python benchmarks/w4a16_bench.py --out w4.json

(1) the W4A16 kernels at full size in bf16 against torch on the dequantized weights (1 to 64 rows);
(2) decode steps as the engine runs them (CUDA graphs; one sequence launched ahead, as greedy text) next to their
    floor: the packed bytes, scales and zero points, the LM head and the KV bytes over the copy ceiling measured in
    the same run, beside the bf16 model's step;
(3) the whole GPU engine in float32 against the golden md2-tiny-4bit fixture (the reference's 4-bit model).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ceilings, decode_steps, engine_golden_check, text_weight_bytes  # noqa: E402
from kestrel_backend.model.config import MoondreamConfig  # noqa: E402
from kestrel_backend.model.moondream import Moondream  # noqa: E402
from kestrel_backend.kernels.packed import PackedWeight  # noqa: E402
from kestrel_backend.model.weights import MLP, LayerNorm, Linear, random_weights  # noqa: E402
from kestrel_backend.kernels import w4a16_kernels  # noqa: E402
from kestrel_backend.kernels.w4a16_kernels import w4_linear2_residual, w4_norm_linear  # noqa: E402

GROUP = 128


def random_packed(n: int, k: int, gen: torch.Generator) -> PackedWeight:
    """Random 4-bit values, zero points near the middle and scales giving weights of about 1 / sqrt(k)."""
    groups = n * k // GROUP
    data = torch.randint(0, 256, (n, k // 2), generator=gen, device="cuda", dtype=torch.uint8)
    scale = torch.full((groups,), 0.5 / k ** 0.5, device="cuda", dtype=torch.bfloat16)
    zero = torch.randint(7, 9, (groups,), generator=gen, device="cuda").to(torch.bfloat16)
    return PackedWeight(data, scale, zero, GROUP)


def four_bit(model: Moondream) -> Moondream:
    """The same model with every text block's linear 4-bit (the bf16 ones freed), as a 4-bit checkpoint loads."""
    gen = torch.Generator(device="cuda").manual_seed(1)

    def packed(lin: Linear) -> Linear:
        return Linear(random_packed(*lin.weight.shape, gen), lin.bias)

    blocks = [dataclasses.replace(b, qkv=packed(b.qkv), proj=packed(b.proj),
                                  mlp=MLP(packed(b.mlp.fc1), packed(b.mlp.fc2))) for b in model.weights.text.blocks]
    text = dataclasses.replace(model.weights.text, blocks=blocks)
    return Moondream(model.config, dataclasses.replace(model.weights, text=text))


def packed_weight_bytes(model: Moondream):
    """The floor's weight bytes of a decode step of the 4-bit model: every block's packed bytes, scales and zero
    points, and the LM head (bf16, as in the checkpoints)."""
    w = model.weights.text
    total = sum(lin.weight.nbytes for b in w.blocks for lin in (b.qkv, b.proj, b.mlp.fc1, b.mlp.fc2))
    total += w.lm_head.weight.numel() * w.lm_head.weight.element_size()
    return lambda config, rows: total


def in_dtype(block, dtype: torch.dtype):
    """A text block whose tensors are in dtype and whose packed weights dequantize to it."""
    def lin(w: Linear) -> Linear:
        return Linear(dataclasses.replace(w.weight, dtype=dtype), w.bias.to(dtype))

    return dataclasses.replace(block, ln=LayerNorm(block.ln.weight.to(dtype), block.ln.bias.to(dtype)),
                               qkv=lin(block.qkv), proj=lin(block.proj),
                               mlp=MLP(lin(block.mlp.fc1), lin(block.mlp.fc2)), out_bias=block.out_bias.to(dtype))


def kernel_check(model: Moondream, dtype: torch.dtype) -> list[dict]:
    """Each W4A16 kernel at full size against torch with the dequantized weights (float32 accumulation). In float32
    the weights must be the reference's values exactly: a relative error of about 1e-7 (one rounding off would
    show as about 1e-3)."""
    b, rows = in_dtype(model.weights.text.blocks[0], dtype), []
    dim = model.config.text.dim
    for m in (1, 2, 16, 64):
        x = torch.randn(m, dim, device="cuda", dtype=dtype)
        qkv, act = w4_norm_linear(x, b.ln.weight, b.ln.bias, b.qkv.weight, b.qkv.bias, b.mlp.fc1.weight, b.mlp.fc1.bias)
        h = torch.nn.functional.layer_norm(x.float(), (dim,), b.ln.weight.float(), b.ln.bias.float())
        ref_qkv = h @ b.qkv.weight.dequantize().float().T + b.qkv.bias.float()
        ref_act = torch.nn.functional.gelu(h @ b.mlp.fc1.weight.dequantize().float().T + b.mlp.fc1.bias.float(),
                                           approximate="tanh")
        out = w4_linear2_residual(qkv[:, :dim], b.proj.weight, act, b.mlp.fc2.weight, x, b.out_bias)
        ref_out = x.float() + qkv[:, :dim].float() @ b.proj.weight.dequantize().float().T + \
            act.float() @ b.mlp.fc2.weight.dequantize().float().T + b.out_bias.float()
        err = lambda got, ref: float((got.float() - ref).norm() / ref.norm())  # noqa: E731
        rows.append({"rows": m, "qkv_rel_err": err(qkv, ref_qkv), "fc1_rel_err": err(act, ref_act),
                     "out_rel_err": err(out, ref_out)})
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.manual_seed(0)
    config = MoondreamConfig()
    bf16 = Moondream(config, random_weights(config, dtype=torch.bfloat16, device="cuda"))
    results = {"device": torch.cuda.get_device_name(), "ceilings": ceilings()}
    bw = results["ceilings"]["copy_bandwidth_GBps"] * 1e9
    results["bf16_steps"] = [decode_steps(bf16, [1], ctx, bw, "graph-ahead")[0] for ctx in (64, 800)]
    results["bf16_steps"] += decode_steps(bf16, [64], 64, bw, "graph")
    model = four_bit(bf16)
    del bf16
    torch.cuda.empty_cache()
    results["kernels_bf16"] = kernel_check(model, torch.bfloat16)
    results["kernels_fp32"] = kernel_check(model, torch.float32)
    weight_bytes = packed_weight_bytes(model)
    results["weight_bytes"] = {"four_bit": weight_bytes(config, 1), "bf16": text_weight_bytes(config)}
    results["w4_steps"] = [decode_steps(model, [1], ctx, bw, "graph-ahead", weight_bytes=weight_bytes)[0]
                           for ctx in (64, 800)]
    results["w4_steps"] += decode_steps(model, [2, 16, 64], 64, bw, "graph", weight_bytes=weight_bytes)
    w4a16_kernels.GROUP_SUMS = False  # the same steps with the reference's roundings in every kernel
    results["w4_steps_rounded"] = decode_steps(model, [1], 64, bw, "graph-ahead", weight_bytes=weight_bytes)
    results["w4_steps_rounded"] += decode_steps(model, [16, 64], 64, bw, "graph", weight_bytes=weight_bytes)
    w4a16_kernels.GROUP_SUMS = True
    del model
    torch.cuda.empty_cache()
    results["golden_fp32"] = engine_golden_check("md2-tiny-4bit")
    for key in ("bf16_steps", "w4_steps", "w4_steps_rounded"):
        for r in results[key]:
            print(f"{key} batch {r['batch']} ctx {r['context']}: {r['step_ms']:.3f} ms, floor {r['floor_ms']:.3f} "
                  f"= {r['ratio']:.2f}x, {r['tokens_per_s']:.0f} tok/s")
    print(json.dumps({k: results[k] for k in ("kernels_bf16", "kernels_fp32", "weight_bytes", "golden_fp32")}))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
