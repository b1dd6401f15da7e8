"""Triton impls of `v41::fp8_act_quant`, `v41::fp8_block_gemm` and `v41::fp8_linear`
(custom_ops/gemm.py is the definition), and the pieces the W4A8 expert kernels share with them.

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
same launch.

W8A8 GEMV, up to GEMV_M rows (decode at batch 1 and 2), same grid and split-K: the weight read
as int32 words of four E4M3 codes, converted by the hardware's FP8 conversion in inline PTX
(E4M3_WORD_PTX; the interpreter's form decodes byte by byte), multiplied on CUDA cores with x's
FP8-QAT values (exact FP32 products), each word's sum scaled by its block's scale, the words
summed after the K loop; the loads software-pipelined. Where an MMA tile would hold one real row
in 16, its in-GEMM quantization of x and its padding dominate (benchmarks/sm90_build.py: 10.97
thread instructions a weight in the 16-row tile's K loop with x quantized inside, 5.84 in the
GEMV's).

fp8_linear from x in the activation dtype: up to FUSED_QUANT_M rows the GEMM or GEMV program
quantizes each block of x it reads with the act-quant kernel's function (QUANT_X); wider, the
act-quant kernel runs first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops import gemm as _ref
from custom_ops.registry import register_impl
from custom_ops.triton.common import TL_DTYPES, ceil_log2, pow2, round_e4m3, rows2d

GROUP = 32
GROUP_K = tl.constexpr(GROUP)   # the same width inside kernels (compiled Triton reads only constexpr globals)
BLOCK_M_MAX = 64
PREFILL_M = 1024
SPLIT_TILES_MAX = 8192        # output tiles a split-K call may have (its counters)
FUSED_QUANT_M = 16            # fp8_linear quantizes x inside the GEMM up to this many rows
GEMV_M = 2                    # up to this many rows the CUDA-core GEMV runs (benchmarks/sm90_build.py)
GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_STAGES = 64, 128, 3
_COUNTERS: dict = {}


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
def e8m0_to_f32(c):
    """2^(c-127) as FP32 for int32 E8M0 codes c: 1..254 from the bits, 0 the subnormal 2^-127,
    255 NaN."""
    v = tl.where(c == 0, 0x400000, c << 23).to(tl.float32, bitcast=True)
    return tl.where(c == 255, float("nan"), v)


@triton.jit
def fp8_quant_groups(y, AXIS: tl.constexpr):
    """(E4M3 values q, scales 2^k) of FP32 `y` whose axis AXIS is one group of 32: q·2^k is
    common.fp8_qat_groups(y), i.e. v41.quant.fp8_qat; the scales keep AXIS with size 1."""
    amax = tl.maximum(tl.max(tl.abs(y), axis=AXIS, keep_dims=True), 1e-4)
    k = ceil_log2(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)))
    return round_e4m3(y * pow2(-k)), pow2(k)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, N, NG, stride_x, stride_q, stride_s,
                      BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
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
            BLOCK_R=BLOCK_R, BLOCK_G=BLOCK_G, num_warps=4)


@triton.jit
def _fp8_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, o_ptr, p_ptr, cnt_ptr, M, N, KB, KB_SPLIT, ROWS_G,
                     stride_xm, stride_sm, stride_wn, stride_wsn, stride_om, stride_ps, stride_pm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr,
                     SPLIT_K: tl.constexpr, QUANT_X: tl.constexpr):
    """Program (m, n, s): K blocks [s·KB_SPLIT, (s+1)·KB_SPLIT) of one output tile. KB and
    KB_SPLIT are multiples of UNROLL. Grouped: the tile's weight rows belong to group
    n0 // ROWS_G (ROWS_G a multiple of BLOCK_N), which reads its own KB blocks of x.
    One split: the tile is rounded into o. SPLIT_K: each split stores its FP32 partial at
    p + s·stride_ps and counts itself in the tile's counter (acq_rel); the split that counts
    last sums the partials in ascending s, rounds once into o and zeroes the counter for the
    next call. QUANT_X: x is the activation itself, each 32-wide block quantized here as
    `_act_quant_kernel` would (the same codes and scales; xs unused)."""
    n0 = tl.program_id(1) * BLOCK_N
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    rk = tl.arange(0, GROUP_K)
    mmask = rm < M
    nmask = rn < N
    g_blocks = (n0 // ROWS_G).to(tl.int64) * KB        # the group's first K block of x
    a_ptrs = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + g_blocks * GROUP_K + rk[None, :]
    b_ptrs = w_ptr + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]
    sa_ptrs = xs_ptr + rm.to(tl.int64) * stride_sm + g_blocks
    sb_ptrs = ws_ptr + (rn // GROUP_K).to(tl.int64) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb0 in range(split * KB_SPLIT, tl.minimum(split * KB_SPLIT + KB_SPLIT, KB), UNROLL):
        for u in tl.static_range(UNROLL):
            kb = kb0 + u
            a = tl.load(a_ptrs + kb * GROUP_K, mask=mmask[:, None], other=0.0)
            if QUANT_X:
                a, sa = fp8_quant_groups(a.to(tl.float32), 1)
                a = a.to(tl.float8e4nv)
            else:
                sa = tl.load(sa_ptrs + kb, mask=mmask, other=0.0)[:, None]
            b = tl.load(b_ptrs + kb * GROUP_K, mask=nmask[None, :], other=0.0)
            part = tl.dot(a, b, out_dtype=tl.float32)
            sb = e8m0_to_f32(tl.load(sb_ptrs + kb, mask=nmask, other=127).to(tl.int32))
            acc += part * sa * sb[None, :]
    store_tile(acc, rm, rn, M, N, o_ptr, stride_om, p_ptr, stride_pm, stride_ps, cnt_ptr, SPLIT_K)


@triton.jit
def store_tile(acc, rm, rn, M, N, o_ptr, stride_om, p_ptr, stride_pm, stride_ps, cnt_ptr, SPLIT_K: tl.constexpr):
    """The output tile [rm, rn] of program (m, n, split): `acc` rounded into o, or with SPLIT_K
    handed to `sum_splits` (partials at p, the tile's counter at cnt_ptr)."""
    omask = (rm < M)[:, None] & (rn < N)[None, :]
    o_ptrs = o_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    if SPLIT_K:
        p_tile = p_ptr + rm.to(tl.int64)[:, None] * stride_pm + rn[None, :]
        counter = cnt_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        sum_splits(acc, o_ptrs, p_tile, stride_ps, tl.program_id(2), tl.num_programs(2), counter, omask)
    else:
        tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=omask)


