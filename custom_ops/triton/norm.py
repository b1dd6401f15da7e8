"""Triton impls of `v41::rms_norm`, `v41::rms_norm_fp8` and the fused forms reading the residual
streams (custom_ops/norm.py is the definition).

Rows of x ([..., D] viewed [N, D]). One program takes BLOCK_R rows and walks D in chunks twice:
the first pass sums x² in FP32, the second (re-reading the chunks, now in L1/L2) writes
`w·(x·rsqrt(Σx²/D + eps))` rounded once to x's dtype. The FP8 variant reads each chunk as a
[BLOCK_R, BLOCK_G, 32] tile, rounds the norm to x's dtype first (as the eager model does), then
applies the FP8 QAT per group of 32 (bit-exact with v41.quant.fp8_qat; see common.py).
Flash: D = 5120 -> chunks of 1024 (5 per pass), one row per program; q_norm (1280), kv_norm
(512) and the index k_norm (128) pack 1..8 rows per program. FP64 (the oracle) and other dtypes
fall back to the reference.

`v41::hc_collapse_norm(_fp8)` are the same kernels reading a row as the collapse of the residual
streams, Σ_k mix[k]·X[k] in FP32 rounded once to X's dtype (hc_collapse's arithmetic, in its
order), instead of a stored x: one launch instead of two, and no [T, D] row written and read
back between them. `v41::hc_expand_norm` runs hc_expand's arithmetic first (the streams it
writes) and reads the rows as their collapse, in the plain norm's tiles and sums; its second
pass recomputes the streams rather than reading back what other threads stored.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops import norm as _ref
from custom_ops.registry import register_impl
from custom_ops.triton.common import TL_DTYPES, fp8_qat_groups, rows2d
from custom_ops.triton.mhc import collapse_rows, expand_rows, store_streams

CHUNK = 1024                  # elements of a row per chunk
TILE = 2048                   # elements per program per chunk (rows x chunk)


@triton.jit
def _rows(x_ptr, mix_ptr, r, c, m, rm, stride_x, stride_xk, stride_m, HC: tl.constexpr):
    """Rows r at columns c in FP32: x itself (HC 0), or the collapse of the HC streams of X
    (row stride stride_x, stream stride stride_xk) with weights mix[r, k] (mhc.collapse_rows).
    `m` masks the elements, `rm` (shaped like r) the rows."""
    if HC == 0:
        return tl.load(x_ptr + r * stride_x + c, mask=m, other=0.0).to(tl.float32)
    return collapse_rows(x_ptr, mix_ptr, r, c, m, rm, stride_x, stride_xk, stride_m, 1, HC)


@triton.jit
def _rms_norm_kernel(x_ptr, mix_ptr, w_ptr, out_ptr, N, D, eps, stride_x, stride_xk, stride_m, stride_o,
                     HC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    r = rows.to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_D)
    ss = tl.zeros([BLOCK_R], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        c = d0 + cols
        m = rmask[:, None] & (c < D)[None, :]
        x = _rows(x_ptr, mix_ptr, r, c[None, :], m, rmask[:, None], stride_x, stride_xk, stride_m, HC)
        ss += tl.sum(x * x, axis=1)
    inv = tl.rsqrt(ss / D + eps)
    for d0 in range(0, D, BLOCK_D):
        c = d0 + cols
        m = rmask[:, None] & (c < D)[None, :]
        x = _rows(x_ptr, mix_ptr, r, c[None, :], m, rmask[:, None], stride_x, stride_xk, stride_m, HC)
        w = tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)
        y = w[None, :] * (x * inv[:, None])
        tl.store(out_ptr + r * stride_o + c[None, :], y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rms_norm_fp8_kernel(x_ptr, mix_ptr, w_ptr, out_ptr, N, D, eps, stride_x, stride_xk, stride_m, stride_o,
                         HC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    r = rows.to(tl.int64)[:, None, None]
    col = tl.arange(0, BLOCK_G)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    ss = tl.zeros([BLOCK_R], tl.float32)
    for d0 in range(0, D, BLOCK_G * 32):
        c = d0 + col
        m = rmask[:, None, None] & (c < D)
        x = _rows(x_ptr, mix_ptr, r, c, m, rmask[:, None, None], stride_x, stride_xk, stride_m, HC)
        ss += tl.sum(tl.sum(x * x, axis=2), axis=1)
    inv = tl.rsqrt(ss / D + eps)[:, None, None]
    for d0 in range(0, D, BLOCK_G * 32):
        c = d0 + col
        m = rmask[:, None, None] & (c < D)
        x = _rows(x_ptr, mix_ptr, r, c, m, rmask[:, None, None], stride_x, stride_xk, stride_m, HC)
        w = tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)
        y = (w * (x * inv)).to(out_ptr.dtype.element_ty).to(tl.float32)   # the norm's one rounding
        q = fp8_qat_groups(y, 2)
        tl.store(out_ptr + r * stride_o + c, q.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _expanded_rows(o_ptr, x_ptr, post_ptr, comb_ptr, pre_ptr, t64, c, m, rm, stride_ot, stride_xt, stride_xk,
                   stride_pt, stride_ct, stride_ci, stride_mt, HC: tl.constexpr):
    """At rows t64 ([R, 1]) and columns c ([1, BD]): the streams Y [R, HC, BD] of hc_expand
    (mhc.expand_rows, not yet rounded) and their collapse Σ_k pre[k]·Y[k] [R, BD] (FP32, from Y
    rounded to X's dtype as hc_collapse reads it, in its order; rounded once to X's dtype,
    returned in FP32)."""
    y = expand_rows(o_ptr, x_ptr, post_ptr, comb_ptr, t64, c, m, rm, stride_ot, stride_xt, stride_xk,
                    stride_pt, stride_ct, stride_ci, HC)
    yr = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    j = tl.arange(0, HC)[None, :, None]
    col = tl.zeros(m.shape, tl.float32)
    for k in tl.static_range(HC):
        p = tl.load(pre_ptr + t64 * stride_mt + k, mask=rm, other=0.0).to(tl.float32)
        col += p * tl.sum(tl.where(j == k, yr, 0.0), axis=1)      # stream k alone: exact
    return y, col.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _hc_expand_norm_kernel(o_ptr, x_ptr, post_ptr, comb_ptr, pre_ptr, w_ptr, y_ptr, out_ptr, N, D, eps,
                           stride_ot, stride_xt, stride_xk, stride_pt, stride_ct, stride_ci, stride_mt,
                           stride_yt, stride_yk, stride_nt,
                           HC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """hc_expand then hc_collapse_norm of its streams: pass one writes Y and sums the
    collapse's squares, pass two recomputes the collapse (the same bits) and writes its norm;
    the tiles and sums of _rms_norm_kernel."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    t64 = rows.to(tl.int64)[:, None]
    rm = rmask[:, None]
    cols = tl.arange(0, BLOCK_D)
    ss = tl.zeros([BLOCK_R], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        c = (d0 + cols)[None, :]
        m = rm & (c < D)
        y, x = _expanded_rows(o_ptr, x_ptr, post_ptr, comb_ptr, pre_ptr, t64, c, m, rm, stride_ot, stride_xt,
                              stride_xk, stride_pt, stride_ct, stride_ci, stride_mt, HC)
        store_streams(y_ptr, y, t64, c, m, stride_yt, stride_yk, HC)
        ss += tl.sum(x * x, axis=1)
    inv = tl.rsqrt(ss / D + eps)
    for d0 in range(0, D, BLOCK_D):
        c = (d0 + cols)[None, :]
        m = rm & (c < D)
        _, x = _expanded_rows(o_ptr, x_ptr, post_ptr, comb_ptr, pre_ptr, t64, c, m, rm, stride_ot, stride_xt,
                              stride_xk, stride_pt, stride_ct, stride_ci, stride_mt, HC)
        w = tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)
        tl.store(out_ptr + t64 * stride_nt + c, (w * (x * inv[:, None])).to(out_ptr.dtype.element_ty), mask=m)


