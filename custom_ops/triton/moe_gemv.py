"""The FP4 expert GEMMs at decode widths (`moe_experts_w4a8` up to its DECODE_PAIRS; moe.py's
steps 1-2): a GEMV per (token, slot) pair, grid (sorted rows, N blocks, K splits): the packed
weights loaded as int32 words along K (eight values a word), a word's nibbles turned into E4M3
values four at a time (`fp4.e2m1_word_values`: on CUDA a few lines of PTX, since the work per
weight, not the bytes, bounds these GEMVs) and multiplied with the activation in FP32 (exact
products), each word's sum scaled by its group's scale, the words summed after the K loop
(FP4_STAGES: the loop's loads not pipelined); the FP32 partials summed in split order by the split
that counts last at its (row, N block) (acq_rel, as the FP8 split-K does; the up GEMMs' before
the epilogue, `moe_tiles.swiglu_store`), so each GEMM is one launch. At decode widths a tile
holds about one real row, so MMA tiles bought nothing: on the H200, one token's six experts' up
GEMMs ran 1.5x and down GEMMs 2.0x faster as GEMVs than as bf16-dequant MMA tiles.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from custom_ops.triton.common import next_block, pdl, pdl_wait, tma_descriptor
from custom_ops.triton.fp4 import fp4_groups_dot, fp4_words_dot, fp4_words_load
from custom_ops.triton.fp8 import sum_splits, tile_counters
from custom_ops.triton.moe_tiles import swiglu_store

# the FP4 GEMVs' K block and weight rows a program: with the plain loads 64 x 128 (and 32 x 256)
# fastest at one token (H200); with the TMA loads 256-wide K blocks, flash-slice's batch-1 FULL
# decode on an H100 9.96 against 10.09 ms of device time at 128 (tma-knobs-h100.json)
FP4_BLOCK_K, FP4_TMA_BLOCK_K = 128, 256
FP4_BLOCK_N = 64
FP4_STAGES = 1           # the GEMVs' loads unpipelined: 3 stages took 1.38-1.54x (native-gemm-paths-h200.json)
# whether the GEMVs on bf16 activations load their weight tiles through tensor descriptors (TMA),
# and how many in flight: flash-slice's batch-1 FULL decode step on the H200, 10.10 ms of device
# time with the plain loads, 9.70 with these TMA, 9.16 with the FP8 GEMV's too (tma-knobs-h200.json)
FP4_TMA, FP4_TMA_STAGES = True, 3


@triton.jit
def gemv_row(order_ptr, ids_ptr, k_split, BLOCK_N: tl.constexpr, SORTED: tl.constexpr):
    """A GEMV program's (row, its pair, the pair's expert (-1: padding), its output columns, the
    first K of its split). SORTED: row r holds pair order[r] (the pairs grouped by expert, so
    the programs of one expert's pairs run together and share its weights in L2); else pair r."""
    r = tl.program_id(0)
    pair = tl.load(order_ptr + r).to(tl.int64) if SORTED else r.to(tl.int64)
    return r, pair, tl.load(ids_ptr + pair).to(tl.int64), \
        tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N), tl.program_id(2) * k_split


