"""The GPU kernels (kernels/decode_kernels.py, kernels/layer_norm_cuda.py) and the GPU code paths built
on them, checked on the CPU with Triton's interpreter against the plain torch path they replace.
float32 only: the interpreter computes bfloat16 tl.dot wrongly (numpy has no bfloat16); the bfloat16
kernels are checked on the GPU by benchmarks/gpu_bench.py."""

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import on_engine_loop

os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined, so before the import below
pytest.importorskip("triton")

from kestrel_backend.model.config import TextConfig  # noqa: E402
from kestrel_backend.model.text import attend, rope_table, split_qkv_with_rope  # noqa: E402
from kestrel_backend.kernels import decode_kernels as dk  # noqa: E402


def segment_tensors(slots: list[int]) -> tuple[torch.Tensor, ...]:
    """The adapter kernels' segments of rows with these adapter slots, as the step's device tensors hold them."""
    from kestrel_backend.kernels.lora_kernels import segments

    return tuple(torch.tensor(v, dtype=torch.int32) for v in segments(slots))


@pytest.fixture
def full_size_tiles(monkeypatch):
    """The GEMV form's tiles as full-size widths get them: the tiny models are about 16x narrower, so their
    programs' target shrinks as much (N tiles of 4 to 8 columns, not 1; the interpreter runs each program
    in Python, so this also keeps the tests fast)."""
    tiles = dk._tiles

    def scaled(*args, gemv_programs: int = 1024, **kwargs):
        return tiles(*args, gemv_programs=gemv_programs // 16, **kwargs)

    monkeypatch.setattr(dk, "_tiles", scaled)


def rel_err(got, ref):
    return float((got.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("m", [1, 2, 5, 40])  # 1 and 2 rows take the GEMV form, more rows tensor cores
def test_norm_linear_matches_layer_norm_then_linear(m, full_size_tiles):
    g = torch.Generator().manual_seed(m)
    k, n1, n2 = 128, 384, 256
    x = torch.randn(m, k, generator=g) * 3 + 1
    ln_w, ln_b = torch.randn(k, generator=g), torch.randn(k, generator=g)
    w1, b1 = (torch.randn(n1, k, generator=g) / 11), torch.randn(n1, generator=g)
    w2, b2 = (torch.randn(n2, k, generator=g) / 11), torch.randn(n2, generator=g)
    out1, out2 = dk.norm_linear(x, ln_w, ln_b, w1, b1, w2, b2, gelu2=True)
    h = F.layer_norm(x.double(), (k,), ln_w.double(), ln_b.double())
    assert rel_err(out1, F.linear(h, w1.double(), b1.double())) < 1e-6
    assert rel_err(out2, F.gelu(F.linear(h, w2.double(), b2.double()), approximate="tanh")) < 1e-6
    logits = torch.empty(m, n1, dtype=torch.float64)  # the LM head form: logits in a wider type
    assert dk.norm_linear(x, ln_w, ln_b, w1, b1, out1=logits)[1] is None
    assert rel_err(logits, F.linear(h, w1.double(), b1.double())) < 1e-6

    # ... and with the greedy choice: ties go to the lowest token id, banned tokens are -inf and skipped
    b1[100] += 1000
    w1[300:], b1[300:] = w1[100:184], b1[100:184]  # tokens 100 and 300 tie for the best logit of every row
    banned = torch.full((m, 2), -1, dtype=torch.int32)
    banned[0] = torch.tensor([100, 5])
    best = dk.greedy_keys(m, "cpu")
    dk.norm_linear(x, ln_w, ln_b, w1, b1, out1=logits, banned=banned, best=best)
    assert logits[0, 100] == logits[0, 5] == float("-inf")
    host = torch.full((m,), -1, dtype=torch.int32)  # (on a GPU: pinned host memory the kernel writes into)
    assert dk.greedy_tokens(best, host_out=host).tolist() == host.tolist() == [300] + [100] * (m - 1)

    # ... where every logit is negative (their keys still above an empty key's zeros)
    b1 -= 5000
    best = dk.greedy_keys(m, "cpu")
    dk.norm_linear(x, ln_w, ln_b, w1, b1, out1=logits, banned=banned, best=best)
    assert logits.max() < 0 and dk.greedy_tokens(best).tolist() == logits.argmax(-1).tolist()


def test_text_widths_the_kernels_cannot_run_are_refused_at_load_with_the_widths_named():
    """Any width is chunked in powers of two (192 runs: test_fused_decode_step_matches_the_torch_decode_step); what
    cannot run is refused before a kernel is compiled, naming the width and what is supported."""
    import dataclasses

    from kestrel_backend.model.weights import CheckpointError
    from kestrel_backend.kernels.shared import power_of_two_chunk
    from kestrel_backend.runtime.gpu_parts import check_kernel_shapes

    assert dk.shape_problems(2048, 8192, 64, 32, 51200) == [] and dk.shape_problems(192, 384, 64, 32, 51200) == []
    assert power_of_two_chunk(192, 1024) == 64 and power_of_two_chunk(2048, 256) == 256
    check_kernel_shapes(TextConfig(dim=192, ff_dim=384, n_heads=3, n_kv_heads=3))
    with pytest.raises(CheckpointError, match=r"head dimension 96 is not a power of two \(the CPU engine can"):
        check_kernel_shapes(TextConfig(dim=192, ff_dim=384, n_heads=2, n_kv_heads=2))
    with pytest.raises(CheckpointError, match=r"vocabulary size 51201 is not a multiple of 32"):
        check_kernel_shapes(dataclasses.replace(TextConfig(), vocab_size=51201))


def test_banned_greedy_matches_argmax_with_bans():
    """The greedy tokens of steps past the GEMV form: argmax over float32 logits (ties to the lowest id, across the
    kernel's blocks too) with each row's banned tokens -inf in the logits and skipped."""
    g = torch.Generator().manual_seed(0)
    m, v = 5, 9000  # (three blocks of 4096, the last partial)
    logits = torch.randn(m, v, generator=g)
    logits[1, [10, 8500]] = 50.0  # a tie across blocks: the lower id wins
    logits[2] -= 1000.0  # every logit negative
    logits[3, 4096] = 60.0  # the best is banned: the next best wins
    banned = torch.full((m, 2), -1, dtype=torch.int32)
    banned[3], banned[4, 0] = torch.tensor([4096, 0]), int(logits[4].argmax())
    expected = logits.clone()
    for row, tokens in enumerate(banned.tolist()):
        expected[row, [t for t in tokens if t >= 0]] = float("-inf")
    out, host = torch.zeros(m, dtype=torch.int32), torch.full((m,), -1, dtype=torch.int32)
    dk.banned_greedy(logits, banned, out, host)
    assert torch.equal(logits, expected)
    assert out.tolist() == host.tolist() == expected.argmax(-1).tolist() and out[1] == 10


@pytest.mark.parametrize("m", [1, 33])
def test_linear2_residual_matches_torch(m):
    g = torch.Generator().manual_seed(m)
    n, k1, k2 = 128, 128, 256
    a, c = torch.randn(m, k1, generator=g), torch.randn(m, k2, generator=g)
    w1, w2 = (torch.randn(n, k1, generator=g) / 11), (torch.randn(n, k2, generator=g) / 16)
    residual = torch.randn(m, 2 * n, generator=g)[:, :n]  # strided rows, like a slice of a buffer
    bias = torch.randn(n, generator=g)
    got = dk.linear2_residual(a, w1, c, w2, residual, bias)
    ref = residual.double() + a.double() @ w1.double().T + c.double() @ w2.double().T + bias.double()
    assert rel_err(got, ref) < 1e-6


def _random_packed(n, k, group, g):
    """A 4-bit weight as a checkpoint stores it, and as PackedWeight keeps it."""
    from kestrel_backend.kernels.packed import PackedWeight

    n_groups = n * k // group
    packed = torch.randint(0, 256, (n_groups // 2, group), generator=g, dtype=torch.uint8)
    scale = (torch.rand(n_groups, 1, generator=g) / 20 + 0.01).to(torch.bfloat16)
    zero = torch.randint(0, 16, (n_groups, 1), generator=g).to(torch.bfloat16)
    return (packed, scale, zero), PackedWeight.from_checkpoint(packed, scale, zero, (n, k))


@pytest.mark.parametrize("n, k, group", [(64, 256, 128), (96, 64, 128)])  # whole groups a row, or groups across rows
def test_packed_weights_dequantize_to_the_references_values(n, k, group):
    """PackedWeight (repacked for streaming) gives exactly the reference's bf16 weight: torch on the CPU, the
    Triton kernel (here in the interpreter) on the GPU."""
    from kestrel_backend.model.weights import dequantize
    from kestrel_backend.kernels.w4a16_kernels import dequantize_packed

    parts, w = _random_packed(n, k, group, torch.Generator().manual_seed(n))
    ref = dequantize(*parts, (n, k))
    assert w.shape == (n, k) and w.data.dtype == torch.uint8 and w.data.numel() == n * k // 2
    assert torch.equal(w.dequantize(), ref) and torch.equal(dequantize_packed(w), ref)


@pytest.mark.parametrize("m, dtype", [(1, torch.float32), (2, torch.float32), (20, torch.float32),
                                      (1, torch.bfloat16), (2, torch.bfloat16)])
def test_w4a16_kernels_match_torch_on_the_dequantized_weights(m, dtype):
    """float32: the GEMV (one or two rows) and tensor-core forms with the reference's roundings, to 1e-6. bf16:
    the GEMV by group sums (_w4_gemv), within bf16's rounding of the outputs (a wrong nibble,
    scale or zero point would be off by order 1)."""
    from kestrel_backend.kernels import w4a16_kernels
    from kestrel_backend.kernels.w4a16_kernels import w4_linear2_residual, w4_norm_linear

    g = torch.Generator().manual_seed(m)
    k, ff, group = 256, 512, 128
    (_, wq), (_, wf), (_, wp), (_, w2) = (_random_packed(n, kk, group, g) for n, kk in
                                          ((3 * k, k), (ff, k), (k, k), (k, ff)))
    for w in (wq, wf, wp, w2):
        w.dtype = dtype
    factored = dtype == torch.bfloat16
    assert w4a16_kernels._factored(m > 2, dtype, k, group, k, ff) == factored
    tol = 1e-2 if factored else 1e-6
    x = (torch.randn(m, k, generator=g) * 3 + 1).to(dtype)
    ln_w, ln_b, bq, bf, bias = (torch.randn(n, generator=g).to(dtype) for n in (k, k, 3 * k, ff, k))
    qkv, act = w4_norm_linear(x, ln_w, ln_b, wq, bq, wf, bf)
    h = F.layer_norm(x.double(), (k,), ln_w.double(), ln_b.double()).to(dtype).double()
    assert rel_err(qkv, F.linear(h, wq.dequantize().double(), bq.double())) < tol
    assert rel_err(act, F.gelu(F.linear(h, wf.dequantize().double(), bf.double()), approximate="tanh")) < tol
    residual = torch.randn(m, k, generator=g).to(dtype)
    got = w4_linear2_residual(qkv[:, :k], wp, act, w2, residual, bias)
    ref = residual.double() + qkv[:, :k].double() @ wp.dequantize().double().T + \
        act.double() @ w2.dequantize().double().T + bias.double()
    assert rel_err(got, ref) < tol / 2


def _paged_context(lens, page, hkv, d, g):
    """Random caches whose pages are scattered, page tables for sequences of these lengths (the new token
    included), and the cache row (slot) of each one's new token."""
    n_pages = sum(-(-n // page) for n in lens) + 2
    k_cache, v_cache = torch.randn(n_pages * page, hkv, d, generator=g), torch.randn(n_pages * page, hkv, d, generator=g)
    perm = torch.randperm(n_pages, generator=g).tolist()
    tables = torch.zeros(len(lens), max(lens) // page + 1, dtype=torch.int32)
    for i, n in enumerate(lens):
        need = -(-n // page)
        tables[i, :need] = torch.tensor(perm[:need], dtype=torch.int32)
        perm = perm[need:]
    last = torch.tensor(lens) - 1
    slots = tables[torch.arange(len(lens)), last // page].long() * page + last % page
    return k_cache, v_cache, tables, slots


@pytest.mark.parametrize("splits", [1, 4])  # the context in one program, or shared by four (flash-decoding)
def test_rotary_paged_attention_matches_rope_then_attention(splits):
    cfg = TextConfig(dim=256, ff_dim=512, n_layers=1, n_heads=4, n_kv_heads=2)  # grouped-query, head_dim 64
    g = torch.Generator().manual_seed(0)
    page, lens = 4, [1, 6, 13, 150]  # tokens per sequence, the new one included
    hkv, d = cfg.n_kv_heads, cfg.head_dim
    k_cache, v_cache, tables, slots = _paged_context(lens, page, hkv, d, g)
    last = torch.tensor(lens) - 1
    width = (cfg.n_heads + 2 * hkv) * d
    qkv = torch.randn(len(lens), 2 * width, generator=g)[:, :width]  # strided rows, like the engine's
    table = rope_table(cfg)
    cos, sin = table[last, :, 0].contiguous(), table[last, :, 1].contiguous()

    before = k_cache.clone(), v_cache.clone()
    got = dk.rotary_paged_attention(qkv, cos, sin, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32),
                                    slots, cfg.n_heads, page, splits=splits)

    q, k, v = split_qkv_with_rope(qkv.clone(), cos, sin, cfg)
    assert torch.allclose(k_cache[slots], k, atol=1e-6) and torch.equal(v_cache[slots], v)
    untouched = torch.ones(len(k_cache), dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(k_cache[untouched], before[0][untouched]) and torch.equal(v_cache[untouched], before[1][untouched])
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        rows = tables[i, pos // page].long() * page + pos % page
        ref = attend(q[i:i + 1], k_cache[rows], v_cache[rows])
        assert rel_err(got[i].view(cfg.n_heads, d), ref[0]) < 1e-5


@pytest.mark.parametrize("tokens, heads", [(7, 4), (9, 3)])  # token blocks and head counts not filling the tiles
def test_rope_kernel_matches_the_torch_rope(tokens, heads):
    from kestrel_backend.kernels.rope_cuda import rope_qk_inplace

    cfg = TextConfig(dim=128, ff_dim=256, n_layers=1, n_heads=2, n_kv_heads=2)
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 2 * 3 * cfg.dim, generator=g)[:, :3 * cfg.dim]  # strided rows, like the engine's
    table = rope_table(cfg)[torch.randint(0, 700, (tokens,), generator=g)]
    cos, sin = table[:, :, 0].contiguous(), table[:, :, 1].contiguous()
    q, k, _ = split_qkv_with_rope(qkv.clone(), cos, sin, cfg)
    got = qkv.clone()
    rope_qk_inplace(got, cos, sin, heads, cfg.head_dim)
    rotated = heads * cfg.head_dim
    assert torch.allclose(got[:, :rotated], torch.cat([q, k], 1).flatten(1)[:, :rotated], atol=1e-6)
    assert torch.equal(got[:, rotated:], qkv[:, rotated:])


@pytest.mark.parametrize("block_m, block_n, context_block_n", [(64, 64, 128), (128, 32, 32)])
def test_prefill_attention_matches_the_torch_path(block_m, block_n, context_block_n, monkeypatch):
    """The GPU prefill kernel against TorchPagedAttention: image prefixes crossing a tile boundary and
    longer than it, text-only sequences, grouped-query heads, and sequences whose first positions are in
    the cache already (an image prefix shared in part or in whole, a text continuation); the same outputs
    and cache rows."""
    from kestrel_backend.kernels import prefill_attention as kernel
    from kestrel_backend.runtime.attention import SeqSlice, TorchPagedAttention
    from kestrel_backend.runtime.kv_cache import PagedKVCache
    from kestrel_backend.runtime.prefill_plan import PrefillAttention

    monkeypatch.setattr(kernel, "BLOCK_M", block_m)
    monkeypatch.setattr(kernel, "BLOCK_N", block_n)
    monkeypatch.setattr(kernel, "CONTEXT_BLOCK_N", context_block_n)
    cfg = TextConfig(dim=64, ff_dim=128, n_layers=2, n_heads=4, n_kv_heads=2)  # head_dim 16
    g = torch.Generator().manual_seed(0)
    d, h, hkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    # (rows, image prefix, positions cached before the step)
    seqs = [(79, 70, 0), (5, 0, 0), (133, 3, 0), (64, 0, 0), (20, 70, 64), (40, 150, 144), (7, 0, 30)]
    caches = [PagedKVCache(cfg, 128, 16, "cpu", torch.float32) for _ in range(2)]
    cached_k = torch.randn(caches[0].k.shape, generator=g)
    cached_v = torch.randn(caches[0].v.shape, generator=g)
    slices, start = [], 0
    for sid, (n, prefix, cached) in enumerate(seqs):
        for cache in caches:
            cache.allocate(sid, cached + n + 3)
            cache.k.copy_(cached_k)  # (every page: the cached positions' k/v, and rows the kernel must overwrite)
            cache.v.copy_(cached_v)
        slices.append(SeqSlice(sid, start, start + n, cached, prefix, torch.arange(cached, cached + n)))
        start += n
    qkv = torch.randn(start, (h + 2 * hkv) * d, generator=g)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], 1)
    q, k, v = q.view(start, h, d), k.view(start, hkv, d), v.view(start, hkv, d)
    outs = []
    for cache, attention in zip(caches, (TorchPagedAttention(caches[0]), PrefillAttention(caches[1]))):
        attention.plan(slices)
        outs.append(attention(1, q, k, v))
    assert rel_err(outs[1], outs[0]) < 1e-6
    for s in slices:
        rows = slice(s.start, s.end)
        assert rel_err(outs[1][rows], outs[0][rows]) < 1e-6, s
    assert torch.equal(caches[1].k, caches[0].k) and torch.equal(caches[1].v, caches[0].v)


# (cached positions, rows, image-prefix length) per sequence: a fresh one, one whose first pages hold part of its
# image prefix already, and a step of three (cached prefix, fresh image, text only)
@pytest.mark.parametrize("seqs", [[(0, 150, 40)], [(32, 150, 40)], [(32, 30, 40), (0, 70, 40), (0, 9, 0)]])
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # (spare work items: 0 / 0, never stored)
def test_prefill_graphs_forward_matches_the_flat_step(tiny_model, seqs):
    """The padded forward that the prefill graphs capture (run eagerly here) against the flat torch step:
    the same last hidden state and logits of each sequence, the same cache rows, nothing stored elsewhere."""
    from kestrel_backend.runtime.attention import SeqSlice, TorchPagedAttention
    from kestrel_backend.runtime.kv_cache import PagedKVCache
    from kestrel_backend.runtime.prefill_graphs import PrefillGraphs

    cfg = tiny_model.config.text
    caches = [PagedKVCache(cfg, 48, 16, "cpu", torch.float32) for _ in range(2)]
    g = torch.Generator().manual_seed(len(seqs))
    for cache in caches:
        cache.allocate(0, 16)  # another sequence's pages: must stay untouched
    slices, xs, start = [], [], 0
    for seq_id, (cached, n, prefix) in enumerate(seqs, 1):
        shape = caches[0].k[:, :cached].shape
        cached_k, cached_v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        for cache in caches:
            cache.allocate(seq_id, cached + n + 5)
            rows = torch.as_tensor(cache.rows([(seq_id, 0, cached)]))
            cache.k[:, rows], cache.v[:, rows] = cached_k, cached_v
        x = torch.randn(n, cfg.dim, generator=g)
        slices.append(SeqSlice(seq_id, start, start + n, cached, prefix, torch.arange(cached, cached + n)))
        xs.append(x)
        start += n
    step = TorchPagedAttention(caches[0])
    step.plan(slices)
    hidden = tiny_model.forward(torch.cat(xs), torch.cat([s.positions for s in slices]), step)
    hidden = hidden[[s.end - 1 for s in slices]]
    prefill = PrefillGraphs(tiny_model, caches[1], max_context=256, max_seqs=4)
    assert prefill.fits([len(x) for x in xs]) and not prefill.fits([100, 100, 100])
    logits, last = prefill.run(torch.cat(xs), slices)
    assert last.shape == hidden.shape and rel_err(last, hidden) < 1e-5
    assert rel_err(logits, tiny_model.logits(hidden)) < 1e-5
    assert rel_err(caches[1].k, caches[0].k) < 1e-6 and rel_err(caches[1].v, caches[0].v) < 1e-6
    others = torch.ones(caches[1].k.shape[1], dtype=torch.bool)
    for seq_id, (cached, n, _) in enumerate(seqs, 1):
        others[torch.as_tensor(caches[1].rows([(seq_id, 0, cached + n)]))] = False
    assert not caches[1].k[:, others].any() and not caches[1].v[:, others].any()


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # (spare work items: 0 / 0, never stored)
def test_prefill_graphs_with_moondream3_adapters_match_the_flat_step(tiny_dir):
    """Moondream 3's prefill graphs in the form with adapters (run eagerly here): sequences of adapter r8, of none and
    of the experts-only adapter in one step, each row's slot read from the graphs' buffer (SlotRows; the dense
    layer's deltas and the experts' through the pair-delta kernel, the experts' rows routed only up to the step's
    real rows) against the flat torch step with each sequence's adapter (LoraRows)."""
    import types

    from kestrel_backend.model.lora import LoraRows
    from kestrel_backend.model.moondream import Moondream
    from kestrel_backend.runtime.attention import SeqSlice, TorchPagedAttention
    from kestrel_backend.runtime.expert_lora_pool import ExpertLoraPool
    from kestrel_backend.runtime.kv_cache import PagedKVCache
    from kestrel_backend.runtime.prefill_graphs import PrefillGraphs

    model = Moondream.from_checkpoint(tiny_dir.parent / "md3-tiny", dtype=torch.float32)
    cfg = model.config.text
    pool = ExpertLoraPool(cfg, 3, 32, "cpu", torch.float32)
    per_seq = [pool.place(md3_adapter(tiny_dir, name, cfg)) for name in ("r8", "experts")]
    per_seq.insert(1, None)
    caches = [PagedKVCache(cfg, 16, 16, "cpu", torch.float32) for _ in range(2)]
    g = torch.Generator().manual_seed(5)
    slices, xs, start = [], [], 0
    for seq_id, n in enumerate((20, 9, 14)):
        for cache in caches:
            cache.allocate(seq_id, n + 1)
        xs.append(torch.randn(n, cfg.dim, generator=g))
        slices.append(SeqSlice(seq_id, start, start + n, 0, 0, torch.arange(n)))
        start += n
    step = TorchPagedAttention(caches[0])
    step.plan(slices)
    x, positions, last_rows = torch.cat(xs), torch.cat([s.positions for s in slices]), [s.end - 1 for s in slices]
    plain = model.forward(x, positions, step)[last_rows]
    hidden = model.forward(x, positions, step, LoraRows.of(per_seq, [len(x) for x in xs]))[last_rows]
    assert rel_err(hidden, plain) > 1e-2  # (the adapters move the answer)
    prefill = PrefillGraphs(model, caches[1], max_context=128, max_seqs=4, adapters=types.SimpleNamespace(pool=pool))
    assert prefill.takes_adapters
    logits, last = prefill.run(x, slices, [a.slot if a else 0 for a in per_seq])
    assert rel_err(last, hidden) < 1e-5 and rel_err(logits, model.logits(hidden)) < 1e-5
    assert rel_err(caches[1].k, caches[0].k) < 1e-6


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # (spare work items: 0 / 0, never stored)
def test_engine_prefill_steps_of_several_sequences_through_the_prefill_graphs(tiny_dir):
    """The scheduler's prefill steps through PrefillGraphs (their padded forward run eagerly here), two requests
    on two images admitted in one step: fresh, then on the images' cached prefix pages. Each answers as the flat
    prefill step makes it answer, and every page is given back."""
    import asyncio

    import numpy as np
    import pyvips

    from kestrel_backend.engine_config import RuntimeConfig
    from kestrel_backend.engine import InferenceEngine
    from kestrel_backend.runtime.prefill_graphs import PrefillGraphs

    def image(seed):
        pixels = np.random.default_rng(seed).integers(0, 256, (120, 160, 3), dtype=np.uint8)
        return pyvips.Image.new_from_array(pixels).pngsave_buffer()

    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                               max_batch_size=2))
    graphs = PrefillGraphs(eng.model, eng.kv, eng.max_context, max_seqs=2)
    steps = []  # sequences per step through the graphs
    run = graphs.run
    graphs.run = lambda x, slices, *slots: steps.append(len(slices)) or run(x, slices, *slots)

    def burst(images, through_graphs: bool):
        """A question on each image, submitted on the engine loop in one go: all admitted at the next step."""
        eng.scheduler.prefill_graphs = graphs if through_graphs else None  # (between steps: no request in flight)

        async def both():
            return await asyncio.gather(*[eng.query(img, q, settings={"temperature": 0, "max_tokens": 6})
                                          for img, q in zip(images, ("Hi", "Count the dogs"))])  # (first tokens differ)
        return [r.output for r in asyncio.run_coroutine_threadsafe(both(), eng.loop).result(timeout=120)]

    def forget_prefixes():  # (the images stay encoded: their requests enter the queue together, no decode between)
        on_engine_loop(eng, lambda: eng.scheduler.prefixes.reclaim(eng.kv.num_pages))

    try:
        ab, cd = (image(1), image(2)), (image(3), image(4))
        for img in ab + cd:
            burst((img,), False)
        forget_prefixes()
        fresh_flat, cached_graphs = burst(ab, False), burst(ab, True)
        assert steps == [2] and cached_graphs == fresh_flat and fresh_flat[0] != fresh_flat[1]  # (order tells)
        forget_prefixes()
        fresh_graphs, cached_flat = burst(cd, True), burst(cd, False)
        assert steps == [2, 2] and fresh_graphs == cached_flat and fresh_graphs != fresh_flat
        assert eng.stats()["prefix_hits"] == 4 and eng.no_request_holds_pages()
    finally:
        eng.shutdown()


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # (spare work items: 0 / 0, never stored)
def test_mixed_steps_through_the_prefill_graphs_answer_as_separate_steps(tiny_dir):
    """Mixed steps (KESTREL_MIXED_STEPS) through PrefillGraphs (the prefill attention kernel in Triton's interpreter):
    three questions on three images through two slots, the third joining as the first takes its last token, so a
    graph step holds its prompt, the first's last decode row and the second's (each after its image prefix). The
    answers equal those of separate prefill and decode steps, and every page is given back."""
    import asyncio

    import numpy as np
    import pyvips

    from kestrel_backend.engine_config import RuntimeConfig
    from kestrel_backend.engine import InferenceEngine
    from kestrel_backend.runtime.prefill_graphs import PrefillGraphs

    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                               max_batch_size=2, max_step_tokens=0))
    graphs = PrefillGraphs(eng.model, eng.kv, eng.max_context, max_seqs=4)  # (twice the batch, as the engine makes)
    steps = []  # (rows, first position) of each sequence of each step through the graphs
    run = graphs.run
    graphs.run = lambda x, slices, *slots: steps.append([(s.end - s.start, s.first_pos) for s in slices]) or \
        run(x, slices, *slots)

    def burst(mixed: bool):
        # (between bursts: nothing running; separate steps from the torch path, which the graphs equal: see above)
        eng.scheduler.prefill_graphs, eng.scheduler.mixed_steps = graphs if mixed else None, mixed

        async def three():
            return await asyncio.gather(*[eng.query(img, q, settings={"temperature": 0, "max_tokens": n})
                                          for img, (q, n) in zip(images, (("Hi", 2), ("Count", 6), ("Red?", 4)))])
        return [r.output for r in asyncio.run_coroutine_threadsafe(three(), eng.loop).result(timeout=300)]

    images = [pyvips.Image.new_from_array(np.random.default_rng(seed).integers(0, 256, (120, 160, 3), dtype=np.uint8))
              .pngsave_buffer() for seed in (5, 6, 7)]
    try:
        separate = burst(False)
        steps.clear()
        mixed = burst(True)
        assert mixed == separate and eng.scheduler.steps_mixed >= 1
        assert any(len(step) == 3 and sum(rows == 1 and first > 0 for rows, first in step) == 2 for step in steps)
        assert eng.no_request_holds_pages()
    finally:
        eng.shutdown()


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide")  # (spare work items: 0 / 0, never stored)
def test_prefixes_ahead_through_the_prefill_graphs_answer_as_without(tiny_dir):
    """Prefixes ahead (KESTREL_PREFIX_AHEAD) through PrefillGraphs (the prefill attention kernel in Triton's
    interpreter): two text queries hold both slots while questions on two encoded images wait; a graph step then
    holds the two running rows and two image prefixes in placeholder page tables (bidirectional over the prefix),
    which the waiting requests find in the prefix cache. The answers equal those with it off, and every page is
    given back."""
    import asyncio

    import numpy as np
    import pyvips

    from kestrel_backend.engine_config import RuntimeConfig
    from kestrel_backend.engine import InferenceEngine
    from kestrel_backend.runtime.prefill_graphs import PrefillGraphs

    eng = InferenceEngine.create(RuntimeConfig(model_path=str(tiny_dir), device="cpu", dtype="float32",
                                               max_batch_size=2, kv_pages=1024, prefix_ahead=0))
    s = eng.scheduler
    graphs = PrefillGraphs(eng.model, eng.kv, eng.max_context, max_seqs=4)
    steps = []  # the sequence ids of each step through the graphs
    run = graphs.run
    graphs.run = lambda x, slices, *slots: steps.append([sl.seq_id for sl in slices]) or run(x, slices, *slots)
    images = [pyvips.Image.new_from_array(np.random.default_rng(seed).integers(0, 256, (90, 120, 3), dtype=np.uint8))
              .pngsave_buffer() for seed in (11, 12)]

    def burst(ahead: int):
        async def on_the_loop():
            # (between bursts: nothing running; the answers without prefixes ahead from the torch path, which the
            # graphs equal: see the test above)
            s.prefill_graphs, s.prefix_ahead = graphs if ahead else None, ahead
            s.prefixes.reclaim(eng.kv.num_pages)  # (the images stay encoded)
            text = [asyncio.ensure_future(eng.query(None, f"count to {i}", settings={"temperature": 0,
                                                                                       "max_tokens": 8}))
                    for i in range(2)]
            await asyncio.sleep(0.05)
            return await asyncio.gather(*text, *[eng.query(img, q, settings={"temperature": 0, "max_tokens": 3})
                                                 for img in images for q in ("What?", "Why?")])
        return [r.output for r in asyncio.run_coroutine_threadsafe(on_the_loop(), eng.loop).result(timeout=300)]

    try:
        without = burst(0)
        steps.clear()
        ahead = burst(2)
        assert ahead == without and s.prefixes_ahead >= 2
        assert any(sum(i < 0 for i in ids) >= 2 and len(ids) >= 3 for ids in steps)  # (prefixes beside running rows)
        assert eng.no_request_holds_pages()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("lens, splits, block_n, fc1_first", [([9], 1, 8, 0), ([150], 4, 4, 0), ([1, 70], 2, 8, 0),
                                                              ([150], 4, 4, 24)])
def test_norm_linear_attention_matches_the_two_kernels(lens, splits, block_n, fc1_first, monkeypatch,
                                                       full_size_tiles):
    """The one-kernel form (attention programs waiting on the qkv programs of their head, with or without
    fc1 programs launched between) equals norm_linear followed by rotary_paged_attention, and each qkv
    program counted itself in once."""
    monkeypatch.setattr(dk, "ONE_KERNEL_FC1_FIRST", fc1_first)
    cfg = TextConfig(dim=128, ff_dim=256, n_layers=1, n_heads=2, n_kv_heads=2)  # head_dim 64, as Moondream
    g = torch.Generator().manual_seed(len(lens) * 10 + splits)
    m, h, d, page = len(lens), cfg.n_heads, cfg.head_dim, 16
    k_cache, v_cache, tables, slots = _paged_context(lens, page, h, d, g)
    x = torch.randn(m, cfg.dim, generator=g) * 3 + 1
    ln_w, ln_b = torch.randn(cfg.dim, generator=g), torch.randn(cfg.dim, generator=g)
    wq, bq = torch.randn(3 * cfg.dim, cfg.dim, generator=g) / 16, torch.randn(3 * cfg.dim, generator=g)
    wf, bf = torch.randn(cfg.ff_dim, cfg.dim, generator=g) / 16, torch.randn(cfg.ff_dim, generator=g)
    last = torch.tensor(lens) - 1
    table = rope_table(cfg)
    cos, sin = table[last, :, 0].contiguous(), table[last, :, 1].contiguous()
    seq_lens = torch.tensor(lens, dtype=torch.int32)

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    qkv, fc1_ref = dk.norm_linear(x, ln_w, ln_b, wq, bq, wf, bf, gelu2=True)
    attn_ref = dk.rotary_paged_attention(qkv, cos, sin, k_ref, v_ref, tables, seq_lens, slots, h, page, splits=splits)
    sync = torch.zeros(dk.one_kernel_counters(h, m), dtype=torch.int32)
    attn, fc1 = dk.norm_linear_attention(x, ln_w, ln_b, wq, bq, wf, bf, cos, sin, k_cache, v_cache, tables, seq_lens,
                                         slots, page, sync, splits, tiles=(m, block_n, 64, 4, 2, False))
    assert rel_err(attn, attn_ref) < 1e-6 and rel_err(fc1, fc1_ref) < 1e-6
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)  # the new token's k/v, nothing else
    stride = dk.ARRIVAL_STRIDE
    assert sync[:h * stride:stride].tolist() == [3 * d // block_n] * h
    assert sync[h * stride:].tolist() == ([splits] * (m * h) if splits > 1 else [0] * (m * h))


# one sequence: the attention inside the norm + qkv/fc1 kernel (split over the context, or not); two: the
# GEMV kernels with the attention a kernel of its own; three: tensor cores for norm + qkv/fc1
@pytest.mark.parametrize("n_seqs, splits, adapters, fixture", [
    (1, None, False, "md2-tiny"), (1, 1, False, "md2-tiny"), (2, None, False, "md2-tiny"), (3, None, False, "md2-tiny"),
    (1, None, True, "md2-tiny"), (3, None, True, "md2-tiny"), (1, None, False, "md3-tiny"), (3, None, False, "md3-tiny"),
    (2, None, False, "md3-tiny"), (1, None, False, "md2-tiny-4bit"), (3, None, False, "md2-tiny-4bit"),
    (3, "grouped", False, "md2-tiny"), (3, "grouped", False, "md3-tiny"), (1, None, False, "192-wide"),
    (2, None, False, "192-wide"), (3, None, True, "md3-tiny")])
def test_fused_decode_step_matches_the_torch_decode_step(tiny_model, tiny_dir, n_seqs, splits, adapters, fixture,
                                                         full_size_tiles):
    """The whole GPU decode step (fused kernels, as the CUDA graphs replay it) against the engine's torch step,
    after a torch prefill of sequences of different lengths. The LM head is cut to 512 tokens: the interpreter runs
    every program in Python. With adapters: rows of adapters r8, none and r4's MLP part alone (from a LoraPool of
    rank 16 slots, in the slot that r4 had) against the torch step's per-row deltas; on md3-tiny rows of its adapters
    r8 (dense layer and experts), none and experts-only, from an ExpertLoraPool. md3-tiny: Moondream 3's layers
    (tau from each row's position, for one or two rows in one kernel; the expert kernels). md2-tiny-4bit: its text
    weights kept 4-bit, as on a GPU (the W4A16 kernels). 192-wide: random weights of a text model whose width is not a
    power of two (3 heads of 64)."""
    import dataclasses

    from kestrel_backend.model.moondream import Moondream
    from kestrel_backend.runtime.attention import SeqSlice, TorchPagedAttention
    from kestrel_backend.runtime.cuda_decode import StepTensors, fused_decode_step
    from kestrel_backend.runtime.kv_cache import PagedKVCache

    if fixture == "md2-tiny-4bit":  # (Moondream.from_checkpoint keeps 4-bit weights packed on a GPU only)
        from kestrel_backend.kernels.packed import PackedWeight
        from kestrel_backend.model.weights import build_weights, load_state

        config = Moondream.from_checkpoint(tiny_dir.parent / fixture).config
        packed = build_weights(load_state(tiny_dir.parent / fixture, config, keep_packed=True), config, torch.float32,
                               "cpu")
        assert isinstance(packed.text.blocks[0].mlp.fc2.weight, PackedWeight)
        tiny_model = Moondream(config, packed, tiny_model.tokenizer)
    elif fixture == "192-wide":
        from kestrel_backend.model.weights import random_weights

        c = tiny_model.config
        config = dataclasses.replace(c, text=dataclasses.replace(c.text, dim=192, ff_dim=384, n_heads=3, n_kv_heads=3,
                                                                  n_layers=1),
                                     vision=dataclasses.replace(c.vision, proj_out_dim=192),
                                     region=dataclasses.replace(c.region, dim=192))
        tiny_model = Moondream(config, random_weights(config, torch.float32, seed=3))
    elif fixture != "md2-tiny":
        tiny_model = Moondream.from_checkpoint(tiny_dir.parent / fixture, dtype=torch.float32)
    text = tiny_model.weights.text
    head = dataclasses.replace(text.lm_head, weight=text.lm_head.weight[:512], bias=text.lm_head.bias[:512])
    weights = dataclasses.replace(tiny_model.weights, text=dataclasses.replace(text, lm_head=head))
    model, cfg = Moondream(tiny_model.config, weights), tiny_model.config.text
    cache = PagedKVCache(cfg, 16, 4, "cpu", torch.float32)
    prompts = [list(range(10, 31)), [1, 2, 3, 4, 5], [40, 41]][:n_seqs]
    slices, start = [], 0
    for sid, ids in enumerate(prompts):
        cache.allocate(sid, len(ids) + 1)
        slices.append(SeqSlice(sid, start, start + len(ids), 0, 0, torch.arange(len(ids))))
        start += len(ids)
    attention = TorchPagedAttention(cache)
    attention.plan(slices)
    flat = [t for ids in prompts for t in ids]
    model.forward(model.embed_tokens(flat), torch.cat([s.positions for s in slices]), attention)

    x = model.embed_tokens([7, 8, 9][:n_seqs])
    positions = torch.tensor([len(ids) for ids in prompts])
    torch_cache = PagedKVCache(cfg, 16, 4, "cpu", torch.float32)
    torch_cache.k, torch_cache.v, torch_cache.tables = cache.k.clone(), cache.v.clone(), cache.tables
    torch_cache.table_tensors = cache.table_tensors
    step = TorchPagedAttention(torch_cache)
    step.plan([SeqSlice(i, i, i + 1, int(p), 0, p.reshape(1)) for i, p in enumerate(positions)])
    lora, rows = None, None
    if adapters and fixture == "md3-tiny":
        from kestrel_backend.model.lora import LoraRows
        from kestrel_backend.runtime.expert_lora_pool import ExpertLoraPool

        pool = ExpertLoraPool(cfg, 3, 32, "cpu", torch.float32)
        r8, experts = [pool.place(md3_adapter(tiny_dir, name, cfg)) for name in ("r8", "experts")]
        per_row = [r8, None, experts][:n_seqs]
        rows = (pool, torch.tensor([a.slot if a else 0 for a in per_row], dtype=torch.int32))
        lora = LoraRows.of(per_row, [1] * n_seqs)
    elif adapters:
        from kestrel_backend.model.lora import LoraRows, build_adapter, read_adapter_tensors
        from kestrel_backend.runtime.lora_pool import LoraPool

        pool = LoraPool(cfg, 3, 16, "cpu", torch.float32)
        r4, r8 = [pool.place(build_adapter(name, read_adapter_tensors([tiny_dir / "adapters" / name / "final.pt"]),
                                           cfg, 16, torch.float32, "cpu")) for name in ("r4", "r8")]
        pool.release(r4)  # (its slot then takes r4's MLP part alone, as Kestrel's adapters are: the rest zeroed)
        state = read_adapter_tensors([tiny_dir / "adapters" / "r4" / "final.pt"])
        mlp_only = pool.place(build_adapter("mlp", {k: v for k, v in state.items() if ".mlp." in k}, cfg, 16,
                                            torch.float32, "cpu"))
        assert mlp_only.slot == r4.slot and set(mlp_only.layers[0]) == {"fc1", "fc2"}
        per_row = [r8, None, mlp_only][:n_seqs]
        rows = (pool, segment_tensors([a.slot if a else 0 for a in per_row]))
        lora = LoraRows.of(per_row, [1] * n_seqs)
    hidden_ref = model.forward(x, positions, step, lora)
    logits_ref = model.logits(hidden_ref)

    tables = torch.full((n_seqs, 8), cache.scratch_page, dtype=torch.int32)
    for sid in range(n_seqs):
        tables[sid, :len(cache.tables[sid])] = cache.table_tensors[sid]
    slots = tables[torch.arange(n_seqs), positions // 4] * 4 + positions % 4
    banned = torch.full((n_seqs, 2), -1, dtype=torch.int32)
    banned[0, 1] = int(logits_ref[0].argmax())  # the step applies it, and chooses greedily (without adapters)
    inputs = StepTensors(tables, (positions + 1).int(), slots.int(), model.rope[positions, :, 0].contiguous(),
                         model.rope[positions, :, 1].contiguous(), banned)
    grouped = splits == "grouped"  # the attention of groups of rows that share pages (here none do: groups of one)
    if grouped:
        from kestrel_backend.kernels.grouped_attention import GROUP, group_rows

        groups, shared = np.zeros((n_seqs, GROUP), dtype=np.int32), np.zeros(n_seqs, dtype=np.int32)
        group_rows(tables.numpy(), positions.numpy(), 4, groups, shared)
        inputs.groups, inputs.shared, splits = torch.from_numpy(groups), torch.from_numpy(shared), None
    logits, greedy = torch.empty(n_seqs, 512), torch.full((n_seqs,), -7, dtype=torch.int32)
    greedy_host = torch.full((n_seqs,), -7, dtype=torch.int32)
    hidden = fused_decode_step(model, x, cache, inputs, logits, splits, greedy, greedy_host, lora=rows, grouped=grouped)
    if not adapters:  # (GEMV form: the LM head chooses; past it banned_greedy after cuBLAS's LM head)
        assert logits[0, banned[0, 1]] == float("-inf")
        logits_ref[0, banned[0, 1]] = float("-inf")
        assert greedy.tolist() == greedy_host.tolist() == logits_ref.argmax(-1).tolist()
    else:
        assert greedy.tolist() == greedy_host.tolist() == [-7] * n_seqs  # (the scheduler chooses from the logits)
    kept = torch.isfinite(logits_ref)
    assert rel_err(hidden, hidden_ref) < 1e-5 and rel_err(logits[kept], logits_ref[kept]) < 1e-5
    assert torch.equal(logits.argmax(-1), logits_ref.argmax(-1))
    assert rel_err(cache.k, torch_cache.k) < 1e-6 and rel_err(cache.v, torch_cache.v) < 1e-6  # the new rows


def md3_adapter(tiny_dir, name: str, cfg):
    """md3-tiny's adapter `name` (a Kestrel checkpoint), float32 on the CPU."""
    from kestrel_backend.model.lora import build_adapter, read_adapter_tensors

    path = tiny_dir.parent / "md3-tiny" / "adapters" / name / "final.pt"
    return build_adapter(name, read_adapter_tensors([path]), cfg, 32, torch.float32, "cpu")


@pytest.mark.parametrize("tokens, path", [(1, "gemv"), (5, "tiles"), (40, "tiles"), (60, "grouped")])
def test_expert_kernels_add_each_rows_adapter(tiny_dir, tokens, path, monkeypatch):
    """Moondream 3's experts with adapters (moe_lora): rows of md3-tiny's adapter r8, of none and of its experts-only
    adapter in one call, on each path (one token's FP8 GEMVs, the expert tiles, the grouped GEMM's, called directly),
    against the per-expert loop with each row's deltas (text.moe_mlp, the form the golden cases check)."""
    from kestrel_backend.model.legacy_layout import fp8_experts
    from kestrel_backend.kernels import moe_kernels as mk
    from kestrel_backend.model.lora import LoraRows
    from kestrel_backend.model.moondream import Moondream
    from kestrel_backend.model.text import moe_mlp
    from kestrel_backend.runtime.expert_lora_pool import ExpertLoraPool

    model = Moondream.from_checkpoint(tiny_dir.parent / "md3-tiny", dtype=torch.float32)
    cfg, moe = model.config.text, model.weights.text.blocks[1].moe
    if path == "gemv":
        monkeypatch.setattr(mk, "GEMV_TILES", (dict(BLOCK_N=16, BLOCK_K=32, num_warps=4),) * 2)
        moe = fp8_experts(moe)
    pool = ExpertLoraPool(cfg, 3, 32, "cpu", torch.float32)
    r8, experts = [pool.place(md3_adapter(tiny_dir, name, cfg)) for name in ("r8", "experts")]
    x = torch.randn(tokens, cfg.dim, generator=torch.Generator().manual_seed(11))
    if tokens == 1:
        spans = [(0, 1, r8)]
    else:
        third = tokens // 3
        spans = [(0, third, r8), (2 * third, tokens, experts)]
    lora = LoraRows(spans)
    want = moe_mlp(x, moe, lora, 1)
    assert rel_err(want, moe_mlp(x, moe)) > 1e-2  # (the adapters move the output)
    kernels = pool.layer(1, lora.row_slots(tokens, "cpu"))
    if path == "grouped":  # (called as moe_mlp_cuda calls it on bf16 CUDA tensors)
        got = mk._moe_mlp_grouped(x, mk._routing(x, moe.router, moe.top_k), moe, lora=kernels)
    else:
        got = mk.moe_mlp_cuda(x, moe, lora=kernels)
    assert rel_err(got, want) < 1e-5


def test_gpu_vision_blocks_match_the_torch_blocks(tiny_model):
    """The GPU form of the vision encoder (residual adds in the GEMMs, biases carried into the norms), and the
    residual stream after a block that it hands out on request."""
    from kestrel_backend.model import vision

    v, w = tiny_model.config.vision, tiny_model.weights.vision
    crops = torch.rand(2, 3, v.crop_size, v.crop_size, generator=torch.Generator().manual_seed(0)) * 2 - 1
    x = vision.embed_patches(crops, w, v)
    out = torch.full_like(x, float("nan"))  # (a CUDA graph's static output buffer)
    early, early_ref = {8: None}, {8: None}
    got = vision._encode_blocks_cuda(x.clone(), w, v, out, early)
    assert got.data_ptr() == out.data_ptr() and rel_err(got, vision.encode_crops(crops, w, v, early=early_ref)) < 1e-5
    assert rel_err(early[8], early_ref[8]) < 1e-5  # the segment refiner's features (the stream's biases added back)


def test_encode_images_takes_each_batch_out_of_a_reused_buffer(tiny_model, monkeypatch):
    """The engine's CUDA graphs (runtime/vision_graphs.py) return their static output buffer, which the next
    batch overwrites: encode_images must copy each batch's features out before encoding the next."""
    import numpy as np

    from kestrel_backend.model import vision

    v, w = tiny_model.config.vision, tiny_model.weights.vision
    rng = np.random.default_rng(0)
    cropped = [vision.crop_image(rng.integers(0, 256, shape, dtype=np.uint8), v)
               for shape in ((400, 900, 3), (300, 300, 3))]
    expected = vision.encode_images(cropped, w, v)
    static = torch.full((3, v.grid * v.grid, v.enc_dim), float("nan"))

    def encode(crops):  # as CropEncoderGraphs: into one buffer, valid until the next call
        static[:len(crops)] = vision.encode_crops(crops, w, v)
        return static[:len(crops)]

    monkeypatch.setattr(vision, "CROPS_PER_BATCH", 3)
    assert sum(len(crops) for crops, _ in cropped) > 2 * vision.CROPS_PER_BATCH  # three batches at least
    got = vision.encode_images(cropped, w, v, encode)
    assert all(rel_err(g, e) < 1e-5 for g, e in zip(got, expected))


def test_step_inputs_pack_tables_lengths_slots_and_rotary_per_sequence(tiny_model):
    from kestrel_backend.runtime.cuda_decode import StepInputs
    from kestrel_backend.runtime.kv_cache import PagedKVCache

    cfg = tiny_model.config.text
    cache = PagedKVCache(cfg, 32, 4, "cpu", torch.float32)
    cache.allocate(5, 30)
    cache.allocate(9, 7)
    cache.free(5)
    cache.allocate(6, 13)  # pages reused out of order
    inputs = StepInputs(4, 10, cache, tiny_model.rope, "cpu")
    inputs.prepare([9], [2], 2)  # staged for a step that does not come: the next upload must not use it
    steps = (([9, 6], [6, 12], [17, -1]), ([6], [3], [5]), ([6], [4], [8]))
    for i, (seq_ids, positions, tokens) in enumerate(steps):  # each step must clear the one before's rows
        if i == 2:
            inputs.prepare(seq_ids, positions, 2)  # staged ahead, as the scheduler does
        inputs.upload(tokens, seq_ids, positions, 2, [(3,)] * (i == 0), buffer=i % 2)  # (the pinned buffers alternate)
        inputs.copy_to_device(i % 2)
        got = inputs.rows(2)
        assert inputs.tokens(len(tokens)).tolist() == tokens
        assert got.banned.tolist() == ([[3, -1], [-1, -1]] if i == 0 else [[-1, -1]] * 2)
        pad = cache.scratch_page
        for row in range(2):
            if row < len(seq_ids):
                table, pos = cache.tables[seq_ids[row]], positions[row]
            else:
                table, pos = [], 0
            want = table + [pad] * (10 - len(table))
            assert got.block_tables[row].tolist() == want
            assert got.seq_lens[row] == pos + 1 and got.slots[row] == want[pos // 4] * 4 + pos % 4
            assert torch.equal(got.cos[row], tiny_model.rope[pos, :, 0])
            assert torch.equal(got.sin[row], tiny_model.rope[pos, :, 1])
    cache.allocate(7, 9, shared=cache.tables[6][:2])  # a question on 6's image: its first two pages shared
    inputs.upload([1, 2], [6, 7], [10, 8], 2, grouped=True)  # (the steps of grouped_attention)
    inputs.copy_to_device(0)
    got = inputs.rows(2)
    assert got.groups[0, :2].tolist() == [0, 1] and (got.groups[0, 2:] == -1).all() and (got.groups[1] == -1).all()
    assert got.shared[0] == 8  # its two shared pages' positions


@pytest.mark.parametrize("width", [256, 192])  # (192: in power-of-two chunks)
def test_embed_rows_takes_token_embeddings_fed_back_tokens_or_the_given_rows(width):
    g = torch.Generator().manual_seed(0)
    table, given = torch.randn(50, width, generator=g), torch.randn(4, width, generator=g)
    previous = torch.tensor([1, 2, 3, 30], dtype=torch.int32)  # what the step before chose
    got = dk.embed_rows(torch.tensor([7, -1, 49, dk.FED_BACK], dtype=torch.int32), table, given, previous)
    assert torch.equal(got, torch.stack([table[7], given[1], table[49], table[30]]))


def test_every_kernel_compiles_for_every_supported_gpu():
    """The interpreter does not type-check the kernels as the compiler does: compile them all to cubins for
    sm80, sm86, sm89, sm90, sm100 and sm120 (PDL from sm90 on; the small-shared-memory tiles on sm86, sm89 and
    sm120; every variant for sm90, the bf16 ones at 1, 2 and 64 rows for the others) through Triton's compiler, here
    on the CPU, the architectures in parallel (tests/compile_kernels.py). A variant whose Triton cache key is in
    fixtures/compiled_kernels.json compiled when the file was written and is not compiled again; a changed kernel
    (or another Triton) has a new key and compiles here."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(Path(__file__).parent / "compile_kernels.py")], env=env,
                         capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for capability in (80, 86, 89, 90, 100, 120):  # (sm90 every variant, the others bf16 at 1, 2 and 64 rows)
        assert run.stdout.count(f"ok   sm{capability} ") >= (140 if capability == 90 else 50), capability
    assert "_norm_linear_attention_kernel" in run.stdout and "_lora_expand_in_kernel" in run.stdout



def test_lora_kernels_give_each_row_its_own_adapters_deltas():
    """The three adapter kernels against torch, row by row: ranks below the pool's (3, 13) and at it (16), rows
    without an adapter (slot 0), segments of more than one 16-row tile, output columns not a multiple of the
    blocks."""
    from kestrel_backend.kernels import lora_kernels as lk

    torch.manual_seed(3)
    dim, nq, ff, cap, n = 128, 200, 300, 16, 70
    ranks = torch.tensor([0, 3, 13, 16], dtype=torch.int32)  # per slot (slot 0: none)
    a_h, a_g = torch.randn(4, 3 * cap, dim) / 8, torch.randn(4, cap, ff) / 8
    b = {t: torch.randn(4, m, cap) / 8 for t, m in (("qkv", nq), ("fc1", ff), ("proj", dim), ("fc2", dim))}
    for slot, r in enumerate(ranks.tolist()):  # the pool leaves rows and columns past a slot's rank zero
        a_h.view(4, 3, cap, dim)[slot, :, r:] = 0
        a_g[slot, r:] = 0
        for t in b.values():
            t[slot, :, r:] = 0
    slots = [i * 7 % 4 for i in range(n)]
    segs = segment_tensors(slots)
    h, x, qkv, f = torch.randn(n, dim), torch.randn(n, dim), torch.randn(n, nq), torch.randn(n, ff)
    v = torch.zeros(n, 4 * cap)
    want_x, want_qkv, want_f, want_v = x.clone(), qkv.clone(), f.clone(), torch.zeros(n, 4 * cap)
    for i, slot in enumerate(slots):
        want_v[i, :3 * cap] = a_h[slot] @ h[i]
        d = want_v[i].view(4, cap)
        want_qkv[i] += b["qkv"][slot] @ d[0]
        want_f[i] = F.gelu(f[i] + b["fc1"][slot] @ d[2], approximate="tanh")
        d[3] = a_g[slot] @ want_f[i]
        want_x[i] += b["proj"][slot] @ d[1] + b["fc2"][slot] @ d[3]
    lk.lora_shrink(h, a_h, segs, ranks, v)
    lk.lora_expand_in(qkv, f, v, b["qkv"], b["fc1"], a_g, segs, ranks)
    lk.lora_expand_out(x, v, b["proj"], b["fc2"], segs, ranks)
    for got, want in ((v, want_v), (qkv, want_qkv), (f, want_f), (x, want_x)):
        assert rel_err(got, want) < 1e-5


def test_step_inputs_pack_the_rows_in_segments_of_one_adapter(tiny_model):
    """Rows sorted by adapter slot, where each slot's run starts (empty segments after the last), its slot;
    a step without adapters leaves every segment empty."""
    from kestrel_backend.runtime.cuda_decode import StepInputs
    from kestrel_backend.runtime.kv_cache import PagedKVCache

    cache = PagedKVCache(tiny_model.config.text, 32, 4, "cpu", torch.float32)
    for sid in range(4):
        cache.allocate(sid, 8)
    inputs = StepInputs(4, 4, cache, tiny_model.rope, "cpu")
    inputs.upload([1, 2, 3, 4], [0, 1, 2, 3], [1, 1, 1, 1], 4, adapter_slots=[3, 0, 3, 1])
    inputs.copy_to_device()
    rows, starts, slots = inputs.segments(4)
    assert rows.tolist() == [1, 3, 0, 2] and starts.tolist() == [0, 1, 2, 4, 4] and slots.tolist()[:3] == [0, 1, 3]
    inputs.upload([1, 2, 3, 4], [0, 1, 2, 3], [1, 1, 1, 1], 4, buffer=1)
    inputs.copy_to_device(1)
    assert inputs.segments(4)[1].tolist() == [0] * 5


def random_moe(gen: torch.Generator, dim: int, inner: int, experts: int, top_k: int):
    """A MoE layer of random weights (router, gated fc1, fc2) in Moondream 3's layout."""
    from kestrel_backend.model.weights import Linear, MoE

    return MoE(Linear(torch.randn(experts, dim, generator=gen), torch.randn(experts, generator=gen)),
               torch.randn(experts, 2 * inner, dim, generator=gen) / dim ** 0.5,
               torch.randn(experts, dim, inner, generator=gen) / inner ** 0.5, top_k)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tokens, top_k", [(1, 3), (5, 3), (40, 2), (64, 8), (300, 3), (1400, 3)])
def test_expert_kernels_match_the_per_expert_loop(tokens, top_k, fp8, monkeypatch):
    """Moondream 3's grouped expert kernels (pairs grouped by expert, each expert's weights read once a tile of its
    rows; at 40 tokens more than one 16-row tile an expert; at 64 the bf16 decode tiles of 128-deep chunks; at 300 the
    prefill tiles of 128 rows; at 1400 more than 4,096 pairs, grouped by torch's sort, and more than one such tile an
    expert; at 1 the bf16 tiles of one token; at 5 in FP8 its few-token tiles; up to 16 tokens the router's logits
    come from its own kernel) against text.moe_mlp's loop; with FP8 experts (read as FP8, scaled after the dot)
    against the loop over the experts times their scales."""
    from kestrel_backend.model.legacy_layout import fp8_experts
    from kestrel_backend.model.text import moe_mlp
    from kestrel_backend.kernels import moe_kernels as mk

    if tokens >= 300:  # the bf16 prefill tiles (the interpreter's float32 is exact, and has room for them)
        monkeypatch.setattr(mk, "_tiles", lambda *_: mk.PREFILL_TILES)
    if tokens == 64:
        monkeypatch.setattr(mk, "_tiles", lambda *_: mk.DECODE_TILES)
    if tokens == 1:
        monkeypatch.setattr(mk, "_tiles", lambda *_: mk.ONE_TOKEN_TILES)
    if tokens == 5 and fp8:
        monkeypatch.setattr(mk, "_tiles", lambda *_: mk.FP8_FEW_TOKEN_TILES)
    gen = torch.Generator().manual_seed(3)
    moe = random_moe(gen, dim=128, inner=128, experts=8, top_k=top_k)
    if fp8:
        moe = fp8_experts(moe)
    x = torch.randn(tokens, 128, generator=gen)
    got = mk.moe_mlp_cuda(x, moe)
    assert rel_err(got, moe_mlp(x, moe)) < 1e-5


@pytest.mark.parametrize("tokens, gemv, reads_fp8", [(1, True, True), (1, False, False), (5, True, True),
                                                     (128, True, True), (129, True, False), (1400, True, False)])
def test_fp8_experts_with_widened_copies_are_read_as_fp8_only_in_decode_steps(tokens, gemv, reads_fp8, monkeypatch):
    """KESTREL_FP8_EXPERTS=both: a prefill reads the widened copies, a decode step the FP8 experts and their scales
    (one row's only where its GEMVs take the experts' shapes); either way the MLP equals the loop over the experts
    times their scales."""
    from kestrel_backend.model.legacy_layout import fp8_experts
    from kestrel_backend.model.text import moe_mlp
    from kestrel_backend.kernels import moe_kernels as mk

    if gemv:
        monkeypatch.setattr(mk, "GEMV_TILES", (dict(BLOCK_N=16, BLOCK_K=32, num_warps=4),) * 2)
    gen = torch.Generator().manual_seed(4)
    moe = fp8_experts(random_moe(gen, dim=64, inner=64, experts=8, top_k=2))
    moe.fc1_wide, moe.fc2_wide = moe.widened(torch.float32)
    fc1, fc1_scale, fc2, fc2_scale = mk.experts_for(moe, tokens)
    assert (fc1 is moe.fc1, fc2 is moe.fc2) == (reads_fp8, reads_fp8)
    assert (fc1_scale is None, fc2_scale is None) == (not reads_fp8, not reads_fp8)
    x = torch.randn(tokens, 64, generator=gen)
    assert rel_err(mk.moe_mlp_cuda(x, moe), moe_mlp(x, moe)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_tokens_fp8_experts_as_gemvs_match_the_per_expert_loop(dtype, monkeypatch):
    """A decode step of one row over FP8 experts: a program a (slot of the token's top k, block of columns), the
    token's top k and their weights ranked by the router kernel's last program; the MLP and each pair's weighted row
    (summed=False, as the decode step takes them) against the loop over the experts times their scales, and each row
    against its slot's expert alone times its weight."""
    from kestrel_backend.model.legacy_layout import fp8_experts
    from kestrel_backend.model.text import moe_mlp, top_experts
    from kestrel_backend.kernels import moe_kernels as mk

    monkeypatch.setattr(mk, "GEMV_TILES", (dict(BLOCK_N=16, BLOCK_K=64, num_warps=4),
                                           dict(BLOCK_N=32, BLOCK_K=32, num_warps=4)))
    gen = torch.Generator().manual_seed(11)
    moe = fp8_experts(random_moe(gen, dim=128, inner=96, experts=8, top_k=3))
    assert mk._gemv_takes(1, True, 128, 96)
    launched = []
    monkeypatch.setattr(mk, "_moe_gemv", lambda *a, _f=mk._moe_gemv, **k: launched.append(1) or _f(*a, **k))
    x = torch.randn(1, 128, generator=gen)
    want = moe_mlp(x, moe)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(mk.moe_mlp_cuda(x.to(dtype), moe).float(), want) < tol
    rows = mk.moe_mlp_cuda(x.to(dtype), moe, summed=False)
    assert rows.shape == (3, 128) and rows.dtype == torch.float32 and launched == [1, 1]
    assert rel_err(rows.sum(0, keepdim=True), want) < tol
    logits = F.linear(x.to(dtype).float(), moe.router.weight, moe.router.bias).to(dtype)  # (the router kernel's)
    ids, weights = top_experts(logits.float(), 3, dtype)
    for j, expert in enumerate(ids[0].tolist()):
        fc1, fc2 = moe.expert(expert, torch.float32)
        h, g = F.linear(x, fc1).split(96, dim=-1)
        row = F.linear(F.gelu(h) * (g + 1.0), fc2)[0] * weights[0, j].float()
        assert rel_err(rows[j], row) < (tol if dtype == torch.float32 else 0.1)  # (bf16: 7e-2 where a row cancels)


@pytest.mark.parametrize("tokens, top_k, fp8", [(300, 3, False), (600, 8, False), (600, 8, True)])
def test_grouped_gemm_path_matches_the_per_expert_loop(tokens, top_k, fp8):
    """The long-prefill path (rows gathered in expert order, torch's grouped GEMM, the gated GELU and the weighted
    sum of each token's rows as kernels of their own) against text.moe_mlp's loop; experts with no rows included;
    FP8 experts widened to the activations' type first. 600 tokens of 8 experts: 4,800 pairs, past the 4,096 from which
    prefill takes this path."""
    from kestrel_backend.model.legacy_layout import fp8_experts
    from kestrel_backend.model.text import moe_mlp
    from kestrel_backend.kernels import moe_kernels as mk

    gen = torch.Generator().manual_seed(8)
    moe = random_moe(gen, dim=96, inner=80, experts=12, top_k=top_k)
    moe.router.bias[5] = -1e4  # (an expert no token chooses)
    if fp8:
        moe = fp8_experts(moe)
    x = torch.randn(tokens, 96, generator=gen)
    routing = mk._route_and_group(mk.router_logits(x, moe.router.weight, moe.router.bias), top_k, x.dtype)
    assert routing.starts[5] == routing.starts[6]
    got = mk._moe_mlp_grouped(x, routing, moe)
    assert rel_err(got, moe_mlp(x, moe)) < 1e-5


@pytest.mark.parametrize("tokens", [40, 600])
def test_experts_added_in_place_with_the_bias(tokens):
    """A MoE layer's residual: out + bias + the expert MLP, added in place (at 600 tokens inside the kernel that
    sums each token's rows on the grouped GEMM's path, at 40 after the expert kernels)."""
    from kestrel_backend.model.text import moe_mlp
    from kestrel_backend.kernels import moe_kernels as mk

    gen = torch.Generator().manual_seed(9)
    moe = random_moe(gen, dim=64, inner=64, experts=8, top_k=3)
    x, out, bias = torch.randn(tokens, 64, generator=gen), torch.randn(tokens, 64, generator=gen), torch.randn(64)
    want = out + bias + moe_mlp(x, moe)
    if tokens < 100:
        mk.add_moe_mlp(out, x, moe, bias)
    else:  # (the grouped GEMM's path runs on bf16 CUDA tensors only: called as add_moe_mlp calls it there)
        assert mk._moe_mlp_grouped(x, mk._routing(x, moe.router, moe.top_k), moe, out, bias) is out
    assert rel_err(out, want) < 1e-5


def test_fp8_rows_for_the_w8a8_grouped_gemm():
    """The W8A8 path's FP8 operands: each pair's token row gathered in the pairs' order with a scale of its own
    (the row's largest magnitude over 448), and the gated GELU's rows with theirs. Values on e4m3's grid in the
    first case, so the conversion is exact (the interpreter rounds some values up to the next power of two wrongly:
    0.06 of a row's norm against 0.025 on the GPU), within that in the second."""
    from kestrel_backend.kernels import moe_kernels as mk

    gen = torch.Generator().manual_seed(10)
    tokens, top_k, dim = 9, 3, 96
    grid = torch.randn(tokens, dim, generator=gen).mul(100).to(torch.float8_e4m3fn).float()
    grid[:, 5] = 448.0  # (each row's largest value: its scale is exactly its token's)
    token_scale = torch.rand(tokens, generator=gen) + 0.5
    x = grid * (token_scale[:, None] / 448.0)
    order = torch.randperm(tokens * top_k, generator=gen).to(torch.int32)
    rows, scales = mk.gathered_fp8_rows(x, order, top_k)
    token = (order // top_k).long()
    assert rows.dtype == torch.float8_e4m3fn and torch.equal(rows.float(), grid[token])
    assert rel_err(scales, token_scale[token] / 448.0) < 1e-6
    h = torch.randn(11, 2 * 40, generator=gen)
    act, act_scales = mk.gated_gelu_fp8(h)
    want = F.gelu(h[:, :40]) * (h[:, 40:] + 1.0)
    assert rel_err(act_scales, want.abs().amax(1) / 448.0) < 1e-6
    assert rel_err(act.float() * act_scales[:, None], want) < 0.08


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 64, 8), (37, 64, 8), (20, 12, 3), (700, 64, 8)])
def test_route_kernel_picks_the_top_experts_and_groups_the_pairs(tokens, experts, top_k):
    """One program's routing (a long prefill's: two passes, a program a block of tokens, then one a block of pairs)
    against torch's topk and softmax: the same top logits best first, equal logits in the order of their expert ids,
    the same weights; every (token, slot) pair in its expert's run, each once."""
    from kestrel_backend.model.text import top_experts
    from kestrel_backend.kernels.moe_kernels import route_and_group

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(tokens, experts, generator=gen).round(decimals=1)  # (ties within rows)
    gates, order, starts = route_and_group(logits, top_k, torch.float32)
    ref_ids, ref_gates = top_experts(logits, top_k, torch.float32)
    assert rel_err(gates, ref_gates) < 1e-6
    pairs = tokens * top_k
    assert sorted(order.tolist()) == list(range(pairs)) and starts[0] == 0 and starts[-1] == pairs
    ids = torch.empty(pairs, dtype=torch.long)
    for e in range(experts):
        ids[order[starts[e]:starts[e + 1]].long()] = e
    ids = ids.view(tokens, top_k)
    chosen = logits.gather(1, ids)
    assert torch.equal(chosen, logits.gather(1, ref_ids))  # the same values, best first
    tied = chosen[:, 1:] == chosen[:, :-1]
    assert tied.any() and (ids[:, 1:] > ids[:, :-1])[tied].all()


@pytest.mark.parametrize("tokens, valid", [(40, 27), (12, 5)])
def test_routing_takes_only_the_valid_leading_tokens(tokens, valid):
    """With a device count of valid tokens (a prefill graph's real rows), the route kernel (40 tokens) and the
    router kernel's last program (12) group the pairs of those tokens only, as routing them alone does: the padded
    tokens, NaN here, choose no expert (pair count valid * k), their gates left unwritten."""
    from kestrel_backend.kernels import moe_kernels as mk

    gen = torch.Generator().manual_seed(tokens)
    moe = random_moe(gen, dim=96, inner=80, experts=12, top_k=3)
    x = torch.randn(tokens, 96, generator=gen)
    x[valid:] = float("nan")
    count = torch.tensor([valid], dtype=torch.int32)
    gates, order, starts = mk.route_and_group(mk.router_logits(x[:valid], moe.router.weight, moe.router.bias), 3,
                                              x.dtype)
    groups = [sorted(order[starts[e]:starts[e + 1]].tolist()) for e in range(12)]
    got_gates, got_order, got_starts = mk.route_experts(x, moe.router, 3, count)
    assert torch.equal(got_starts, starts) and starts[-1] == 3 * valid
    assert torch.equal(got_gates[:valid], gates)
    assert [sorted(got_order[starts[e]:starts[e + 1]].tolist()) for e in range(12)] == groups


@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_the_router_kernels_last_program_routes_as_the_route_kernel(tokens):
    """route_experts (the router's logits, then in the same launch its last program's routing) gives the gates and
    groups of route_and_group on router_logits, twice in a row: its done counter is back at zero after a launch."""
    from kestrel_backend.kernels import moe_kernels as mk

    gen = torch.Generator().manual_seed(tokens)
    moe = random_moe(gen, dim=96, inner=80, experts=12, top_k=3)
    x = torch.randn(tokens, 96, generator=gen)
    gates, order, starts = mk.route_and_group(mk.router_logits(x, moe.router.weight, moe.router.bias), 3, x.dtype)
    groups = [sorted(order[starts[e]:starts[e + 1]].tolist()) for e in range(12)]
    for _ in range(2):
        got_gates, got_order, got_starts = mk.route_experts(x, moe.router, 3)
        assert torch.equal(got_gates, gates) and torch.equal(got_starts, starts)
        assert [sorted(got_order[starts[e]:starts[e + 1]].tolist()) for e in range(12)] == groups
        assert mk._done_counter(x).item() == 0


@pytest.mark.parametrize("experts, top_k", [(64, 8), (12, 3)])
def test_one_tokens_top_experts_ranked_in_the_router_kernel_match_torchs_topk(experts, top_k):
    """top_experts_of_one (the router kernel's last program ranks the token's logits at once) against torch's topk
    and softmax: the same experts best first, equal logits in the order of their expert ids, the same weights; twice
    in a row (its done counter back at zero)."""
    from kestrel_backend.model.text import top_experts
    from kestrel_backend.model.weights import Linear
    from kestrel_backend.kernels import moe_kernels as mk

    gen = torch.Generator().manual_seed(experts)
    logits = torch.randn(experts, generator=gen).round(decimals=1)
    logits[[1, 5, 9]] = logits.max()  # (ties at the top)
    weight = torch.zeros(experts, 32)
    weight[:, 0] = logits
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0  # (x @ weight.T = the logits)
    want_ids, want_gates = top_experts(logits[None], top_k, torch.float32)
    for _ in range(2):
        ids, gates = mk.top_experts_of_one(x, Linear(weight, torch.zeros(experts)), top_k)
        chosen = logits[ids.long()]
        assert torch.equal(chosen, logits[want_ids[0]]) and rel_err(gates, want_gates) < 1e-6
        tied = chosen[1:] == chosen[:-1]
        assert tied.sum() >= 2 and (ids[1:] > ids[:-1])[tied].all()
        assert mk._done_counter(x).item() == 0


@pytest.mark.parametrize("top_k, norm", [(3, True), (0, True), (3, False)])
def test_residual_norm_kernel_matches_torch(top_k, norm):
    """The end of a Moondream 3 decode layer in one kernel (expert rows summed, + proj, + x, the next layer's
    norm) against torch's ops, on rows of a width that is not a power of two."""
    from kestrel_backend.model.layers import layer_norm
    from kestrel_backend.model.weights import LayerNorm
    from kestrel_backend.kernels.residual_kernels import residual_norm

    gen = torch.Generator().manual_seed(7)
    t, n = 5, 96
    proj, x = torch.randn(t, n, generator=gen), torch.randn(t, n, generator=gen)
    mlp = torch.randn(t * top_k if top_k else t, n, generator=gen)
    ln = LayerNorm(torch.randn(n, generator=gen), torch.randn(n, generator=gen))
    out, h = residual_norm(proj, mlp, top_k, x, ln if norm else None)
    want = proj + (mlp.view(t, top_k, n).sum(1) if top_k else mlp) + x
    assert rel_err(out, want) < 1e-6
    assert (rel_err(h, layer_norm(want, ln)) < 1e-5) if norm else h is None


@pytest.mark.parametrize("tokens", [1, 6])
def test_tau_kernel_matches_the_torch_scales(tokens):
    """Moondream 3's tau scaling in one kernel, in place, against text.tau_scales at positions past 4,096."""
    from kestrel_backend.kernels.tau_cuda import tau_inplace
    from kestrel_backend.model.text import tau_scales, tau_token_part
    from kestrel_backend.model.weights import Tau

    gen = torch.Generator().manual_seed(4)
    heads, hd = 2, 64
    tau = Tau(torch.randn(heads, generator=gen), torch.randn(2 * heads, 3 * heads * hd, generator=gen) / 20)
    qkv = torch.randn(tokens, 3 * heads * hd, generator=gen)
    positions = torch.tensor([0, 5, 700, 2048, 4100, 30000][:tokens])
    scale_q, scale_v = tau_scales(qkv, positions, tau)
    want = qkv.view(tokens, 3, heads, hd).clone()
    want[:, 0] *= scale_q[..., None]
    want[:, 2] *= scale_v[..., None]
    got = qkv.clone()
    tau_inplace(got, tau_token_part(qkv, tau), tau.alpha, positions, heads, hd)
    assert rel_err(got, want.view(tokens, -1)) < 1e-6


def _shared_prefix_tables(page: int, g):
    """Page tables of rows on two image prefixes (18 rows on the first: two groups; 2 on the second) and of
    three rows alone, the prefixes' pages shared, every other page a row's own, scattered; lengths count the new
    token. -> (tables [B, P] int32, lens [B], slots [B], number of pages)."""
    prefix_pages, page_pool = [3, 2], torch.randperm(400, generator=g).tolist()
    prefixes = [[page_pool.pop() for _ in range(n)] for n in prefix_pages]
    rows = [(0, 3 * page + 1 + i) for i in range(18)] + [(1, 2 * page + 5), (1, 2 * page + 9)]
    rows += [(None, n) for n in (1, 7, 3 * page + 2)]
    tables = torch.zeros(len(rows), 8, dtype=torch.int32)
    for i, (prefix, n) in enumerate(rows):
        own = prefixes[prefix] if prefix is not None else []
        pages = own + [page_pool.pop() for _ in range(-(-n // page) - len(own))]
        tables[i, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    last = lens.long() - 1
    slots = tables[torch.arange(len(rows)), last // page].long() * page + last % page
    return tables, lens, slots, 400


@pytest.mark.parametrize("rotate", [True, False])  # the decode step's unrotated qkv; a flat step's rotated q/k rows
def test_grouped_attention_matches_attention_over_each_rows_pages(rotate):
    from kestrel_backend.kernels.grouped_attention import GROUP, group_rows, grouped_attention

    cfg = TextConfig(dim=256, ff_dim=512, n_layers=1, n_heads=4, n_kv_heads=2)  # grouped-query, head_dim 64
    g = torch.Generator().manual_seed(1)
    page, hkv, d = 4, cfg.n_kv_heads, cfg.head_dim
    tables, lens, slots, n_pages = _shared_prefix_tables(page, g)
    b = len(lens)
    k_cache, v_cache = (torch.randn(n_pages * page, hkv, d, generator=g) for _ in range(2))
    groups, shared = np.zeros((b, GROUP), dtype=np.int32), np.zeros(b, dtype=np.int32)
    n_groups = group_rows(tables.numpy(), lens.numpy() - 1, page, groups, shared)
    # 16 + 2 rows on the first prefix, 2 on the second, three alone (all their cached positions their own)
    assert n_groups == 6 and sorted(shared[:n_groups].tolist()) == [0, 6, 2 * page, 3 * page, 3 * page, 3 * page + 1]
    assert (groups[n_groups:] == -1).all() and sorted(groups[groups >= 0].tolist()) == list(range(b))
    width = (cfg.n_heads + 2 * hkv) * d
    qkv = torch.randn(b, 2 * width, generator=g)[:, :width]  # strided rows, like the engine's
    table = rope_table(cfg)
    cos, sin = table[lens.long() - 1, :, 0].contiguous(), table[lens.long() - 1, :, 1].contiguous()
    q, k, v = split_qkv_with_rope(qkv.clone(), cos, sin, cfg)
    before = k_cache.clone(), v_cache.clone()
    if rotate:
        heads = qkv.view(b, -1, d)
        got = grouped_attention(heads[:, :cfg.n_heads], heads[:, cfg.n_heads:cfg.n_heads + hkv],
                                heads[:, cfg.n_heads + hkv:], k_cache, v_cache, tables, lens, slots,
                                torch.from_numpy(groups), torch.from_numpy(shared), page, cos, sin)
    else:  # the rows at other places of the step: rows[j] is row j's
        place = torch.randperm(b + 3, generator=g)[:b]
        flat = torch.zeros(b + 3, width)
        flat[place] = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)
        heads = flat.view(b + 3, -1, d)
        got = grouped_attention(heads[:, :cfg.n_heads], heads[:, cfg.n_heads:cfg.n_heads + hkv],
                                heads[:, cfg.n_heads + hkv:], k_cache, v_cache, tables, lens, slots,
                                torch.from_numpy(groups), torch.from_numpy(shared), page,
                                rows=place.to(torch.int32))[place]
    assert torch.allclose(k_cache[slots], k, atol=1e-6) and torch.equal(v_cache[slots], v)
    untouched = torch.ones(len(k_cache), dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(k_cache[untouched], before[0][untouched])
    assert torch.equal(v_cache[untouched], before[1][untouched])
    for i, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        rows = tables[i, pos // page].long() * page + pos % page
        ref = attend(q[i:i + 1], k_cache[rows], v_cache[rows])
        assert rel_err(got[i].view(cfg.n_heads, d), ref[0]) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tau_of_a_few_rows_in_one_kernel_matches_the_torch_path(dtype):
    """tau_rows (the token part's GELU and product inside the kernel, out of place) against the torch path's
    scales, one row at position 3 and one at 4,100 (past 2,048 and 4,096), k left as it is."""
    from kestrel_backend.kernels.tau_cuda import tau_rows
    from kestrel_backend.model.text import tau_scales
    from kestrel_backend.model.weights import Tau

    g = torch.Generator().manual_seed(5)
    heads, head_dim, rows = 4, 16, 2
    qkv = (torch.randn(rows, 3 * heads * head_dim, generator=g) * 2).to(dtype)
    tau = Tau(alpha=torch.randn(heads, generator=g).to(dtype), w=(torch.randn(2 * heads, qkv.shape[1], generator=g)
                                                                   / 8).to(dtype))
    positions = torch.tensor([3, 4100], dtype=torch.int32)
    got = tau_rows(qkv, tau.w, tau.alpha, positions, heads, head_dim)
    scale_q, scale_v = tau_scales(qkv, positions, tau)
    q, k, v = qkv.view(rows, 3, heads, head_dim).unbind(1)
    ref = torch.stack([q * scale_q[..., None], k, v * scale_v[..., None]], 1).view(rows, -1)
    assert torch.equal(got.view(rows, 3, heads, head_dim)[:, 1], k)
    assert rel_err(got.float(), ref.float()) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("tma", [False, True])
def test_fp8_linear_applies_both_scales_the_bias_and_gelu(tma):
    """KESTREL_VISION_FP8's GEMM (kernels/fp8_linear.py), by pointer loads (sm89) and by tensor descriptors
    (Hopper): e4m3 rows times e4m3 output channels, each with its own scale, plus the bias and the tanh GELU, equal
    the same matmul of the dequantised operands; edge tiles (rows and columns past a tile) are stored and no more."""
    from kestrel_backend.kernels.fp8_linear import Fp8Weight, fp8_linear
    from kestrel_backend.kernels.layer_norm_cuda import shifted_layer_norm_fp8

    g = torch.Generator().manual_seed(5)
    m, k, n = 131, 256, 200
    x = torch.randn(m, k, generator=g) * torch.linspace(0.1, 8, m)[:, None]  # rows of other ranges
    ln_w, ln_b = torch.randn(k, generator=g), torch.randn(k, generator=g)
    shift = torch.randn(k, generator=g)
    x8, x_scale = shifted_layer_norm_fp8(x, shift, ln_w, ln_b)
    normed = F.layer_norm(x + shift, (k,), ln_w, ln_b)
    assert x8.dtype == torch.float8_e4m3fn and rel_err(x_scale, normed.abs().amax(1) / 448) < 1e-6  # (e4m3's max)
    want8 = (normed / x_scale[:, None]).to(torch.float8_e4m3fn)
    assert rel_err(want8.float() * x_scale[:, None], normed) < 0.04  # (e4m3: 3 mantissa bits)
    # Triton's interpreter rounds some values just under a power of two down a binade (124 -> 64); the GPU as torch
    assert float((x8.float() != want8.float()).float().mean()) < 0.05
    w = Fp8Weight.of(torch.randn(n, k, generator=g) * torch.linspace(0.01, 1, n)[:, None])
    bias = torch.randn(n, generator=g)
    dequantised = (x8.float() * x_scale[:, None]) @ (w.weight.float() * w.scale[:, None]).t() + bias
    for gelu in (False, True):
        got = fp8_linear(x8, x_scale, w, bias, gelu=gelu, out_dtype=torch.float32, tma=tma)
        want = F.gelu(dequantised, approximate="tanh") if gelu else dequantised
        assert got.shape == (m, n) and rel_err(got, want) < 1e-5
    # as the FP8 MLP runs it: fc1's GELU output in e4m3 at given row scales (clamped at e4m3's 448 where a scale is
    # too small: some of these are), then fc2 with no bias, added onto the residual stream in place
    out_scale = torch.rand(m, generator=g) * 0.05 + 0.005
    got8 = fp8_linear(x8, x_scale, w, bias, gelu=True, out_scale=out_scale, tma=tma)
    limit = 448 * out_scale[:, None]
    want = torch.maximum(torch.minimum(F.gelu(dequantised, approximate="tanh"), limit), -limit)
    assert got8.dtype == torch.float8_e4m3fn and bool((want.abs() == limit).any())
    assert rel_err(got8.float() * out_scale[:, None], want) < 0.04  # (e4m3: 3 mantissa bits)
    stream = torch.randn(m, n, generator=g)
    added = stream.clone()
    assert fp8_linear(x8, x_scale, w, None, tma=tma, accumulate=added) is added
    assert rel_err(added, stream + dequantised - bias) < 1e-5


def test_norm_bounds_fc1s_gelu_output_for_e4m3():
    """shifted_layer_norm_fp8's third output, the row scales at which the FP8 MLP's fc1 writes its GELU output: no
    row's largest value passes e4m3's 448 at its scale, and the bound is loose by a bounded factor only (these random
    weights: 11 to 16x; e4m3 keeps 3 mantissa bits down to 2^-6 of 448)."""
    from kestrel_backend.kernels.fp8_linear import Fp8Weight
    from kestrel_backend.kernels.layer_norm_cuda import shifted_layer_norm_fp8

    g = torch.Generator().manual_seed(6)
    m, k, n = 67, 256, 320
    x = torch.randn(m, k, generator=g) * torch.linspace(0.1, 8, m)[:, None]
    ln_w, ln_b, shift = torch.randn(k, generator=g), torch.randn(k, generator=g), torch.randn(k, generator=g)
    w = Fp8Weight.of(torch.randn(n, k, generator=g) / 16)
    bias = torch.randn(n, generator=g)
    weight = w.weight.float() * w.scale[:, None]
    x8, x_scale, bound = shifted_layer_norm_fp8(x, shift, ln_w, ln_b,
                                                gelu_bound=(float(weight.norm(dim=1).max()), float(bias.abs().max())))
    peak = F.gelu((x8.float() * x_scale[:, None]) @ weight.t() + bias, approximate="tanh").abs().amax(1)
    assert bool((peak <= 448 * bound).all()) and bool((448 * bound < 20 * peak).all()), (448 * bound / peak)


def test_fp8_vision_blocks_follow_the_bf16_blocks(tiny_model):
    """The encoder with qkv, fc1 and fc2 in e4m3 (KESTREL_VISION_FP8) stays near the unquantised blocks and uses the
    quantised weights (an fc1 or fc2 weight zeroed in e4m3 alone moves the output). Its first four blocks: in the
    Triton interpreter all 27 took a minute of CI, and the blocks are alike."""
    import dataclasses

    from kestrel_backend.model import vision

    v = tiny_model.config.vision
    w = dataclasses.replace(tiny_model.weights.vision, blocks=tiny_model.weights.vision.blocks[:4])
    crops = torch.rand(1, 3, v.crop_size, v.crop_size, generator=torch.Generator().manual_seed(0)) * 2 - 1
    x = vision.embed_patches(crops, w, v)
    want = vision._encode_blocks_cuda(x.clone(), w, v)
    try:
        vision.quantize_encoder(w)
        got = vision._encode_blocks_cuda(x.clone(), w, v)
        cosine = F.cosine_similarity(got.flatten(1), want.flatten(1), dim=1)
        assert rel_err(got, want) < 0.1 and bool((cosine > 0.99).all()), (rel_err(got, want), cosine)
        w.fp8[3].fc2.weight.zero_()
        without_fc2 = vision._encode_blocks_cuda(x.clone(), w, v)
        assert rel_err(without_fc2, got) > 1e-3
        w.fp8[2].fc1.weight.zero_()
        assert rel_err(vision._encode_blocks_cuda(x.clone(), w, v), without_fc2) > 1e-3
    finally:
        w.fp8 = None


def test_fp8_prefill_follows_the_bf16_blocks(tiny_model):
    """KESTREL_PREFILL_FP8: a step of 256 tokens through the text blocks with qkv, fc1 and fc2 in e4m3 stays near the
    unquantised blocks and uses the quantised weights (fc2 zeroed in e4m3 alone moves the output); a step of fewer
    tokens (decode) is not quantised at all: bit for bit the unquantised blocks' output. Attention hands back v: the
    random tiny model's sharp softmax turns any 5% change of its input into 20-50% of its output, which would hide
    what the matmuls do."""
    import dataclasses

    from kestrel_backend.model import text

    config = tiny_model.config.text
    w = dataclasses.replace(tiny_model.weights.text)  # (its own fp8 list; the blocks stay shared and unchanged)
    x = torch.randn(text.FP8_MIN_ROWS, config.dim, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(len(x))

    def run(rows: int) -> torch.Tensor:
        return text.decode(x[:rows].clone(), positions[:rows], w, config, tiny_model.rope, lambda i, q, k, v: v)

    want, want_short = run(len(x)), run(len(x) - 1)
    text.quantize_prefill(w)
    got = run(len(x))
    cosine = F.cosine_similarity(got, want, dim=1)
    assert rel_err(got, want) < 0.12 and bool((cosine > 0.98).all()), (rel_err(got, want), cosine.min())
    assert torch.equal(run(len(x) - 1), want_short)
    w.fp8[-1].fc2.weight.zero_()
    assert rel_err(run(len(x)), got) > 1e-3