def _tiles(D: int, fp8: bool) -> dict:
    """A program's rows and chunk of D: chunks of up to CHUNK elements (the FP8 kernel's as
    32-wide groups), rows filling TILE elements. hc_expand_norm takes the plain kernel's, so
    its sums are the norm's."""
    if fp8:
        bg = min(triton.next_power_of_2(D // 32), CHUNK // 32)
        return dict(BLOCK_R=max(1, min(16, TILE // (bg * 32))), BLOCK_G=bg)
    bd = min(triton.next_power_of_2(D), CHUNK)
    return dict(BLOCK_R=max(1, min(16, TILE // bd)), BLOCK_D=bd)


def _launch(kernel, x, w, eps, out, fp8: bool, mix=None) -> bool:
    """x [..., D] rows, or with `mix` the streams X [T, hc, D] collapsed by mix [T, hc] (FP32)."""
    D = x.shape[-1]
    if x.dtype not in TL_DTYPES or out.dtype != x.dtype or w.dtype == torch.float64 or \
            (fp8 and D % 32) or D == 0:
        return False
    if mix is None:
        hc, x2 = 0, rows2d(x, D)
        if x2 is None:
            x2 = x.reshape(-1, D).contiguous()
        mix2, stride_k, stride_m = x2, 0, 0
    else:
        hc = x.shape[1]
        if mix.dtype != torch.float32 or hc & (hc - 1) or x.stride(-1) != 1 or mix.stride(-1) != 1:
            return False
        x2, mix2, stride_k, stride_m = x, mix, x.stride(1), mix.stride(0)
    o2 = rows2d(out, D)
    dst = o2 if o2 is not None else torch.empty((x2.shape[0], D), dtype=out.dtype, device=out.device)
    w = w if w.stride(-1) == 1 else w.contiguous()
    N = x2.shape[0]
    if N:
        blocks = _tiles(D, fp8)
        kernel[(triton.cdiv(N, blocks["BLOCK_R"]),)](x2, mix2, w, dst, N, D, eps, x2.stride(0), stride_k, stride_m, dst.stride(0),
                                      HC=hc, **blocks, num_warps=4)
    if o2 is None:
        out.copy_(dst.view(out.shape))
    return True


def triton_rms_norm(x, w, eps, out) -> None:
    """`v41::rms_norm` (same signature)."""
    if not _launch(_rms_norm_kernel, x, w, eps, out, False):
        _ref.rms_norm(x, w, eps, out)


def triton_rms_norm_fp8(x, w, eps, out) -> None:
    """`v41::rms_norm_fp8` (same signature)."""
    if not _launch(_rms_norm_fp8_kernel, x, w, eps, out, True):
        _ref.rms_norm_fp8(x, w, eps, out)


def triton_hc_collapse_norm(X, mix, w, eps, out) -> None:
    """`v41::hc_collapse_norm` (same signature)."""
    if not _launch(_rms_norm_kernel, X, w, eps, out, False, mix):
        _ref.hc_collapse_norm(X, mix, w, eps, out)


def triton_hc_collapse_norm_fp8(X, mix, w, eps, out) -> None:
    """`v41::hc_collapse_norm_fp8` (same signature)."""
    if not _launch(_rms_norm_fp8_kernel, X, w, eps, out, True, mix):
        _ref.hc_collapse_norm_fp8(X, mix, w, eps, out)


def triton_hc_expand_norm(out_, X, post, comb, pre, w, eps, Y, out) -> None:
    """`v41::hc_expand_norm` (same signature)."""
    T, hc, D = X.shape
    ok = X.dtype in TL_DTYPES and out_.dtype in TL_DTYPES and Y.dtype == X.dtype == out.dtype and \
        all(t.dtype == torch.float32 for t in (post, comb, pre)) and not hc & (hc - 1) and \
        w.dtype != torch.float64 and all(t.stride(-1) == 1 for t in (out_, X, post, comb, pre, w, Y, out))
    if not ok:
        return _ref.hc_expand_norm(out_, X, post, comb, pre, w, eps, Y, out)
    if T == 0 or D == 0:
        return
    blocks = _tiles(D, False)
    _hc_expand_norm_kernel[(triton.cdiv(T, blocks["BLOCK_R"]),)](
        out_, X, post, comb, pre, w, Y, out, T, D, eps, out_.stride(0), X.stride(0), X.stride(1), post.stride(0),
        comb.stride(0), comb.stride(1), pre.stride(0), Y.stride(0), Y.stride(1), out.stride(0),
        HC=hc, **blocks, num_warps=4)


register_impl("rms_norm", "triton", triton_rms_norm, device_type="cuda")
register_impl("rms_norm_fp8", "triton", triton_rms_norm_fp8, device_type="cuda")
register_impl("hc_collapse_norm", "triton", triton_hc_collapse_norm, device_type="cuda")
register_impl("hc_collapse_norm_fp8", "triton", triton_hc_collapse_norm_fp8, device_type="cuda")
register_impl("hc_expand_norm", "triton", triton_hc_expand_norm, device_type="cuda")
