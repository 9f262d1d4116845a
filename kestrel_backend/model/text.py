"""Text decoder: parallel attention + MLP blocks, partial rotary embeddings, LM head. Moondream 3's blocks
add tau attention (q and v scaled per head) and mixture-of-experts MLPs past its first layers.

Attention is pluggable: the decoder hands each layer's q, k, v for a flat list of tokens to an
`Attention` object, which stores k/v in its cache and returns the attention output. The dense
single-sequence cache below is the plain reference; the engine's paged cache implements the same.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from .config import TextConfig
from .fp8 import fp8_block
from .layers import layer_norm, linear, mlp, mlp_hidden
from .lora import LoraRows, SlotRows
from ..kernels.dense import dense
from .weights import MoE, Tau, TextBlock, TextWeights


class Attention(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] for this step's tokens -> [T, H, D]."""


def rope_table(config: TextConfig, device=None) -> torch.Tensor:
    """cos/sin per position and frequency: [max_context, rope_dim/2, 2], float32."""
    half = config.rope_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.rope_dim, 2, dtype=torch.float32)[:half] / config.rope_dim))
    angles = torch.arange(config.max_context, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.stack([angles.cos(), angles.sin()], dim=-1).to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]: rotate the first rope_dim dims. Input halves are (real, imag); output interleaves them."""
    rot = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    real, imag = x_rot[..., : rot // 2], x_rot[..., rot // 2:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1).flatten(-2)
    return torch.cat([out.to(x.dtype), x_pass], dim=-1)


def tau_token_part(qkv: torch.Tensor, tau: Tau) -> torch.Tensor:
    """[T, 2H]: the token part of the q and v scales before its tanh, from the whole qkv projection (exact GELU)."""
    return F.gelu(qkv) @ tau.w.t()


def tau_scales(qkv: torch.Tensor, positions: torch.Tensor, tau: Tau) -> tuple[torch.Tensor, torch.Tensor]:
    """Moondream 3's per-token, per-head scales of q and v [T, H]: tanh of the token part plus a position part
    that grows with log(position + 1)."""
    heads = tau.alpha.shape[0]
    token = torch.tanh(tau_token_part(qkv, tau))
    by_position = 0.5 + torch.sigmoid(tau.alpha.float()[None, :] * torch.log1p(positions.float())[:, None])
    return (token[:, :heads] + by_position).to(qkv.dtype), (token[:, heads:] + by_position).to(qkv.dtype)


def apply_tau(qkv: torch.Tensor, positions: torch.Tensor, tau: Tau, config: TextConfig) -> torch.Tensor:
    """qkv with its q and v heads scaled by tau_scales (tau needs n_kv_heads == n_heads); in place on a GPU."""
    n, hd, heads = qkv.shape[0], config.head_dim, config.n_heads
    if qkv.is_cuda:
        from ..kernels.tau_cuda import tau_inplace

        tau_inplace(qkv, tau_token_part(qkv, tau), tau.alpha, positions, heads, hd)
        return qkv
    scale_q, scale_v = tau_scales(qkv, positions, tau)
    ones = torch.ones_like(scale_q)
    return (qkv.view(n, 3, heads, hd) * torch.stack([scale_q, ones, scale_v], dim=1)[..., None]).view(n, -1)


def route_tokens(x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor, top_k: int):
    """Each token's top-k experts by router logit and their weights (softmax over those k, in x's dtype as the
    reference rounds them) -> (expert ids [T, k], weights [T, k])."""
    return top_experts(F.linear(x, router_weight, router_bias), top_k, x.dtype)


def top_experts(logits: torch.Tensor, top_k: int, dtype: torch.dtype):
    """Router logits [T, E] -> (the top_k expert ids [T, k], best first; their softmax weights in dtype)."""
    top_logits, top_ids = torch.topk(logits, top_k, dim=-1)
    return top_ids, torch.softmax(top_logits, dim=-1, dtype=torch.float32).to(dtype)


def moe_mlp(x: torch.Tensor, moe: MoE, lora: LoraRows | SlotRows | None = None, layer: int = 0,
            valid: torch.Tensor | None = None) -> torch.Tensor:
    """[T, dim] -> [T, dim]: each token through its top-k experts, weighted by the softmax of their router
    logits. Experts run one after another over the tokens routed to them (on a GPU: grouped kernels, no sync).
    lora: the rows whose adapter adds its deltas of this layer's experts (before the GELU and before the weight).
    valid: as moe_kernels.add_moe_mlp's (a prefill graph's real rows)."""
    if x.is_cuda or isinstance(lora, SlotRows):  # (SlotRows are for the kernels: in the tests' CPU forms too)
        from ..kernels.moe_kernels import moe_mlp_cuda

        return moe_mlp_cuda(x, moe, valid=valid, lora=expert_lora(lora, layer, x))
    top_ids, weights = route_tokens(x, moe.router.weight, moe.router.bias, moe.top_k)
    out = torch.zeros_like(x)
    inner = moe.fc2.shape[-1]
    for expert in torch.unique(top_ids).tolist():
        rows, slot = (top_ids == expert).nonzero(as_tuple=True)
        fc1, fc2 = moe.expert(expert, x.dtype)
        h = F.linear(x[rows], fc1)
        if lora is not None:
            lora.add_expert(h, x[rows], rows, layer, "experts_up", expert)
        h, g = h.split(inner, dim=-1)
        a = F.gelu(h) * (g + 1.0)
        y = F.linear(a, fc2)
        if lora is not None:
            lora.add_expert(y, a, rows, layer, "experts_down", expert)
        out.index_add_(0, rows, y * weights[rows, slot, None])
    return out


def expert_lora(lora: LoraRows | SlotRows | None, layer: int, x: torch.Tensor):
    """The GPU kernels' view of the rows' adapters in this layer (moe_lora.ExpertLora), or None."""
    if lora is None or lora.pool is None:
        return None
    return lora.pool.layer(layer, lora.row_slots(x.shape[0], x.device))


def split_qkv_with_rope(qkv: torch.Tensor, cos, sin, config: TextConfig):
    """[T, q+k+v] -> q [T, H, D], k, v [T, Hkv, D] with q and k rotated."""
    n, hd = qkv.shape[0], config.head_dim
    q_dim, kv_dim = config.n_heads * hd, config.n_kv_heads * hd
    if qkv.is_cuda:
        from ..kernels.rope_cuda import rope_qk_inplace

        rope_qk_inplace(qkv, cos, sin, config.n_heads + config.n_kv_heads, hd)
        q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
        return q.view(n, config.n_heads, hd), k.view(n, config.n_kv_heads, hd), v.view(n, config.n_kv_heads, hd)
    q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
    q = apply_rope(q.view(n, config.n_heads, hd), cos, sin)
    k = apply_rope(k.view(n, config.n_kv_heads, hd), cos, sin)
    return q, k, v.view(n, config.n_kv_heads, hd)


FP8_MIN_ROWS = 256  # KESTREL_PREFILL_FP8 runs steps of at least this many tokens in FP8: shorter ones (decode) are
# bound by reading the weights, where FP8 matmuls save nothing, and keep bf16's accuracy


def quantize_prefill(w: TextWeights) -> None:
    """KESTREL_PREFILL_FP8: each dense block's qkv, fc1 and fc2 in e4m3 too (model/fp8.py), for the long steps (image
    prefills). MoE blocks stay as they are (their experts have KESTREL_FP8_EXPERTS); proj's input would need a
    quantising pass of its own, as in the vision encoder."""
    if any(not isinstance(block.qkv.weight, torch.Tensor) for block in w.blocks):
        raise ValueError("KESTREL_PREFILL_FP8=1 needs a model of bf16 weights, not 4-bit ones")
    w.fp8 = [None if block.moe is not None else fp8_block(block) for block in w.blocks]


def embed_tokens(ids: torch.Tensor, w: TextWeights) -> torch.Tensor:
    return F.embedding(ids, w.wte)


def decode(x: torch.Tensor, positions: torch.Tensor, w: TextWeights, config: TextConfig,
           rope: torch.Tensor, attention: Attention, lora: LoraRows | SlotRows | None = None) -> torch.Tensor:
    """Run all blocks over x [T, dim] (tokens of one or many sequences) -> hidden [T, dim]. lora: the rows
    that add an adapter's deltas, if any. An attention with valid_rows (a device int32 [1]: a prefill graph's) has
    only that many leading rows route to experts: its padded rows take none (moe_kernels.add_moe_mlp)."""
    n = x.shape[0]
    cos, sin = rope[positions, :, 0], rope[positions, :, 1]  # gathered once per step, not per layer
    # (w.fp8 is set on a GPU only, by the engine; the tests run its kernels in Triton's interpreter)
    fp8_blocks = w.fp8 if w.fp8 is not None and n >= FP8_MIN_ROWS and lora is None else None
    if fp8_blocks:
        from ..kernels.fp8_linear import fp8_linear
        from ..kernels.layer_norm_cuda import shifted_layer_norm_fp8

        no_shift = x.new_zeros(x.shape[1], dtype=torch.float32)
    for i, block in enumerate(w.blocks):
        fp8 = fp8_blocks[i] if fp8_blocks else None
        if fp8 is None:
            h = layer_norm(x, block.ln)
            qkv = linear(h, block.qkv)
        else:  # (the norm quantises its output for qkv and fc1, and bounds fc1's GELU output: model/fp8.py)
            h8, scale, hidden_scale = shifted_layer_norm_fp8(x, no_shift, block.ln.weight, block.ln.bias,
                                                             gelu_bound=fp8.gelu_bound)
            qkv = fp8_linear(h8, scale, fp8.qkv, block.qkv.bias, out_dtype=x.dtype)
        if lora is not None:
            lora.add(qkv, h, i, "qkv")
        if block.tau is not None:
            qkv = apply_tau(qkv, positions, block.tau, config)
        q, k, v = split_qkv_with_rope(qkv, cos, sin, config)
        out = attention(i, q, k, v).reshape(n, -1)
        if lora is not None and block.moe is not None:
            x = x + lora.add(linear(out, block.proj), h, i, "proj") + \
                moe_mlp(h, block.moe, lora, i, getattr(attention, "valid_rows", None))
        elif lora is not None:
            attn_out, mlp_out = _block_outputs_with_lora(h, out, block, lora, i)
            x = x + attn_out + mlp_out
        elif x.is_cuda or fp8 is not None:  # residual adds folded into the output GEMMs (beta = 1) and the experts'
            # sum: fewer kernels
            proj = dense(block.proj.weight).t()
            x = torch.addmm(x, out, proj) if i == 0 else x.addmm_(out, proj)  # in place past layer 0: x is ours then
            if block.moe is not None:
                from ..kernels.moe_kernels import add_moe_mlp

                add_moe_mlp(x, h, block.moe, block.out_bias, getattr(attention, "valid_rows", None))
            elif fp8 is not None:
                hidden8 = fp8_linear(h8, scale, fp8.fc1, fp8.fc1_bias, gelu=True, out_scale=hidden_scale)
                fp8_linear(hidden8, hidden_scale, fp8.fc2, block.out_bias, accumulate=x)
            else:
                x.addmm_(mlp_hidden(h, block.mlp), dense(block.mlp.fc2.weight).t()).add_(block.out_bias)
        else:
            x = x + linear(out, block.proj) + (moe_mlp(h, block.moe) if block.moe is not None else mlp(h, block.mlp))
    return x


def _block_outputs_with_lora(h: torch.Tensor, out: torch.Tensor, block: TextBlock, lora: LoraRows,
                             layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention projection plus MLP, each with its adapter delta added as the reference adds it (proj's
    delta from the normed input h; fc1's before the GELU)."""
    return lora.add(linear(out, block.proj), h, layer, "proj"), mlp_with_lora(h, block.mlp, lora, layer)


