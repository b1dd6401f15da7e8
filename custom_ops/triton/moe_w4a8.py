"""`v41::moe_experts_w4a8`: the routed experts read as stored, FP4 E2M1 packed two per byte with
an E8M0 scale per 32 along K. `triton_moe_experts_w4a8` dispatches by `expert_path`: moe_gemv.py's
FP4 GEMVs while the (token, slot) pairs are few, moe.py's MMA tiles on FP4 tiles dequantized to
bf16 beyond ('tiles'); or, asked for by path='mma', the FP8-MMA kernels of this file, multiplied
on FP8 tensor cores with a per-32 scale promotion after every 32-deep dot.

The tile scheme is moe.py's (tokens sorted by expert, BLOCK_M-row tiles of one expert, a static
tile bound, a deterministic reduction in ascending expert id), with W4A8 GEMMs inside:
  0. x -> FP8 codes + per-32 FP32 scales once (fp8_gemm's activation quant).
  1. Up kernel, grid (tiles, I / BLOCK_N): per 32-wide K block, the tile's 16 bytes per output
     row are split into low / high nibbles, each moved bit by bit to the E4M3 code of 2^-6 times
     its E2M1 value (fp4.e2m1_e4m3; Hopper has no FP4 MMA), interleaved back into element order
     (element 2k is the low nibble), then one FP8 dot per weight and the promotion
     acc += tile · s_x[token] · s_w[row] · 2^6 (powers of two: exact). In registers as moe.py: both
     rounded to the activation dtype, clamp, silu, x routing weight, rounded, then the FP8 act
     quant of w2's input per 32 along I -> h codes [pairs, I] + scales [pairs, I/32].
  2. Down kernel, grid (tiles, D / BLOCK_N): h · w2[e]ᵀ the same way, rounded to the activation
     dtype, at the pair's row of y [T·k, D].
  3. moe.py's reduce kernel: out[t] = Σ of the token's slots in ascending expert id, FP32.
FP64, out not FP32, or widths not a multiple of 32 run the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops import gemm as _ref
from custom_ops.registry import register_impl
from custom_ops.triton.common import TL_DTYPES, pdl, pdl_wait
from custom_ops.triton.fp8 import GROUP, GROUP_K, fp8_quant_groups
from custom_ops.triton.fp8_gemm import triton_fp8_act_quant
from custom_ops.triton.fp4 import e2m1_codes, e2m1_scale
from custom_ops.triton.moe import _block_m, fits, run_experts
from custom_ops.triton.moe_tiles import expert_tiles, reduce_pairs, tile_rows

BLOCK_N_UP = 64
BLOCK_N_DOWN = 64
DECODE_PAIRS = 384         # 64 tokens x top-6: up to here moe_gemv.py's FP4 GEMVs (H200: faster than these at 1-64 tokens)
GEMV_PAIRS_PER_EXPERT = 2  # a GEMV reads its expert's weights once per pair, an MMA tile once per tile


@triton.jit
def e2m1_tile(w_rows, kb, nmask, BLOCK_N: tl.constexpr, ASM: tl.constexpr):
    """The [32, BLOCK_N] FP8 tile of K block kb of packed E2M1 rows (w_rows: [BLOCK_N] row
    pointers to int8 bytes), element 2j from byte j's low nibble, 2j+1 from its high nibble, as
    fp4.e2m1_e4m3's codes: 2^-6 times the values (their scales: fp4.e2m1_scale)."""
    j = tl.arange(0, GROUP_K // 2)
    b = tl.load(w_rows[:, None] + kb * (GROUP_K // 2) + j[None, :], mask=nmask[:, None], other=0)
    lo, hi = e2m1_codes(b, ASM)
    return tl.trans(tl.reshape(tl.join(lo, hi), [BLOCK_N, GROUP_K]).to(tl.float8e4nv, bitcast=True))


@triton.jit
def _w4a8_up_kernel(xq_ptr, xs_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, order_ptr, wts_ptr, meta_ptr,
                    hq_ptr, hs_ptr, n_tiles, I, KB, k, limit,
                    stride_x, stride_xs, stride_we, stride_wn, stride_se, stride_sn,
                    stride_h, stride_hs,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACT: tl.constexpr, ASM: tl.constexpr,
                    PDL: tl.constexpr = False):
    pdl_wait(PDL)
    r0, r1, e, rows, rmask, pair = tile_rows(meta_ptr, order_ptr, n_tiles, BLOCK_M)
    if r0 >= r1:
        return
    pid_n = tl.program_id(1)
    tok = (pair // k).to(tl.int64)
    wt = tl.load(wts_ptr + pair, mask=rmask, other=0.0).to(tl.float32)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < I
    rk = tl.arange(0, GROUP_K)
    a_rows = xq_ptr + tok[:, None] * stride_x + rk[None, :]
    w_off = e * stride_we + rn.to(tl.int64) * stride_wn       # w1 and w3 share their strides
    s_off = e * stride_se + rn.to(tl.int64) * stride_sn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(KB):
        a = tl.load(a_rows + kb * GROUP_K, mask=rmask[:, None], other=0.0)
        sa = tl.load(xs_ptr + tok * stride_xs + kb, mask=rmask, other=0.0)
        pg = tl.dot(a, e2m1_tile(w1_ptr + w_off, kb, nmask, BLOCK_N, ASM), out_dtype=tl.float32)
        pu = tl.dot(a, e2m1_tile(w3_ptr + w_off, kb, nmask, BLOCK_N, ASM), out_dtype=tl.float32)
        sg = e2m1_scale(tl.load(s1_ptr + s_off + kb, mask=nmask, other=127).to(tl.int32))
        su = e2m1_scale(tl.load(s3_ptr + s_off + kb, mask=nmask, other=127).to(tl.int32))
        acc_g += pg * sa[:, None] * sg[None, :]
        acc_u += pu * sa[:, None] * su[None, :]
    g = acc_g.to(ACT).to(tl.float32)
    u = acc_u.to(ACT).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    g = tl.minimum(g, limit)
    h = ((g / (1.0 + tl.exp(-g))) * u * wt[:, None]).to(ACT).to(tl.float32)
    q, s = fp8_quant_groups(tl.reshape(h, [BLOCK_M, BLOCK_N // GROUP_K, GROUP_K]), 2)
    m2 = rmask[:, None] & nmask[None, :]
    r64 = rows.to(tl.int64)
    tl.store(hq_ptr + r64[:, None] * stride_h + rn[None, :],
             tl.reshape(q, [BLOCK_M, BLOCK_N]).to(hq_ptr.dtype.element_ty), mask=m2)
    gi = pid_n * (BLOCK_N // GROUP_K) + tl.arange(0, BLOCK_N // GROUP_K)
    tl.store(hs_ptr + r64[:, None] * stride_hs + gi[None, :], tl.reshape(s, [BLOCK_M, BLOCK_N // GROUP_K]),
             mask=rmask[:, None] & (gi * GROUP_K < I)[None, :])


@triton.jit
def _w4a8_down_kernel(hq_ptr, hs_ptr, w2_ptr, s2_ptr, order_ptr, meta_ptr, y_ptr, n_tiles, D, KB,
                      stride_h, stride_hs, stride_we, stride_wn, stride_se, stride_sn, stride_y,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    r0, r1, e, rows, rmask, pair = tile_rows(meta_ptr, order_ptr, n_tiles, BLOCK_M)
    if r0 >= r1:
        return
    pid_n = tl.program_id(1)
    r64 = rows.to(tl.int64)
    pair = pair.to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < D
    rk = tl.arange(0, GROUP_K)
    w_rows = w2_ptr + e * stride_we + rn.to(tl.int64) * stride_wn
    s_rows = s2_ptr + e * stride_se + rn.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(KB):
        a = tl.load(hq_ptr + r64[:, None] * stride_h + kb * GROUP_K + rk[None, :], mask=rmask[:, None],
                    other=0.0)
        sa = tl.load(hs_ptr + r64 * stride_hs + kb, mask=rmask, other=0.0)
        part = tl.dot(a, e2m1_tile(w_rows, kb, nmask, BLOCK_N, ASM), out_dtype=tl.float32)
        sb = e2m1_scale(tl.load(s_rows + kb, mask=nmask, other=127).to(tl.int32))
        acc += part * sa[:, None] * sb[None, :]
    tl.store(y_ptr + pair[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rmask[:, None] & nmask[None, :])


def w4a8_expert_gemms(x, ids, weights, w1, s1, w3, s3, w2, s2, limit, *, block_m=None,
                      block_n_up=None, block_n_down=None, num_warps: int = 4, num_stages: int | None = None):
    """Steps 0-2: (h codes [T·k, I] float8_e4m3fn, h scales [T·k, I/32] FP32, y [T·k, D] in x's
    dtype), rows of h in expert order (`order`), rows of y per (token, slot) pair; rows of
    padding slots are left unwritten. Returns (hq, hs, y, order). Knobs: tile sizes, warps and
    pipeline stages (None: Triton's default) of both kernels."""
    T, D = x.shape
    E, I = w1.shape[0], w1.shape[1]
    k = ids.shape[1]
    dev = x.device
    xq = torch.empty(T, D, dtype=torch.float8_e4m3fn, device=dev)
    xs = torch.empty(T, D // GROUP, dtype=torch.float32, device=dev)
    triton_fp8_act_quant(x, xq, xs)
    bm = block_m or _block_m(T * k, E)
    bnu, bnd = block_n_up or BLOCK_N_UP, block_n_down or BLOCK_N_DOWN
    order, meta, n_tiles = expert_tiles(ids, E, bm)
    wts = weights.reshape(-1).contiguous()
    hq = torch.empty(T * k, I, dtype=torch.float8_e4m3fn, device=dev)
    hs = torch.empty(T * k, I // GROUP, dtype=torch.float32, device=dev)
    y = torch.empty(T * k, D, dtype=x.dtype, device=dev)
    s1, s3, s2 = (s.view(torch.uint8) for s in (s1, s3, s2))
    launch = {"num_warps": num_warps, **({"num_stages": num_stages} if num_stages else {})}
    _w4a8_up_kernel[(n_tiles, triton.cdiv(I, bnu))](
        xq, xs, w1, s1, w3, s3, order, wts, meta, hq, hs, n_tiles, I, D // GROUP, k, limit,
        xq.stride(0), xs.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1),
        hq.stride(0), hs.stride(0), BLOCK_M=bm, BLOCK_N=bnu, ACT=TL_DTYPES[x.dtype], ASM=dev.type == "cuda",
        **launch, **pdl(dev))
    _w4a8_down_kernel[(n_tiles, triton.cdiv(D, bnd))](
        hq, hs, w2, s2, order, meta, y, n_tiles, D, I // GROUP, hq.stride(0), hs.stride(0),
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bnd, ASM=dev.type == "cuda", **launch, **pdl(dev))
    return hq, hs, y, order


def expert_path(pairs: int, experts: int) -> str:
    """'gemv' (moe_gemv.py's FP4 GEMVs, a pass over an expert's weights per pair) while the (token,
    slot) pairs are few, at most DECODE_PAIRS and GEMV_PAIRS_PER_EXPERT per expert on average;
    'tiles' (moe.py's MMA tiles on FP4 weight tiles dequantized to bf16, one pass per tile)
    beyond. H200, one run (native-gemm-paths-h200.json): flash-slice's 16 experts at 6 / 16 /
    96 tokens 244.6 / 265.3 / 417.5 µs as 'tiles' against 346.5 / 357.2 / 826.6 µs on the
    FP8-MMA tiles above ('mma'); Flash's 384 at 2,048 tokens 7,270 µs against 11,334."""
    return "gemv" if pairs <= min(DECODE_PAIRS, GEMV_PAIRS_PER_EXPERT * experts) else "tiles"


def triton_moe_experts_w4a8(x, ids, weights, w1, s1, w3, s3, w2, s2, limit, out, *, path: str | None = None,
                            **knobs) -> None:
    """`v41::moe_experts_w4a8` (same signature). `path` (default `expert_path`; knobs without a
    path imply 'gemv'): 'gemv', moe.py's tile grouping with moe_gemv.py's FP4 GEMVs
    (`run_experts` with scales); 'tiles', moe.py's MMA tile kernels with each FP4 weight tile
    dequantized exactly to x's dtype in registers (no per-32 scale promotion after the dots: the
    scales are in the tile); 'mma', the FP8-MMA kernels above. Every product is exact in FP32,
    so only the order of the FP32 sums differs from the reference. Knobs: 'gemv' and 'tiles',
    run_experts' (block_m, block_n_up, block_n_down, block_k, splits, num_warps, num_stages, prefetch);
    'mma', w4a8_expert_gemms'."""
    if x.dtype not in TL_DTYPES or w1.dtype != torch.int8 or w1.stride() != w3.stride() or \
            s1.stride() != s3.stride() or not fits(x, (w1, w3, w2, s1, s3, s2), w1.shape[1], out, knobs):
        return _ref.moe_experts_w4a8(x, ids, weights, w1, s1, w3, s3, w2, s2, limit, out)
    path = path or ("gemv" if knobs else expert_path(ids.numel(), w1.shape[0]))
    if path not in ("gemv", "mma", "tiles"):
        raise ValueError(f"moe_experts_w4a8: path {path!r} is not 'gemv', 'mma' or 'tiles'")
    if path == "mma":
        if x.shape[0]:
            _, _, y, _ = w4a8_expert_gemms(x if x.stride(1) == 1 else x.contiguous(), ids, weights,
                                           w1, s1, w3, s3, w2, s2, limit, **knobs)
            reduce_pairs(y, ids, w1.shape[0], out)
        return
    run_experts(x, ids, weights, w1, w3, w2, tuple(t.view(torch.uint8) for t in (s1, s3, s2)), limit, out,
                tiles=path == "tiles", **knobs)


register_impl("moe_experts_w4a8", "triton", triton_moe_experts_w4a8, device_type="cuda")
