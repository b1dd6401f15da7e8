"""Triton impl of `v41::moe_route` (custom_ops/moe.py is the definition), two launches.
Scores: the split-K skinny GEMM of common.py, x[T, D] · gateᵀ in FP32 with full-precision
products (Flash: E = 384 in 64-wide tiles, K split to fill the GPU at decode). Selection,
BLOCK_T tokens x all experts per program: the splits summed in a fixed order, sqrt(softplus)
(torch's threshold 20; log1p by the compensated log(1+u)·u/((1+u)-1)), then top_k rounds of
(max of the biased scores, smallest expert id among the maxima), the unbiased score gathered
per round, the weights normalized and scaled at the end.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops import moe as _ref
from custom_ops.registry import register_impl
from custom_ops.triton.common import TL_DTYPES, pdl, pdl_wait, skinny_gemm

ROUTE_BLOCK_T = 4


@triton.jit
def _route_select_kernel(part_ptr, bias_ptr, ids_ptr, w_ptr, T, E, S, top_k, route_scale,
                         stride_ps, stride_pt, stride_it, stride_wt,
                         BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    tmask = t < T
    emask = e < E
    t64 = t.to(tl.int64)
    m2 = tmask[:, None] & emask[None, :]
    raw = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for s in range(S):
        raw += tl.load(part_ptr + s * stride_ps + t64[:, None] * stride_pt + e[None, :], mask=m2,
                       other=0.0)
    u = tl.exp(raw)
    v = 1.0 + u
    log1p = tl.where(v == 1.0, u, tl.log(v) * (u / (v - 1.0)))
    sc = tl.sqrt(tl.where(raw > 20.0, raw, log1p))
    b = tl.load(bias_ptr + e, mask=emask, other=0.0)
    biased = tl.where(m2, sc + b[None, :], float("-inf"))
    kk = tl.arange(0, BLOCK_K)
    sel_ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    sel_w = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    for r in range(top_k):
        mx = tl.max(biased, axis=1)
        sel = tl.min(tl.where(biased == mx[:, None], e[None, :], BLOCK_E), axis=1)
        hit = e[None, :] == sel[:, None]
        w = tl.sum(tl.where(hit, sc, 0.0), axis=1)
        sel_ids = tl.where(kk[None, :] == r, sel[:, None], sel_ids)
        sel_w = tl.where(kk[None, :] == r, w[:, None], sel_w)
        biased = tl.where(hit, float("-inf"), biased)
    tot = tl.sum(sel_w, axis=1)
    wn = sel_w / (tot + 1e-20)[:, None] * route_scale
    km = tmask[:, None] & (kk < top_k)[None, :]
    tl.store(ids_ptr + t64[:, None] * stride_it + kk[None, :], sel_ids.to(ids_ptr.dtype.element_ty), mask=km)
    tl.store(w_ptr + t64[:, None] * stride_wt + kk[None, :], wn.to(w_ptr.dtype.element_ty), mask=km)


def triton_moe_route(x, gate, bias, top_k, route_scale, ids, weights, *,
                     split: int | None = None) -> None:
    """`v41::moe_route` (same signature); `split`: K splits of the score GEMM."""
    T, D = x.shape
    E = gate.shape[0]
    if x.dtype not in TL_DTYPES or gate.dtype != torch.float32 or bias.dtype != torch.float32 or \
            weights.dtype != torch.float32 or ids.dtype not in (torch.int64, torch.int32) or top_k > E:
        return _ref.moe_route(x, gate, bias, top_k, route_scale, ids, weights)
    if T == 0:
        return
    x = x if x.stride(1) == 1 else x.contiguous()
    part, _ = skinny_gemm(x, gate, False, split=split)
    dst_i, dst_w = (t if t.stride(1) == 1 or top_k == 1 else
                    torch.empty_like(t, memory_format=torch.contiguous_format) for t in (ids, weights))
    BLOCK_E = triton.next_power_of_2(E)
    bt = max(1, min(ROUTE_BLOCK_T, 4096 // BLOCK_E))
    _route_select_kernel[(triton.cdiv(T, bt),)](
        part, bias.contiguous(), dst_i, dst_w, T, E, part.shape[0], top_k, route_scale,
        part.stride(0), part.stride(1), dst_i.stride(0), dst_w.stride(0),
        BLOCK_T=bt, BLOCK_E=BLOCK_E, BLOCK_K=triton.next_power_of_2(top_k), num_warps=4, **pdl(part.device))
    if dst_i is not ids:
        ids.copy_(dst_i)
    if dst_w is not weights:
        weights.copy_(dst_w)


register_impl("moe_route", "triton", triton_moe_route, device_type="cuda")
