"""LoRA deltas of Moondream 3's adapters on the GPU, rows of different adapters (and of none) in one launch, with no
host sync (decode steps replay as CUDA graphs).

The unit of work is a pair: a row of the forward and one expert it goes to (a dense MLP is one expert that every
row takes). One program of `_pair_delta_kernel` takes one pair and one block of output columns: it reads the row's
slot in the pool, shrinks the pair's input through the slot's A of that expert (rank-many dot products, on the CUDA
cores: a pair's A is its own, so there is no tile to share) and expands through its B (stored transposed, rank-major,
so the loads run along the output columns), then writes the delta or adds it in place, times the routing weight
where the caller asks. Loads past a slot's own rank are masked off (a pool of rank R costs a rank-r adapter r's
reads, slot 0 none). The shrunk values are rounded to the activations' type, as a bf16 matmul would.

Where the delta must land inside a kernel (fc1's, before the expert kernels' gated GELU) it is written to a buffer
in pair order that those kernels add (`moe_kernels`: `delta` of the up kernels); elsewhere it is added onto the
output rows in place. Rows kept in the expert kernels' order (their activations, the grouped GEMM's outputs) are
taken in that order, up to the count of pairs the routing filled (a prefill graph routes only its real rows).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class ExpertLora(NamedTuple):
    """One layer's adapters as the kernels read them: A [slots, E, R, in] and B transposed [slots, E, R, out] of the
    up (fc1) and down (fc2) projections, each slot's rank [slots] int32 (0 for slot 0), and each row's slot [T]."""
    up_a: torch.Tensor
    up_bt: torch.Tensor
    down_a: torch.Tensor
    down_bt: torch.Tensor
    ranks: torch.Tensor
    row_slots: torch.Tensor



@triton.jit
def _pair_delta_kernel(src_ptr, src_stride, order_ptr, count_ptr, ids_ptr, row_slots_ptr, ranks_ptr, a_ptr, bt_ptr,
                       dst_ptr, dst_stride, gates_ptr, TOP_K: tl.constexpr, E: tl.constexpr, K: tl.constexpr,
                       N: tl.constexpr, R: tl.constexpr, ORDERED: tl.constexpr, SRC_BY_TOKEN: tl.constexpr,
                       DST_BY_PAIR: tl.constexpr, GATED: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    q, nb = tl.program_id(0), tl.program_id(1)
    if ORDERED:  # (an order of fewer rows than programs: those past its count, count_ptr's, do nothing)
        live = q < tl.load(count_ptr)
        # the pair (token * TOP_K + slot) this program's row q holds (0 past the count, where order is anything)
        p = tl.where(live, tl.load(order_ptr + tl.where(live, q, 0)), 0)
    else:
        live = q >= 0
        p = q
    slot = tl.load(row_slots_ptr + p // TOP_K)
    rank = tl.where(live, tl.load(ranks_ptr + slot), 0)
    if E > 1:  # (clamped: the expert ids of rows a caller leaves unrouted are anything)
        e = tl.minimum(tl.maximum(tl.load(ids_ptr + p), 0), E - 1)
    else:
        e = 0
    src_row = p // TOP_K if SRC_BY_TOKEN else q
    dst_row = p if DST_BY_PAIR else q
    offs_r = tl.arange(0, R)
    r_mask = offs_r < rank
    base = slot.to(tl.int64) * E + e
    u = tl.zeros((R,), dtype=tl.float32)
    k_end = tl.where(rank > 0, K, 0)  # (a row without an adapter reads nothing)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        xs = tl.load(src_ptr + src_row.to(tl.int64) * src_stride + offs_k, mask=k_mask, other=0.0)
        a = tl.load(a_ptr + base * (R * K) + offs_r[:, None] * K + offs_k[None, :],
                    mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        u += tl.sum(a.to(tl.float32) * xs.to(tl.float32)[None, :], 1)
    u = u.to(dst_ptr.dtype.element_ty).to(tl.float32)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < tl.where(live, N, 0)  # (a row past the order's count writes nothing)
    bt = tl.load(bt_ptr + base * (R * N) + offs_r[:, None] * N + offs_n[None, :],
                 mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    delta = tl.sum(bt.to(tl.float32) * u[:, None], 0)
    if GATED:
        delta *= tl.load(gates_ptr + p).to(tl.float32)
    dst = dst_ptr + dst_row.to(tl.int64) * dst_stride + offs_n
    if ACCUMULATE:
        delta += tl.load(dst, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(dst, delta.to(dst_ptr.dtype.element_ty), mask=n_mask)


def pair_delta(src: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, lora: ExpertLora, dst: torch.Tensor,
               rows: int, top_k: int = 1, ids: torch.Tensor | None = None, order: torch.Tensor | None = None,
               count: torch.Tensor | None = None, src_by_token: bool = True, dst_by_pair: bool = True,
               gates: torch.Tensor | None = None, accumulate: bool = True) -> None:
    """For each of `rows` rows q, holding pair p = order[q] (or q without an order: token p // top_k and expert
    ids[p], the one expert without ids): the delta `src[row] @ A^T @ B^T` of the token's adapter and that expert,
    times gates[p] if given, added to dst's row (accumulate) or written there. src's row: the token's
    (src_by_token) or q; dst's: p (dst_by_pair) or q. count: with an order, a device int32 holding how many of its
    rows are filled (a routing of only a prefill graph's real rows fills fewer than `rows`)."""
    if rows == 0:
        return
    n_experts, rank_cap, k = a.shape[1], a.shape[2], a.shape[3]
    n = bt.shape[3]
    assert (order is None) == (count is None)
    assert src.stride(-1) == 1 and dst.stride(-1) == 1 and src.shape[-1] == k and dst.shape[-1] == n
    block_n = min(triton.next_power_of_2(n), 1024)
    _pair_delta_kernel[(rows, triton.cdiv(n, block_n))](
        src, src.stride(0), *(t if t is not None else lora.row_slots for t in (order, count, ids)),  # (unread if None)
        lora.row_slots, lora.ranks, a, bt, dst, dst.stride(0), gates if gates is not None else dst, TOP_K=top_k,
        E=n_experts, K=k, N=n, R=rank_cap, ORDERED=order is not None, SRC_BY_TOKEN=src_by_token,
        DST_BY_PAIR=dst_by_pair, GATED=gates is not None, ACCUMULATE=accumulate,
        # (shrink tiles of 8,192 values: a one-row step's serial K loop is its cost; H100, +20% against +33% at 2,048)
        BLOCK_K=min(triton.next_power_of_2(k), max(64, 8192 // rank_cap)), BLOCK_N=block_n, num_warps=8)
