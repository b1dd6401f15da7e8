"""Triton impls of `v41::rms_norm`, `v41::rms_norm_fp8`, `v41::rms_norm_act_quant` and
`v41::hc_collapse_rms_norm_act_quant` (custom_ops/norm.py is the definition).

Rows of x ([..., D] viewed [N, D]), BLOCK_R of them a program (`tile`). A row up to ONE_PASS_MAX
wide is read once, as one tile held in registers: the FP32 Σx², then `w·(x·rsqrt(Σx²/D + eps))`
rounded once to x's dtype. A wider row takes two passes over CHUNK-wide pieces, the second
re-reading them (now in L1/L2). The FP8 variant reads [BLOCK_R, BLOCK_G, 32] tiles, rounds the
norm to x's dtype first (as the eager model does), then applies the FP8 QAT per group of 32
(bit-exact with v41.quant.fp8_qat; see common.py), or with CODES writes the rounded norm and,
beside it, its E4M3 codes and group scales (what the act-quant kernel of fp8_gemm.py would make
of it). Collapsing mHC's streams first (HC > 0), each element is the streams' weighted sum,
rounded as `hc_collapse` rounds it (recomputed in a wide row's second pass).
Flash: D = 5120 -> one row a program, a tile of 8192 columns, 16 warps at decode; q_norm (1280),
kv_norm (512) and the index k_norm (128) pack 1..16 rows a program. FP64 (the oracle) and other
dtypes fall back to the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops import norm as _ref
from custom_ops.registry import register_impl
from custom_ops.triton.common import TL_DTYPES, fp8_qat_groups, pdl, pdl_wait, rows2d
from custom_ops.triton.fp8 import fp8_quant_groups
from custom_ops.triton.mhc import collapse_streams

CHUNK = 1024                  # elements of a row per chunk
TILE = 2048                   # elements per program per chunk (rows x chunk)
ONE_PASS_MAX = 8192           # rows up to this wide are read once, whole (Flash's 5120 in one
                              # program: at decode a row's two passes over five chunks were a
                              # chain of ten dependent loads for one program)
FEW_ROWS = 128                # tiles wider than TILE: 16 warps up to this many rows, else 4
                              # (H100, Flash's collapse + norm + act quant, mean of two rounds: 4.05 /
                              # 4.66 / 5.02 us at 16 / 8 / 4 warps for one row, 84.6 / 93.8 / 100.3 us
                              # at 4 / 8 / 16 for 4096; kernels-norm-h100.json)


@triton.jit
def _norm_store(x, inv, w_ptr, out_ptr, r, c, m, D, stride_o):
    """One chunk of the plain norm's output from its FP32 input x and the rows' rsqrt."""
    w = tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * stride_o + c[None, :], (w[None, :] * (x * inv[:, None])).to(out_ptr.dtype.element_ty),
             mask=m)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, D, eps, stride_x, stride_o,
                     BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, ONE_PASS: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    r = rows.to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_D)
    if ONE_PASS:            # the row in one tile, read once
        m = rmask[:, None] & (cols < D)[None, :]
        x = tl.load(x_ptr + r * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        _norm_store(x, tl.rsqrt(tl.sum(x * x, axis=1) / D + eps), w_ptr, out_ptr, r, cols, m, D, stride_o)
    else:
        ss = tl.zeros([BLOCK_R], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            c = d0 + cols
            m = rmask[:, None] & (c < D)[None, :]
            x = tl.load(x_ptr + r * stride_x + c[None, :], mask=m, other=0.0).to(tl.float32)
            ss += tl.sum(x * x, axis=1)
        inv = tl.rsqrt(ss / D + eps)
        for d0 in range(0, D, BLOCK_D):
            c = d0 + cols
            m = rmask[:, None] & (c < D)[None, :]
            x = tl.load(x_ptr + r * stride_x + c[None, :], mask=m, other=0.0).to(tl.float32)
            _norm_store(x, inv, w_ptr, out_ptr, r, c, m, D, stride_o)


@triton.jit
def norm_input(x_ptr, mix_ptr, r, c, m, rmask, stride_x, stride_xk, stride_m, HC: tl.constexpr):
    """The norm's input at rows r, columns c (mask m; rmask the rows'), in x's dtype: x itself,
    or with HC > 0 mHC's collapse of the rows' HC streams (x [N, HC, D], mix [N, HC] FP32,
    unit stride), rounded once as `hc_collapse` rounds it."""
    if HC == 0:
        return tl.load(x_ptr + r * stride_x + c, mask=m, other=0.0)
    else:
        acc = collapse_streams(x_ptr + r * stride_x + c, mix_ptr + r * stride_m, stride_xk, 1, m, rmask, HC)
        return acc.to(x_ptr.dtype.element_ty)


@triton.jit
def _norm_fp8_store(x, inv, w_ptr, out_ptr, q_ptr, s_ptr, r, c, m, rmask, g, d0, D, stride_o, stride_q, stride_s,
                    CODES: tl.constexpr):
    """One chunk of the norm's output from its input x (x's dtype) and the rows' rsqrt."""
    w = tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)
    y = (w * (x.to(tl.float32) * inv)).to(x.dtype).to(tl.float32)   # the norm's one rounding
    if CODES:
        tl.store(out_ptr + r * stride_o + c, y.to(out_ptr.dtype.element_ty), mask=m)
        q, scale = fp8_quant_groups(y, 2)
        tl.store(q_ptr + r * stride_q + c, q.to(q_ptr.dtype.element_ty), mask=m)
        tl.store(s_ptr + r * stride_s + d0 // 32 + g, scale, mask=rmask & (d0 + g * 32 < D))
    else:
        q = fp8_qat_groups(y, 2)
        tl.store(out_ptr + r * stride_o + c, q.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _rms_norm_fp8_kernel(x_ptr, w_ptr, out_ptr, q_ptr, s_ptr, mix_ptr, N, D, eps, stride_x, stride_xk, stride_m,
                         stride_o, stride_q, stride_s, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr,
                         CODES: tl.constexpr, HC: tl.constexpr, ONE_PASS: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = (rows < N)[:, None, None]
    r = rows.to(tl.int64)[:, None, None]
    g = tl.arange(0, BLOCK_G)[None, :, None]
    col = g * 32 + tl.arange(0, 32)[None, None, :]
    if ONE_PASS:            # the row in one tile, read once
        m = rmask & (col < D)
        x = norm_input(x_ptr, mix_ptr, r, col, m, rmask, stride_x, stride_xk, stride_m, HC)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(tl.sum(xf * xf, axis=2), axis=1) / D + eps)[:, None, None]
        _norm_fp8_store(x, inv, w_ptr, out_ptr, q_ptr, s_ptr, r, col, m, rmask, g, 0, D, stride_o, stride_q,
                        stride_s, CODES)
    else:
        ss = tl.zeros([BLOCK_R], tl.float32)
        for d0 in range(0, D, BLOCK_G * 32):
            c = d0 + col
            m = rmask & (c < D)
            x = norm_input(x_ptr, mix_ptr, r, c, m, rmask, stride_x, stride_xk, stride_m, HC).to(tl.float32)
            ss += tl.sum(tl.sum(x * x, axis=2), axis=1)
        inv = tl.rsqrt(ss / D + eps)[:, None, None]
        for d0 in range(0, D, BLOCK_G * 32):
            c = d0 + col
            m = rmask & (c < D)
            x = norm_input(x_ptr, mix_ptr, r, c, m, rmask, stride_x, stride_xk, stride_m, HC)
            _norm_fp8_store(x, inv, w_ptr, out_ptr, q_ptr, s_ptr, r, c, m, rmask, g, d0, D, stride_o, stride_q,
                            stride_s, CODES)


def tile(N: int, D: int) -> tuple[bool, int, int, int]:
    """(one pass, the tile's width, rows a program, warps) of a norm over N rows of D: a row up
    to ONE_PASS_MAX wide whole, in as many rows as fill TILE; wider rows in CHUNK-wide pieces."""
    width = triton.next_power_of_2(D)
    one_pass = width <= ONE_PASS_MAX
    width = width if one_pass else CHUNK
    br = max(1, min(16, TILE // width))
    return one_pass, width, br, 4 if br * width <= TILE or N > FEW_ROWS else 16


def _launch(kernel, x, w, eps, out, fp8: bool, codes=None, mix=None) -> bool:
    """Launch `kernel` on x's rows; False where it does not apply (the reference runs). `codes`:
    (q, s) of `rms_norm_act_quant`, written beside out; `mix`: x is mHC's streams [T, hc, D],
    collapsed first (`hc_collapse_rms_norm_act_quant`)."""
    D = x.shape[-1]
    if x.dtype not in TL_DTYPES or out.dtype != x.dtype or w.dtype == torch.float64 or \
            (fp8 and D % 32) or D == 0:
        return False
    q2, s2 = (rows2d(codes[0], D), rows2d(codes[1], D // 32)) if codes else (None, None)
    if codes and (q2 is None or s2 is None or s2.dtype != torch.float32):
        return False
    if mix is not None:
        if mix.dtype != torch.float32 or x.stride(-1) != 1 or mix.stride(-1) != 1:
            return False
        x2 = x
    else:
        x2 = rows2d(x, D)
        if x2 is None:
            x2 = x.reshape(-1, D).contiguous()
    o2 = rows2d(out, D)
    dst = o2 if o2 is not None else torch.empty(x2.shape[0], D, dtype=out.dtype, device=out.device)
    w = w if w.stride(-1) == 1 else w.contiguous()
    N = x2.shape[0]
    if N:
        one_pass, width, br, warps = tile(N, D)
        if fp8:
            bg = width // 32
            q2, s2 = (q2, s2) if codes else (dst, dst)
            m = mix if mix is not None else dst
            kernel[(triton.cdiv(N, br),)](x2, w, dst, q2, s2, m, N, D, eps, x2.stride(0),
                                          x2.stride(1) if mix is not None else 0, m.stride(0), dst.stride(0),
                                          q2.stride(0), s2.stride(0), BLOCK_R=br, BLOCK_G=bg,
                                          CODES=codes is not None, HC=0 if mix is None else x.shape[1],
                                          ONE_PASS=one_pass, num_warps=warps, **pdl(x2.device))
        else:
            kernel[(triton.cdiv(N, br),)](x2, w, dst, N, D, eps, x2.stride(0), dst.stride(0),
                                          BLOCK_R=br, BLOCK_D=width, ONE_PASS=one_pass, num_warps=warps,
                                          **pdl(x2.device))
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


def triton_rms_norm_act_quant(x, w, eps, out, q, s) -> None:
    """`v41::rms_norm_act_quant` (same signature)."""
    if not _launch(_rms_norm_fp8_kernel, x, w, eps, out, True, (q, s)):
        _ref.rms_norm_act_quant(x, w, eps, out, q, s)


def triton_hc_collapse_rms_norm_act_quant(X, mix, w, eps, out, q, s) -> None:
    """`v41::hc_collapse_rms_norm_act_quant` (same signature)."""
    if not _launch(_rms_norm_fp8_kernel, X, w, eps, out, True, (q, s), mix):
        _ref.hc_collapse_rms_norm_act_quant(X, mix, w, eps, out, q, s)


register_impl("rms_norm", "triton", triton_rms_norm, device_type="cuda")
register_impl("rms_norm_fp8", "triton", triton_rms_norm_fp8, device_type="cuda")
register_impl("rms_norm_act_quant", "triton", triton_rms_norm_act_quant, device_type="cuda")
register_impl("hc_collapse_rms_norm_act_quant", "triton", triton_hc_collapse_rms_norm_act_quant, device_type="cuda")
