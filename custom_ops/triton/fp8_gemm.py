"""Triton impls of `v41::fp8_act_quant`, `v41::fp8_block_gemm`, `v41::fp8_block_gemm_act_quant`
and `v41::fp8_linear` (custom_ops/gemm.py is the definition).

Activation quant, grid (row tiles, group tiles): per group of 32, the scale 2^k and the E4M3
codes of common.py's FP8 QAT (bit-exact with v41.quant), stored as float8_e4m3fn codes plus
FP32 scales instead of their product.

W8A8 GEMM, grid (M / BLOCK_M, N / BLOCK_N): the K loop walks 32-wide blocks, the width of both
the activation groups and the weight's 32x32 scale blocks, UNROLL of them per iteration (at
decode widths four where K allows: a weight row's whole 128-byte line requested at once instead
of a 32-byte sector per iteration). Each block is one FP8 x FP8 dot into
a fresh FP32 tile, then promoted: acc += tile · s_x[m] · s_w[n] (DeepGEMM's per-block scale
promotion; both scales are powers of two, so the promotion is exact and only the order of the
FP32 sums differs from the reference). The E8M0 weight scales are decoded from their bits.
Output rounded once to out's dtype. FP64 outputs and K not a multiple of 32 run the reference.
Grouped (wo_a's G output groups): one launch, each output tile inside one group, whose x
columns its K loop starts at.

Split-K (grid axis 2) where the output tiles alone leave SMs idle (decode widths): each split
walks its share of the K blocks into FP32 partials [splits, M, N]; the split that arrives last
at its tile (a per-tile counter) sums them in ascending split order and rounds once, in the
same launch (fp8.py).

For one row (decode at batch 1) the GEMV of fp8_gemv.py runs instead, same grid and split-K.

Path 'bf16' (prefill widths): x's and the weight's codes decoded to bf16 values times their
scales (`dequant_bf16`: exact, an E4M3 value's 4 significant bits times a power of two within
bf16's range, tests/test_quant.py), then cuBLAS's bf16 GEMM with FP32 accumulation and no
reduced-precision split-K reduction: the products are exact and the sums differ from the
reference's in order only, as with the FP8 dots. The bf16 copy of the weight lives for the call.

fp8_linear from x in the activation dtype: the one-row GEMV quantizes each block of x it reads
with the act-quant kernel's function (QUANT_X) where its column tiles, each quantizing all of K
again, quantize little (`quantizes_inside`); otherwise the act-quant kernel runs first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops import gemm as _ref
from custom_ops.registry import register_impl
from custom_ops.triton.common import TL_DTYPES, fp8_qat, pdl, pdl_wait, rows2d, tma_descriptor
from custom_ops.triton.fp8 import GROUP, GROUP_K, e8m0_to_f32, fp8_quant_groups, split_count, store_tile, \
    tile_counters
from custom_ops.triton.fp8_gemv import _fp8_gemv_kernel

BLOCK_M_MAX = 64
PREFILL_M = 1024
# fp8_linear quantizes x inside the GEMV while its column tiles quantize at most this many
# elements of x in all (`quantizes_inside`)
FUSED_QUANT_WORK = 1 << 17
# up to this many rows the CUDA-core GEMV runs, one row a program (the second row's programs read
# the weight tiles again, mostly from L2). H100, Flash's five dense shapes at two rows, one run
# (gemm-swap-h100.json run a, sweep): 9.3 / 22.1 / 25.2 / 10.3 / 33.7 µs against the MMA kernel's
# 10.4 / 25.0 / 26.0 / 11.5 / 38.2 (wq_a_kv, wq_b, wo_b, shared_w1, 4096x16384); at four rows the
# GEMV lost on every shape. flash-slice's native decode at batch 2: 13.12 against 14.13 ms of
# device time (gemv-two-rows-h100.json)
GEMV_M = 2
# from this many rows cuBLAS's bf16 GEMM on the decoded values (path 'bf16', the decode included):
# H100, Flash's five dense shapes at 2,048 rows, 121.5-482.3 µs against the FP8 MMA kernel's
# 176.6-853.4, 1.45-1.77x faster (dense-prefill-cublas-h100.json); fewer rows not timed
BF16_M = 2048
# the GEMV's weight rows a program, K block, pipeline stages of its plain loads. With the TMA
# loads, 64 rows: flash-slice's batch-1 FULL decode on an H100, 9.97 against 10.09 ms of device
# time at 128 (128 was fastest with the plain loads, native-gemm-one-row-h200.json); 256-wide K
# blocks took 10.61 against 10.18 (tma-knobs-h100.json)
GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_STAGES = 64, 128, 1
# whether the GEMV from codes loads its weight tiles through a tensor descriptor (TMA), and how
# many in flight: flash-slice's batch-1 FULL decode step on the H200, 10.10 ms of device time with
# the plain loads, 9.66 with this one's TMA, 9.16 with the FP4 GEMVs' too (tma-knobs-h200.json)
GEMV_TMA, GEMV_TMA_STAGES = True, 3


def _tiles(M: int) -> tuple[int, int, int]:
    """(BLOCK_N, K blocks per iteration, pipeline stages) by width, H200 (native-gemm-h200.json,
    sweep rows): up to 16 rows, 64-wide tiles and four K blocks per iteration (Flash's four
    projections at M = 1: 78.8 -> 66.1 µs); to 1,023, 128-wide tiles and six stages (M = 64:
    104.3 -> 89.1 µs); from PREFILL_M, 128-wide tiles (at 2,048 rows 1.26-1.46x faster than 64)
    and one block per iteration (four took 1.3-1.5x the time)."""
    if M <= 16:
        return 64, 4, 3
    return 128, 1, 6 if M < PREFILL_M else 3


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, N, NG, stride_x, stride_q, stride_s,
                      BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    gs = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    j = tl.arange(0, GROUP_K)
    r = rows.to(tl.int64)[:, None, None]
    col = gs[None, :, None] * GROUP_K + j[None, None, :]
    rg = (rows < N)[:, None] & (gs < NG)[None, :]
    mask = rg[:, :, None] & (j < GROUP_K)[None, None, :]
    y = tl.load(x_ptr + r * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    q, s = fp8_quant_groups(y, 2)
    tl.store(q_ptr + r * stride_q + col, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows.to(tl.int64)[:, None] * stride_s + gs[None, :], tl.reshape(s, [BLOCK_R, BLOCK_G]),
             mask=rg)


def triton_fp8_act_quant(x, q, s) -> None:
    """`v41::fp8_act_quant` (same signature)."""
    K = x.shape[-1]
    x2, q2, s2 = rows2d(x, K), rows2d(q, K), rows2d(s, K // GROUP)
    if K % GROUP or x.dtype not in TL_DTYPES or None in (x2, q2, s2) or s.dtype != torch.float32:
        return _ref.fp8_act_quant(x, q, s)
    N, NG = x2.shape[0], K // GROUP
    if N:
        BLOCK_G = min(triton.next_power_of_2(NG), 32)
        BLOCK_R = max(1, 64 // BLOCK_G)
        _act_quant_kernel[(triton.cdiv(N, BLOCK_R), triton.cdiv(NG, BLOCK_G))](
            x2, q2, s2, N, NG, x2.stride(0), q2.stride(0), s2.stride(0),
            BLOCK_R=BLOCK_R, BLOCK_G=BLOCK_G, num_warps=4, **pdl(x2.device))


@triton.jit
def _fp8_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, o_ptr, p_ptr, cnt_ptr, os_ptr, M, N, KB, KB_SPLIT, ROWS_G,
                     stride_xm, stride_sm, stride_wn, stride_wsn, stride_om, stride_ps, stride_pm, stride_osm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
                     SPLIT_K: tl.constexpr, QUANT_X: tl.constexpr, PDL: tl.constexpr = False,
                     QUANT_OUT: tl.constexpr = False, OUT_DTYPE: tl.constexpr = tl.bfloat16):
    """Program (m, n, s): K blocks [s·KB_SPLIT, (s+1)·KB_SPLIT) of one output tile. KB and
    KB_SPLIT are multiples of UNROLL. Grouped: the tile's weight rows belong to group
    n0 // ROWS_G (ROWS_G a multiple of BLOCK_N), which reads its own KB blocks of x.
    One split: the tile is rounded into o. SPLIT_K: each split stores its FP32 partial at
    p + s·stride_ps and counts itself in the tile's counter (acq_rel); the split that counts
    last sums the partials in ascending s, rounds once into o and zeroes the counter for the
    next call. QUANT_X: x is the activation itself, each 32-wide block quantized here as
    `_act_quant_kernel` would (the same codes and scales; xs unused). QUANT_OUT: the output
    rounded to OUT_DTYPE is act-quantized in the epilogue, codes into o, scales into os
    (fp8.store_tile)."""
    pdl_wait(PDL)
    n0 = tl.program_id(1) * BLOCK_N
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    rk = tl.arange(0, GROUP_K)
    mmask = rm < M
    nmask = rn < N
    kb_lo = split * KB_SPLIT
    g_blocks = (n0 // ROWS_G).to(tl.int64) * KB + kb_lo        # the group's first K block of x, then the split's
    # the pointers start at the split's first K block and step by UNROLL blocks, rather than
    # offsets from kb each block (with `column_scales`, the sm_90 builds' 16-row tile: its K loop
    # 6.44 -> 5.59 instructions a weight; sm90-build-cpu.json, 6.44 in the file as of 95c9bd2)
    a_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + g_blocks * GROUP_K + rk[None, :]
    b_ptrs = w_ptr + rn.to(tl.int64)[None, :] * stride_wn + kb_lo * GROUP_K + rk[:, None]
    sa_ptrs = xs_ptr + rm.to(tl.int64) * stride_sm + g_blocks
    if BLOCK_M <= 16:   # the warp-level MMA's layout: a weight scale code a 32-column block (column_scales)
        sb_ptrs = ws_ptr + kb_lo + (n0 // GROUP_K + tl.arange(0, BLOCK_N // GROUP_K)).to(tl.int64) * stride_wsn
        sb_mask = n0 // GROUP_K + tl.arange(0, BLOCK_N // GROUP_K) < tl.cdiv(N, GROUP_K)
    else:
        sb_ptrs = ws_ptr + kb_lo + (rn // GROUP_K).to(tl.int64) * stride_wsn
        sb_mask = nmask
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, tl.minimum(KB_SPLIT, KB - kb_lo), UNROLL):
        for kb in tl.static_range(UNROLL):
            a = tl.load(a_ptrs + kb * GROUP_K, mask=mmask[:, None], other=0.0)
            if QUANT_X:
                a, sa = fp8_quant_groups(a.to(tl.float32), 1)
                a = a.to(tl.float8e4nv)
            else:
                sa = tl.load(sa_ptrs + kb, mask=mmask, other=0.0)[:, None]
            b = tl.load(b_ptrs + kb * GROUP_K, mask=nmask[None, :], other=0.0)
            part = tl.dot(a, b, out_dtype=tl.float32)
            acc += part * sa * column_scales(sb_ptrs + kb, sb_mask, BLOCK_N, BLOCK_M <= 16)[None, :]
        a_ptrs += UNROLL * GROUP_K
        b_ptrs += UNROLL * GROUP_K
        sa_ptrs += UNROLL
        sb_ptrs += UNROLL
    store_tile(acc, rm, rn, M, N, o_ptr, stride_om, p_ptr, stride_pm, stride_ps, cnt_ptr, os_ptr, stride_osm, SPLIT_K,
               QUANT_OUT, OUT_DTYPE)


@triton.jit
def column_scales(s_ptrs, mask, BLOCK_N: tl.constexpr, REPEAT: tl.constexpr):
    """[BLOCK_N] FP32 weight scales of a K block for BLOCK_N columns from n0 (a multiple of
    GROUP_K): REPEAT, s_ptrs point at the E8M0 codes of their [BLOCK_N / GROUP_K] 32-wide column
    blocks, each code decoded once and repeated over its block's columns (the 16-row tile's
    layout; in trial builds of the 64- and 128-row warpgroup-MMA tiles the repeat lengthened the
    K loop, so they keep it off); else one code a column."""
    s = e8m0_to_f32(tl.load(s_ptrs, mask=mask, other=127).to(tl.int32))
    if REPEAT:
        s = tl.reshape(tl.broadcast_to(s[:, None], [BLOCK_N // GROUP_K, GROUP_K]), [BLOCK_N])
    return s


def _block_m(M: int) -> int:
    return min(BLOCK_M_MAX, max(16, triton.next_power_of_2(M)))


def triton_fp8_block_gemm(xq, xs, w, ws, out, groups: int = 1, **knobs) -> None:
    """`v41::fp8_block_gemm` (same signature; the groups in one launch, each output tile inside
    one group); keyword knobs: `_gemm`'s."""
    if xs.dtype != torch.float32 or xs.stride(-1) != 1 or not _gemm(xq, xs, w, ws, out, groups, **knobs):
        _ref.fp8_block_gemm(xq, xs, w, ws, out, groups)


