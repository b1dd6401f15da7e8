"""Triton impls of `v41::rope`, `v41::rope_fp8_qat` and `v41::rms_norm_rope_fp8_qat`
(custom_ops/rope.py is the definition).

x [T, ..., d] is viewed as rows [T·R, d] (R = the product of the middle dims, e.g. the 64 query
heads); row n belongs to token n // R. One program takes one token and BLOCK_R of its rows, the
whole width d at once ([BLOCK_R, BLOCK_D] tiles; the FP8 variant [BLOCK_R, d/32, 32] tiles with
the group axis last). In the last rot dims every element also loads its pair partner (col ^ 1)
and its token's cos/sin entry (FP32 table row at the token's position, pair (col - (d-rot))/2)
and computes the reference's `a·cos - b·sin` / `a·sin + b·cos` in FP32, rounded once to x's
dtype; the other dims are copied. The FP8 variant then quantizes the whole row (all d dims,
groups of 32; the window KV row: d = 512, one row per token), after, with NORM, the row's
RMSNorm (each element and its pair partner normed and rounded to x's dtype as `rms_norm` rounds
them). FP64 falls back to the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops import rope as _ref
from custom_ops.registry import register_impl
from custom_ops.triton.common import TL_DTYPES, fp8_qat_groups, pdl, pdl_wait

TILE = 4096                   # elements per program


@triton.jit
def rope_values(ptrs, hcol, mask, cos_row, sin_row, tail0, INVERSE: tl.constexpr):
    """x at `ptrs` (any tile shape) with the rotation applied where the in-head column `hcol`
    is >= tail0 (= d - rot, even); `cos_row`/`sin_row` point at the token's table row (any
    shape broadcasting to the tile). Returns x's dtype."""
    x, partner, rot = load_pairs(ptrs, hcol, mask, tail0)
    return rotate(x, partner, hcol, rot, cos_row, sin_row, tail0, INVERSE)


