"""Moondream 3's expert MLPs on the GPU as grouped work, with no host sync (so decode steps replay as CUDA graphs).

One program (`_route`) takes each token's top-k experts from the router's logits and their softmax weights, and
groups the (token, expert) pairs by expert on the device (past ONE_PROGRAM_PAIRS pairs, in long prefills: the same
in two passes of many programs); for a few tokens it is the last program of the router's own kernel, which for one
token on the FP8 GEMVs (below) only ranks its experts (`_top_k_ranked`: its k pairs need no grouping). A program of
`_moe_up_kernel` takes one expert and one block of its inner columns and runs every pair routed to that expert
through fc1 (tiles of 16 rows in decode steps, 128 in prefill; tensor-core dots), reading the expert's weights once
a tile, then applies gelu(h) * (g + 1). `_moe_down_kernel` does the same through fc2 and scales each row by its
routing weight; the k rows of a token are summed in float32 at the end (in decode steps by residual_kernels, with
the residual). Experts no token chose cost one program that returns at once. FP8 experts (Kestrel's checkpoints)
are read as FP8, half the bytes, widened to the activations' type in the kernels, and each output column scaled by
its row's float32 scale after the dot; one token's run as GEMVs instead (`_moe_gemv_up_kernel`: a 16-row tile
would be 15 rows of padding, and widening its FP8 values to them cost more than the bytes saved).

Long bf16 prefills on Hopper and later take another path (`_moe_mlp_grouped`): the pairs' rows gathered in
expert order, both matmuls as torch's grouped GEMM (CUTLASS: about 600 TFLOP/s on an H100 where the kernels
above reach 200, their programs each looping over one expert's rows), gelu(h) * (g + 1) and the weighted sum of a
token's k rows as one pass each (added to the layer's residual there: `add_moe_mlp`). FP8 experts on Hopper run
as Kestrel runs them (W8A8): each gathered row and each gated-GELU row in FP8 with a float32 scale of its own, both
matmuls as torch's FP8 grouped GEMM with a scale a row (H100, the MLP of 5,936 tokens 1.10 against 1.35 ms with
widened bf16 experts; a relative error of 4e-2 against 4e-3 from the activations' rounding). Elsewhere FP8 experts
are widened to bf16 (weight * scale, one pass) into scratch, unless widened copies are kept beside them
(KESTREL_FP8_EXPERTS=both: `experts_for`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .moe_lora import ExpertLora, pair_delta
from .shared import fp8_rows

# MoE, what these kernels read of a layer's experts, is a Protocol at the end of this file (model.weights.MoE has it;
# model/ imports this module, not the other way round). It sits there so that no kernel's line moves.


@triton.jit
def _pair_rows(order_ptr, r0, end, BLOCK_M: tl.constexpr):
    """Sorted pair rows r0.. of an expert's segment (which ends at end), which of them exist, their pair indices."""
    rows = r0 + tl.arange(0, BLOCK_M)
    mask = rows < end
    return rows, mask, tl.load(order_ptr + rows, mask=mask, other=0)


@triton.jit
def exact_gelu(x):
    """The exact (erf) GELU of float32 values, as torch's F.gelu."""
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def _gated_gelu(h, g):
    """gelu(h) * (g + 1) in float32, the exact (erf) GELU."""
    return exact_gelu(h) * (g + 1.0)