def mlp_with_lora(h: torch.Tensor, w, lora: LoraRows | SlotRows, layer: int) -> torch.Tensor:
    """A dense MLP with the rows' adapter deltas: fc1's before the GELU, fc2's from its activations."""
    g = F.gelu(lora.add(linear(h, w.fc1), h, layer, "fc1"), approximate="tanh")
    return lora.add(linear(g, w.fc2), g, layer, "fc2")


def lm_head(hidden: torch.Tensor, w: TextWeights) -> torch.Tensor:
    return linear(layer_norm(hidden, w.post_ln), w.lm_head)


def lm_head_rows(hidden: torch.Tensor, w: TextWeights, ids: torch.Tensor) -> torch.Tensor:
    """The logits of the vocabulary ids only."""
    return F.linear(layer_norm(hidden, w.post_ln), w.lm_head.weight[ids], w.lm_head.bias[ids])


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, prefix_len: int,
                   blocks: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
    """True where a query may see a key: causal, except the image prefix [0, prefix_len) and each block
    [start, end) of a later image see themselves bidirectionally."""
    mask = k_pos[None, :] <= q_pos[:, None]
    for start, end in ((0, prefix_len), *blocks):
        mask |= ((q_pos >= start) & (q_pos < end))[:, None] & ((k_pos >= start) & (k_pos < end))[None, :]
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
           is_causal: bool = False) -> torch.Tensor:
    """q [(N,) T, H, D], k/v [(N,) S, Hkv, D], mask [T, S] (True: may attend) -> [(N,) T, H, D].
    Grouped-query aware. SDPA gets 4-D [N, H, T, D] tensors: the fused (flash / memory-efficient)
    kernels take nothing else."""
    single = q.dim() == 3
    if single:
        q, k, v = q[None], k[None], v[None]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                         is_causal=is_causal, enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
    return out[0] if single else out


class DenseCache:
    """Contiguous K/V for one sequence: the simple reference path (parity, CLI, tests)."""

    def __init__(self, config: TextConfig, device, dtype, prefix_len: int, blocks: tuple[tuple[int, int], ...] = ()):
        shape = (config.n_layers, config.max_context, config.n_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.prefix_len, self.blocks = prefix_len, blocks
        self.positions: torch.Tensor | None = None
        self.length = 0

    def set_positions(self, positions: torch.Tensor) -> None:
        self.positions = positions

    def __call__(self, layer: int, q, k, v):
        pos = self.positions
        self.k[layer, pos] = k
        self.v[layer, pos] = v
        end = int(pos[-1]) + 1
        keys = torch.arange(end, device=q.device)
        return attend(q, self.k[layer, :end], self.v[layer, :end],
                                attention_mask(pos, keys, self.prefix_len, self.blocks))
