"""Decode attention for rows that share an image prefix: one program per (group of rows, head) reads the
shared KV pages once for every row of its group.

Questions on one image share its prefix's pages (the prefix cache), so a step of 64 rows on 32 images need
read each image's 720 shared positions only once, not twice. The per-row kernel (decode_kernels) reads them
once per row, and is bound by moving each row's keys into its program more than by HBM: H200, 64 rows at 776
positions, each call in a CUDA graph, 144 / 126 / 105 us a layer when no rows, pairs or all rows share the first 720
(here 135 / 76 / 62, pairs against a 52 us KV floor; benchmarks/experiments/decode_attention.py). Here a group's rows
are one tensor-core tile of GROUP query rows: the shared positions are read once for the tile, each row's own
positions (after the shared ones) in the same program with the other rows masked, and its new token, whose k/v the
program also stores into the cache, straight from its qkv row. With few rows there are too few programs (H100, 16
rows, none sharing: 117 against 89 us).

Groups come from the rows' page tables (group_rows): rows whose tables start with the same page share the
pages that their tables have in common; a row alone is a group of one."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

GROUP = 16  # rows a program takes (tl.dot's smallest tile); more rows on one prefix make several groups
# positions a tile, warps, pipeline stages (64 rows in pairs: `decode_attention.py --tiles`; H100: 3 or 4 stages, or
# 32 or 128 positions a tile, 7 to 12% slower, 8 warps 24%; H200 in CUDA graphs: every other tile 8 to 59% slower)
KV_BLOCK, WARPS, STAGES = 64, 4, 2


@triton.jit
def _attend_block(qr, qp, k_cache_ptr, v_cache_ptr, tables_ptr, bt_stride, row, start, hi, visible_rows, m_i, l_i,
                  acc, kvh, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Positions [start, start + BLOCK_N) below hi of page-table row `row`, seen by visible_rows of the tile:
    one online-softmax update (base 2) of every row's maximum, sum and output."""
    offs_n = start + tl.arange(0, BLOCK_N)
    valid = offs_n < hi
    page = tl.load(tables_ptr + row * bt_stride + offs_n // PAGE, mask=valid, other=0)
    base = ((page.to(tl.int64) * PAGE + offs_n % PAGE) * HKV + kvh) * D
    kr = tl.load(k_cache_ptr + base[:, None] + tl.arange(0, ROT)[None, :], mask=valid[:, None], other=0.0)
    kp = tl.load(k_cache_ptr + base[:, None] + ROT + tl.arange(0, D - ROT)[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(v_cache_ptr + base[:, None] + tl.arange(0, D)[None, :], mask=valid[:, None], other=0.0)
    s = tl.dot(qr, tl.trans(kr), input_precision=PRECISION) + tl.dot(qp, tl.trans(kp), input_precision=PRECISION)
    s = tl.where(visible_rows[:, None] & valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # (every row's m_i is finite: its new token's score)
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _grouped_attention_kernel(q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, rows_ptr, cos_ptr, sin_ptr,
                              k_cache_ptr, v_cache_ptr, tables_ptr, bt_stride, lens_ptr, slots_ptr, groups_ptr,
                              shared_ptr, out_ptr, out_stride, scale, H: tl.constexpr, HKV: tl.constexpr,
                              D: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr, GROUP: tl.constexpr,
                              BLOCK_N: tl.constexpr, ROTATE: tl.constexpr, GATHER: tl.constexpr,
                              PRECISION: tl.constexpr):
    """Program (group, head). A group is up to GROUP row indices j (-1 after the last), each naming a row's
    page table, length counting its new token (lens), new token's cache row (slots) and, with ROTATE, the
    rotary cos/sin of its position; its q/k/v are row rows[j] of q/k/v (row j without GATHER). Without ROTATE
    q and k are rotated already. The first `shared` positions are in the same pages for every row of the
    group (those of its first row are read)."""
    g, h = tl.program_id(0), tl.program_id(1)
    lead = tl.load(groups_ptr + g * GROUP)
    if lead >= 0:
        ROT: tl.constexpr = 2 * HALF
        kvh = h // (H // HKV)
        offs_g = tl.arange(0, GROUP)
        members = tl.load(groups_ptr + g * GROUP + offs_g)
        member = members >= 0
        j = tl.where(member, members, lead)
        r = (tl.load(rows_ptr + j) if GATHER else j).to(tl.int64)
        offs_rot, offs_pass, offs_d = tl.arange(0, ROT), ROT + tl.arange(0, D - ROT), tl.arange(0, D)
        q_row = q_ptr + r[:, None] * q_stride + h * D
        k_row = k_ptr + r[:, None] * k_stride + kvh * D
        if ROTATE:  # halves are the real and imaginary parts; the rotated values interleave them (the cache's layout)
            i = tl.arange(0, HALF)[None, :]
            c = tl.load(cos_ptr + j[:, None] * HALF + i)
            s = tl.load(sin_ptr + j[:, None] * HALF + i)
            re, im = tl.load(q_row + i).to(tl.float32), tl.load(q_row + HALF + i).to(tl.float32)
            q_rot = tl.reshape(tl.join(re * c - im * s, re * s + im * c), [GROUP, ROT])
            re, im = tl.load(k_row + i).to(tl.float32), tl.load(k_row + HALF + i).to(tl.float32)
            k_rot = tl.reshape(tl.join(re * c - im * s, re * s + im * c), [GROUP, ROT]).to(k_cache_ptr.dtype.element_ty)
        else:
            q_rot = tl.load(q_row + offs_rot[None, :]).to(tl.float32)
            k_rot = tl.load(k_row + offs_rot[None, :]).to(k_cache_ptr.dtype.element_ty)
        q_rot = q_rot * scale
        q_pass = tl.load(q_row + offs_pass[None, :]).to(tl.float32) * scale
        k_pass = tl.load(k_row + offs_pass[None, :]).to(k_cache_ptr.dtype.element_ty)
        v_new = tl.load(v_ptr + r[:, None] * v_stride + kvh * D + offs_d[None, :])
        if h % (H // HKV) == 0:  # the first head of each kv head stores the new tokens' k/v
            base = (tl.load(slots_ptr + j).to(tl.int64)[:, None] * HKV + kvh) * D
            tl.store(k_cache_ptr + base + offs_rot[None, :], k_rot, mask=member[:, None])
            tl.store(k_cache_ptr + base + offs_pass[None, :], k_pass, mask=member[:, None])
            tl.store(v_cache_ptr + base + offs_d[None, :], v_new.to(v_cache_ptr.dtype.element_ty), mask=member[:, None])
        # each row's own new token first: its score starts the running maximum
        m_i = tl.sum(q_rot * k_rot.to(tl.float32), 1) + tl.sum(q_pass * k_pass.to(tl.float32), 1)
        l_i = tl.full([GROUP], 1.0, tl.float32)
        acc = v_new.to(tl.float32)
        qr, qp = q_rot.to(k_cache_ptr.dtype.element_ty), q_pass.to(k_cache_ptr.dtype.element_ty)
        shared = tl.load(shared_ptr + g)
        for start in range(0, shared, BLOCK_N):
            m_i, l_i, acc = _attend_block(qr, qp, k_cache_ptr, v_cache_ptr, tables_ptr, bt_stride, lead, start, shared,
                                          member, m_i, l_i, acc, kvh, HKV, D, ROT, PAGE, BLOCK_N, PRECISION)
        for m in range(0, tl.sum(member.to(tl.int32), 0)):  # each row's own cached positions
            row = tl.load(groups_ptr + g * GROUP + m)
            cached = tl.load(lens_ptr + row) - 1
            for start in range(shared, cached, BLOCK_N):
                m_i, l_i, acc = _attend_block(qr, qp, k_cache_ptr, v_cache_ptr, tables_ptr, bt_stride, row, start,
                                              cached, offs_g == m, m_i, l_i, acc, kvh, HKV, D, ROT, PAGE, BLOCK_N,
                                              PRECISION)
        tl.store(out_ptr + r[:, None] * out_stride + h * D + offs_d[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=member[:, None])


def grouped_attention(q, k, v, k_cache, v_cache, tables, lens, slots, groups, shared, page_size: int, cos=None,
                      sin=None, rows=None, out=None) -> torch.Tensor:
    """Attention of one new token per row over its paged context, rows grouped by shared pages.

    q [T, H, D] and k/v [T, Hkv, D] (rows may be strided: views of the qkv GEMM's output); caches [rows, Hkv, D];
    tables [B, P] int32, lens [B] int32 (counting the new token), slots [B] (its cache row), groups [G, GROUP]
    and shared [G] int32 (group_rows), for the B rows j; their q/k/v rows are rows[j] (int32), or j if rows is None.
    With cos/sin [B, rope_dim / 2] float32, q and k are rotated here (unrotated inputs), else they are rotated
    already. -> out [T, H * D] (rows not in a group left as they are)."""
    h, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and h % hkv == 0 and groups.shape[1] == GROUP
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and tables.stride(1) == 1
    out = torch.empty(q.shape[0], h * d, device=q.device, dtype=q.dtype) if out is None else out
    rotate = cos is not None
    # (the kernel splits each head at the rotary width into two dots; unrotated, any power-of-two split will do)
    half = cos.shape[1] if rotate else d // 4
    cos, sin = (cos, sin) if rotate else (lens, lens)  # (unread without ROTATE)
    _grouped_attention_kernel[(groups.shape[0], h)](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), rows if rows is not None else lens, cos, sin,
        k_cache, v_cache, tables, tables.stride(0), lens, slots, groups, shared, out, out.stride(0),
        1.4426950408889634 * d ** -0.5, H=h, HKV=hkv, D=d, HALF=half, PAGE=page_size, GROUP=GROUP, BLOCK_N=KV_BLOCK,
        ROTATE=rotate, GATHER=rows is not None, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=WARPS, num_stages=STAGES)
    return out



def group_rows(tables: np.ndarray, cached: np.ndarray, page_size: int, groups: np.ndarray, shared: np.ndarray) -> int:
    """Fill groups [B, GROUP] (row indices, -1 after each group's last) and shared [B] (positions its rows hold in
    the same pages) for B rows with page tables tables [B, P] and cached [B] positions before their new token.
    Rows whose tables start with the same page are one group (GROUP rows at most), sharing the pages their
    tables have in common; other rows are groups of one. -> the number of groups (the rest of groups is -1)."""
    n = len(tables)
    order = np.lexsort((np.arange(n), tables[:, 0]))
    first = tables[order, 0]
    new_run = np.r_[True, first[1:] != first[:-1]]
    run_start = np.flatnonzero(new_run)[np.cumsum(new_run) - 1]
    in_run = np.arange(n) - run_start
    new_group = in_run % GROUP == 0
    starts = np.flatnonzero(new_group)
    group = np.cumsum(new_group) - 1
    groups.fill(-1)
    groups[group, in_run % GROUP] = order
    cols = max(1, -(-int(cached.max()) // page_size))
    sorted_tables = tables[order, :cols]
    same = sorted_tables == sorted_tables[starts[group]]
    common = np.where(same.all(1), cols, same.argmin(1)) * page_size  # pages in common with the group's first row
    shared[:len(starts)] = np.minimum.reduceat(np.minimum(common, cached[order]), starts)
    shared[len(starts):] = 0
    return len(starts)
