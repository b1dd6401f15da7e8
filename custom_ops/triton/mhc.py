"""Triton impls of `v41::mhc_mix`, `v41::hc_collapse`, `v41::hc_expand` (custom_ops/mhc.py is
the definition).

mhc_mix, two launches.
  1. The coefficient projection m_raw[T, hc·(hc+2)] = X_flat[T, hc·D] · fnᵀ (FP32, full-precision
     products: with X in bf16, fn split exactly into three bf16 parts multiplied on tensor cores)
     and Σ X_flat² per token: the split-K skinny GEMM of common.py (Flash: K = 20480,
     N = 24 padded to a 32-wide tile; token tiles of 16..64; K split so that even one decode
     token spreads the 1.9 MB of fn over ~2x the SMs; each split writes FP32 partials).
  2. Coefficients, BLOCK_T tokens per program (one token a program up to COEF_TOKEN_PROGRAMS
     tokens, token tiles beyond; every token's math is independent): the splits summed in a fixed
     order, BLOCK_S of them per load, summed as a tree (a program of one token, Flash: its 80
     splits in one load), m = m_raw·rsqrt(Σx²/(hc·D) + norm_eps); pre = sigmoid(m·scale0 + base)
     + hc_eps; post = 2·sigmoid(m·scale1 + base); comb = softmax_row(m·scale2 + base) + hc_eps on
     a [BLOCK_T, hc, hc] tile, then the column normalization and iters-1 (row, column) Sinkhorn
     rounds in registers.
  One launch, the split that counts last in its token tile computing the coefficients, was
  slower on an H100 both times it was built: 13.1 µs a call against 6.3 + 4.9 (native-decode-ab-h100.json), then
  13.2 (1,058.9 µs over flash-slice's 80 calls at batch 1, dependent launch off,
  `tma-knobs-h100.json` run a).
hc_collapse: [BLOCK_T, BLOCK_D] tiles, Σ_k mix[k]·X[k] over the hc streams in FP32 (a static
loop), one rounding. hc_expand: [BLOCK_T, hc, BLOCK_D] tiles, Σ_i comb[i][j]·X[i] as hc
broadcast FMAs over the stream tile, plus post[j]·out_, one rounding. Both are pure streaming
(Flash: 4 x 5120 bf16 per token). hc must be a power of two (Flash and the toy: 4); FP64 and
anything else fall back to the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops import mhc as _ref
from custom_ops.registry import register_impl
from custom_ops.triton.common import TL_DTYPES, pdl, pdl_wait, skinny_gemm

COEF_BLOCK_T = 16
# up to this many tokens each coefficient program takes one token, its splits summed as a tree
# in one load, where a tile of tokens a program walks the splits one load at a time. H100, the
# mix alone (mhc-h100.json, both rounds): 10.1 / 10.3 / 11.7 / 12.5 / 23.7-23.8 µs at 6 / 16 /
# 64 / 96 / 512 tokens against 18.0 / 20.3 / 21.9-22.0 / 23.6-23.8 / 24.2-24.3 in tiles, which
# win at 4,096 (103.6-105.5 against 118.9-120.7); flash-slice's native decode step
# (mhc-knobs-h100.json, the rule at 64 tokens): batch 16 19.08 against 19.96 ms of device time,
# batch 64 32.05 against 32.93
COEF_TOKEN_PROGRAMS = 512
# warps of a coefficient program: at 4, a one-token program's split sums cross warps through
# shared memory (14 barriers in its Triton 3.6 sm_90 build), at 1 in one warp's shuffles; at 1
# flash-slice's batch-1 step took 9.42 against 9.46 ms of device time (knobs-h100.json), within
# the run's noise, so the long-measured 4 stays
COEF_WARPS = 4
COEF_TILE = 2048              # elements of the [splits, hc, hc] tile a one-token program sums at once
STREAM_TILE = 4096            # elements of X per program in collapse / expand
# columns a collapse / expand program takes at most, read at each launch (so step_bench
# --knob-variants can try others in one engine): at one token and Flash's D that is 5 programs
STREAM_BLOCK_D = 1024


@triton.jit
def _mhc_coef_kernel(part_ptr, sq_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr,
                     T, S, K, iters, hc_eps, norm_eps, stride_ps, stride_pt, stride_ss,
                     stride_pre, stride_post, stride_ct, stride_ci,
                     HC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t64 = t.to(tl.int64)
    i = tl.arange(0, HC)
    m2 = tmask[:, None] & (i < HC)[None, :]
    m3 = tmask[:, None, None] & (i < HC)[None, :, None] & (i < HC)[None, None, :]
    off2 = t64[:, None] * stride_pt + i[None, :]
    off3 = t64[:, None, None] * stride_pt + 2 * HC + i[None, :, None] * HC + i[None, None, :]
    a_pre = tl.zeros([BLOCK_T, HC], tl.float32)
    a_post = tl.zeros([BLOCK_T, HC], tl.float32)
    a_comb = tl.zeros([BLOCK_T, HC, HC], tl.float32)
    ss = tl.zeros([BLOCK_T], tl.float32)
    for s0 in range(0, S, BLOCK_S):      # BLOCK_S splits a load, summed as a tree
        rs = s0 + tl.arange(0, BLOCK_S)
        smask = rs < S
        ps = rs.to(tl.int64) * stride_ps
        s2 = ps[:, None, None]
        s3 = ps[:, None, None, None]
        k2 = smask[:, None, None] & m2[None, :, :]
        k3 = smask[:, None, None, None] & m3[None, :, :, :]
        a_pre += tl.sum(tl.load(part_ptr + s2 + off2[None, :, :], mask=k2, other=0.0), axis=0)
        a_post += tl.sum(tl.load(part_ptr + s2 + HC + off2[None, :, :], mask=k2, other=0.0), axis=0)
        a_comb += tl.sum(tl.load(part_ptr + s3 + off3[None, :, :, :], mask=k3, other=0.0), axis=0)
        sq = tl.load(sq_ptr + rs.to(tl.int64)[:, None] * stride_ss + t64[None, :],
                     mask=smask[:, None] & tmask[None, :], other=0.0)
        ss += tl.sum(sq, axis=0)
    r = tl.rsqrt(ss / K + norm_eps)
    sc0 = tl.load(scale_ptr)
    sc1 = tl.load(scale_ptr + 1)
    sc2 = tl.load(scale_ptr + 2)
    b_pre = tl.load(base_ptr + i)
    b_post = tl.load(base_ptr + HC + i)
    b_comb = tl.load(base_ptr + 2 * HC + i[:, None] * HC + i[None, :])
    pre = tl.sigmoid((a_pre * r[:, None]) * sc0 + b_pre[None, :]) + hc_eps
    post = 2 * tl.sigmoid((a_post * r[:, None]) * sc1 + b_post[None, :])
    c = (a_comb * r[:, None, None]) * sc2 + b_comb[None, :, :]
    c = tl.exp(c - tl.max(c, axis=2, keep_dims=True))
    c = c / tl.sum(c, axis=2, keep_dims=True) + hc_eps
    c = c / (tl.sum(c, axis=1, keep_dims=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (tl.sum(c, axis=2, keep_dims=True) + hc_eps)
        c = c / (tl.sum(c, axis=1, keep_dims=True) + hc_eps)
    tl.store(pre_ptr + t64[:, None] * stride_pre + i[None, :], pre.to(pre_ptr.dtype.element_ty), mask=m2)
    tl.store(post_ptr + t64[:, None] * stride_post + i[None, :], post.to(post_ptr.dtype.element_ty), mask=m2)
    tl.store(comb_ptr + t64[:, None, None] * stride_ct + i[None, :, None] * stride_ci + i[None, None, :],
             c.to(comb_ptr.dtype.element_ty), mask=m3)


@triton.jit
def _hc_collapse_kernel(x_ptr, mix_ptr, out_ptr, T, D, stride_xt, stride_xk, stride_mt, stride_mk,
                        stride_ot, HC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                        PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tmask = t < T
    t64 = t.to(tl.int64)
    m = tmask[:, None] & (c < D)[None, :]
    acc = collapse_streams(x_ptr + t64[:, None] * stride_xt + c[None, :], (mix_ptr + t64 * stride_mt)[:, None],
                           stride_xk, stride_mk, m, tmask[:, None], HC)
    tl.store(out_ptr + t64[:, None] * stride_ot + c[None, :], acc.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def collapse_streams(x_at, mix_at, stride_xk, stride_mk, mask, mix_mask, HC: tl.constexpr):
    """Σ_k mix[k]·x[k] over the HC streams in FP32 (v41.mhc.collapse before its one rounding):
    x_at points at stream 0 of each element (mask), mix_at at its row's first mix weight
    (mix_mask; a shape broadcasting to x_at's, so each weight loads once a row)."""
    acc = tl.zeros(x_at.shape, tl.float32)
    for k in tl.static_range(HC):
        w = tl.load(mix_at + k * stride_mk, mask=mix_mask, other=0.0).to(tl.float32)
        acc += w * tl.load(x_at + k * stride_xk, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _hc_expand_kernel(o_ptr, x_ptr, post_ptr, comb_ptr, y_ptr, T, D,
                      stride_ot, stride_xt, stride_xk, stride_pt, stride_ct, stride_ci,
                      stride_yt, stride_yk,
                      HC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, HC)
    tmask = t < T
    t64 = t.to(tl.int64)
    m = tmask[:, None] & (c < D)[None, :]
    mj = tmask[:, None] & (j < HC)[None, :]
    acc = tl.zeros([BLOCK_T, HC, BLOCK_D], tl.float32)
    for i in tl.static_range(HC):
        x = tl.load(x_ptr + t64[:, None] * stride_xt + i * stride_xk + c[None, :], mask=m, other=0.0)
        w = tl.load(comb_ptr + t64[:, None] * stride_ct + i * stride_ci + j[None, :], mask=mj, other=0.0)
        acc += w.to(tl.float32)[:, :, None] * x.to(tl.float32)[:, None, :]
    o = tl.load(o_ptr + t64[:, None] * stride_ot + c[None, :], mask=m, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t64[:, None] * stride_pt + j[None, :], mask=mj, other=0.0).to(tl.float32)
    y = post[:, :, None] * o[:, None, :] + acc
    ptrs = y_ptr + t64[:, None, None] * stride_yt + j[None, :, None] * stride_yk + c[None, None, :]
    tl.store(ptrs, y.to(y_ptr.dtype.element_ty), mask=m[:, None, :] & (j < HC)[None, :, None])


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _unit_last(*ts) -> bool:
    return all(t.shape[-1] <= 1 or t.stride(-1) == 1 for t in ts)


def triton_mhc_mix(X, fn, base, scale, iters, hc_eps, norm_eps, pre, post, comb, *,
                   split: int | None = None, block_t: int | None = None, block_s: int | None = None,
                   split_w: bool | None = None) -> None:
    """`v41::mhc_mix` (same signature); keyword knobs: K splits of the projection, tokens per
    coefficient program, splits per load of the coefficient program (a power of two), and
    `split_w` (skinny_gemm's: fn split into three bf16 parts on tensor cores, X in bf16)."""
    T, hc, D = X.shape
    if X.dtype not in TL_DTYPES or fn.dtype != torch.float32 or not _pow2(hc) or iters < 1 or \
            fn.shape != (hc * (hc + 2), hc * D) or \
            any(t.dtype != torch.float32 for t in (base, scale, pre, post, comb)):
        return _ref.mhc_mix(X, fn, base, scale, iters, hc_eps, norm_eps, pre, post, comb)
    if T == 0:
        return
    xf = X.reshape(T, hc * D)
    if xf.stride(1) != 1:
        xf = xf.contiguous()
    part, sq = skinny_gemm(xf, fn, True, split=split, split_w=split_w)
    base, scale = base.contiguous(), scale.contiguous()
    outs = [t if _unit_last(t) else torch.empty(t.shape, dtype=t.dtype, device=t.device)
            for t in (pre, post, comb)]
    bt = block_t or coef_block_t(T)
    S = part.shape[0]
    # a lone token's splits in one load; a token tile (past COEF_TOKEN_PROGRAMS): one split a
    # load, as fast as the tree or faster at 4,096 tokens on the H200 (benchmarks/results/mhc-h200.json)
    bs = block_s or (min(triton.next_power_of_2(S), COEF_TILE // (hc * hc)) if bt == 1 else 1)
    _mhc_coef_kernel[(triton.cdiv(T, bt),)](
        part, sq, base, scale, outs[0], outs[1], outs[2], T, S, hc * D, iters,
        hc_eps, norm_eps, part.stride(0), part.stride(1), sq.stride(0), outs[0].stride(0),
        outs[1].stride(0), outs[2].stride(0), outs[2].stride(1), HC=hc, BLOCK_T=bt, BLOCK_S=bs,
        num_warps=COEF_WARPS, **pdl(part.device))
    for o, t in zip(outs, (pre, post, comb)):
        if o is not t:
            t.copy_(o)


def coef_block_t(T: int) -> int:
    """Tokens a coefficient program (COEF_TOKEN_PROGRAMS, COEF_BLOCK_T)."""
    return 1 if T <= COEF_TOKEN_PROGRAMS else min(COEF_BLOCK_T, triton.next_power_of_2(T))


def _stream_tiles(T: int, D: int, hc: int, block_d: int | None):
    bd = block_d or min(triton.next_power_of_2(D), STREAM_BLOCK_D)
    bt = max(1, min(triton.next_power_of_2(T), STREAM_TILE // (bd * hc)))
    return bt, bd, (triton.cdiv(T, bt), triton.cdiv(D, bd))


def triton_hc_collapse(X, mix, out, *, block_d: int | None = None) -> None:
    """`v41::hc_collapse` (same signature)."""
    T, hc, D = X.shape
    if X.dtype not in TL_DTYPES or mix.dtype != torch.float32 or out.dtype != X.dtype or \
            not _pow2(hc) or not _unit_last(X, out):
        return _ref.hc_collapse(X, mix, out)
    if T == 0 or D == 0:
        return
    bt, bd, grid = _stream_tiles(T, D, 1, block_d)
    _hc_collapse_kernel[grid](X, mix, out, T, D, X.stride(0), X.stride(1), mix.stride(0),
                              mix.stride(1), out.stride(0), HC=hc, BLOCK_T=bt, BLOCK_D=bd, num_warps=4, **pdl(X.device))


def triton_hc_expand(out_, X, post, comb, Y, *, block_d: int | None = None) -> None:
    """`v41::hc_expand` (same signature)."""
    T, hc, D = X.shape
    if X.dtype not in TL_DTYPES or out_.dtype not in TL_DTYPES or Y.dtype != X.dtype or \
            post.dtype != torch.float32 or comb.dtype != torch.float32 or not _pow2(hc) or \
            not _unit_last(out_, X, post, comb, Y):
        return _ref.hc_expand(out_, X, post, comb, Y)
    if T == 0 or D == 0:
        return
    bt, bd, grid = _stream_tiles(T, D, hc, block_d)
    _hc_expand_kernel[grid](out_, X, post, comb, Y, T, D, out_.stride(0), X.stride(0), X.stride(1),
                            post.stride(0), comb.stride(0), comb.stride(1), Y.stride(0),
                            Y.stride(1), HC=hc, BLOCK_T=bt, BLOCK_D=bd, num_warps=4, **pdl(X.device))


register_impl("mhc_mix", "triton", triton_mhc_mix, device_type="cuda")
register_impl("hc_collapse", "triton", triton_hc_collapse, device_type="cuda")
register_impl("hc_expand", "triton", triton_hc_expand, device_type="cuda")