@triton.jit
def _moe_up_kernel(x_ptr, x_stride, w1_ptr, s1_ptr, order_ptr, starts_ptr, act_ptr, delta_ptr, K: tl.constexpr,
                   I: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr, DELTA: tl.constexpr):
    e, nb = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(starts_ptr + e), tl.load(starts_ptr + e + 1)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    w_h = w1_ptr + e.to(tl.int64) * (2 * I * K) + offs_n[None, :] * K + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    w_g = w_h + I * K
    if SCALED:  # (FP8 weights: a scale a row of fc1, i.e. a column here)
        s_h = tl.load(s1_ptr + e * (2 * I) + offs_n, mask=n_mask, other=0.0)
        s_g = tl.load(s1_ptr + e * (2 * I) + I + offs_n, mask=n_mask, other=0.0)
    for r0 in range(start, end, BLOCK_M):
        rows, r_mask, pair = _pair_rows(order_ptr, r0, end, BLOCK_M)
        x_rows = x_ptr + (pair // TOP_K)[:, None].to(tl.int64) * x_stride + offs_k[None, :]
        acc_h = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xs = tl.load(x_rows + k0, mask=r_mask[:, None], other=0.0)
            acc_h = tl.dot(xs, tl.load(w_h + k0, mask=n_mask[None, :], other=0.0).to(xs.dtype), acc_h,
                           input_precision=PRECISION)
            acc_g = tl.dot(xs, tl.load(w_g + k0, mask=n_mask[None, :], other=0.0).to(xs.dtype), acc_g,
                           input_precision=PRECISION)
        if SCALED:
            acc_h *= s_h[None, :]
            acc_g *= s_g[None, :]
        if DELTA:  # (adapters' fc1 deltas [pairs, 2I], in pair order: moe_lora)
            d = delta_ptr + pair[:, None].to(tl.int64) * (2 * I) + offs_n[None, :]
            d_mask = r_mask[:, None] & n_mask[None, :]
            acc_h += tl.load(d, mask=d_mask, other=0.0).to(tl.float32)
            acc_g += tl.load(d + I, mask=d_mask, other=0.0).to(tl.float32)
        act = _gated_gelu(acc_h, acc_g)
        tl.store(act_ptr + rows[:, None].to(tl.int64) * I + offs_n[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=r_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_down_kernel(act_ptr, w2_ptr, s2_ptr, order_ptr, starts_ptr, gates_ptr, out_ptr, N: tl.constexpr,
                     I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr, SCALED: tl.constexpr):
    e, nb = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(starts_ptr + e), tl.load(starts_ptr + e + 1)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w = w2_ptr + e.to(tl.int64) * (N * I) + offs_n[None, :] * I + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    for r0 in range(start, end, BLOCK_M):
        rows, r_mask, pair = _pair_rows(order_ptr, r0, end, BLOCK_M)
        a_rows = act_ptr + rows[:, None].to(tl.int64) * I + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            a = tl.load(a_rows + k0, mask=r_mask[:, None], other=0.0)
            acc = tl.dot(a, tl.load(w + k0, mask=n_mask[None, :], other=0.0).to(a.dtype), acc,
                         input_precision=PRECISION)
        if SCALED:
            acc *= tl.load(s2_ptr + e * N + offs_n, mask=n_mask, other=0.0)[None, :]
        gate = tl.load(gates_ptr + pair, mask=r_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + pair[:, None].to(tl.int64) * N + offs_n[None, :], acc * gate[:, None],
                 mask=r_mask[:, None] & n_mask[None, :])


@triton.jit
def _top_k_ranked(logits_ptr, ids_ptr, gates_ptr, E: tl.constexpr, E_P2: tl.constexpr, K: tl.constexpr,
                  K_P2: tl.constexpr):
    """One token's top K experts and their weights, stored as _top_k_block stores them, from each expert's rank
    among its E logits (the others above it, or equal and of a lower id: _top_k_block's K passes give the same
    order) worked out at once."""
    offs_e, offs_k = tl.arange(0, E_P2), tl.arange(0, K_P2)
    logits = tl.load(logits_ptr + offs_e, mask=offs_e < E, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
    above = (logits[None, :] > logits[:, None]) | ((logits[None, :] == logits[:, None])
                                                   & (offs_e[None, :] < offs_e[:, None]))
    rank = tl.sum(above.to(tl.int32), 1)
    at = (rank[None, :] == offs_k[:, None]) & (offs_e < E)[None, :] & (offs_k < K)[:, None]  # [K_P2, E_P2]
    ids = tl.minimum(tl.sum(tl.where(at, offs_e[None, :], 0), 1), E - 1)  # (NaN logits share a rank: still an expert)
    top = tl.where(offs_k < K, tl.sum(tl.where(at, logits[None, :], 0.0), 1), float("-inf"))
    weights = tl.exp(top - tl.max(top, 0))  # (as _top_k_block's)
    weights = weights / tl.sum(weights, 0)
    tl.store(ids_ptr + offs_k, ids, mask=offs_k < K)
    tl.store(gates_ptr + offs_k, weights.to(gates_ptr.dtype.element_ty), mask=offs_k < K)


@triton.jit
def _moe_gemv_up_kernel(x_ptr, w1_ptr, s1_ptr, ids_ptr, act_ptr, delta_ptr, K: tl.constexpr, I: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DELTA: tl.constexpr):
    """_moe_up_kernel for one token's FP8 experts: a program a (slot of its top k, block of inner columns), products
    on the CUDA cores in float32 (no 16-row tile of which 15 rows are padding), each FP8 weight widened once."""
    j, nb = tl.program_id(0), tl.program_id(1)
    e = tl.load(ids_ptr + j).to(tl.int64)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_h = w1_ptr + e * (2 * I * K) + offs_n[:, None] * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    acc_h = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xs = tl.load(x_ptr + k0 + offs_k).to(tl.float32)[None, :]
        acc_h += tl.load(w_h + k0).to(tl.float32) * xs
        acc_g += tl.load(w_h + I * K + k0).to(tl.float32) * xs
    h = tl.sum(acc_h, 1) * tl.load(s1_ptr + e * (2 * I) + offs_n)
    g = tl.sum(acc_g, 1) * tl.load(s1_ptr + e * (2 * I) + I + offs_n)
    if DELTA:
        h += tl.load(delta_ptr + j * (2 * I) + offs_n).to(tl.float32)
        g += tl.load(delta_ptr + j * (2 * I) + I + offs_n).to(tl.float32)
    act = _gated_gelu(h, g)
    tl.store(act_ptr + j * I + offs_n, act.to(act_ptr.dtype.element_ty))


@triton.jit
def _moe_gemv_down_kernel(act_ptr, w2_ptr, s2_ptr, ids_ptr, gates_ptr, out_ptr, N: tl.constexpr, I: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """_moe_down_kernel for one token's FP8 experts, as _moe_gemv_up_kernel: row j of out is slot j's (the token's
    pair j), times its weight."""
    j, nb = tl.program_id(0), tl.program_id(1)
    e = tl.load(ids_ptr + j).to(tl.int64)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w = w2_ptr + e * (N * I) + offs_n[:, None] * I + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        a = tl.load(act_ptr + j * I + k0 + offs_k).to(tl.float32)[None, :]
        acc += tl.load(w + k0).to(tl.float32) * a
    y = tl.sum(acc, 1) * tl.load(s2_ptr + e * N + offs_n) * tl.load(gates_ptr + j).to(tl.float32)
    tl.store(out_ptr + j * N + offs_n, y)


@triton.jit
def _router_kernel(x_ptr, x_stride, w_ptr, b_ptr, out_ptr, T, K: tl.constexpr, E: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, ROUTE: tl.constexpr, done_ptr, ids_ptr, gates_ptr,
                   starts_ptr, fill_ptr, order_ptr, E_P2: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr,
                   BINS: tl.constexpr, ROUTE_BLOCK_T: tl.constexpr, valid_ptr=None, VALID: tl.constexpr = False):
    """The router's logits of a few tokens, one program an expert (cuBLAS runs this 64 x 2048 product in one
    block: 5.1 us at batch 1 against 3.0; the decode step of one token 1.596 against 1.614 ms). ROUTE: the last
    program to finish then routes the step (_route; ROUTE 2, one token: only its top k, _top_k_ranked) and sets the
    done counter back to zero: a launch less on the decode step's critical path. VALID: only the first valid_ptr[0]
    tokens are routed (_valid_tokens)."""
    e = tl.program_id(0)
    offs_t = tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    acc = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_t[:, None] * x_stride + offs_k[None, :], mask=t_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + e * K + offs_k, mask=k_mask, other=0.0)
        acc += tl.sum(x.to(tl.float32) * w.to(tl.float32)[None, :], axis=1)
    acc += tl.load(b_ptr + e).to(tl.float32)
    tl.store(out_ptr + offs_t * E + e, acc.to(out_ptr.dtype.element_ty), mask=t_mask)
    if ROUTE:
        tl.debug_barrier()  # every thread's logits are stored before the count says so
        if tl.atomic_add(done_ptr, 1, sem="acq_rel") == E - 1:
            tl.store(done_ptr, 0)
            if ROUTE == 2:
                _top_k_ranked(out_ptr, ids_ptr, gates_ptr, E, E_P2, TOP_K, K_P2)
            else:
                _route(out_ptr, _valid_tokens(T, valid_ptr, VALID), ids_ptr, gates_ptr, starts_ptr, fill_ptr,
                       order_ptr, E, E_P2, TOP_K, K_P2, BINS, ROUTE_BLOCK_T)


@triton.jit
def _gated_gelu_tile(h_ptr, rows, cols, P, I: tl.constexpr):
    """gelu(h) * (g + 1) in float32 for these rows and columns of [h | g] rows [P, 2I]; 0 outside them."""
    mask = (rows < P)[:, None] & (cols < I)[None, :]
    h_rows = h_ptr + rows[:, None].to(tl.int64) * (2 * I) + cols[None, :]
    h = tl.load(h_rows, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(h_rows + I, mask=mask, other=0.0).to(tl.float32)
    return _gated_gelu(h, g), mask


@triton.jit
def _gated_gelu_kernel(h_ptr, act_ptr, P, I: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_I: tl.constexpr):
    """act = gelu(h) * (g + 1) for rows [h | g] of fc1's grouped output [P, 2I] -> [P, I]."""
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    act, mask = _gated_gelu_tile(h_ptr, rows, cols, P, I)
    tl.store(act_ptr + rows[:, None].to(tl.int64) * I + cols[None, :], act.to(act_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_gelu_fp8_kernel(h_ptr, act_ptr, scale_ptr, P, I: tl.constexpr, I_P2: tl.constexpr, BLOCK_P: tl.constexpr):
    """_gated_gelu_kernel's rows in FP8 with a float32 scale a row (the second GEMM of the W8A8 path)."""
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, I_P2)
    act, mask = _gated_gelu_tile(h_ptr, rows, cols, P, I)
    values, scale = fp8_rows(act)
    tl.store(act_ptr + rows[:, None].to(tl.int64) * I + cols[None, :], values, mask=mask)
    tl.store(scale_ptr + rows, scale, mask=rows < P)


@triton.jit
def _gather_fp8_kernel(x_ptr, x_stride, order_ptr, out_ptr, scale_ptr, P, K: tl.constexpr, K_P2: tl.constexpr,
                       TOP_K: tl.constexpr, BLOCK_P: tl.constexpr):
    """Row p of out: the row of x of pair order[p]'s token (order[p] // TOP_K), in FP8 with a scale of its own."""
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.arange(0, K_P2)
    r_mask = rows < P
    mask = r_mask[:, None] & (cols < K)[None, :]
    token = (tl.load(order_ptr + rows, mask=r_mask, other=0) // TOP_K).to(tl.int64)
    x = tl.load(x_ptr + token[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    values, scale = fp8_rows(x)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], values, mask=mask)
    tl.store(scale_ptr + rows, scale, mask=r_mask)


@triton.jit
def _widen_rows_kernel(w_ptr, s_ptr, out_ptr, COLS: tl.constexpr, BLOCK: tl.constexpr):
    """out[row] = w[row] * s[row] in float32, stored in out's type (as the loader's dequantisation)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < COLS
    w = tl.load(w_ptr + row * COLS + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * COLS + cols, (w * tl.load(s_ptr + row)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_kernel(y_ptr, where_ptr, gates_ptr, out_ptr, bias_ptr, N: tl.constexpr, TOP_K: tl.constexpr,
                    BLOCK_N: tl.constexpr, ADD: tl.constexpr):
    """out[t] = the sum over t's k pairs of gate * (the pair's fc2 row), in float32: where[t * k + j] is the row
    of pair (t, j) in the grouped output. ADD: out[t] += bias + that sum instead (one rounding)."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(where_ptr + t * TOP_K + j).to(tl.int64)
        gate = tl.load(gates_ptr + t * TOP_K + j).to(tl.float32)
        acc += tl.load(y_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32) * gate
    out = out_ptr + t.to(tl.int64) * N + cols
    if ADD:
        acc += tl.load(out, mask=mask, other=0.0).to(tl.float32) + tl.load(bias_ptr + cols, mask=mask).to(tl.float32)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _route_kernel(logits_ptr, T, ids_ptr, gates_ptr, starts_ptr, fill_ptr, order_ptr, E: tl.constexpr,
                  E_P2: tl.constexpr, K: tl.constexpr, K_P2: tl.constexpr, BINS: tl.constexpr, BLOCK_T: tl.constexpr,
                  valid_ptr=None, VALID: tl.constexpr = False):
    _route(logits_ptr, _valid_tokens(T, valid_ptr, VALID), ids_ptr, gates_ptr, starts_ptr, fill_ptr, order_ptr, E,
           E_P2, K, K_P2, BINS, BLOCK_T)


@triton.jit
def _valid_tokens(T, valid_ptr, VALID: tl.constexpr):
    """The tokens to route: all T, or with VALID the first valid_ptr[0] of them (a prefill graph's real rows: its
    padded ones, whatever they hold, then choose no expert, so no expert's tiles grow with them)."""
    if VALID:
        return tl.minimum(T, tl.load(valid_ptr))
    return T


@triton.jit
def _top_k_block(logits_ptr, offs_t, T, ids_ptr, gates_ptr, E: tl.constexpr, E_P2: tl.constexpr, K: tl.constexpr,
                 K_P2: tl.constexpr, BLOCK_T: tl.constexpr):
    """Tokens offs_t's top-K experts by router logit, best first (ties: the lower expert id), and the softmax of
    those K logits in float32 (text.top_experts' values), stored; -> the ids [BLOCK_T, K_P2] (E past K and T)."""
    offs_e, offs_k = tl.arange(0, E_P2), tl.arange(0, K_P2)
    t_mask = offs_t < T
    logits = tl.load(logits_ptr + offs_t[:, None] * E + offs_e[None, :], cache_modifier=".cg",  # (other programs')
                     mask=t_mask[:, None] & (offs_e < E)[None, :], other=float("-inf")).to(tl.float32)
    logits = tl.where(t_mask[:, None], logits, 0.0)  # (rows past T: finite, written nowhere)
    top = tl.full([BLOCK_T, K_P2], float("-inf"), tl.float32)
    ids = tl.full([BLOCK_T, K_P2], E, tl.int32)  # (slots past K, tokens past T: bin E, no expert's)
    for j in range(K):  # (a loop: unrolled, the 64-token variant took 3.5 minutes to compile for sm80, 21 s sm90)
        best = tl.argmax(logits, axis=1, tie_break_left=True)
        top = tl.where(offs_k[None, :] == j, tl.max(logits, axis=1)[:, None], top)
        ids = tl.where((offs_k[None, :] == j) & t_mask[:, None], best[:, None].to(tl.int32), ids)
        logits = tl.where(offs_e[None, :] == best[:, None], float("-inf"), logits)
    weights = tl.exp(top - tl.max(top, axis=1)[:, None])
    weights = weights / tl.sum(weights, axis=1)[:, None]
    pairs = offs_t[:, None] * K + offs_k[None, :]
    mask = t_mask[:, None] & (offs_k < K)[None, :]
    tl.store(ids_ptr + pairs, ids, mask=mask)
    tl.store(gates_ptr + pairs, weights.to(gates_ptr.dtype.element_ty), mask=mask)
    return ids


@triton.jit
def _route(logits_ptr, T, ids_ptr, gates_ptr, starts_ptr, fill_ptr, order_ptr, E: tl.constexpr, E_P2: tl.constexpr,
           K: tl.constexpr, K_P2: tl.constexpr, BINS: tl.constexpr, BLOCK_T: tl.constexpr):
    """One program for the whole step: each token's top-K experts and their weights (_top_k_block); then the
    (token, slot) pairs grouped by expert: where each expert's run starts, and every pair placed in its expert's run
    (an atomic counter an expert; the order inside a run does not change any row's result)."""
    counts = tl.zeros([BINS], dtype=tl.int32)
    for t0 in range(0, T, BLOCK_T):
        ids = _top_k_block(logits_ptr, t0 + tl.arange(0, BLOCK_T), T, ids_ptr, gates_ptr, E, E_P2, K, K_P2, BLOCK_T)
        counts += tl.histogram(tl.reshape(ids, [BLOCK_T * K_P2]), BINS)
    e = tl.arange(0, BINS)
    starts = tl.cumsum(counts, 0) - counts
    P = T * K
    tl.store(starts_ptr + e, tl.where(e < E, starts, P), mask=e <= E)
    tl.store(fill_ptr + e, starts, mask=e < E)
    tl.debug_barrier()  # the ids and the counters' start values, visible to every thread of the program
    for p0 in range(0, P, 1024):
        offs = p0 + tl.arange(0, 1024)
        mask = offs < P
        ids = tl.load(ids_ptr + offs, mask=mask, other=0)
        tl.store(order_ptr + tl.atomic_add(fill_ptr + ids, 1, mask=mask, sem="relaxed"), offs, mask=mask)


@triton.jit
def _top_k_count_kernel(logits_ptr, T, ids_ptr, gates_ptr, counts_ptr, E: tl.constexpr, E_P2: tl.constexpr,
                        K: tl.constexpr, K_P2: tl.constexpr, BINS: tl.constexpr, BLOCK_T: tl.constexpr):
    """Long prefills' routing, first pass (a program a block of tokens): _top_k_block, and each expert's pairs
    counted into counts (zero before)."""
    ids = _top_k_block(logits_ptr, tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T), T, ids_ptr, gates_ptr, E,
                       E_P2, K, K_P2, BLOCK_T)
    e = tl.arange(0, BINS)
    tl.atomic_add(counts_ptr + e, tl.histogram(tl.reshape(ids, [BLOCK_T * K_P2]), BINS), mask=e < E, sem="relaxed")


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, fill_ptr, starts_ptr, order_ptr, P, E: tl.constexpr, BINS: tl.constexpr,
                  BLOCK_P: tl.constexpr):
    """Second pass (a program a block of pairs): where each expert's run starts (from the counts), and each pair
    placed in its expert's run by an atomic counter an expert (fill: zero before)."""
    e = tl.arange(0, BINS)
    counts = tl.load(counts_ptr + e, mask=e < E, other=0)
    starts = tl.cumsum(counts, 0) - counts
    if tl.program_id(0) == 0:
        tl.store(starts_ptr + e, tl.where(e < E, starts, P), mask=e <= E)
    offs = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask = offs < P
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    run_start = tl.gather(starts, ids, 0)
    tl.store(order_ptr + run_start + tl.atomic_add(fill_ptr + ids, 1, mask=mask, sem="relaxed"), offs, mask=mask)


ONE_PROGRAM_PAIRS = 4096  # up to this many pairs (decode steps) one program routes and groups them; more: two passes
ROUTE_BLOCK_T = 64  # tokens a program of the first pass


def route_and_group(logits: torch.Tensor, top_k: int, dtype: torch.dtype, valid: torch.Tensor | None = None):
    """Router logits [T, E] -> (each token's top_k expert weights [T, k] in dtype, the (token, slot) pairs grouped
    by expert: pair indices (token * k + slot) in that order, and where each expert's run starts ([E + 1], the
    last is the pair count)). On the device, no sync. valid: a device int32 [1], the count of leading tokens to
    route (_valid_tokens; up to ONE_PROGRAM_PAIRS pairs: past that every token is routed)."""
    r = _route_and_group(logits, top_k, dtype, valid)
    return r.gates, r.order, r.starts


def _route_and_group(logits: torch.Tensor, top_k: int, dtype: torch.dtype,
                     valid: torch.Tensor | None = None) -> "_Routing":
    t, n_experts = logits.shape
    pairs = t * top_k
    r = _Routing.empty(t, n_experts, top_k, dtype, logits.device)
    if pairs <= ONE_PROGRAM_PAIRS:
        _route_kernel[(1,)](logits, t, *r, **_route_constants(t, n_experts, top_k), **_valid_args(valid), num_warps=4)
        return r
    counters = torch.zeros(2, n_experts, dtype=torch.int32, device=logits.device)  # (counts, fill)
    constants = _route_constants(ROUTE_BLOCK_T, n_experts, top_k)
    _top_k_count_kernel[(triton.cdiv(t, ROUTE_BLOCK_T),)](logits, t, r.ids, r.gates, counters[0], **constants,
                                                          num_warps=4)
    _place_kernel[(triton.cdiv(pairs, 1024),)](r.ids, counters[0], counters[1], r.starts, r.order, pairs, E=n_experts,
                                               BINS=constants["BINS"], BLOCK_P=1024, num_warps=4)
    return r


class _Routing(NamedTuple):
    """_route's outputs and scratch, in its arguments' order."""
    ids: torch.Tensor  # [T * k] int32: each pair's expert
    gates: torch.Tensor  # [T, k]
    starts: torch.Tensor  # [E + 1] int32
    fill: torch.Tensor  # [E] int32 (scratch)
    order: torch.Tensor  # [T * k] int32: pair indices grouped by expert

    @classmethod
    def empty(cls, t: int, n_experts: int, top_k: int, dtype: torch.dtype, dev) -> "_Routing":
        ids, order = (torch.empty(t * top_k, dtype=torch.int32, device=dev) for _ in range(2))
        starts, fill = (torch.empty(n, dtype=torch.int32, device=dev) for n in (n_experts + 1, n_experts))
        return cls(ids, torch.empty(t, top_k, dtype=dtype, device=dev), starts, fill, order)


def _route_constants(t: int, n_experts: int, top_k: int) -> dict:
    return dict(E=n_experts, E_P2=triton.next_power_of_2(n_experts), K=top_k, K_P2=triton.next_power_of_2(top_k),
                BINS=triton.next_power_of_2(n_experts + 1), BLOCK_T=min(64, max(16, triton.next_power_of_2(t))))


ROUTER_KERNEL_TOKENS = 16  # up to here the router's logits come from _router_kernel (and it routes them), else cuBLAS


def _router_kernel_takes(x: torch.Tensor) -> bool:
    return x.shape[0] <= ROUTER_KERNEL_TOKENS and x.stride(1) == 1


def route_experts(x: torch.Tensor, router, top_k: int,
                  valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """route_and_group(router_logits(x, ...), top_k, x.dtype, valid)'s result; up to ROUTER_KERNEL_TOKENS tokens in
    one launch (the router kernel's last program routes)."""
    r = _routing(x, router, top_k, valid)
    return r.gates, r.order, r.starts


def _routing(x: torch.Tensor, router, top_k: int, valid: torch.Tensor | None = None) -> "_Routing":
    """route_experts' routing, with each pair's expert (ids)."""
    if not _router_kernel_takes(x) or x.shape[0] * top_k > ONE_PROGRAM_PAIRS:
        return _route_and_group(router_logits(x, router.weight, router.bias), top_k, x.dtype, valid)
    return _route_in_router_kernel(x, router, top_k, _Routing.empty(x.shape[0], router.weight.shape[0], top_k,
                                                                    x.dtype, x.device), valid=valid)


def top_experts_of_one(x: torch.Tensor, router, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's top_k experts best first [top_k] int32 and their weights [1, top_k] (text.top_experts' values),
    in one launch (the router kernel's last program ranks the logits; no grouping: each is a pair of its own)."""
    assert _router_kernel_takes(x) and x.shape[0] == 1
    r = _route_in_router_kernel(x, router, top_k, _Routing.empty(1, router.weight.shape[0], top_k, x.dtype, x.device),
                                ranked=True)
    return r.ids, r.gates


def _route_in_router_kernel(x: torch.Tensor, router, top_k: int, r: "_Routing", ranked: bool = False,
                            valid: torch.Tensor | None = None) -> "_Routing":
    t, d = x.shape
    n_experts = router.weight.shape[0]
    logits = torch.empty(t, n_experts, device=x.device, dtype=x.dtype)
    route = _route_constants(t, n_experts, top_k)
    _router_kernel[(n_experts,)](x, x.stride(0), router.weight, router.bias, logits, t, d, n_experts,
                                 **_router_tiles(t, d), ROUTE=2 if ranked else 1, done_ptr=_done_counter(x),
                                 ids_ptr=r.ids, gates_ptr=r.gates, starts_ptr=r.starts, fill_ptr=r.fill,
                                 order_ptr=r.order, E_P2=route["E_P2"], TOP_K=top_k, K_P2=route["K_P2"],
                                 BINS=route["BINS"], ROUTE_BLOCK_T=route["BLOCK_T"], **_valid_args(valid))
    return r


def _valid_args(valid: torch.Tensor | None) -> dict:
    return dict(valid_ptr=valid, VALID=valid is not None)


def _done_counter(x: torch.Tensor) -> torch.Tensor:
    """The router kernel's count of its finished programs, zero between launches (the last program resets it): one
    for each stream, on which launches run one after another (a CUDA graph uses the one of the stream it was
    captured on, and replays one at a time)."""
    return _counter(x.device, torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0)


@functools.lru_cache
def _counter(device: torch.device, stream: int) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def _router_tiles(t: int, d: int) -> dict:
    """For a few tokens each program reads its expert's whole row in one pass (512-wide chunks before; H100, with the
    routing in the same launch and tau's positions once a step: Moondream 3's one-token step 1.469 against 1.542 ms,
    h100_2026-11-26_ab_router_routes.json, in the git history); tiles of at most 8192 values."""
    block_t = max(2, triton.next_power_of_2(t))
    return dict(BLOCK_T=block_t, BLOCK_K=min(triton.next_power_of_2(d), max(256, 8192 // block_t)), num_warps=4)


def _tiles(tokens: int, dtype: torch.dtype, scaled: bool = False) -> tuple[dict, dict]:
    """Tile sizes of the up and down kernels: few tokens (decode) want many small programs to keep the memory
    system busy reading the experts; many (prefill) want large tiles for the tensor cores (in bf16: float32's
    would not fit the shared memory of every GPU). benchmarks/experiments/tune_moe.py compares others."""
    if tokens == 1 and dtype != torch.float32:
        return ONE_TOKEN_TILES
    if tokens <= 16 and scaled and dtype != torch.float32:
        return FP8_FEW_TOKEN_TILES
    if tokens <= 16:
        small = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4)
        return small, small
    if dtype == torch.float32:
        medium = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4)
        return medium, medium
    if tokens <= DECODE_ROWS:
        return DECODE_TILES
    return PREFILL_TILES


# One token (H100, tune_moe.py --one-token: tiles swept inside the whole decode step, where the expert kernels share
# the GPU with the attention's on the other stream; step 1.540 against 1.598 ms with the 16-token tiles). Tiles
# that were faster for the MLP alone made the step slower (1.705 ms).
ONE_TOKEN_TILES = (dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=2, num_stages=2),
                   dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=2, num_stages=3))


# FP8 experts, 2 to 16 tokens: twice as deep as bf16's tiles (a 128-deep chunk of FP8 is 128 bytes a row, as 64 of
# bf16), more stages (H100, ab_code.py --model moondream3 --fp8-experts: steps of 2 / 8 / 16 rows 10 to 17% faster)
FP8_FEW_TOKEN_TILES = (dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=3),
                       dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4))


# Deeper K tiles for a decode step of many rows (H100, tune_moe.py --decode, 64 tokens: the expert MLP 0.325 against
# 0.346 ms with the up kernel's, 0.343 with the down kernel's; at 16 tokens within 2%)
DECODE_TILES = (dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4),
                dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=4))


DECODE_ROWS = 128  # steps of up to this many tokens take DECODE_TILES

PREFILL_TILES = (dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8),
                 dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8))