@triton.jit
def sum_splits(acc, o_ptrs, p_tile, stride_ps, split, splits, counter, omask):
    """Split-K's end of a program: its FP32 partial `acc` stored at p_tile + split·stride_ps and
    counted in the tile's counter (acq_rel); the split that counts last sums the partials in
    ascending split order, rounds once into o_ptrs and zeroes the counter for the next call."""
    tl.store(p_tile + split.to(tl.int64) * stride_ps, acc, mask=omask)
    if tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1:
        tot = tl.zeros_like(acc)
        for s in range(splits):
            # .cg: from L2, where the other splits' stores are (not a stale L1 line)
            tot += tl.load(p_tile + s * stride_ps, mask=omask, other=0.0, cache_modifier=".cg")
        tl.store(o_ptrs, tot.to(o_ptrs.dtype.element_ty), mask=omask)
        tl.atomic_xchg(counter, 0)


def e4m3_word_ptx(w: str, outs: tuple[str, ...], p: str = "") -> str:
    """PTX lines: the four E4M3 codes of the 32-bit register w (byte i: element i) into the FP32
    registers outs, by the hardware's E4M3 pair -> f16x2 conversion twice, then f16 -> f32; the
    lines' own registers are named with the prefix p."""
    return "\n".join([f".reg .b16 {p}l0, {p}l1, {p}x0, {p}x1, {p}x2, {p}x3;", f".reg .b32 {p}f0, {p}f1;",
                      f"mov.b32 {{{p}l0, {p}l1}}, {w};",
                      f"cvt.rn.f16x2.e4m3x2 {p}f0, {p}l0;", f"cvt.rn.f16x2.e4m3x2 {p}f1, {p}l1;",
                      f"mov.b32 {{{p}x0, {p}x1}}, {p}f0;", f"mov.b32 {{{p}x2, {p}x3}}, {p}f1;"] +
                     [f"cvt.f32.f16 {o}, {p}x{i};" for i, o in enumerate(outs)])


