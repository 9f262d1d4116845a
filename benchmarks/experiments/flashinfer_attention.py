"""flashinfer's attention against ours at Moondream 2's shapes (GPU only; flashinfer installed): decode of 1, 16 and
64 rows over 64 and 776 positions (ours: decode_kernels.rotary_paged_attention, which also rotates q and k and
writes the new k/v, and grouped_attention for 64 rows on one shared image prefix; flashinfer's decode on CUDA cores
and on tensor cores), and the prefill of 1, 5 and 16 fresh 742-token prompts with our mask (the 730-position image
prefix sees itself whole, the text causally; ours: prefill_attention, which also writes the k/v into the paged cache;
flashinfer's ragged prefill with that mask as a custom mask, as two calls (prefixes whole, then tails causal), and
causal alone as its bound). flashinfer's plan() runs once, outside the timing, as it would once a step. Outputs are
checked against torch's attention on the same inputs. Microseconds a layer, each call one of 20 in a CUDA graph.
Results: PERFORMANCE.md, What we tried (h200_2026-11-29_attention.json).

    python benchmarks/experiments/flashinfer_attention.py [--out flashinfer_attention.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.experiments.decode_attention import (HEAD_DIM, HEADS, PAGE, decode_inputs,  # noqa: E402
                                                    graphed_us, tables_for)
from kestrel_backend.kernels import decode_kernels as dk  # noqa: E402
from kestrel_backend.kernels import prefill_attention as pa  # noqa: E402
from kestrel_backend.kernels.grouped_attention import GROUP, group_rows, grouped_attention  # noqa: E402

PROMPT, IMAGE_PREFIX = 742, 730  # a fresh prompt's positions; its image prefix (BOS and 729 image tokens)
WORKSPACE = 256 * 2**20


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(float((a.float() - b.float()).norm() / b.float().norm()), 5)


def decode(fi, rows: int, length: int, sharing: str) -> dict:
    tables, pages = tables_for(rows, sharing, length)  # ("all": 720 of the positions a shared prefix)
    k_cache, v_cache, lens, slots, qkv, cos, sin = decode_inputs(tables, pages, length)
    us = {"ours, per-row kernel (rope and k/v write included)": graphed_us(lambda: dk.rotary_paged_attention(
        qkv, cos, sin, k_cache, v_cache, tables, lens, slots, HEADS, PAGE))}
    heads = qkv.view(rows, 3 * HEADS, HEAD_DIM)
    if sharing == "all":
        groups, shared = np.zeros((rows, GROUP), np.int32), np.zeros(rows, np.int32)
        group_rows(tables.cpu().numpy(), np.full(rows, length - 1), PAGE, groups, shared)
        groups, shared = torch.from_numpy(groups).cuda(), torch.from_numpy(shared).cuda()
        us["ours, grouped (rope and k/v write included)"] = graphed_us(lambda: grouped_attention(
            heads[:, :HEADS], heads[:, HEADS:2 * HEADS], heads[:, 2 * HEADS:], k_cache, v_cache, tables, lens, slots,
            groups, shared, PAGE, cos, sin))
    q = torch.randn(rows, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)  # (taken as rotated already)
    n_pages = -(-length // PAGE)
    indptr = torch.arange(rows + 1, dtype=torch.int32, device="cuda") * n_pages
    indices = tables[:, :n_pages].reshape(-1).contiguous()
    last = torch.full((rows,), length - (n_pages - 1) * PAGE, dtype=torch.int32, device="cuda")
    paged = (k_cache.view(pages, PAGE, HEADS, HEAD_DIM), v_cache.view(pages, PAGE, HEADS, HEAD_DIM))
    for name, tensor_cores in (("flashinfer decode (attention alone)", False),
                               ("flashinfer decode on tensor cores (attention alone)", True)):
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"),
                                                        "NHD", use_tensor_cores=tensor_cores)
        wrapper.plan(indptr, indices, last, HEADS, HEADS, HEAD_DIM, PAGE, q_data_type=torch.bfloat16,
                     kv_data_type=torch.bfloat16)
        out = wrapper.run(q, paged)
        us[name] = graphed_us(lambda: wrapper.run(q, paged))
    positions = torch.arange(length, device="cuda")
    rows_of = tables[:, positions // PAGE].long() * PAGE + positions % PAGE  # [rows, length] cache rows
    k, v = k_cache[rows_of], v_cache[rows_of]  # [rows, length, H, D]
    reference = torch.nn.functional.scaled_dot_product_attention(q[:, :, None].float(), k.transpose(1, 2).float(),
                                                                 v.transpose(1, 2).float())[:, :, 0]
    return {"us_a_layer": {name: round(t, 1) for name, t in us.items()},
            "flashinfer_relative_difference": relative(out, reference)}


def our_mask(prompt: int, prefix: int) -> torch.Tensor:
    rows = torch.arange(prompt)
    return (rows[None, :] <= rows[:, None]) | ((rows[:, None] < prefix) & (rows[None, :] < prefix))


def prefill(fi, sequences: int) -> dict:
    t = sequences * PROMPT
    qkv = torch.randn(t, 3 * HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    heads = qkv.view(t, 3 * HEADS, HEAD_DIM)
    q, k, v = heads[:, :HEADS], heads[:, HEADS:2 * HEADS], heads[:, 2 * HEADS:]
    k_cache = torch.zeros(t + PAGE, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(t, device="cuda")  # (the cache rows of the step's tokens)
    work = torch.tensor([[s * PROMPT, PROMPT, IMAGE_PREFIX, tile, 0, 0] for s in range(sequences)
                         for tile in range(-(-PROMPT // pa.BLOCK_M))], dtype=torch.int32, device="cuda").reshape(-1)
    context = torch.zeros(1, dtype=torch.long, device="cuda")
    ours = pa.prefill_attention(q, k, v, k_cache, v_cache, slots, work, context)
    us = {"ours (k/v write included)": graphed_us(lambda: pa.prefill_attention(q, k, v, k_cache, v_cache, slots, work,
                                                                               context))}
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    indptr = torch.arange(sequences + 1, dtype=torch.int32, device="cuda") * PROMPT
    mask = our_mask(PROMPT, IMAGE_PREFIX)
    out = {}
    for name, kwargs in (("flashinfer, our mask as a custom mask (attention alone)",
                          {"custom_mask": mask.reshape(-1).repeat(sequences).cuda()}),
                         ("flashinfer, causal, no custom mask (its bound; not our mask)", {"causal": True})):
        wrapper = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"),
                                                          "NHD")
        wrapper.plan(indptr, indptr, HEADS, HEADS, HEAD_DIM, q_data_type=torch.bfloat16, **kwargs)
        out[name] = wrapper.run(qc, kc, vc)
        us[name] = graphed_us(lambda: wrapper.run(qc, kc, vc))
    # our mask in two calls: every image prefix whole (no mask), then every text tail causally over its prompt
    prefix_rows = torch.cat([torch.arange(i * PROMPT, i * PROMPT + IMAGE_PREFIX) for i in range(sequences)]).cuda()
    tail_rows = torch.cat([torch.arange(i * PROMPT + IMAGE_PREFIX, (i + 1) * PROMPT) for i in range(sequences)]).cuda()
    qp, kp, vp, qt = qc[prefix_rows], kc[prefix_rows], vc[prefix_rows], qc[tail_rows]
    whole, tail = (fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda"),
                                                           "NHD") for _ in range(2))
    prefix_indptr = torch.arange(sequences + 1, dtype=torch.int32, device="cuda") * IMAGE_PREFIX
    tail_indptr = torch.arange(sequences + 1, dtype=torch.int32, device="cuda") * (PROMPT - IMAGE_PREFIX)
    whole.plan(prefix_indptr, prefix_indptr, HEADS, HEADS, HEAD_DIM, q_data_type=torch.bfloat16)
    tail.plan(tail_indptr, indptr, HEADS, HEADS, HEAD_DIM, causal=True, q_data_type=torch.bfloat16)
    two = torch.empty_like(qc)
    two[prefix_rows], two[tail_rows] = whole.run(qp, kp, vp), tail.run(qt, kc, vc)
    us["flashinfer, our mask in two calls: prefixes whole, tails causal (attention alone)"] = graphed_us(
        lambda: (whole.run(qp, kp, vp), tail.run(qt, kc, vc)))
    s0 = slice(0, PROMPT)
    reference = torch.nn.functional.scaled_dot_product_attention(
        *(x[s0].transpose(0, 1)[None].float() for x in (q, k, v)), attn_mask=mask.cuda())[0].transpose(0, 1)
    return {"us_a_layer": {name: round(t, 1) for name, t in us.items()},
            "ours_relative_difference": relative(ours[s0], reference),
            "flashinfer_two_calls_relative_difference": relative(two[s0], reference),
            "flashinfer_custom_mask_relative_difference": relative(
                out["flashinfer, our mask as a custom mask (attention alone)"][s0], reference)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="flashinfer_attention.json")
    args = p.parse_args()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    import flashinfer as fi
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "flashinfer": fi.__version__,
           "import_s": round(time.perf_counter() - t0, 1), "decode": {}, "prefill": {}, "errors": []}
    cases = [("decode", f"{rows} rows, {length} positions", lambda rows=rows, length=length: decode(
        fi, rows, length, "none")) for length in (64, 776) for rows in (1, 16, 64)]
    cases.append(("decode", "64 rows, 776 positions, one shared image prefix", lambda: decode(fi, 64, 776, "all")))
    cases += [("prefill", f"{n} fresh prompts of {PROMPT}", lambda n=n: prefill(fi, n)) for n in (1, 5, 16)]
    for part, name, case in cases:
        t0 = time.perf_counter()
        try:
            res[part][name] = case()
        except Exception:
            res["errors"].append(f"{part} {name}: {traceback.format_exc()[-1500:]}")
            print(res["errors"][-1], flush=True)
        else:
            res[part][name]["wall_s"] = round(time.perf_counter() - t0, 1)  # (the first of a kind compiles)
            print(part, name, res[part][name], flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
