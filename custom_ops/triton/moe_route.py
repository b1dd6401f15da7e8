"""Triton impl of `v41::moe_route` (custom_ops/moe.py is the definition), one launch
(`_route_kernel`). Scores: the split-K skinny GEMM's programs (common.skinny_program), x[T, D] · gateᵀ
in FP32 with full-precision products (Flash: E = 384 in 64-wide tiles, K split to fill the GPU
at decode); each program stores its FP32 partial and counts itself in its token tile's counter.
Selection, in the program that counts last for its token tile, BLOCK_T tokens x all experts at a
time: the splits summed in a fixed order (read from L2), sqrt(softplus) (torch's threshold 20;
log1p by the compensated log(1+u)·u/((1+u)-1)), then top_k rounds of (max of the biased scores,
smallest expert id among the maxima), the unbiased score gathered per round, the weights
normalized and scaled at the end; then the counter back to zero. A decode step had launched the
selection as a second kernel, 40 a flash-slice step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops import moe as _ref
from custom_ops.registry import register_impl
from custom_ops.triton.common import TL_DTYPES, last_of_tile, skinny_launch, skinny_program
from custom_ops.triton.fp8 import tile_counters

ROUTE_BLOCK_T = 4


@triton.jit
def _route_kernel(x_ptr, gate_ptr, part_ptr, cnt_ptr, bias_ptr, ids_ptr, w_ptr, T, E, K, k_split, top_k,
                  route_scale, stride_xt, stride_g, stride_ps, stride_pt, stride_it, stride_wt,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_W: tl.constexpr,
                  DOT_F32: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr):
    """Program (token tile, expert tile, split s): the scores' partial over the split's K range;
    the token tile's last program selects its tokens' experts (`select_rows`)."""
    skinny_program(x_ptr, gate_ptr, part_ptr, part_ptr, T, E, K, k_split, stride_xt, stride_g, stride_ps, stride_pt,
                   0, BLOCK_M, BLOCK_N, BLOCK_K, False, SPLIT_W, DOT_F32)
    if last_of_tile(cnt_ptr):
        m0 = tl.program_id(0) * BLOCK_M
        t_end = tl.minimum(m0 + BLOCK_M, T)
        for t0 in range(m0, t_end, BLOCK_T):
            select_rows(t0 + tl.arange(0, BLOCK_T), t_end, part_ptr, bias_ptr, ids_ptr, w_ptr, E,
                        tl.num_programs(2), top_k, route_scale, stride_ps, stride_pt, stride_it, stride_wt,
                        BLOCK_T, BLOCK_E, BLOCK_TOP)
        tl.atomic_xchg(cnt_ptr + tl.program_id(0), 0)


@triton.jit
def select_rows(t, T, part_ptr, bias_ptr, ids_ptr, w_ptr, E, S, top_k, route_scale,
                stride_ps, stride_pt, stride_it, stride_wt,
                BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """The experts and weights of tokens t (those < T) from the S splits' partial scores."""
    e = tl.arange(0, BLOCK_E)
    tmask = t < T
    emask = e < E
    t64 = t.to(tl.int64)
    m2 = tmask[:, None] & emask[None, :]
    raw = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for s in range(S):
        raw += tl.load(part_ptr + s * stride_ps + t64[:, None] * stride_pt + e[None, :], mask=m2,
                       other=0.0, cache_modifier=".cg")
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
    gate = gate if gate.stride(1) == 1 else gate.contiguous()
    grid, k_split, meta = skinny_launch(x, E, split=split)
    part = torch.empty(grid[2], T, E, dtype=torch.float32, device=x.device)
    dst_i, dst_w = (t if t.stride(1) == 1 or top_k == 1 else
                    torch.empty_like(t, memory_format=torch.contiguous_format) for t in (ids, weights))
    BLOCK_E = triton.next_power_of_2(E)
    bt = max(1, min(ROUTE_BLOCK_T, 4096 // BLOCK_E))
    _route_kernel[grid](
        x, gate, part, tile_counters(x.device, grid[0]), bias.contiguous(), dst_i, dst_w, T, E, D, k_split, top_k,
        route_scale, x.stride(0), gate.stride(0), part.stride(0), part.stride(1), dst_i.stride(0), dst_w.stride(0),
        BLOCK_T=bt, BLOCK_E=BLOCK_E, BLOCK_TOP=triton.next_power_of_2(top_k), **meta)
    if dst_i is not ids:
        ids.copy_(dst_i)
    if dst_w is not weights:
        weights.copy_(dst_w)


register_impl("moe_route", "triton", triton_moe_route, device_type="cuda")