# an int32 word $4 of four E4M3 codes -> their FP32 values $0..$3
E4M3_WORD_PTX = tl.constexpr("{\n" + e4m3_word_ptx("$4", ("$0", "$1", "$2", "$3")) + "\n}")


@triton.jit
def e4m3_byte(codes, i: tl.constexpr):
    """Byte i of int32 words of E4M3 codes, as its FP32 value."""
    return ((codes >> (8 * i)) & 0xFF).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def e4m3_word_values(w, ASM: tl.constexpr):
    """The four FP32 values of int32 words w of E4M3 codes, in element order. ASM (CUDA):
    E4M3_WORD_PTX; else (the interpreter runs no PTX) byte by byte."""
    if ASM:
        return tl.inline_asm_elementwise(E4M3_WORD_PTX, "=f,=f,=f,=f,r", [w], dtype=(tl.float32,) * 4,
                                         is_pure=True, pack=1)
    else:
        return e4m3_byte(w, 0), e4m3_byte(w, 1), e4m3_byte(w, 2), e4m3_byte(w, 3)


@triton.jit
def _fp8_gemv_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, o_ptr, p_ptr, cnt_ptr, M, N, K, K_SPLIT, ROWS_G,
                     stride_xm, stride_sm, stride_wn, stride_wsn, stride_om, stride_ps, stride_pm,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, QUANT_X: tl.constexpr, ASM: tl.constexpr, STAGES: tl.constexpr):
    """The W8A8 GEMM on CUDA cores for a few rows of x, program (m, n, s): ROWS rows of x against
    BLOCK_N weight rows over K range [s·K_SPLIT, (s+1)·K_SPLIT) (multiples of BLOCK_K, itself a
    multiple of 32). The weight arrives as int32 words of four E4M3 codes (stride_wn in words).
    Each word's four products with x's FP8-QAT values (x quantized here per 32 with QUANT_X,
    else its codes times its scales: the same values) are summed and scaled by the word's 32x32
    block scale into an FP32 accumulator per word; the words are summed once, after the K loop.
    The K loop's loads are software-pipelined STAGES deep (the weight words through shared
    memory), so a program keeps that many K blocks of its rows in flight. Grouped, split-K and
    the output as in `_fp8_gemm_kernel`."""
    W: tl.constexpr = BLOCK_K // 4                      # words a row a K block
    n0 = tl.program_id(1) * BLOCK_N
    rm = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rn = n0 + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    j = tl.arange(0, W)[None, None, :]
    mmask = (rm < M)[:, None, None]
    nmask = (rn < N)[None, :, None]
    x_at = x_ptr + rm.to(tl.int64)[:, None, None] * stride_xm + (n0 // ROWS_G).to(tl.int64) * K + 4 * j
    xs_at = xs_ptr + rm.to(tl.int64)[:, None, None] * stride_sm + (n0 // ROWS_G).to(tl.int64) * (K // GROUP_K) + \
        j // (GROUP_K // 4)
    w_at = w_ptr + rn.to(tl.int64)[None, :, None] * stride_wn + j
    s_at = ws_ptr + (rn // GROUP_K).to(tl.int64)[None, :, None] * stride_wsn + j // (GROUP_K // 4)
    acc = tl.zeros([ROWS, BLOCK_N, W], tl.float32)
    for k0 in tl.range(split * K_SPLIT, tl.minimum(split * K_SPLIT + K_SPLIT, K), BLOCK_K, num_stages=STAGES):
        w0, w1, w2, w3 = e4m3_word_values(tl.load(w_at + k0 // 4, mask=nmask, other=0), ASM)
        sw = e8m0_to_f32(tl.load(s_at + k0 // GROUP_K, mask=nmask, other=127).to(tl.int32))
        x0 = tl.load(x_at + k0, mask=mmask, other=0.0).to(tl.float32)
        x1 = tl.load(x_at + k0 + 1, mask=mmask, other=0.0).to(tl.float32)
        x2 = tl.load(x_at + k0 + 2, mask=mmask, other=0.0).to(tl.float32)
        x3 = tl.load(x_at + k0 + 3, mask=mmask, other=0.0).to(tl.float32)
        if QUANT_X:
            x0, x1, x2, x3 = fp8_qat_words(x0, x1, x2, x3, W)
        else:
            sx = tl.load(xs_at + k0 // GROUP_K, mask=mmask, other=0.0)
            x0, x1, x2, x3 = x0 * sx, x1 * sx, x2 * sx, x3 * sx
        acc += (w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3) * sw
    store_tile(tl.sum(acc, axis=2), rm, rn, M, N, o_ptr, stride_om, p_ptr, stride_pm, stride_ps, cnt_ptr, SPLIT_K)


@triton.jit
def fp8_qat_words(x0, x1, x2, x3, W: tl.constexpr):
    """The FP8-QAT values (`fp8_quant_groups`' q·2^k) of x [.., 1, W] held as four tensors of
    word elements 0..3: each group of 32 is 8 consecutive words."""
    m = tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3)))
    R: tl.constexpr = x0.shape[0]
    amax = tl.max(tl.reshape(m, [R, 1, W // (GROUP_K // 4), GROUP_K // 4]), axis=3, keep_dims=True)
    k = ceil_log2(tl.math.div_rn(tl.maximum(amax, 1e-4), tl.full(amax.shape, 448.0, tl.float32)))
    up = tl.reshape(tl.broadcast_to(pow2(k), [R, 1, W // (GROUP_K // 4), GROUP_K // 4]), [R, 1, W])
    down = tl.reshape(tl.broadcast_to(pow2(-k), [R, 1, W // (GROUP_K // 4), GROUP_K // 4]), [R, 1, W])
    return (round_e4m3(x0 * down) * up, round_e4m3(x1 * down) * up, round_e4m3(x2 * down) * up,
            round_e4m3(x3 * down) * up)


def _block_m(M: int) -> int:
    return min(BLOCK_M_MAX, max(16, triton.next_power_of_2(M)))


def split_count(tiles: int, KB: int, M: int, K: int, device) -> int:
    """Split-K count: enough programs for two waves over the SMs when the output tiles alone
    leave them idle (a decode GEMM at N = 1280 is 20 tiles on 132 SMs), each split keeping at
    least 4 K blocks; under 4 tiles per SM, at least 4 splits where their FP32 partials
    (written and read, 8·M·N bytes a split) stay under half the weight's N·K bytes (H200: 4
    splits took 16384x4096 at M = 1 from 59 to 32 µs; at M = 64 they slowed wq_b, whose
    partials outweigh it, from 38 to 49 µs). KB counts K in blocks of 32."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    n = max(1, min(KB // 4, triton.cdiv(2 * sms, tiles))) if tiles < sms else 1
    return max(n, min(4, KB // 4, K // (16 * M))) if tiles < 4 * sms else n


def triton_fp8_block_gemm(xq, xs, w, ws, out, groups: int = 1, **knobs) -> None:
    """`v41::fp8_block_gemm` (same signature; the groups in one launch, each output tile inside
    one group); keyword knobs: `_gemm`'s."""
    if xs.dtype != torch.float32 or xs.stride(-1) != 1 or not _gemm(xq, xs, w, ws, out, groups, **knobs):
        _ref.fp8_block_gemm(xq, xs, w, ws, out, groups)


def triton_fp8_linear(x, w, ws, out, groups: int = 1, **knobs) -> None:
    """`v41::fp8_linear` (same signature): up to FUSED_QUANT_M rows x is quantized inside the
    GEMM (each program quantizes the blocks it reads: no act-quant launch, no FP8 copy of x);
    wider, `triton_fp8_act_quant` first, since every column tile would quantize x again.
    Knobs: `_gemm`'s."""
    if x.shape[0] > FUSED_QUANT_M or x.dtype not in TL_DTYPES:
        q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(x.shape[0], x.shape[1] // GROUP, dtype=torch.float32, device=x.device)
        triton_fp8_act_quant(x, q, s)
        return triton_fp8_block_gemm(q, s, w, ws, out, groups, **knobs)
    if not _gemm(x, x, w, ws, out, groups, quant_x=True, **knobs):
        _ref.fp8_linear(x, w, ws, out, groups)


def _gemm(x, xs, w, ws, out, groups: int, *, quant_x: bool = False, gemv: bool | None = None,
          block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
          split_k: int | None = None, unroll: int | None = None, num_warps: int = 4,
          num_stages: int | None = None) -> bool:
    """Launch `_fp8_gemv_kernel` (up to GEMV_M rows, or as `gemv` says) or `_fp8_gemm_kernel`,
    or False where neither applies. Knobs: tile sizes (block_m: the GEMV's rows a program;
    block_k: its K block), split-K count (None: `split_count`), pipeline stages (None: the
    GEMV's GEMV_STAGES, the GEMM's `_tiles`), the GEMM's K blocks per iteration (None: `_tiles`,
    one block per iteration where its count does not divide K), warps. Split-K sums FP32 partials in a fixed order: deterministic, and only the order of
    the FP32 sums differs from one split."""
    K, R = _ref.gemm_group_shape(x, w, groups)
    M, N = x.shape[0], w.shape[0]
    gemv = (M <= GEMV_M if gemv is None else gemv) and w.stride(0) % 4 == 0 and w.storage_offset() % 4 == 0
    tile_n, tile_unroll, stages = (GEMV_BLOCK_N, GEMV_BLOCK_K // GROUP, GEMV_STAGES) if gemv else _tiles(M)
    bn = block_n or (tile_n if groups == 1 else min(tile_n, R & -R))   # a power of two dividing R
    if K % GROUP or out.dtype not in TL_DTYPES or (groups > 1 and (R % bn or bn < 16)) or \
            x.stride(-1) != 1 or w.stride(-1) != 1 or out.stride(-1) != 1:
        return False
    if M == 0 or N == 0:
        return True
    KB = K // GROUP
    if gemv:
        bm = block_m or min(GEMV_M, triton.next_power_of_2(M))
        unroll = (block_k or GEMV_BLOCK_K) // GROUP
        if KB % unroll:
            unroll = 1
    else:
        bm = block_m or _block_m(M)
        unroll = unroll or (tile_unroll if KB % tile_unroll == 0 else 1)
    if KB % unroll:
        raise ValueError(f"unroll={unroll} does not divide the {KB} K blocks of 32")
    grid_m, grid_n = triton.cdiv(M, bm), triton.cdiv(N, bn)
    splits = min(KB // unroll, split_k or split_count(grid_m * grid_n, KB, M, K, out.device))
    per = triton.cdiv(KB // unroll, splits) * unroll
    splits = triton.cdiv(KB, per)                   # no empty split
    wsc = ws.view(torch.uint8)
    part = out if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=out.device)
    counters = tile_counters(out.device, grid_m * grid_n if splits > 1 else 0)
    if gemv:
        words = w.view(torch.int32)
        _fp8_gemv_kernel[(grid_m, grid_n, splits)](
            x, xs, words, wsc, out, part, counters, M, N, K, per * GROUP, R, x.stride(0), xs.stride(0),
            words.stride(0), wsc.stride(0), out.stride(0), part.stride(0), part.stride(-2), ROWS=bm,
            BLOCK_N=bn, BLOCK_K=unroll * GROUP, SPLIT_K=splits > 1, QUANT_X=quant_x, ASM=x.is_cuda,
            STAGES=num_stages or stages, num_warps=num_warps)
        return True
    _fp8_gemm_kernel[(grid_m, grid_n, splits)](
        x, xs, w, wsc, out, part, counters,
        M, N, KB, per, R, x.stride(0), xs.stride(0), w.stride(0), wsc.stride(0), out.stride(0),
        part.stride(0), part.stride(-2), BLOCK_M=bm, BLOCK_N=bn, UNROLL=unroll, SPLIT_K=splits > 1,
        QUANT_X=quant_x, num_warps=num_warps, num_stages=num_stages or stages)
    return True


def tile_counters(device, tiles: int) -> torch.Tensor:
    """The split-K kernels' per-tile arrival counters on `device`: one zeroed buffer made once
    and kept (a CUDA graph that captured a GEMM keeps its address), every counter back at zero
    when its tile's last split has summed."""
    if tiles > SPLIT_TILES_MAX:
        raise ValueError(f"fp8_block_gemm: split-K over {tiles} output tiles (counters for {SPLIT_TILES_MAX})")
    c = _COUNTERS.get(device)
    if c is None:
        c = _COUNTERS[device] = torch.zeros(SPLIT_TILES_MAX, dtype=torch.int32, device=device)
    return c


register_impl("fp8_act_quant", "triton", triton_fp8_act_quant, device_type="cuda")
register_impl("fp8_block_gemm", "triton", triton_fp8_block_gemm, device_type="cuda")
register_impl("fp8_linear", "triton", triton_fp8_linear, device_type="cuda")
