"""Moondream 3's expert MLPs on the GPU as grouped work, with no host sync (so decode steps replay as CUDA graphs).

Each token's top-k (token, expert) pairs are grouped by expert on the device; a program of `_moe_up_kernel` takes
one expert and one block of its inner columns and runs every pair routed to that expert through fc1 (tiles of 16
rows in decode steps, 128 in prefill; tensor-core dots), reading the expert's weights once a tile, then applies
gelu(h) * (g + 1). `_moe_down_kernel` does the same through fc2 and scales each row by its routing weight; the k
rows of a token are summed in float32 at the end. Experts no token chose cost one program that returns at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..model.text import route_tokens



@triton.jit
def _pair_rows(order_ptr, r0, end, BLOCK_M: tl.constexpr):
    """Sorted pair rows r0.. of an expert's segment (which ends at end), which of them exist, their pair indices."""
    rows = r0 + tl.arange(0, BLOCK_M)
    mask = rows < end
    return rows, mask, tl.load(order_ptr + rows, mask=mask, other=0)


@triton.jit
def _moe_up_kernel(x_ptr, x_stride, w1_ptr, order_ptr, starts_ptr, act_ptr, K: tl.constexpr, I: tl.constexpr,
                   TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    e, nb = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(starts_ptr + e), tl.load(starts_ptr + e + 1)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    w_h = w1_ptr + e.to(tl.int64) * (2 * I * K) + offs_n[None, :] * K + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    w_g = w_h + I * K
    for r0 in range(start, end, BLOCK_M):
        rows, r_mask, pair = _pair_rows(order_ptr, r0, end, BLOCK_M)
        x_rows = x_ptr + (pair // TOP_K)[:, None].to(tl.int64) * x_stride + offs_k[None, :]
        acc_h = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xs = tl.load(x_rows + k0, mask=r_mask[:, None], other=0.0)
            acc_h = tl.dot(xs, tl.load(w_h + k0, mask=n_mask[None, :], other=0.0), acc_h, input_precision=PRECISION)
            acc_g = tl.dot(xs, tl.load(w_g + k0, mask=n_mask[None, :], other=0.0), acc_g, input_precision=PRECISION)
        act = 0.5 * acc_h * (1.0 + tl.math.erf(acc_h * 0.7071067811865476)) * (acc_g + 1.0)  # exact GELU
        tl.store(act_ptr + rows[:, None].to(tl.int64) * I + offs_n[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=r_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_down_kernel(act_ptr, w2_ptr, order_ptr, starts_ptr, gates_ptr, out_ptr, N: tl.constexpr, I: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
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
            acc = tl.dot(tl.load(a_rows + k0, mask=r_mask[:, None], other=0.0),
                         tl.load(w + k0, mask=n_mask[None, :], other=0.0), acc, input_precision=PRECISION)
        gate = tl.load(gates_ptr + pair, mask=r_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + pair[:, None].to(tl.int64) * N + offs_n[None, :], acc * gate[:, None],
                 mask=r_mask[:, None] & n_mask[None, :])


@triton.jit
def _segments_kernel(ids_ptr, P, starts_ptr, fill_ptr, order_ptr, E: tl.constexpr, BINS: tl.constexpr,
                     BLOCK: tl.constexpr):
    """One program: count the pairs of each expert, write where each expert's run starts, then place every pair in
    its expert's run (an atomic counter an expert; the order inside a run does not change any row's result)."""
    counts = tl.zeros([BINS], dtype=tl.int32)
    for p0 in range(0, P, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        counts += tl.histogram(tl.load(ids_ptr + offs, mask=offs < P, other=E), BINS)  # (padding: bin E)
    e = tl.arange(0, BINS)
    starts = tl.cumsum(counts, 0) - counts
    tl.store(starts_ptr + e, tl.where(e < E, starts, P), mask=e <= E)
    tl.store(fill_ptr + e, starts, mask=e < E)
    tl.debug_barrier()  # the counters' start values, visible to every thread of the program
    for p0 in range(0, P, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        mask = offs < P
        ids = tl.load(ids_ptr + offs, mask=mask, other=0)
        tl.store(order_ptr + tl.atomic_add(fill_ptr + ids, 1, mask=mask), offs, mask=mask)


ONE_PROGRAM_PAIRS = 4096  # up to this many pairs (decode steps) one program groups them; more (prefill): torch's sort


def expert_segments(top_ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs grouped by expert: pair indices (token * k + slot) in that order, and where each
    expert's run starts ([E + 1], the last is the pair count). On the device, no sync."""
    flat = top_ids.reshape(-1).to(torch.int32)
    pairs = flat.shape[0]
    if pairs > ONE_PROGRAM_PAIRS:
        counts = torch.zeros(n_experts + 1, dtype=torch.int32, device=flat.device)
        counts.scatter_add_(0, flat.long() + 1, torch.ones_like(flat))
        return torch.argsort(flat, stable=True).to(torch.int32), counts.cumsum(0, dtype=torch.int32)
    order = torch.empty(pairs, dtype=torch.int32, device=flat.device)
    starts = torch.empty(n_experts + 1, dtype=torch.int32, device=flat.device)
    fill = torch.empty(n_experts, dtype=torch.int32, device=flat.device)
    _segments_kernel[(1,)](flat, pairs, starts, fill, order, E=n_experts, BINS=triton.next_power_of_2(n_experts + 1),
                           BLOCK=1024, num_warps=4)
    return order, starts


def _tiles(tokens: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """Tile sizes of the up and down kernels: few tokens (decode) want many small programs to keep the memory
    system busy reading the experts; many (prefill) want large tiles for the tensor cores (in bf16: float32's
    would not fit the shared memory of every GPU). benchmarks/tune_moe.py compares others."""
    if tokens <= 16:
        small = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4)
        return small, small
    if dtype == torch.float32:
        medium = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, num_warps=4)
        return medium, medium
    if tokens <= 128:
        return DECODE_TILES
    return PREFILL_TILES


# Deeper K tiles for a decode step of many rows (H100, tune_moe.py --decode, 64 tokens: the expert MLP 0.325 against
# 0.346 ms with the up kernel's, 0.343 with the down kernel's; at 16 tokens within 2%)
DECODE_TILES = (dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4),
                dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=4))


PREFILL_TILES = (dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=8),
                 dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8))


def moe_mlp_cuda(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor, fc1: torch.Tensor,
                 fc2: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T, dim] -> [T, dim]: text.moe_mlp's result, computed as grouped work over the experts."""
    t, d = x.shape
    n_experts, inner = fc1.shape[0], fc1.shape[1] // 2
    up, down = _tiles(t, x.dtype)
    assert d % up["BLOCK_K"] == 0 and inner % down["BLOCK_K"] == 0 and x.stride(1) == 1
    top_ids, gates = route_tokens(x, router_weight, router_bias, top_k)
    order, starts = expert_segments(top_ids, n_experts)
    pairs = t * top_k
    act = torch.empty(pairs, inner, device=x.device, dtype=x.dtype)
    out = torch.empty(pairs, d, device=x.device, dtype=torch.float32)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # (float32: exact products, as the torch path)
    _moe_up_kernel[(n_experts, triton.cdiv(inner, up["BLOCK_N"]))](
        x, x.stride(0), fc1, order, starts, act, K=d, I=inner, TOP_K=top_k, PRECISION=precision, **up)
    _moe_down_kernel[(n_experts, triton.cdiv(d, down["BLOCK_N"]))](
        act, fc2, order, starts, gates.reshape(-1), out, N=d, I=inner, PRECISION=precision, **down)
    return out.view(t, top_k, d).sum(1).to(x.dtype)
