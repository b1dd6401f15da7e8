"""Triton impl of `v41::moe_experts` (custom_ops/moe.py is the definition; the routing is
moe_route.py).

moe_experts: tokens sorted by expert, grouped GEMM tiles, a deterministic reduction.
  0. x is FP8-QAT'd once ([T, D], common.fp8_qat); the (token, slot) pairs are grouped by
     expert on the device (moe_tiles.expert_tiles): each expert's pairs a contiguous run, cut
     into BLOCK_M-row tiles; a static upper bound of tiles (cdiv(T·k, BLOCK_M) + min(E, T·k))
     is launched and the tiles past the real count return at once, so nothing on the host
     depends on the routing (CUDA-graph safe). One token's FP4 GEMVs skip the grouping: its
     pairs are distinct experts, with no weights to share.
  1. Up kernel, grid (tiles, I / BLOCK_N): gathers the tile's token rows of x_q, two
     accumulators (w1 and w3 tiles of the tile's expert), then in registers: both rounded to
     the activation dtype (the reference's GEMM outputs), clamp, silu, x routing weight, rounded,
     FP8 QAT per 32 along I (BLOCK_N is a multiple of 32) -> h [pairs in expert order, I].
  2. Down kernel, grid (tiles, D / BLOCK_N): h tile · w2[e]ᵀ, rounded to the activation dtype,
     stored at the pair's own row of y [T·k, D].
  Asked for `splits`, steps 1-2 also split K over a third grid axis, their FP32 partials summed
  in split order by the GEMVs' tile-wise sum kernels (below), the epilogue after the sum.
  FP4 experts (`moe_experts_w4a8` up to its DECODE_PAIRS): steps 1-2 as a GEMV per pair, two
     launches (moe_gemv.py), or on tensor cores, a program per pair or per tile of up to eight
     of an expert's pairs (fp4_mma.py, with x put in its MMA form first).
  3. Reduce (moe_tiles.reduce_pairs): out[t] = Σ of the token's valid slots in ascending
     expert id, in FP32 from 0 — the reference's accumulation order, so the result does not
     depend on the batch or on atomics.
FP64 (the oracle) and widths not a multiple of 32 fall back to the reference.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from custom_ops import moe as _ref
from custom_ops.registry import register_impl
from custom_ops.triton.common import TL_DTYPES, dot_precision, fp8_qat, pdl, pdl_wait
from custom_ops.triton.fp4 import fp4_tile, scale_words, word_aligned
from custom_ops.triton.fp4_mma import fp4_mma_gemvs
from custom_ops.triton.fp4_mma_lanes import mma_act_values
from custom_ops.triton.moe_gemv import fp4_gemvs, k_split
from custom_ops.triton.moe_tiles import expert_tiles, reduce_pairs, swiglu_store, tile_rows

BLOCK_N_UP = 64
BLOCK_N_DOWN = 128
BLOCK_K = 64


@triton.jit
def split_range(k_split, K, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr):
    """(first K, length) of a tile program's split (SPLIT), or (0, K). The first K is declared
    a multiple of BLOCK_K (as `_k_split` makes it) and the kernels move their pointers there and
    loop from 0: so written, the split kernels' sm_90 builds stay near the unsplit ones'
    registers (`sm90-build-cpu.json`); without the hint, or looping from the first K, they took
    far more."""
    if SPLIT:
        k_lo = tl.multiple_of(tl.program_id(2) * k_split, BLOCK_K)
        return k_lo, tl.minimum(K - k_lo, k_split)
    else:
        return 0, K


@triton.jit
def _moe_up_kernel(xq_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, order_ptr, wts_ptr, meta_ptr, h_ptr, part_ptr, n_tiles,
                   I, D, k, k_split, limit, stride_x, stride_w1e, stride_w1n, stride_w3e, stride_w3n, stride_se,
                   stride_sn, stride_h, stride_ps, stride_pu,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                   DOT_F32: tl.constexpr, PREC: tl.constexpr, FP4: tl.constexpr, ASM: tl.constexpr,
                   SCALE_WORDS: tl.constexpr = 0, PDL: tl.constexpr = False):
    """One (tile, N block, K split): the tile's token rows against w1[e] and w3[e] over the
    split's K range, then the epilogue, or (SPLIT) the FP32 sums into the partials [splits, 2,
    rows, I] as the GEMVs' (_moe_up_sum_kernel finishes them). FP4: w1 and w3 packed E2M1 in
    int32 words (s1, s3 their scales, strides shared), each tile dequantized exactly
    (`fp4_tile`; its scales as SCALE_WORDS says) to x's dtype before its dot; BLOCK_K divides D."""
    pdl_wait(PDL)
    r0, r1, e, rows, rmask, pair = tile_rows(meta_ptr, order_ptr, n_tiles, BLOCK_M)
    if r0 >= r1:
        return
    tok = (pair // k).to(tl.int64)
    wt = tl.load(wts_ptr + pair, mask=rmask, other=0.0).to(tl.float32)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < I
    rk = tl.arange(0, BLOCK_K)
    k_lo, k_len = split_range(k_split, D, SPLIT, BLOCK_K)
    w_lo = k_lo // 8 if FP4 else k_lo          # packed FP4: int32 words of eight values
    a_rows = xq_ptr + tok[:, None] * stride_x + k_lo
    b1 = w1_ptr + e * stride_w1e + rn.to(tl.int64) * stride_w1n + w_lo
    b3 = w3_ptr + e * stride_w3e + rn.to(tl.int64) * stride_w3n + w_lo
    sc = e * stride_se + rn.to(tl.int64) * stride_sn + (k_lo // 128 if SCALE_WORDS else k_lo // 32)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_len, BLOCK_K):
        ks = k0 + rk
        kmask = ks < k_len
        a = tl.load(a_rows + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        if FP4:
            wg = fp4_tile(b1, s1_ptr + sc, k0, nmask, BLOCK_K, BLOCK_N, a.dtype, ASM, SCALE_WORDS)
            wu = fp4_tile(b3, s3_ptr + sc, k0, nmask, BLOCK_K, BLOCK_N, a.dtype, ASM, SCALE_WORDS)
        else:
            bm = kmask[:, None] & nmask[None, :]
            wg = tl.load(b1[None, :] + ks[:, None], mask=bm, other=0.0)
            wu = tl.load(b3[None, :] + ks[:, None], mask=bm, other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        acc_g = tl.dot(a, wg, acc_g, input_precision=PREC)
        acc_u = tl.dot(a, wu, acc_u, input_precision=PREC)
    if SPLIT:
        at = part_ptr + tl.program_id(2) * stride_ps + rows.to(tl.int64)[:, None] * I + rn[None, :]
        m = rmask[:, None] & nmask[None, :]
        tl.store(at, acc_g, mask=m)
        tl.store(at + stride_pu, acc_u, mask=m)
    else:
        swiglu_store(acc_g, acc_u, wt, rows, rn, rmask, nmask, h_ptr, stride_h, limit, BLOCK_M, BLOCK_N)


@triton.jit
def _moe_up_sum_kernel(part_ptr, order_ptr, wts_ptr, meta_ptr, h_ptr, n_tiles, I, splits, limit,
                       stride_ps, stride_pu, stride_h, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Split-K up GEMMs, grid (tiles, N blocks): the partials summed in split order from 0,
    then the epilogue."""
    pdl_wait(PDL)
    r0, r1, _, rows, rmask, pair = tile_rows(meta_ptr, order_ptr, n_tiles, BLOCK_M)
    if r0 >= r1:
        return
    wt = tl.load(wts_ptr + pair, mask=rmask, other=0.0).to(tl.float32)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < I
    m = rmask[:, None] & nmask[None, :]
    at = part_ptr + rows.to(tl.int64)[:, None] * I + rn[None, :]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for sp in range(splits):
        acc_g += tl.load(at + sp * stride_ps, mask=m, other=0.0)
        acc_u += tl.load(at + sp * stride_ps + stride_pu, mask=m, other=0.0)
    swiglu_store(acc_g, acc_u, wt, rows, rn, rmask, nmask, h_ptr, stride_h, limit, BLOCK_M, BLOCK_N)


@triton.jit
def _moe_down_kernel(h_ptr, w2_ptr, s2_ptr, order_ptr, meta_ptr, y_ptr, part_ptr, n_tiles, D, I, k_split,
                     stride_h, stride_w2e, stride_w2n, stride_se, stride_sn, stride_y, stride_ps,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                     DOT_F32: tl.constexpr, PREC: tl.constexpr, FP4: tl.constexpr, ASM: tl.constexpr,
                     SCALE_WORDS: tl.constexpr = 0, PDL: tl.constexpr = False):
    """One (tile, N block, K split): h rows · w2[e]ᵀ over the split's K range, rounded, at the
    pairs' own rows of y, or (SPLIT) the FP32 sums at the pairs' rows of the partials [splits,
    pairs, D] (_moe_down_sum_kernel finishes them). FP4: as the up kernel's."""
    pdl_wait(PDL)
    r0, r1, e, rows, rmask, pair = tile_rows(meta_ptr, order_ptr, n_tiles, BLOCK_M)
    if r0 >= r1:
        return
    pair = pair.to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < D
    rk = tl.arange(0, BLOCK_K)
    k_lo, k_len = split_range(k_split, I, SPLIT, BLOCK_K)
    a_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h + k_lo
    b = w2_ptr + e * stride_w2e + rn.to(tl.int64) * stride_w2n + (k_lo // 8 if FP4 else k_lo)
    sc = s2_ptr + e * stride_se + rn.to(tl.int64) * stride_sn + (k_lo // 128 if SCALE_WORDS else k_lo // 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_len, BLOCK_K):
        ks = k0 + rk
        kmask = ks < k_len
        a = tl.load(a_rows + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        if FP4:
            w = fp4_tile(b, sc, k0, nmask, BLOCK_K, BLOCK_N, a.dtype, ASM, SCALE_WORDS)
        else:
            w = tl.load(b[None, :] + ks[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PREC)
    m = rmask[:, None] & nmask[None, :]
    if SPLIT:
        tl.store(part_ptr + tl.program_id(2) * stride_ps + pair[:, None] * D + rn[None, :], acc, mask=m)
    else:
        tl.store(y_ptr + pair[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _moe_down_sum_kernel(part_ptr, order_ptr, meta_ptr, y_ptr, n_tiles, D, splits, stride_ps, stride_y,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    """Split-K down GEMM, grid (tiles, N blocks): each pair's partials summed in split order
    from 0, rounded to the activation dtype at the pair's row of y."""
    pdl_wait(PDL)
    r0, r1, _, rows, rmask, pair = tile_rows(meta_ptr, order_ptr, n_tiles, BLOCK_M)
    if r0 >= r1:
        return
    pair = pair.to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = rmask[:, None] & (rn < D)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for sp in range(splits):
        acc += tl.load(part_ptr + sp * stride_ps + pair[:, None] * D + rn[None, :], mask=m, other=0.0)
    tl.store(y_ptr + pair[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=m)


def _block_m(pairs: int, E: int) -> int:
    per = pairs / max(E, 1)
    return 16 if per <= 16 else 32 if per <= 32 else 64


def triton_moe_experts(x, ids, weights, w1, w3, w2, limit, out, **knobs) -> None:
    """`v41::moe_experts` (same signature); keyword knobs: block_m, block_n_up (a multiple of
    32), block_n_down, block_k, num_warps."""
    if x.dtype not in TL_DTYPES or not (w1.dtype == w3.dtype == w2.dtype == x.dtype) or \
            not fits(x, (w1, w3, w2), w1.shape[1], out, knobs):
        return _ref.moe_experts(x, ids, weights, w1, w3, w2, limit, out)
    run_experts(x, ids, weights, w1, w3, w2, None, limit, out, **knobs)


def fits(x, weights, I: int, out, knobs) -> bool:
    D = x.shape[1]
    return out.dtype == torch.float32 and not D % 32 and not I % 32 and \
        not (knobs.get("block_n_up") or BLOCK_N_UP) % 32 and all(t.stride(-1) == 1 for t in weights)


def run_experts(x, ids, weights, w1, w3, w2, scales, limit, out, *, block_m: int | None = None,
                block_n_up: int | None = None, block_n_down: int | None = None,
                block_k: int | None = None, splits: int | None = None, num_warps: int = 4,
                num_stages: int | None = None, tiles: bool = False, prefetch: bool = False, tma: bool | None = None,
                mma: bool = False, mma_cols: int | None = None,
                hidden: list | None = None) -> None:
    """Steps 0-3 on dequantized experts (`scales` None: the tile kernels) or packed FP4 ones
    (`scales` = their E8M0 scales as uint8, (s1, s3, s2): a GEMV per pair, both GEMMs split
    over K, `splits` or `fp4_splits` of each GEMM's K, their FP32 partials summed in split
    order by each output block's last split, their loads pipelined `num_stages` deep (FP4_STAGES: 1,
    not pipelined); `tiles`: the tile kernels, each weight tile dequantized exactly to x's dtype
    in registers, `splits` (default 1) and `num_stages` (default Triton's) as `tile_gemms`).
    `prefetch`: the FP4 GEMVs load each next K block during this one's products; `tma` (default
    FP4_TMA): they load their weights through tensor descriptors, `num_stages` deep
    (FP4_TMA_STAGES). `mma`: the
    GEMVs on tensor cores instead (fp4_mma.py; `splits`, `num_warps` (4 its default) and
    `mma_cols`, its pairs a program, apply).
    `hidden`, when given, receives (h, order, y): w2's input rows (row r: pair order[r]), the
    order, the per-pair outputs, for the tests."""
    T, D = x.shape
    E, I = w1.shape[:2]
    k = ids.shape[1]
    if T == 0:
        return
    dev = x.device
    x = x if x.stride(1) == 1 else x.contiguous()
    bm = block_m or _block_m(T * k, E)
    wts = weights.reshape(-1).contiguous()
    y = torch.empty(T * k, D, dtype=x.dtype, device=dev)
    if mma:             # fp4_mma.py takes x as it is; h comes back in its MMA form
        ha, ho, order = fp4_mma_gemvs(x, ids, wts, w1, w3, w2, scales, limit, y, splits, num_warps, mma_cols)
        h = mma_act_values(ha, ho) if hidden is not None else None
    else:
        xq = torch.empty_like(x)
        fp8_qat(x, xq)
        h = torch.empty(T * k, I, dtype=x.dtype, device=dev)
        if scales is None or tiles:
            order, meta, n_tiles = expert_tiles(ids, E, bm)
            tile_gemms(xq, w1, w3, w2, scales, order, meta, n_tiles, wts, limit, h, y, bm, k, block_n_up,
                       block_n_down, block_k, splits or 1, num_warps, num_stages)
        else:
            # one token's pairs are distinct experts: nothing to share, so no sort (a launch less)
            order = expert_tiles(ids, E, bm)[0] if T > 1 else None
            fp4_gemvs(xq, ids, order, wts, w1, w3, w2, scales, limit, h, y, block_n_up, block_n_down, block_k,
                      splits, num_warps, num_stages, prefetch, tma)
    if hidden is not None:
        hidden.extend((h, order if order is not None else torch.arange(T * k, device=dev), y))
    reduce_pairs(y, ids, E, out)


def tile_gemms(xq, w1, w3, w2, scales, order, meta, n_tiles, wts, limit, h, y, bm, k, block_n_up, block_n_down,
               block_k, splits, num_warps, stages) -> None:
    """Steps 1-2 as MMA tiles (FP4 `scales` given: each weight tile dequantized in registers):
    the up tiles and their epilogue -> h, the down tiles -> y; with `splits` > 1 each GEMM's K
    is split as the GEMVs' is (`_k_split`), its FP32 partials summed in split order by the same
    tile-wise kernels. `stages` None: Triton's default pipelining of the K loop. FP4 scale codes
    come as int32 words wherever K allows (`fp4.scale_words`)."""
    P, I = h.shape
    D = y.shape[1]
    interp = xq.device.type == "cpu"
    f32, prec = interp and xq.dtype != torch.float32, "ieee" if interp else dot_precision(xq)
    bk, bnu, bnd = block_k or BLOCK_K, block_n_up or BLOCK_N_UP, block_n_down or BLOCK_N_DOWN
    fp4 = scales is not None
    s1, s3, s2 = scales if fp4 else (w1, w3, w2)         # unread without FP4
    if fp4:             # the tile kernels read packed FP4 as int32 words, eight values a word
        w1, w3, w2 = (w.view(torch.int32) for w in (w1, w3, w2))
    bku, bkd = (math.gcd(bk, D), math.gcd(bk, I)) if fp4 else (bk, bk)      # FP4: dividing K
    ku, su = k_split(D, bku, splits)
    kd, sd = k_split(I, bkd, splits)
    swu = scale_words(D, bku, ku) if fp4 and word_aligned(s1, s3) else 0
    swd = scale_words(I, bkd, kd) if fp4 and word_aligned(s2) else 0
    if swu:             # the scale codes as int32 words of four (fp4.word_scale_codes)
        s1, s3 = s1.view(torch.int32), s3.view(torch.int32)
    if swd:
        s2 = s2.view(torch.int32)
    pu = torch.empty(su, 2, P, I, dtype=torch.float32, device=h.device) if su > 1 else h
    pd = torch.empty(sd, P, D, dtype=torch.float32, device=h.device) if sd > 1 else y
    common = dict(BLOCK_M=bm, DOT_F32=f32, PREC=prec, FP4=fp4, ASM=not interp, num_warps=num_warps)
    if stages is not None:
        common["num_stages"] = stages
    _moe_up_kernel[(n_tiles, triton.cdiv(I, bnu), su)](
        xq, w1, w3, s1, s3, order, wts, meta, h, pu, n_tiles, I, D, k, ku, limit, xq.stride(0), w1.stride(0),
        w1.stride(1), w3.stride(0), w3.stride(1), s1.stride(0), s1.stride(1), h.stride(0),
        pu.stride(0), pu.stride(1) if su > 1 else 0, BLOCK_N=bnu, BLOCK_K=bku, SPLIT=su > 1, SCALE_WORDS=swu, **common,
        **pdl(h.device))
    if su > 1:
        _moe_up_sum_kernel[(n_tiles, triton.cdiv(I, 32))](
            pu, order, wts, meta, h, n_tiles, I, su, limit, pu.stride(0), pu.stride(1), h.stride(0),
            BLOCK_M=bm, BLOCK_N=32, num_warps=4, **pdl(h.device))
    _moe_down_kernel[(n_tiles, triton.cdiv(D, bnd), sd)](
        h, w2, s2, order, meta, y, pd, n_tiles, D, I, kd, h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0),
        s2.stride(1), y.stride(0), pd.stride(0), BLOCK_N=bnd, BLOCK_K=bkd, SPLIT=sd > 1, SCALE_WORDS=swd, **common,
        **pdl(h.device))
    if sd > 1:
        _moe_down_sum_kernel[(n_tiles, triton.cdiv(D, 128))](
            pd, order, meta, y, n_tiles, D, sd, pd.stride(0), y.stride(0), BLOCK_M=bm, BLOCK_N=128, num_warps=4, **pdl(h.device))


register_impl("moe_experts", "triton", triton_moe_experts, device_type="cuda")
