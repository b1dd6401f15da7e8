"""Triton impl of `v41::compress_pool` (ratio-2 pool with FP32 tails; the reference in
custom_ops/compressor.py is the definition).

One program takes BLOCK_T tokens x BLOCK_D channels. A token at an odd position of a real
request closes its pair: the first member is its request's tail row (tail_src >= 0, a token
computed by an earlier forward) or the previous token of this batch; the pair is pooled with a
per-channel softmax of the gates, in FP32. Every other row is written 0. The tails are then
refreshed by a second launch (the sentinel-aware row scatter), after every read of them: a
request's first token may read the same slot its last token writes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops import compressor as _ref
from custom_ops.registry import register_impl
from custom_ops.triton.common import pdl, pdl_wait
from custom_ops.triton.cache import triton_scatter_rows

BLOCK_T = 16
BLOCK_D = 128


@triton.jit
def _compress_pool_kernel(v_ptr, g_ptr, pos_ptr, bid_ptr, src_ptr, tv_ptr, tg_ptr, out_ptr, T, D,
                          stride_v, stride_g, stride_tv, stride_tg, stride_o,
                          BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < T
    cmask = cols < D
    m2 = rmask[:, None] & cmask[None, :]
    r = rows.to(tl.int64)
    pos = tl.load(pos_ptr + r, mask=rmask, other=0)
    bid = tl.load(bid_ptr + r, mask=rmask, other=-1)
    src = tl.load(src_ptr + r, mask=rmask, other=-1).to(tl.int64)
    closes = (bid >= 0) & ((pos & 1) == 1)
    from_tail = src >= 0
    prev = tl.maximum(r - 1, 0)
    v1 = tl.load(v_ptr + r[:, None] * stride_v + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    g1 = tl.load(g_ptr + r[:, None] * stride_g + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    tmask = m2 & from_tail[:, None]
    bmask = m2 & (src < 0)[:, None]
    s = tl.maximum(src, 0)
    # the pair's first member: the request's tail row, or the previous token of this batch
    v0 = tl.where(from_tail[:, None],
                  tl.load(tv_ptr + s[:, None] * stride_tv + cols[None, :], mask=tmask, other=0.0),
                  tl.load(v_ptr + prev[:, None] * stride_v + cols[None, :], mask=bmask, other=0.0))
    g0 = tl.where(from_tail[:, None],
                  tl.load(tg_ptr + s[:, None] * stride_tg + cols[None, :], mask=tmask, other=0.0),
                  tl.load(g_ptr + prev[:, None] * stride_g + cols[None, :], mask=bmask, other=0.0))
    v0 = v0.to(tl.float32)
    g0 = g0.to(tl.float32)
    m = tl.maximum(g0, g1)
    e0 = tl.exp(g0 - m)
    e1 = tl.exp(g1 - m)
    tot = e0 + e1
    pooled = v0 * (e0 / tot) + v1 * (e1 / tot)
    pooled = tl.where(closes[:, None], pooled, 0.0)
    tl.store(out_ptr + r[:, None] * stride_o + cols[None, :], pooled.to(out_ptr.dtype.element_ty),
             mask=m2)


def _rows(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def triton_compress_pool(v, g, positions, batch_ids, tail_src, tail_dst, tail_v, tail_g, out) -> None:
    """`v41::compress_pool` (same signature)."""
    T, D = v.shape
    if v.dtype == torch.float64 or g.dtype == torch.float64:   # the oracle's dtype
        return _ref.compress_pool(v, g, positions, batch_ids, tail_src, tail_dst, tail_v, tail_g, out)
    if T == 0:
        return
    v, g = _rows(v), _rows(g)
    tv, tg = _rows(tail_v), _rows(tail_g)
    positions, batch_ids, tail_src = _rows(positions), _rows(batch_ids), _rows(tail_src)
    dst = out if out.stride(-1) == 1 else torch.empty_like(out, memory_format=torch.contiguous_format)
    grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(D, BLOCK_D))
    _compress_pool_kernel[grid](v, g, positions, batch_ids, tail_src, tv, tg, dst, T, D,
                                v.stride(0), g.stride(0), tv.stride(0), tg.stride(0), dst.stride(0),
                                BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=4, **pdl(v.device))
    if dst is not out:
        out.copy_(dst)
    # only now may the tails move on (every read of them above is ordered before this launch)
    triton_scatter_rows(tail_v, v, tail_dst)
    triton_scatter_rows(tail_g, g, tail_dst)


register_impl("compress_pool", "triton", triton_compress_pool, device_type="cuda")