# From here on (prefills of 512 tokens and more) the grouped GEMM path; H100, tune_moe.py, the MLP of 5,936 tokens
# 1.395 against 2.946 ms, of 1,484 0.570 against 0.882, of 742 0.480 against 0.493, equal at 512.
GROUPED_GEMM_PAIRS = 4096


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight, bias): for a few tokens one program an expert, else cuBLAS."""
    t, d = x.shape
    if not _router_kernel_takes(x):
        return F.linear(x, weight, bias)
    out = torch.empty(t, weight.shape[0], device=x.device, dtype=x.dtype)
    _router_kernel[(weight.shape[0],)](x, x.stride(0), weight, bias, out, t, d, weight.shape[0], **_router_tiles(t, d),
                                       ROUTE=0, done_ptr=out, ids_ptr=out, gates_ptr=out, starts_ptr=out,
                                       fill_ptr=out, order_ptr=out, E_P2=1, TOP_K=1, K_P2=1, BINS=1, ROUTE_BLOCK_T=1)
    return out


def gated_gelu(h: torch.Tensor) -> torch.Tensor:
    """[P, 2I] rows [h | g] -> gelu(h) * (g + 1), [P, I]."""
    p, inner = h.shape[0], h.shape[1] // 2
    act = torch.empty(p, inner, device=h.device, dtype=h.dtype)
    _gated_gelu_kernel[(triton.cdiv(p, 16), triton.cdiv(inner, 256))](h, act, p, I=inner, BLOCK_P=16, BLOCK_I=256,
                                                                     num_warps=4)
    return act


def gated_gelu_fp8(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gated_gelu(h) as FP8 rows and their float32 scales [P]."""
    p, inner = h.shape[0], h.shape[1] // 2
    act = torch.empty(p, inner, device=h.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(p, device=h.device, dtype=torch.float32)
    _gated_gelu_fp8_kernel[(triton.cdiv(p, 4),)](h, act, scale, p, I=inner, I_P2=triton.next_power_of_2(inner),
                                                 BLOCK_P=4, num_warps=4)
    return act, scale


def gathered_fp8_rows(x: torch.Tensor, order: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows of the pairs in this order (a token's row once for each of its pairs) as FP8 rows and their float32
    scales."""
    p, d = order.numel(), x.shape[1]
    out = torch.empty(p, d, device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(p, device=x.device, dtype=torch.float32)
    _gather_fp8_kernel[(triton.cdiv(p, 2),)](x, x.stride(0), order, out, scale, p, K=d,
                                             K_P2=triton.next_power_of_2(d), TOP_K=top_k, BLOCK_P=2, num_warps=4)
    return out, scale


def combine_rows(y: torch.Tensor, where: torch.Tensor, gates: torch.Tensor, dtype: torch.dtype,
                 into: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's k rows of y (at where[t * k + j]) weighted by its gates [T, k] and summed -> [T, N]; or added
    to `into` with bias, in place."""
    t, top_k = gates.shape
    n = y.shape[1]
    out = torch.empty(t, n, device=y.device, dtype=dtype) if into is None else into
    _combine_kernel[(t, triton.cdiv(n, 512))](y, where, gates, out, out if bias is None else bias, N=n, TOP_K=top_k,
                                              BLOCK_N=512, ADD=into is not None, num_warps=4)
    return out


def widened(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Experts' weights [E, rows, cols] in dtype: FP8 ones times their row scales [E, rows] (float32 products)."""
    if scale is None:
        return weight
    out = torch.empty(weight.shape, device=weight.device, dtype=dtype)
    rows, cols = weight.shape[0] * weight.shape[1], weight.shape[2]
    _widen_rows_kernel[(rows, triton.cdiv(cols, 1024))](weight, scale, out, COLS=cols, BLOCK=1024, num_warps=4)
    return out


def experts_for(moe: MoE, tokens: int) -> tuple:
    """(fc1, fc1_scale, fc2, fc2_scale) a step of this many tokens reads: with widened copies kept beside FP8 experts
    (KESTREL_FP8_EXPERTS=both), the FP8 ones in steps of up to DECODE_ROWS tokens (decode steps, short prefills; one
    token's as GEMVs), where reading half the bytes pays; longer prefills (tensor-core bound) read the widened ones."""
    fp8_pays = 1 < tokens <= DECODE_ROWS or _gemv_takes(tokens, True, moe.fc1.shape[2], moe.fc1.shape[1] // 2)
    if moe.fc1_wide is not None and not fp8_pays:
        return moe.fc1_wide, None, moe.fc2_wide, None
    return moe.fc1, moe.fc1_scale, moe.fc2, moe.fc2_scale


def _moe_mlp_grouped(x: torch.Tensor, r: "_Routing", moe: MoE, into: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, lora: ExpertLora | None = None) -> torch.Tensor:
    """The expert MLP with torch's grouped GEMM over the pairs in expert order (r.starts[e + 1]: where expert e's
    rows end); with `into`, added to it with bias, in place. lora: the adapters' deltas onto fc1's output before the
    gated GELU and onto fc2's before the routing weights (then in bf16, not W8A8: the activations' deltas need
    them unquantised)."""
    gates, order, ends, top_k = r.gates, r.order, r.starts[1:], moe.top_k
    where = torch.empty_like(order)
    where[order.long()] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    if lora is None and _w8a8_takes(x, moe):
        a, a_scale = gathered_fp8_rows(x, order, top_k)
        h = torch._scaled_grouped_mm(a, moe.fc1.transpose(1, 2), a_scale, moe.fc1_scale, offs=ends, out_dtype=x.dtype,
                                     use_fast_accum=W8A8_FAST_ACCUM)
        act, act_scale = gated_gelu_fp8(h)
        y = torch._scaled_grouped_mm(act, moe.fc2.transpose(1, 2), act_scale, moe.fc2_scale, offs=ends,
                                     out_dtype=x.dtype, use_fast_accum=W8A8_FAST_ACCUM)
    else:
        fc1, fc1_scale, fc2, fc2_scale = experts_for(moe, x.shape[0])
        fc1, fc2 = widened(fc1, fc1_scale, x.dtype), widened(fc2, fc2_scale, x.dtype)
        h = torch._grouped_mm(x.index_select(0, order // top_k), fc1.transpose(1, 2), offs=ends)
        if lora is not None:  # (h's and y's rows are in expert order)
            pair_delta(x, lora.up_a, lora.up_bt, lora, h, order.numel(), top_k, r.ids, order, r.starts[-1:],
                       dst_by_pair=False)
        act = gated_gelu(h)
        y = torch._grouped_mm(act, fc2.transpose(1, 2), offs=ends)
        if lora is not None:
            pair_delta(act, lora.down_a, lora.down_bt, lora, y, order.numel(), top_k, r.ids, order, r.starts[-1:],
                       src_by_token=False, dst_by_pair=False)
    return combine_rows(y, where, gates, x.dtype, into, bias)


W8A8_PREFILL = True  # FP8 experts in long prefills: activations in FP8 too (a scale a row), FP8 tensor-core GEMMs
# Hopper's FP8 dots summed in the tensor cores' own precision, not promoted to float32 every few chunks: without it
# torch's kernel is slower than the bf16 one past 1,500 tokens (H100, 5,936 tokens 1.60 against 1.35 ms), with it
# 1.10; the error stays the activations' rounding (4.2e-2 either way, tune_moe.py --fp8)
W8A8_FAST_ACCUM = True


def _w8a8_takes(x: torch.Tensor, moe: MoE) -> bool:
    """torch's FP8 grouped GEMM with a scale a row runs on Hopper (sm90) only."""
    return (W8A8_PREFILL and moe.fc1_scale is not None and x.dtype == torch.bfloat16 and x.is_cuda
            and hasattr(torch, "_scaled_grouped_mm") and torch.cuda.get_device_capability(x.device) == (9, 0))


def _grouped_gemm_pays(x: torch.Tensor, pairs: int) -> bool:
    return (pairs >= GROUPED_GEMM_PAIRS and x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


def add_moe_mlp(out: torch.Tensor, x: torch.Tensor, moe: MoE, bias: torch.Tensor,
                valid: torch.Tensor | None = None) -> None:
    """out += bias + the expert MLP of x, in place (in long prefills inside the kernel that sums each token's rows).
    valid: a device int32 [1], the count of leading rows that matter (a prefill graph's real rows): on the expert
    kernels' path only those are routed (route_and_group), the rows past them come out as anything; the grouped
    GEMM's path (long prefills: a few padded rows among hundreds) takes every row's pairs."""
    if not _grouped_gemm_pays(x, x.shape[0] * moe.top_k):
        out.add_(moe_mlp_cuda(x, moe, valid=valid)).add_(bias)
        return
    _moe_mlp_grouped(x, _routing(x, moe.router, moe.top_k), moe, out, bias)


def moe_mlp_cuda(x: torch.Tensor, moe: MoE, summed: bool = True, valid: torch.Tensor | None = None,
                 lora: ExpertLora | None = None) -> torch.Tensor:
    """[T, dim] -> [T, dim]: text.moe_mlp's result, computed as grouped work over the experts. summed=False: each
    token's top_k weighted expert rows instead, [T * top_k, dim] float32 (residual_norm sums them). valid: as
    add_moe_mlp's. lora: each row's adapter's deltas of its experts (moe_lora)."""
    t, top_k = x.shape[0], moe.top_k
    fc1, fc1_scale, fc2, fc2_scale = experts_for(moe, t)
    if _gemv_takes(t, fc1_scale is not None, x.shape[1], fc1.shape[1] // 2) and _router_kernel_takes(x):
        out = _moe_gemv(x, fc1, fc1_scale, fc2, fc2_scale, *top_experts_of_one(x, moe.router, top_k), lora)
        return out.sum(0, keepdim=True).to(x.dtype) if summed else out
    grouped = summed and _grouped_gemm_pays(x, t * top_k)
    r = _routing(x, moe.router, top_k, None if grouped else valid)
    if grouped:
        return _moe_mlp_grouped(x, r, moe, lora=lora)
    return _moe_mlp_routed(x, moe, r, summed, lora)


def _moe_mlp_routed(x: torch.Tensor, moe: MoE, r: "_Routing", summed: bool = True,
                    lora: ExpertLora | None = None) -> torch.Tensor:
    """moe_mlp_cuda on the expert kernels, the tokens already routed."""
    t, d = x.shape
    top_k = moe.top_k
    n_experts, inner = moe.fc1.shape[0], moe.fc1.shape[1] // 2
    pairs = t * top_k
    fc1, fc1_scale, fc2, fc2_scale = experts_for(moe, t)
    scaled = fc1_scale is not None
    assert x.stride(1) == 1
    act = torch.empty(pairs, inner, device=x.device, dtype=x.dtype)
    out = torch.empty(pairs, d, device=x.device, dtype=torch.float32)
    delta = _up_deltas(x, lora, pairs, top_k, r.ids)
    up, down = _tiles(t, x.dtype, scaled)
    assert d % up["BLOCK_K"] == 0 and inner % down["BLOCK_K"] == 0
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # (float32: exact products, as the torch path)
    _moe_up_kernel[(n_experts, triton.cdiv(inner, up["BLOCK_N"]))](
        x, x.stride(0), fc1, fc1_scale if scaled else fc1, r.order, r.starts, act, delta if delta is not None else act,
        K=d, I=inner, TOP_K=top_k, PRECISION=precision, SCALED=scaled, DELTA=delta is not None, **up)
    _moe_down_kernel[(n_experts, triton.cdiv(d, down["BLOCK_N"]))](
        act, fc2, fc2_scale if scaled else fc2, r.order, r.starts, r.gates.reshape(-1), out, N=d, I=inner,
        PRECISION=precision, SCALED=scaled, **down)
    if lora is not None:  # fc2's deltas times the routing weight onto the pairs' rows (act's rows are in expert order)
        pair_delta(act, lora.down_a, lora.down_bt, lora, out, pairs, top_k, r.ids, r.order, r.starts[-1:],
                   src_by_token=False, gates=r.gates.reshape(-1))
    return out.view(t, top_k, d).sum(1).to(x.dtype) if summed else out


def _up_deltas(x: torch.Tensor, lora: ExpertLora | None, pairs: int, top_k: int, ids: torch.Tensor):
    """The adapters' fc1 deltas of the pairs [pairs, 2I] float32, in pair order, for the up kernels to add before
    their gated GELU (None without adapters)."""
    if lora is None:
        return None
    delta = torch.empty(pairs, lora.up_bt.shape[-1], device=x.device, dtype=torch.float32)
    pair_delta(x, lora.up_a, lora.up_bt, lora, delta, pairs, top_k, ids, accumulate=False)
    return delta


# One token's FP8 experts as GEMVs (_moe_gemv_up_kernel): a program a pair and BLOCK_N inner or output columns. H100
# (h100_2026-11-27_moe_fp8_one_token_gemv.json in the git history, seven tiles swept inside the whole step): the MLP
# 33 against 69 us a layer on the 16-row tiles, the one-row step 1.229 against 1.818 ms; 16 x 256 tiles gave the MLP
# alone 26.5 us but the step 1.246 (the MLP shares the GPU with the attention's kernels on the other stream).
GEMV_TILES = (dict(BLOCK_N=32, BLOCK_K=128, num_warps=4), dict(BLOCK_N=32, BLOCK_K=128, num_warps=4))
ONE_TOKEN_FP8_GEMV = True  # (False: one-token steps take the tile kernels, as before; for A/B runs)


def _gemv_takes(tokens: int, scaled: bool, dim: int, inner: int) -> bool:
    up, down = GEMV_TILES
    return (ONE_TOKEN_FP8_GEMV and tokens == 1 and scaled and inner % up["BLOCK_N"] == 0
            and dim % up["BLOCK_K"] == 0 and dim % down["BLOCK_N"] == 0 and inner % down["BLOCK_K"] == 0)


def _moe_gemv(x, fc1, fc1_scale, fc2, fc2_scale, ids, gates, lora: ExpertLora | None = None) -> torch.Tensor:
    """One token's expert MLP over its FP8 experts (ids [k] best first, their weights: top_experts_of_one) -> [k,
    dim] float32, each slot's row times its weight; lora: its adapter's deltas (moe_lora)."""
    inner, d, top_k = fc1.shape[1] // 2, fc1.shape[2], ids.numel()
    act = torch.empty(top_k, inner, device=x.device, dtype=x.dtype)
    out = torch.empty(top_k, d, device=x.device, dtype=torch.float32)
    delta = _up_deltas(x, lora, top_k, top_k, ids)
    up, down = GEMV_TILES
    _moe_gemv_up_kernel[(top_k, inner // up["BLOCK_N"])](x, fc1, fc1_scale, ids, act,
                                                         delta if delta is not None else act, K=d, I=inner,
                                                         DELTA=delta is not None, **up)
    _moe_gemv_down_kernel[(top_k, d // down["BLOCK_N"])](act, fc2, fc2_scale, ids, gates, out, N=d, I=inner, **down)
    if lora is not None:
        pair_delta(act, lora.down_a, lora.down_bt, lora, out, top_k, top_k, ids, src_by_token=False,
                   gates=gates.reshape(-1))
    return out


class MoE(Protocol):
    router: Any  # a Linear: .weight [E, dim], .bias [E]
    fc1: torch.Tensor  # [E, 2 * inner, dim]
    fc2: torch.Tensor  # [E, dim, inner]
    top_k: int
    fc1_scale: torch.Tensor | None  # FP8 experts' row scales
    fc2_scale: torch.Tensor | None
    fc1_wide: torch.Tensor | None  # the same experts widened (KESTREL_FP8_EXPERTS=both)
    fc2_wide: torch.Tensor | None