def triton_fp8_block_gemm_act_quant(xq, xs, w, ws, dtype, q, s, groups: int = 1, **knobs) -> None:
    """`v41::fp8_block_gemm_act_quant` (same signature): the act quant in the GEMM's epilogue."""
    if xs.dtype != torch.float32 or xs.stride(-1) != 1 or s.dtype != torch.float32 or \
            not _gemm(xq, xs, w, ws, q, groups, scales=s, out_dtype=dtype, **knobs):
        _ref.fp8_block_gemm_act_quant(xq, xs, w, ws, dtype, q, s, groups)


def quantizes_inside(M: int, N: int, K: int) -> bool:
    """Whether `fp8_linear` leaves x's quantization to the GEMV (no act-quant launch, no FP8 copy
    of x): one row, and its N / GEMV_BLOCK_N column tiles, each quantizing all K of x again,
    quantize at most FUSED_QUANT_WORK elements. H200, Flash's dense shapes from bf16 x, the
    quantization inside against the act-quant kernel first (same run each, 128-row tiles then):
    one row, wq_a (10 tiles x 5,120) 8.8 against 9.5 µs, shared_w1 (18 x 5,120) 11.7 against
    11.6, wo_b (40 x 8,192) 28.2 against 25.4, wq_b (256 x 1,280) 24.4 against 21.0
    (native-gemm-one-row-h200.json);
    at 4-16 rows the MMA tiles quantizing inside took 1.0-1.4x the time of the act quant first on
    every shape (native-gemm-h200.json). Two GEMV rows quantize first: that form was timed."""
    return M == 1 and triton.cdiv(N, GEMV_BLOCK_N) * K <= FUSED_QUANT_WORK


