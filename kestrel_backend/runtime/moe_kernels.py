"""Moondream 3's expert MLPs on the GPU as grouped work, with no host sync (so decode steps replay as CUDA graphs).

Each token's top-k (token, expert) pairs are sorted by expert on the device; a program of `_moe_up_kernel` takes
one expert and one block of its inner columns and runs every pair routed to that expert through fc1 (16 rows a
tile, tensor-core dots), reading the expert's weights once however many tokens chose it, then applies
gelu(h) * (g + 1). `_moe_down_kernel` does the same through fc2 and scales each row by its routing weight; the k
rows of a token are summed in float32 at the end. Experts no token chose cost one program that returns at once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M = 16  # pair rows a tile (tl.dot's smallest)
BLOCK_K = 64


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


def route(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor, top_k: int):
    """Each token's top-k experts by router logit and their weights (softmax over those k, in x's dtype as the
    reference rounds them) -> (expert ids [T, k], weights [T, k])."""
    top_logits, top_ids = torch.topk(F.linear(x, router_weight, router_bias), top_k, dim=-1)
    return top_ids, torch.softmax(top_logits, dim=-1, dtype=torch.float32).to(x.dtype)


def expert_segments(top_ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs sorted by expert: pair indices (token * k + slot) in that order, and where each
    expert's run starts ([E + 1], the last is the pair count). On the device, no sync."""
    flat = top_ids.reshape(-1)
    order = torch.argsort(flat, stable=True).to(torch.int32)
    counts = torch.zeros(n_experts + 1, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat + 1, torch.ones_like(flat, dtype=torch.int32))
    return order, counts.cumsum(0, dtype=torch.int32)


def moe_mlp_cuda(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor, fc1: torch.Tensor,
                 fc2: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T, dim] -> [T, dim]: text.moe_mlp's result, computed as grouped work over the experts."""
    t, d = x.shape
    n_experts, inner = fc1.shape[0], fc1.shape[1] // 2
    assert d % BLOCK_K == 0 and inner % BLOCK_K == 0 and x.stride(1) == 1
    top_ids, gates = route(x, router_weight, router_bias, top_k)
    order, starts = expert_segments(top_ids, n_experts)
    pairs = t * top_k
    act = torch.empty(pairs, inner, device=x.device, dtype=x.dtype)
    out = torch.empty(pairs, d, device=x.device, dtype=torch.float32)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # (float32: exact products, as the torch path)
    block_n = 32 if t <= 16 else 64  # few tokens: more, smaller programs to keep the GPU's memory system busy
    _moe_up_kernel[(n_experts, triton.cdiv(inner, block_n))](
        x, x.stride(0), fc1, order, starts, act, K=d, I=inner, TOP_K=top_k, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=BLOCK_K, PRECISION=precision, num_warps=4)
    _moe_down_kernel[(n_experts, triton.cdiv(d, block_n))](
        act, fc2, order, starts, gates.reshape(-1), out, N=d, I=inner, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=BLOCK_K, PRECISION=precision, num_warps=4)
    return out.view(t, top_k, d).sum(1).to(x.dtype)