@triton.jit
def tma_gemv_sums(desc, s_rows, row0, a_ptr, k_lo, k_hi, nmask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  STAGES: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_N] FP32 sums over K range [k_lo, k_hi) of rows row0.. of packed FP4 weights (desc: a
    tensor descriptor of their int32 words, [rows, K / 8] in blocks [BLOCK_N, BLOCK_K / 8], loads
    pipelined STAGES deep; s_rows: the rows' scale codes) against the bf16 activation at a_ptr
    (`fp4_groups_dot`)."""
    G: tl.constexpr = BLOCK_K // 32
    g3 = tl.arange(0, G)[None, :, None]
    a_words = a_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + \
        (16 * g3 + 4 * tl.arange(0, 4)[None, None, :])[:, :, :, None] + tl.arange(0, 4)[None, None, None, :]
    acc = tl.zeros([BLOCK_N, G, 4], tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        words = tl.reshape(desc.load([row0, k0 // 8]), [BLOCK_N, G, 4])
        codes = tl.load(s_rows[:, None, None] + k0 // 32 + g3, mask=nmask[:, None, None], other=127)
        acc = fp4_groups_dot(acc, a_words + k0 // 2, words, codes, ASM)
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _fp4_up_gemv(xq_ptr, ids_ptr, order_ptr, wts_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, part_ptr, cnt_ptr, h_ptr,
                 I, D, k, k_split, limit, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_ps, stride_pu,
                 stride_h, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr, STAGES: tl.constexpr,
                 SORTED: tl.constexpr, PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False,
                 TMA: tl.constexpr = False):
    """FP4 up GEMMs at decode widths, grid (rows, I / BLOCK_N, K splits): one pair's
    token row against BLOCK_N rows of w1[e] and w3[e] (int32 words, strides in words), its FP32
    sums over the split's K range into the partials [splits, 2, rows, I]; the split that counts
    last at its (row, N block) sums them in split order and runs the epilogue into h's row.
    PREFETCH: the next K block's words and scales load while this one is multiplied. TMA: w1_ptr
    and w3_ptr are tensor descriptors of the words [E·I, D / 8] in blocks [BLOCK_N, BLOCK_K / 8],
    loaded by the copy engine STAGES deep (`fp4_groups_dot`)."""
    pdl_wait(PDL)
    r, pair, e, rn, k_lo = gemv_row(order_ptr, ids_ptr, k_split, BLOCK_N, SORTED)
    if e < 0:
        return
    nmask = rn < I
    a = xq_ptr + (pair // k) * stride_x
    w_off = e * stride_we + rn.to(tl.int64) * stride_wn          # w1 and w3 share their strides
    s_off = e * stride_se + rn.to(tl.int64) * stride_sn
    k_hi = tl.minimum(D, k_lo + k_split)
    if TMA:
        row0 = (e * I + tl.program_id(1) * BLOCK_N).to(tl.int32)       # descriptor rows: int32
        g_sum = tma_gemv_sums(w1_ptr, s1_ptr + s_off, row0, a, k_lo, k_hi, nmask, BLOCK_N, BLOCK_K, STAGES, ASM)
        u_sum = tma_gemv_sums(w3_ptr, s3_ptr + s_off, row0, a, k_lo, k_hi, nmask, BLOCK_N, BLOCK_K, STAGES, ASM)
    else:
        acc_g = tl.zeros([BLOCK_N, BLOCK_K // 8], tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K // 8], tl.float32)
        if PREFETCH:
            g_next, gs_next = fp4_words_load(w1_ptr + w_off, s1_ptr + s_off, k_lo, nmask, BLOCK_K)
            u_next, us_next = fp4_words_load(w3_ptr + w_off, s3_ptr + s_off, k_lo, nmask, BLOCK_K)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            if PREFETCH:
                gw, gs, uw, us = g_next, gs_next, u_next, us_next
                k_next = next_block(k0, k_hi, BLOCK_K)
                g_next, gs_next = fp4_words_load(w1_ptr + w_off, s1_ptr + s_off, k_next, nmask, BLOCK_K)
                u_next, us_next = fp4_words_load(w3_ptr + w_off, s3_ptr + s_off, k_next, nmask, BLOCK_K)
            else:
                gw, gs = fp4_words_load(w1_ptr + w_off, s1_ptr + s_off, k0, nmask, BLOCK_K)
                uw, us = fp4_words_load(w3_ptr + w_off, s3_ptr + s_off, k0, nmask, BLOCK_K)
            acc_g = fp4_words_dot(acc_g, a, gw, gs, k0, BLOCK_K, ASM)
            acc_u = fp4_words_dot(acc_u, a, uw, us, k0, BLOCK_K, ASM)
        g_sum, u_sum = tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)
    at = part_ptr + r * I + rn
    tl.store(at + tl.program_id(2) * stride_ps, g_sum, mask=nmask)
    tl.store(at + tl.program_id(2) * stride_ps + stride_pu, u_sum, mask=nmask)
    counter = cnt_ptr + r * tl.num_programs(1) + tl.program_id(1)
    if tl.atomic_add(counter, 1, sem="acq_rel") == tl.num_programs(2) - 1:
        g = tl.zeros([1, BLOCK_N], tl.float32)
        u = tl.zeros([1, BLOCK_N], tl.float32)
        for sp in range(tl.num_programs(2)):     # .cg: the other splits' stores are in L2
            g += tl.load(at[None, :] + sp * stride_ps, mask=nmask[None, :], other=0.0, cache_modifier=".cg")
            u += tl.load(at[None, :] + sp * stride_ps + stride_pu, mask=nmask[None, :], other=0.0,
                         cache_modifier=".cg")
        row = tl.full([1], r, tl.int64)
        wt = tl.load(wts_ptr + pair + tl.zeros([1], tl.int64)).to(tl.float32)
        swiglu_store(g, u, wt, row, rn, row >= 0, nmask, h_ptr, stride_h, limit, 1, BLOCK_N)
        tl.atomic_xchg(counter, 0)


@triton.jit
def _fp4_down_gemv(h_ptr, ids_ptr, order_ptr, w2_ptr, s2_ptr, part_ptr, cnt_ptr, y_ptr, D, I, k_split,
                   stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_ps, stride_y,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr, STAGES: tl.constexpr,
                   SORTED: tl.constexpr, PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False,
                   TMA: tl.constexpr = False):
    """FP4 down GEMM at decode widths, grid (rows, D / BLOCK_N, K splits): one h row
    against BLOCK_N rows of w2[e] (int32 words), the FP32 sum over the split's K range into the
    partials [splits, pairs, D] at the pair's row, which the split that counts last at its (row,
    N block) sums in split order into the pair's row of y (fp8.sum_splits, as the FP8 split-K).
    PREFETCH, TMA (w2_ptr a descriptor of [E·D, I / 8] words): as the up GEMV's."""
    pdl_wait(PDL)
    r, pair, e, rn, k_lo = gemv_row(order_ptr, ids_ptr, k_split, BLOCK_N, SORTED)
    if e < 0:
        return
    nmask = rn < D
    sc = s2_ptr + e * stride_se + rn.to(tl.int64) * stride_sn
    k_hi = tl.minimum(I, k_lo + k_split)
    if TMA:
        row0 = (e * D + tl.program_id(1) * BLOCK_N).to(tl.int32)
        total = tma_gemv_sums(w2_ptr, sc, row0, h_ptr + r * stride_h, k_lo, k_hi, nmask, BLOCK_N, BLOCK_K, STAGES, ASM)
    else:
        w = w2_ptr + e * stride_we + rn.to(tl.int64) * stride_wn
        acc = tl.zeros([BLOCK_N, BLOCK_K // 8], tl.float32)
        if PREFETCH:
            w_next, s_next = fp4_words_load(w, sc, k_lo, nmask, BLOCK_K)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            if PREFETCH:
                words, codes = w_next, s_next
                w_next, s_next = fp4_words_load(w, sc, next_block(k0, k_hi, BLOCK_K), nmask, BLOCK_K)
            else:
                words, codes = fp4_words_load(w, sc, k0, nmask, BLOCK_K)
            acc = fp4_words_dot(acc, h_ptr + r * stride_h, words, codes, k0, BLOCK_K, ASM)
        total = tl.sum(acc, axis=1)
    sum_splits(total, y_ptr + pair * stride_y + rn, part_ptr + pair * D + rn, stride_ps,
               tl.program_id(2), tl.num_programs(2), cnt_ptr + r * tl.num_programs(1) + tl.program_id(1), nmask)


def fp4_splits(K: int, block_k: int) -> int:
    """Split-K count of an FP4 expert GEMV over K: about 4 K blocks a program (one token's six
    experts are few rows, each walking K alone). Set by the shape, not the batch, so a pair's
    sums do not depend on the other tokens; that path serves at most DECODE_PAIRS pairs, so the
    FP32 partials stay small."""
    return max(1, triton.cdiv(K, block_k) // 4)


def k_split(K: int, block_k: int, splits: int) -> tuple[int, int]:
    """(K range of a split, a multiple of block_k; the number of splits, none empty)."""
    per = triton.cdiv(triton.cdiv(K, block_k), splits) * block_k
    return per, triton.cdiv(K, per)


def fp4_gemvs(xq, ids, order, wts, w1, w3, w2, scales, limit, h, y, block_n_up, block_n_down, block_k, splits,
              num_warps, stages: int | None = None, prefetch: bool = False, tma: bool | None = None) -> None:
    """Steps 1-2 on FP4 experts, two launches: the up GEMVs into partials, whose last split
    sums them and runs the epilogue -> h; the down GEMVs likewise -> y. `order` (the pairs
    sorted by expert: h's rows in that order) or None (h's rows are the pairs'). `prefetch`:
    each GEMV loads its next K block during this one's products (PREFETCH); `tma` (default
    FP4_TMA): bf16 activations and contiguous weights, loaded through tensor descriptors (TMA),
    `stages` deep (default FP4_TMA_STAGES; plain loads FP4_STAGES) in K blocks of FP4_TMA_BLOCK_K
    (plain loads FP4_BLOCK_K) unless `block_k` is given."""
    P, I = h.shape
    D = y.shape[1]
    k = ids.shape[1]
    s1, s3, s2 = scales
    flat = ids.reshape(-1).contiguous()
    w1, w3, w2 = (w.view(torch.int32) for w in (w1, w3, w2))     # eight E2M1 values a word
    tma = FP4_TMA and not prefetch if tma is None else tma
    if tma and prefetch:
        raise ValueError("moe_experts_w4a8: the GEMVs' register prefetch and their TMA loads are exclusive")
    # bf16 activations only: the TMA loop reads them as words of bf16 pairs
    tma = tma and xq.dtype == torch.bfloat16 and all(w.is_contiguous() for w in (w1, w3, w2))
    bnu, bnd = block_n_up or FP4_BLOCK_N, block_n_down or FP4_BLOCK_N
    bk = block_k or (FP4_TMA_BLOCK_K if tma else FP4_BLOCK_K)
    bku, bkd = math.gcd(bk, D), math.gcd(bk, I)                   # dividing K: no K mask
    ku, su = k_split(D, bku, splits or fp4_splits(D, bku))
    kd, sd = k_split(I, bkd, splits or fp4_splits(I, bkd))
    pu = torch.empty(su, 2, P, I, dtype=torch.float32, device=h.device)
    pd = torch.empty(sd, P, D, dtype=torch.float32, device=h.device)
    # descriptors of the experts' rows stacked, [E·rows, K / 8] words
    descs = [tma_descriptor(w.view(-1, w.shape[-1]), [bn, bk // 8]) for w, bn, bk in
             ((w1, bnu, bku), (w3, bnu, bku), (w2, bnd, bkd))] if tma else [None]
    tma = None not in descs
    stages = stages or (FP4_TMA_STAGES if tma else FP4_STAGES)
    d1, d3, d2 = descs if tma else (w1, w3, w2)
    asm = h.device.type == "cuda"
    grid_up, grid_down = (P, triton.cdiv(I, bnu), su), (P, triton.cdiv(D, bnd), sd)
    sorted_ = order is not None
    order = order if sorted_ else flat                 # unread unsorted
    _fp4_up_gemv[grid_up](
        xq, flat, order, wts, d1, d3, s1, s3, pu, tile_counters(h.device, P * grid_up[1]), h, I, D, k, ku, limit,
        xq.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), pu.stride(0), pu.stride(1), h.stride(0),
        BLOCK_N=bnu, BLOCK_K=bku, ASM=asm, STAGES=stages, SORTED=sorted_, PREFETCH=prefetch, TMA=tma,
        num_warps=num_warps, **pdl(h.device))
    _fp4_down_gemv[grid_down](
        h, flat, order, d2, s2, pd, tile_counters(h.device, P * grid_down[1]), y, D, I, kd, h.stride(0), w2.stride(0),
        w2.stride(1), s2.stride(0), s2.stride(1), pd.stride(0), y.stride(0), BLOCK_N=bnd, BLOCK_K=bkd, ASM=asm,
        STAGES=stages, SORTED=sorted_, PREFETCH=prefetch, TMA=tma, num_warps=num_warps, **pdl(h.device))