def triton_fp8_linear(x, w, ws, out, groups: int = 1, **knobs) -> None:
    """`v41::fp8_linear` (same signature): x is quantized inside the GEMV where
    `quantizes_inside` says so (each program quantizes the blocks it reads), to its FP8 values in
    bf16 in one pass on path 'bf16', else by `triton_fp8_act_quant` first. Knobs: `_gemm`'s."""
    bf16 = cublas_applies(knobs.get("path") or gemm_path(x.shape[0]), groups, out)
    if not (bf16 or quantizes_inside(x.shape[0], w.shape[0], w.shape[1])) or x.dtype not in TL_DTYPES:
        q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(x.shape[0], x.shape[1] // GROUP, dtype=torch.float32, device=x.device)
        triton_fp8_act_quant(x, q, s)
        return triton_fp8_block_gemm(q, s, w, ws, out, groups, **knobs)
    if not _gemm(x, x, w, ws, out, groups, quant_x=True, **knobs):
        _ref.fp8_linear(x, w, ws, out, groups)


def gemm_path(M: int) -> str:
    """'gemv' up to GEMV_M rows, 'mma' (FP8 tensor cores, per-32 promotion) beyond, 'bf16' (cuBLAS
    on the decoded values) from BF16_M rows. H200, Flash's five dense shapes in one run
    (native-gemm-paths-h200.json): at one row the unpipelined GEMV took 0.83-0.93x the MMA
    kernel's time from codes and 0.72-0.81x from bf16 x (fp8_linear); three pipeline stages made it
    1.7-3.1x slower than the MMA kernel; at eight rows and more it lost."""
    return "gemv" if M <= GEMV_M else "bf16" if M >= BF16_M else "mma"


def cublas_applies(path: str, groups: int, out: torch.Tensor) -> bool:
    """Whether path 'bf16' runs as asked: ungrouped, into a bf16 output (elsewhere the FP8 MMA kernel)."""
    return path == "bf16" and groups == 1 and out.dtype == torch.bfloat16


def _gemm(x, xs, w, ws, out, groups: int, *, quant_x: bool = False, path: str | None = None,
          block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
          split_k: int | None = None, unroll: int | None = None, num_warps: int | None = None,
          num_stages: int | None = None, prefetch: bool = False, tma: bool | None = None, scales=None,
          out_dtype=None) -> bool:
    """Launch the kernel of `path` (default `gemm_path`): `_fp8_gemv_kernel` or
    `_fp8_gemm_kernel`, or return False where it does not apply. Knobs: tile sizes (block_m: the
    GEMV's rows a program; block_k: the GEMV's K block), split-K count (None: `split_count`),
    pipeline stages, the MMA kernel's K blocks per iteration (None: `_tiles`, one
    block per iteration where its count does not divide K), warps, the GEMV's register prefetch
    of the next K block (`_fp8_gemv_kernel` PREFETCH) or its weight loads through a tensor
    descriptor (TMA, default GEMV_TMA; pipelined over `num_stages`, default GEMV_TMA_STAGES). Split-K sums FP32 partials in
    a fixed order: deterministic, and only the order of the FP32 sums differs from one split.
    `scales`: out takes the E4M3 codes of the output rounded to `out_dtype`, `scales` their
    FP32 scales per 32 columns (QUANT_OUT)."""
    K, R = _ref.gemm_group_shape(x, w, groups)
    M, N = x.shape[0], w.shape[0]
    path = path or gemm_path(M)
    if path not in ("gemv", "mma", "bf16"):
        raise ValueError(f"fp8_block_gemm: path {path!r} is not 'gemv', 'mma' or 'bf16'")
    bf16 = scales is None and cublas_applies(path, groups, out)
    path = "mma" if path == "bf16" else path     # grouped, or an act-quant epilogue: the FP8 kernel
    if path == "gemv" and (w.stride(0) % 4 or w.storage_offset() % 4):
        path = "mma"                               # no int32 view of the codes
    tile_n, tile_unroll, stages = (GEMV_BLOCK_N, GEMV_BLOCK_K // GROUP, GEMV_STAGES) if path == "gemv" else _tiles(M)
    bn = block_n or (tile_n if groups == 1 else min(tile_n, R & -R))   # a power of two dividing R
    codes = scales is not None
    if K % GROUP or (out.dtype != torch.float8_e4m3fn if codes else out.dtype not in TL_DTYPES) or \
            (groups > 1 and (R % bn or bn < 16)) or (path == "mma" and bn % GROUP) or \
            (codes and (bn % GROUP or N % GROUP or out_dtype not in TL_DTYPES or scales.stride(-1) != 1)) or \
            x.stride(-1) != 1 or w.stride(-1) != 1 or out.stride(-1) != 1:
        return False
    if M == 0 or N == 0:
        return True
    if bf16:
        _bf16_gemm(x, xs, w, ws, out, quant_x)
        return True
    KB = K // GROUP
    if path == "mma":
        bm, unroll = block_m or _block_m(M), unroll or (tile_unroll if KB % tile_unroll == 0 else 1)
    else:                                          # the K block: the knob's or the default, if it divides K
        bm = block_m or 1                            # the TMA loads take one row a program
        unroll = (block_k or GROUP * tile_unroll) // GROUP
        unroll = unroll if KB % unroll == 0 else 1
    if KB % unroll:
        raise ValueError(f"unroll={unroll} does not divide the {KB} K blocks of 32")
    grid_m, grid_n = triton.cdiv(M, bm), triton.cdiv(N, bn)
    wsc = ws.view(torch.uint8)
    # x from codes only, one row a program: the GEMV's TMA loop reads one row of x as words of
    # codes (and a prefetch knob asks for the plain loads)
    tma = GEMV_TMA and not prefetch and bm == 1 if tma is None else tma
    if tma and path == "gemv" and bm > 1:
        raise ValueError(f"fp8_block_gemm: the GEMV's TMA loads take one row a program, not block_m={bm}")
    desc = tma_descriptor(w.view(torch.int32), [bn, unroll * GROUP // 4]) if path == "gemv" and tma and not quant_x \
        else None
    launch = dict(num_warps=num_warps or 4, num_stages=num_stages or (GEMV_TMA_STAGES if desc is not None else stages))
    splits = min(KB // unroll, split_k or split_count(grid_m * grid_n, KB, M, K, out.device))
    per = triton.cdiv(KB // unroll, splits) * unroll
    splits = triton.cdiv(KB, per)                   # no empty split
    part = out if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=out.device)
    counters = tile_counters(out.device, grid_m * grid_n if splits > 1 else 0)
    os_ = scales if codes else part
    epilogue = dict(QUANT_OUT=codes, OUT_DTYPE=TL_DTYPES[out_dtype] if codes else tl.bfloat16)
    if path == "gemv":
        words = w.view(torch.int32)
        if desc is not None and prefetch:
            raise ValueError("fp8_block_gemm: the GEMV's register prefetch and its TMA loads are exclusive")
        _fp8_gemv_kernel[(grid_m, grid_n, splits)](
            x, xs, words if desc is None else desc, wsc, out, part, counters, os_, M, N, K, per * GROUP, R,
            x.stride(0), xs.stride(0), words.stride(0), wsc.stride(0), out.stride(0), part.stride(0),
            part.stride(-2), os_.stride(0), ROWS=bm, BLOCK_N=bn, BLOCK_K=unroll * GROUP, SPLIT_K=splits > 1,
            QUANT_X=quant_x, ASM=x.is_cuda, STAGES=launch.pop("num_stages"), PREFETCH=prefetch,
            TMA=desc is not None, **epilogue, **launch, **pdl(out.device))
        return True
    _fp8_gemm_kernel[(grid_m, grid_n, splits)](
        x, xs, w, wsc, out, part, counters, os_,
        M, N, KB, per, R, x.stride(0), xs.stride(0), w.stride(0), wsc.stride(0), out.stride(0),
        part.stride(0), part.stride(-2), os_.stride(0), BLOCK_M=bm, BLOCK_N=bn, UNROLL=unroll, SPLIT_K=splits > 1,
        QUANT_X=quant_x, **epilogue, **launch, **pdl(out.device))
    return True


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, o_ptr, R, C, stride_q, stride_s, stride_o, SCALE_ROWS: tl.constexpr,
                    E8M0: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (rows < R)[:, None] & (cols < C)[None, :]
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_q + cols[None, :], mask=m, other=0.0).to(tl.float32)
    at = s_ptr + (rows // SCALE_ROWS).to(tl.int64)[:, None] * stride_s + (cols // GROUP_K)[None, :]
    if E8M0:
        s = e8m0_to_f32(tl.load(at, mask=m, other=127).to(tl.int32))
    else:
        s = tl.load(at, mask=m, other=0.0)
    tl.store(o_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :], (q * s).to(o_ptr.dtype.element_ty), mask=m)


def dequant_bf16(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """bf16 [R, C] values of E4M3 codes q [R, C] times their scales: s E8M0 [⌈R/32⌉, C/32] (a
    weight's 32x32 blocks) or FP32 [R, C/32] (an activation's groups of 32)."""
    R, C = q.shape
    o = torch.empty(R, C, dtype=torch.bfloat16, device=q.device)
    e8m0 = s.dtype != torch.float32
    block_c = min(128, triton.next_power_of_2(C))
    _dequant_kernel[(triton.cdiv(R, 32), triton.cdiv(C, block_c))](
        q, s.view(torch.uint8) if e8m0 else s, o, R, C, q.stride(0), s.stride(0), o.stride(0),
        SCALE_ROWS=GROUP if e8m0 else 1, E8M0=e8m0, BLOCK_R=32, BLOCK_C=block_c, num_warps=4, **pdl(q.device))
    return o


def _bf16_gemm(x, xs, w, ws, out, quant_x: bool) -> None:
    """Path 'bf16': out <- x's values @ w's values, both in bf16 (x quantized to its FP8 values
    first where `quant_x`), by cuBLAS with FP32 sums throughout."""
    if quant_x:
        xb = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
        fp8_qat(x, xb)
    else:
        xb = dequant_bf16(x, xs)
    wb = dequant_bf16(w, ws)
    flag = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        torch.mm(xb, wb.t(), out=out)
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = flag


register_impl("fp8_act_quant", "triton", triton_fp8_act_quant, device_type="cuda")
register_impl("fp8_block_gemm", "triton", triton_fp8_block_gemm, device_type="cuda")
register_impl("fp8_linear", "triton", triton_fp8_linear, device_type="cuda")
register_impl("fp8_block_gemm_act_quant", "triton", triton_fp8_block_gemm_act_quant, device_type="cuda")