@triton.jit
def load_pairs(ptrs, hcol, mask, tail0):
    """(x at `ptrs`, its pair partner (col ^ 1) where it rotates, that mask `rot`)."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    rot = mask & (hcol >= tail0)
    return x, tl.load(ptrs + tl.where((hcol & 1) == 1, -1, 1), mask=rot, other=0.0), rot


@triton.jit
def rotate(x, partner, hcol, rot, cos_row, sin_row, tail0, INVERSE: tl.constexpr):
    """x with its pair `partner` (col ^ 1) rotated where `rot`, in FP32, rounded once to x's
    dtype; x unchanged elsewhere."""
    odd = (hcol & 1) == 1
    pair = tl.maximum(hcol - tail0, 0) // 2
    c = tl.load(cos_row + pair, mask=rot, other=0.0)
    s = tl.load(sin_row + pair, mask=rot, other=0.0)
    if INVERSE:
        s = -s
    xf = x.to(tl.float32)
    pf = partner.to(tl.float32)
    # even lane: a = x, b = partner -> a·cos - b·sin;  odd lane: a = partner, b = x -> a·sin + b·cos
    y = tl.where(odd, pf * s + xf * c, xf * c - pf * s)
    return tl.where(rot, y.to(x.dtype), x)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, R, d, tail0,
                 stride_xt, stride_xr, stride_ot, stride_or, stride_cos, stride_sin,
                 INVERSE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    rr = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tl.arange(0, BLOCK_D)
    mask = (rr < R)[:, None] & (col < d)[None, :]
    p = tl.load(pos_ptr + t).to(tl.int64)
    ptrs = x_ptr + t * stride_xt + rr.to(tl.int64)[:, None] * stride_xr + col[None, :]
    hcol = tl.zeros([BLOCK_R, BLOCK_D], tl.int32) + col[None, :]
    y = rope_values(ptrs, hcol, mask, cos_ptr + p * stride_cos, sin_ptr + p * stride_sin, tail0,
                    INVERSE)
    o = out_ptr + t * stride_ot + rr.to(tl.int64)[:, None] * stride_or + col[None, :]
    tl.store(o, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_fp8_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, w_ptr, R, d, tail0, eps,
                     stride_xt, stride_xr, stride_ot, stride_or, stride_cos, stride_sin,
                     INVERSE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, NORM: tl.constexpr,
                     PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    rr = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    col = tl.arange(0, BLOCK_G)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    mask = (rr < R)[:, None, None] & (col < d)
    p = tl.load(pos_ptr + t).to(tl.int64)
    roff = rr.to(tl.int64)[:, None, None]
    hcol = tl.zeros([BLOCK_R, BLOCK_G, 32], tl.int32) + col
    ptrs = x_ptr + t * stride_xt + roff * stride_xr + col
    cos_row, sin_row = cos_ptr + p * stride_cos, sin_ptr + p * stride_sin
    if NORM:   # the row RMS-normed first (whole rows in the tile), element and partner alike
        x, partner, rot = load_pairs(ptrs, hcol, mask, tail0)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(tl.sum(xf * xf, axis=2), axis=1) / d + eps)[:, None, None]
        w = tl.load(w_ptr + col, mask=col < d, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + (col ^ 1), mask=col < d, other=0.0).to(tl.float32)
        x = (w * (xf * inv)).to(x.dtype)
        partner = (wp * (partner.to(tl.float32) * inv)).to(x.dtype)
        y = rotate(x, partner, hcol, rot, cos_row, sin_row, tail0, INVERSE)
    else:
        y = rope_values(ptrs, hcol, mask, cos_row, sin_row, tail0, INVERSE)
    q = fp8_qat_groups(y.to(tl.float32), 2)
    tl.store(out_ptr + t * stride_ot + roff * stride_or + col, q.to(out_ptr.dtype.element_ty),
             mask=mask)


def _as3d(t: torch.Tensor, T: int, d: int) -> torch.Tensor | None:
    """[T, R, d] view with unit last stride, or None."""
    try:
        v = t.view(T, -1, d)
    except RuntimeError:
        return None
    return v if d <= 1 or v.stride(2) == 1 else None


def _launch(kernel, x, cos, sin, positions, inverse, out, fp8: bool, norm=None) -> bool:
    """Launch `kernel`; False where it does not apply (the reference runs). `norm`: (w, eps) of
    the RMSNorm `rms_norm_rope_fp8_qat` applies first."""
    T, d = x.shape[0], x.shape[-1]
    rot = 2 * cos.shape[-1]
    if x.dtype not in TL_DTYPES or out.dtype != x.dtype or cos.dtype != torch.float32 or \
            sin.dtype != torch.float32 or (d - rot) % 2 or rot > d or (fp8 and d % 32) or \
            (norm is not None and (norm[0].dtype == torch.float64 or norm[0].stride(-1) != 1)):
        return False
    if T == 0 or x.numel() == 0:
        return True
    x3 = _as3d(x, T, d)
    if x3 is None:
        x3 = x.reshape(T, -1, d).contiguous()
    o3 = _as3d(out, T, d)
    dst = o3 if o3 is not None else torch.empty(x3.shape, dtype=out.dtype, device=out.device)
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    positions = positions if positions.stride(0) == 1 else positions.contiguous()
    R = x3.shape[1]
    strides = (x3.stride(0), x3.stride(1), dst.stride(0), dst.stride(1), cos.stride(0), sin.stride(0))
    if fp8:
        w, eps = norm if norm is not None else (cos, 0.0)
        bg = triton.next_power_of_2(d // 32)
        br = max(1, min(triton.next_power_of_2(R), TILE // (bg * 32)))
        kernel[(T, triton.cdiv(R, br))](x3, cos, sin, positions, dst, w, R, d, d - rot, eps, *strides,
                                        INVERSE=bool(inverse), BLOCK_R=br, BLOCK_G=bg, NORM=norm is not None,
                                        num_warps=4, **pdl(x3.device))
    else:
        bd = triton.next_power_of_2(d)
        br = max(1, min(triton.next_power_of_2(R), TILE // bd))
        kernel[(T, triton.cdiv(R, br))](x3, cos, sin, positions, dst, R, d, d - rot, *strides,
                                        INVERSE=bool(inverse), BLOCK_R=br, BLOCK_D=bd, num_warps=4,
                                        **pdl(x3.device))
    if o3 is None:
        out.copy_(dst.view(out.shape))
    return True


def triton_rope(x, cos, sin, positions, inverse, out) -> None:
    """`v41::rope` (same signature)."""
    if not _launch(_rope_kernel, x, cos, sin, positions, inverse, out, False):
        _ref.rope(x, cos, sin, positions, inverse, out)


def triton_rope_fp8_qat(x, cos, sin, positions, inverse, out) -> None:
    """`v41::rope_fp8_qat` (same signature)."""
    if not _launch(_rope_fp8_kernel, x, cos, sin, positions, inverse, out, True):
        _ref.rope_fp8_qat(x, cos, sin, positions, inverse, out)


def triton_rms_norm_rope_fp8_qat(x, w, eps, cos, sin, positions, inverse, out) -> None:
    """`v41::rms_norm_rope_fp8_qat` (same signature)."""
    if not _launch(_rope_fp8_kernel, x, cos, sin, positions, inverse, out, True, (w, eps)):
        _ref.rms_norm_rope_fp8_qat(x, w, eps, cos, sin, positions, inverse, out)


register_impl("rope", "triton", triton_rope, device_type="cuda")
register_impl("rope_fp8_qat", "triton", triton_rope_fp8_qat, device_type="cuda")
register_impl("rms_norm_rope_fp8_qat", "triton", triton_rms_norm_rope_fp8_qat, device_type="cuda")
