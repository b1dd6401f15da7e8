"""Triton impl of `v41::inv_rope_wo_a` (custom_ops/attn_out.py is the definition).

A grouped GEMM with the inverse RoPE fused into the A operand: for group g, Z_g[T, R] =
O_g[T, I] · W_gᵀ with O_g the g-th slice of the attention output o [T, H, d] viewed [T, G, I]
(I = (H/G)·d; Flash: G = 8, I = 4096, R = 1024). Grid (M tiles, R tiles, G); each program walks
I in BLOCK_K steps. A K step whose columns reach into some head's last rot dims (in-head column
>= d - rot) loads the tile through `rope_values` (pair partner + the token's cos/sin row,
conjugate rotation, rounded to o's dtype exactly as the reference's inverse RoPE does); every
other step is a plain tile load. W_g tiles [BLOCK_K, BLOCK_N] are read from wo_a [G, R, I] in
place. FP32 accumulation, one rounding to the output dtype (the reference's einsum output).
Tiles: BLOCK_M by token count (16 for decode up to 128 for prefill), BLOCK_N = 64 for decode
(128 programs at T <= 16: the 64 MB wo_a read is the whole cost) and 128 for prefill, BLOCK_K =
64 (with d = 512, rot = 64 only the last K step of each head rotates).

Split-K (grid axis 2 holds G x splits) where the output tiles alone leave SMs idle (`split_for`):
each split walks its share of I into FP32 partials [splits, T, G·R]; the split that arrives last
at its tile (fp8.tile_counters) sums them in ascending split order and rounds once, in the
same launch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops import attn_out as _ref
from custom_ops.registry import register_impl
from custom_ops.triton.common import TL_DTYPES, dot_precision, num_sms, pdl, pdl_wait
from custom_ops.triton.fp8 import sum_splits, tile_counters
from custom_ops.triton.rope import rope_values


@triton.jit
def _inv_rope_wo_a_kernel(o_ptr, cos_ptr, sin_ptr, pos_ptr, w_ptr, out_ptr, p_ptr, cnt_ptr, T, R, I, d, tail0,
                          K_SPLIT, stride_ot, stride_og, stride_cos, stride_sin,
                          stride_wg, stride_wr, stride_zt, stride_ps,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          SPLITS: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr = False):
    """Program (m, n, g·SPLITS + s): columns [s·K_SPLIT, (s+1)·K_SPLIT) of group g's I (K_SPLIT
    a multiple of BLOCK_K)."""
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2) // SPLITS
    split = tl.program_id(2) % SPLITS
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < T
    nmask = rn < R
    rm64 = rm.to(tl.int64)
    pos = tl.load(pos_ptr + rm64, mask=mmask, other=0).to(tl.int64)
    cos_rows = (cos_ptr + pos * stride_cos)[:, None]
    sin_rows = (sin_ptr + pos * stride_sin)[:, None]
    a_base = o_ptr + rm64[:, None] * stride_ot + g.to(tl.int64) * stride_og
    w_base = w_ptr + g.to(tl.int64) * stride_wg + rn.to(tl.int64)[None, :] * stride_wr
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(split * K_SPLIT, tl.minimum(split * K_SPLIT + K_SPLIT, I), BLOCK_K):
        ks = k0 + rk
        kmask = ks < I
        amask = mmask[:, None] & kmask[None, :]
        ptrs = a_base + ks[None, :]
        if (k0 % d) + BLOCK_K > tail0:           # some column of this step is rotated
            hcol = tl.zeros([BLOCK_M, BLOCK_K], tl.int32) + (ks % d)[None, :]
            a = rope_values(ptrs, hcol, amask, cos_rows, sin_rows, tail0, True)
        else:
            a = tl.load(ptrs, mask=amask, other=0.0)
        w = tl.load(w_base + ks[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
        if DOT_F32:                             # the interpreter's tl.dot takes no bf16: widen
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PREC)
    cols = (g * R + rn)[None, :]
    omask = mmask[:, None] & nmask[None, :]
    z = out_ptr + rm64[:, None] * stride_zt + cols
    if SPLITS > 1:
        G = tl.num_programs(2) // SPLITS
        p_tile = p_ptr + rm64[:, None] * (G * R) + cols
        counter = cnt_ptr + (pid_m * tl.num_programs(1) + pid_n) * G + g
        sum_splits(acc, z, p_tile, stride_ps, split, SPLITS, counter, omask)
    else:
        tl.store(z, acc.to(out_ptr.dtype.element_ty), mask=omask)


def _block_m(T: int) -> int:
    return 16 if T <= 16 else 32 if T <= 32 else 64 if T <= 256 else 128


def split_for(tiles: int, steps: int, T: int, I: int, device) -> int:
    """Split-K count when the output tiles leave SMs idle: about four waves of programs, each
    split at least 4 K steps, the FP32 partials (8·T·R bytes a split and group, written and
    read) at most half the bf16 weight's 2·R·I. On the H200 (kernels-wo-a-h200.json) 128 tiles (T <= 16) took
    25.9 µs at 4 splits, 28.1 at 8 and 35.3 at 2; 64 tiles (T = 64) 84.3 µs at 8 splits, where
    5 (a ragged third wave) took 103.5 and 2 took 98.1."""
    sms = num_sms(device)
    return 1 if tiles >= sms else max(1, min(steps // 4, 4 * sms // tiles, I // (8 * T)))


def triton_inv_rope_wo_a(o, cos, sin, positions, wo_a, out, *, block_m: int | None = None,
                         block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
                         num_stages: int | None = None, num_warps: int | None = None) -> None:
    """`v41::inv_rope_wo_a` (same signature); keyword knobs: tile sizes, the split-K count (None:
    `split_for`), stages and warps (None: Triton's and the tile's)."""
    T, H, d = o.shape
    G, R, I = wo_a.shape
    rot = 2 * cos.shape[-1]
    if o.dtype not in TL_DTYPES or wo_a.dtype != o.dtype or out.dtype != o.dtype or \
            cos.dtype != torch.float32 or sin.dtype != torch.float32 or (d - rot) % 2 or \
            H * d != G * I:
        return _ref.inv_rope_wo_a(o, cos, sin, positions, wo_a, out)
    if T == 0:
        return
    try:
        o3 = o.view(T, G, I)
    except RuntimeError:
        o3 = o.contiguous().view(T, G, I)
    if o3.stride(2) != 1:
        o3 = o3.contiguous()
    w = wo_a if wo_a.stride(2) == 1 else wo_a.contiguous()
    try:
        z = out.view(T, G * R)
        z = z if z.stride(1) == 1 else None
    except RuntimeError:
        z = None
    dst = z if z is not None else torch.empty(T, G * R, dtype=out.dtype, device=out.device)
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    bm = block_m or _block_m(T)
    # decode: narrower N tiles, so the wo_a read (the whole cost there) spreads over more SMs
    bn = block_n or min(128 if bm >= 64 else 64, max(16, triton.next_power_of_2(R)))
    bk = block_k or min(64, max(16, triton.next_power_of_2(I)))
    interp = o.device.type == "cpu"
    grid_m, grid_n, steps = triton.cdiv(T, bm), triton.cdiv(R, bn), triton.cdiv(I, bk)
    splits = min(steps, split_k or split_for(grid_m * grid_n * G, steps, T, I, o.device))
    per = triton.cdiv(steps, splits)
    splits = triton.cdiv(steps, per)                  # no empty split
    part = dst if splits == 1 else torch.empty(splits, T, G * R, dtype=torch.float32, device=o.device)
    counters = tile_counters(o.device, grid_m * grid_n * G if splits > 1 else 0)
    kw = {} if num_stages is None else {"num_stages": num_stages}
    _inv_rope_wo_a_kernel[(grid_m, grid_n, G * splits)](
        o3, cos, sin, positions, w, dst, part, counters, T, R, I, d, d - rot, per * bk,
        o3.stride(0), o3.stride(1), cos.stride(0), sin.stride(0), w.stride(0), w.stride(1), dst.stride(0),
        part.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLITS=splits,
        DOT_F32=interp and o.dtype != torch.float32, PREC=dot_precision(o),
        num_warps=num_warps or (8 if bm >= 128 else 4), **kw, **pdl(o.device))
    if z is None:
        out.copy_(dst.view(out.shape))


register_impl("inv_rope_wo_a", "triton", triton_inv_rope_wo_a, device_type="cuda")
