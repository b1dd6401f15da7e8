"""The FP4 expert GEMVs on tensor cores (`moe_experts_w4a8` path 'mma'): moe_gemv.py's GEMVs, one
(token, slot) pair a program row, with each group of 32 weights of 16 rows multiplied by two
`mma.sync.m16n8k16` (f16 x f16 -> FP32) instead of a conversion and an FFMA a weight: in the
sm_90 builds under Triton 3.6 the down GEMV's K loop issues about half the instructions a weight
of moe_gemv.py's (benchmarks/sm90_build.py `fp4_mma_rows`), and the instructions, not the bytes,
bound those GEMVs.

The activation in MMA form (`mma_act`, and the up GEMV's epilogue for h): an FP8-QAT row (E4M3
values q times a UE8M0 scale 2^k a group of 32) as q in f16 (every E4M3 value is one), each eight
elements in the order 0, 2, 1, 3, 4, 6, 5, 7, so that its int32 words are the f16 pairs (0, 2),
(1, 3), (4, 6), (5, 7) that lane position t of the MMA's fragments takes; and per group the FP32
bits (k + 6) << 23. Added to a weight's E8M0 code << 23 they are the bits of the group's
combined scale 2^(code - 127) · 2^6 · 2^k (2^6: the E4M3 codes of nibbles are 2^-6 times the
E2M1 values, fp4.py), which is a normal FP32 for weight codes of at least 17 (k >= -22: the QAT
floors amax at 1e-4) and codes + k up to 248.

Lanes: every tensor of the K loop is [32 · warps], which Triton lays out one element a lane
(tests/test_kernels_sm90_build.py checks the build), so an inline PTX block sees one lane's
registers, as mma.sync wants. Warp w takes weight rows 16w.. of the program's 16 · warps; lane
l = 4g + t holds rows g and g + 8 (A's rows, and D's) and, for each group, the rows' int32 word t
(elements 8t..8t+7) and the activation's four words of position t. Two MMAs cover the group: the
first on the pairs (0, 2) and (1, 3) in A's k slots (2t, 2t + 1) and (2t + 8, 2t + 9), the second on
(4, 6) and (5, 7); B's columns all hold the activation, so every column of D is the rows' group
sums, which one FMA a row adds, times the combined scale, to its FP32 accumulator. Every product
is exact; the tensor cores sum 16 of them at a time (tests/test_fp4_mma_gpu.py bounds it).
Under the interpreter, which runs no PTX, the same sums come from Triton ops (a lane's eight
products, then its quad's four lanes).

K is split as moe_gemv.py's, each split's FP32 partials stored by lane position 0 and summed in
split order by the split that counts last at its (row, N block): there the up GEMV's epilogue
(moe_tiles.swiglu_values) stores h in MMA form, the down GEMV's sum is rounded into y.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.triton.common import TL_DTYPES, group_exponent, pdl, pdl_wait, pow2, round_e4m3
from custom_ops.triton.fp4 import _HI_CODES, _LO_CODES, e2m1_word_values, word_aligned
from custom_ops.triton.fp8 import tile_counters
from custom_ops.triton.moe_gemv import fp4_splits, gemv_row, k_split
from custom_ops.triton.moe_tiles import swiglu_values

MMA_WARPS = 4           # 64 weight rows a program
MMA_BLOCK_K = 128       # four groups a K step; one int32 word of scale codes a row


def _pairs(w: str, out: tuple[str, ...], p: str) -> str:
    """PTX: the int32 word w of eight E2M1 values -> f16 pairs out = ((0, 2), (4, 6), (1, 3), (5, 7)),
    2^-6 times their values (registers a, b, lo, hi declared by the caller)."""
    return "\n".join([_LO_CODES.format(w=w, out="lo"), _HI_CODES.format(w=w, out="hi"),
                      f"mov.b32 {{{p}0, {p}1}}, lo;", f"mov.b32 {{{p}2, {p}3}}, hi;"] +
                     [f"cvt.rn.f16x2.e4m3x2 {o}, {p}{i};" for i, o in enumerate(out)])


# $0, $1 <- the accumulators $8, $9 of rows g, g + 8 plus their group's sums times the scales $10, $11;
# $2, $3: the rows' weight words; $4..$7: the activation's f16 pairs (0, 2), (1, 3), (4, 6), (5, 7)
GROUP_PTX = tl.constexpr(
    "{\n.reg .b32 a, b, lo, hi, p0, p1, p2, p3, q0, q1, q2, q3;\n.reg .b16 u0, u1, u2, u3, v0, v1, v2, v3;\n"
    ".reg .f32 d0, d1, d2, d3, z;\nmov.f32 z, 0f00000000;\n" +
    _pairs("$2", ("p0", "p1", "p2", "p3"), "u") + "\n" + _pairs("$3", ("q0", "q1", "q2", "q3"), "v") + "\n" +
    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0, d1, d2, d3}, {p0, q0, p2, q2}, {$4, $5}, {z, z, z, z};\n"
    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0, d1, d2, d3}, {p1, q1, p3, q3}, {$6, $7}, "
    "{d0, d1, d2, d3};\nfma.rn.f32 $0, d0, $10, $8;\nfma.rn.f32 $1, d2, $11, $9;\n}")


@triton.jit
def _halves(a):
    """The two f16 values of int32 words a (low half first) as FP32."""
    return ((a & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
            (a >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32))


@triton.jit
def _quad_dot(w, a0, a1, a2, a3, LANES: tl.constexpr):
    """GROUP_PTX's sums without PTX: each lane's eight products of its word w and activation words,
    summed over the lane's quad (the four lanes of one row), for every lane of the quad."""
    v0, v1, v2, v3, v4, v5, v6, v7 = e2m1_word_values(w, False)
    x0, x2 = _halves(a0)
    x1, x3 = _halves(a1)
    x4, x6 = _halves(a2)
    x5, x7 = _halves(a3)
    p = v0 * x0 + v1 * x1 + v2 * x2 + v3 * x3 + v4 * x4 + v5 * x5 + v6 * x6 + v7 * x7
    s = tl.sum(tl.reshape(p, [LANES // 4, 4]), axis=1)
    return tl.reshape(tl.broadcast_to(s[:, None], [LANES // 4, 4]), [LANES])


@triton.jit
def group_step(acc0, acc1, w0, w1, a0, a1, a2, a3, f0, f1, LANES: tl.constexpr, ASM: tl.constexpr):
    """acc0, acc1 (rows g, g + 8 of each lane) plus f0, f1 (the rows' combined scales) times the
    rows' sums over one group of 32: weight words w0, w1 (the lane's word t), activation words
    a0..a3 (its pairs at position t)."""
    if ASM:
        return tl.inline_asm_elementwise(GROUP_PTX, "=f,=f,r,r,r,r,r,r,f,f,f,f",
                                         [w0, w1, a0, a1, a2, a3, acc0, acc1, f0, f1],
                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        return (tl.fma(_quad_dot(w0, a0, a1, a2, a3, LANES), f0, acc0),
                tl.fma(_quad_dot(w1, a0, a1, a2, a3, LANES), f1, acc1))


@triton.jit
def lane_rows(n0, LANES: tl.constexpr):
    """Each lane's rows g and g + 8 of its warp's 16 from n0, and its position t in its quad."""
    lane = tl.arange(0, LANES)
    r0 = n0 + (lane // 32) * 16 + (lane % 32) // 4
    return r0, r0 + 8, lane % 4


@triton.jit
def scale_bits(s_row, sw, grp, c: tl.constexpr, mask, SCALE_WORDS: tl.constexpr):
    """A row's E8M0 code of group grp (c-th of its K step) as FP32 exponent bits: from the K step's
    word of four codes sw (SCALE_WORDS) or loaded as a byte."""
    if SCALE_WORDS:
        code = (sw >> (8 * c)) & 0xFF
    else:
        code = tl.load(s_row + grp, mask=mask, other=0).to(tl.int32)
    return code << 23


@triton.jit
def rows_k_step(acc0, acc1, w0, w1, s0, s1, a0, a1, a2, a3, off, grp, t, m0, m1, c: tl.constexpr, sw0, sw1,
                LANES: tl.constexpr, SCALE_WORDS: tl.constexpr, ASM: tl.constexpr):
    """One group of one weight matrix: rows' word pointers w0, w1 and scale pointers s0, s1."""
    f0 = (scale_bits(s0, sw0, grp, c, m0, SCALE_WORDS) + off).to(tl.float32, bitcast=True)
    f1 = (scale_bits(s1, sw1, grp, c, m1, SCALE_WORDS) + off).to(tl.float32, bitcast=True)
    return group_step(acc0, acc1, tl.load(w0 + grp * 4 + t, mask=m0, other=0),
                      tl.load(w1 + grp * 4 + t, mask=m1, other=0), a0, a1, a2, a3, f0, f1, LANES, ASM)


@triton.jit
def scale_word(s_row, k0, mask, SCALE_WORDS: tl.constexpr):
    """The int32 word of a row's four scale codes of K step k0 (SCALE_WORDS), else 0 (unread)."""
    if SCALE_WORDS:
        return tl.load(s_row + k0 // 128, mask=mask, other=0)
    else:
        return tl.zeros(mask.shape, tl.int32)


@triton.jit
def act_group(a_row, o_row, grp, t):
    """Lane position t's four words of group grp of an activation row in MMA form, and the group's
    exponent bits."""
    v = tl.load((a_row + grp * 16 + t * 4)[:, None] + tl.arange(0, 4)[None, :])
    x02, x13 = tl.split(tl.reshape(v, [v.shape[0], 2, 2]))
    a0, a2 = tl.split(x02)
    a1, a3 = tl.split(x13)
    return a0, a1, a2, a3, tl.load(o_row + grp)


@triton.jit
def store_lanes(p, acc0, acc1, r0, r1, m0, m1, t):
    """Lane position 0's row sums at p + row (every lane of a quad holds them)."""
    tl.store(p + r0, acc0, mask=m0 & (t == 0))
    tl.store(p + r1, acc1, mask=m1 & (t == 0))


@triton.jit
def counted_last(counter):
    """Whether this program counts last at its counter (acq_rel), once all its lanes have stored."""
    tl.debug_barrier()
    return tl.atomic_add(counter, 1, sem="acq_rel") == tl.num_programs(2) - 1


@triton.jit
def split_total(p, stride_ps, rn, nmask):
    """The splits' partials at p + rn summed in split order (.cg: from L2, where they were stored)."""
    tot = tl.zeros(rn.shape, tl.float32)
    for sp in range(tl.num_programs(2)):
        tot += tl.load(p + sp * stride_ps + rn, mask=nmask, other=0.0, cache_modifier=".cg")
    return tot


@triton.jit
def mma_column(n):
    """Where element n of a row sits in MMA form: bits 0 and 1 of n swapped."""
    return (n & ~3) | ((n & 1) << 1) | ((n >> 1) & 1)


@triton.jit
def store_mma_act(v, a_row, o_row, n0, N, BLOCK: tl.constexpr):
    """FP32 values v [BLOCK] of columns n0.. (n0 and BLOCK multiples of 32; those below N stored)
    FP8-QAT'd per 32 (common.fp8_qat_groups) into an activation row in MMA form: the E4M3 values
    as f16 at their columns, each group's exponent bits at o_row."""
    vg = tl.reshape(v, [BLOCK // 32, 32])
    k = group_exponent(tl.max(tl.abs(vg), axis=1, keep_dims=True))
    q = tl.reshape(round_e4m3(vg * pow2(-k)), [BLOCK])
    rn = n0 + tl.arange(0, BLOCK)
    tl.store(a_row + mma_column(rn), q.to(tl.float16), mask=rn < N)
    grp = n0 // 32 + tl.arange(0, BLOCK // 32)
    tl.store(o_row + grp, tl.reshape((k + 6) << 23, [BLOCK // 32]), mask=grp * 32 < N)


@triton.jit
def _mma_act_kernel(x_ptr, a_ptr, o_ptr, D, stride_x, stride_a, stride_o, BLOCK: tl.constexpr,
                    PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK
    rn = n0 + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * stride_x + rn, mask=rn < D, other=0.0).to(tl.float32)
    store_mma_act(v, a_ptr + row * stride_a, o_ptr + row * stride_o, n0, D, BLOCK)


def mma_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] (D a multiple of 32) FP8-QAT'd (v41.quant.fp8_qat's values) in MMA form: (f16 [T, D],
    int32 [T, D / 32] exponent bits)."""
    T, D = x.shape
    a = torch.empty(T, D, dtype=torch.float16, device=x.device)
    o = torch.empty(T, D // 32, dtype=torch.int32, device=x.device)
    block = min(1024, triton.next_power_of_2(D))
    _mma_act_kernel[(T, triton.cdiv(D, block))](x, a, o, D, x.stride(0), a.stride(0), o.stride(0), BLOCK=block,
                                                num_warps=4, **pdl(x.device))
    return a, o


def mma_act_values(a: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """The FP32 values of an activation in MMA form (the inverse of `mma_act`'s layout)."""
    T, D = a.shape
    q = a.float().reshape(T, D // 8, 8)[..., [0, 2, 1, 3, 4, 6, 5, 7]].reshape(T, D // 32, 32)
    return (q * torch.pow(2.0, (o >> 23).float() - 6)[..., None]).reshape(T, D)


@triton.jit
def _fp4_mma_up(xa_ptr, xo_ptr, ids_ptr, order_ptr, wts_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, part_ptr, cnt_ptr,
                ha_ptr, ho_ptr, I, D, k, k_split, limit, stride_xa, stride_xo, stride_we, stride_wn, stride_se,
                stride_sn, stride_ps, stride_pu, stride_ha, stride_ho, ACT: tl.constexpr, LANES: tl.constexpr,
                BLOCK_K: tl.constexpr, SCALE_WORDS: tl.constexpr, ASM: tl.constexpr, SORTED: tl.constexpr,
                PDL: tl.constexpr = False):
    """FP4 up GEMMs, grid (rows, I / (LANES / 2), K splits): one pair's token row (MMA form)
    against LANES / 2 rows of w1[e] and w3[e], the split's FP32 sums into the partials
    [splits, 2, rows, I]; the last split's sums through the SwiGLU epilogue into h's row (MMA form)."""
    pdl_wait(PDL)
    r, pair, e, rn, k_lo = gemv_row(order_ptr, ids_ptr, k_split, LANES // 2, SORTED)
    if e < 0:
        return
    r0, r1, t = lane_rows(tl.program_id(1) * (LANES // 2), LANES)
    m0, m1 = r0 < I, r1 < I
    a_row = xa_ptr + (pair // k) * stride_xa
    o_row = xo_ptr + (pair // k) * stride_xo
    wr0, wr1 = e * stride_we + r0.to(tl.int64) * stride_wn, e * stride_we + r1.to(tl.int64) * stride_wn
    sr0, sr1 = e * stride_se + r0.to(tl.int64) * stride_sn, e * stride_se + r1.to(tl.int64) * stride_sn
    g0 = tl.zeros([LANES], tl.float32)
    g1 = tl.zeros([LANES], tl.float32)
    u0 = tl.zeros([LANES], tl.float32)
    u1 = tl.zeros([LANES], tl.float32)
    for k0 in range(k_lo, tl.minimum(D, k_lo + k_split), BLOCK_K):
        gw0, gw1 = scale_word(s1_ptr + sr0, k0, m0, SCALE_WORDS), scale_word(s1_ptr + sr1, k0, m1, SCALE_WORDS)
        uw0, uw1 = scale_word(s3_ptr + sr0, k0, m0, SCALE_WORDS), scale_word(s3_ptr + sr1, k0, m1, SCALE_WORDS)
        for c in tl.static_range(BLOCK_K // 32):
            grp = k0 // 32 + c
            a0, a1, a2, a3, off = act_group(a_row, o_row, grp, t)
            g0, g1 = rows_k_step(g0, g1, w1_ptr + wr0, w1_ptr + wr1, s1_ptr + sr0, s1_ptr + sr1, a0, a1, a2, a3,
                                 off, grp, t, m0, m1, c, gw0, gw1, LANES, SCALE_WORDS, ASM)
            u0, u1 = rows_k_step(u0, u1, w3_ptr + wr0, w3_ptr + wr1, s3_ptr + sr0, s3_ptr + sr1, a0, a1, a2, a3,
                                 off, grp, t, m0, m1, c, uw0, uw1, LANES, SCALE_WORDS, ASM)
    at = part_ptr + r * I
    store_lanes(at + tl.program_id(2) * stride_ps, g0, g1, r0, r1, m0, m1, t)
    store_lanes(at + tl.program_id(2) * stride_ps + stride_pu, u0, u1, r0, r1, m0, m1, t)
    counter = cnt_ptr + r * tl.num_programs(1) + tl.program_id(1)
    if counted_last(counter):
        nmask = rn < I
        g = split_total(at, stride_ps, rn, nmask)
        u = split_total(at + stride_pu, stride_ps, rn, nmask)
        h = swiglu_values(g, u, tl.load(wts_ptr + pair).to(tl.float32), limit, ACT)
        store_mma_act(h, ha_ptr + r * stride_ha, ho_ptr + r * stride_ho, tl.program_id(1) * (LANES // 2), I,
                      LANES // 2)
        tl.atomic_xchg(counter, 0)


@triton.jit
def _fp4_mma_down(ha_ptr, ho_ptr, ids_ptr, order_ptr, w2_ptr, s2_ptr, part_ptr, cnt_ptr, y_ptr, D, I, k_split,
                  stride_ha, stride_ho, stride_we, stride_wn, stride_se, stride_sn, stride_ps, stride_y,
                  LANES: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_WORDS: tl.constexpr, ASM: tl.constexpr,
                  SORTED: tl.constexpr, PDL: tl.constexpr = False):
    """FP4 down GEMM, grid (rows, D / (LANES / 2), K splits): one h row (MMA form) against
    LANES / 2 rows of w2[e], the split's FP32 sums into the partials [splits, pairs, D] at the
    pair's row; the last split's sum rounded into the pair's row of y."""
    pdl_wait(PDL)
    r, pair, e, rn, k_lo = gemv_row(order_ptr, ids_ptr, k_split, LANES // 2, SORTED)
    if e < 0:
        return
    r0, r1, t = lane_rows(tl.program_id(1) * (LANES // 2), LANES)
    m0, m1 = r0 < D, r1 < D
    a_row = ha_ptr + r * stride_ha
    o_row = ho_ptr + r * stride_ho
    w0 = w2_ptr + e * stride_we + r0.to(tl.int64) * stride_wn
    w1 = w2_ptr + e * stride_we + r1.to(tl.int64) * stride_wn
    s0 = s2_ptr + e * stride_se + r0.to(tl.int64) * stride_sn
    s1 = s2_ptr + e * stride_se + r1.to(tl.int64) * stride_sn
    acc0 = tl.zeros([LANES], tl.float32)
    acc1 = tl.zeros([LANES], tl.float32)
    for k0 in range(k_lo, tl.minimum(I, k_lo + k_split), BLOCK_K):
        sw0, sw1 = scale_word(s0, k0, m0, SCALE_WORDS), scale_word(s1, k0, m1, SCALE_WORDS)
        for c in tl.static_range(BLOCK_K // 32):
            grp = k0 // 32 + c
            a0, a1, a2, a3, off = act_group(a_row, o_row, grp, t)
            acc0, acc1 = rows_k_step(acc0, acc1, w0, w1, s0, s1, a0, a1, a2, a3, off, grp, t, m0, m1, c, sw0, sw1,
                                     LANES, SCALE_WORDS, ASM)
    at = part_ptr + pair * D
    store_lanes(at + tl.program_id(2) * stride_ps, acc0, acc1, r0, r1, m0, m1, t)
    counter = cnt_ptr + r * tl.num_programs(1) + tl.program_id(1)
    if counted_last(counter):
        nmask = rn < D
        tot = split_total(at, stride_ps, rn, nmask)
        tl.store(y_ptr + pair * stride_y + rn, tot.to(y_ptr.dtype.element_ty), mask=nmask)
        tl.atomic_xchg(counter, 0)


def fp4_mma_gemvs(x, ids, order, wts, w1, w3, w2, scales, limit, I, y, splits=None, num_warps=None):
    """Steps 1-2 on FP4 experts on tensor cores, three launches: x to MMA form (`mma_act`), the up
    GEMVs into partials, whose last split sums them and runs the epilogue -> h (MMA form), the
    down GEMVs likewise -> y. `order` as moe_gemv.fp4_gemvs'. Returns h's (f16 words, exponent bits)."""
    P, D = y.shape
    k = ids.shape[1]
    dev = x.device
    warps = num_warps or MMA_WARPS
    lanes, rows = 32 * warps, 16 * warps
    xa, xo = mma_act(x)
    ha = torch.empty(P, I, dtype=torch.float16, device=dev)
    ho = torch.empty(P, I // 32, dtype=torch.int32, device=dev)
    flat = ids.reshape(-1).contiguous()
    sorted_ = order is not None
    order = order if sorted_ else flat                 # unread unsorted
    bku, bkd = (MMA_BLOCK_K if K % MMA_BLOCK_K == 0 else 32 for K in (D, I))
    ku, su = k_split(D, bku, splits or fp4_splits(D, bku))
    kd, sd = k_split(I, bkd, splits or fp4_splits(I, bkd))
    s1, s3, s2 = scales
    swu, swd = bku == MMA_BLOCK_K and word_aligned(s1, s3), bkd == MMA_BLOCK_K and word_aligned(s2)
    if swu:             # the scale codes as int32 words of four
        s1, s3 = s1.view(torch.int32), s3.view(torch.int32)
    if swd:
        s2 = s2.view(torch.int32)
    w1, w3, w2 = (w.view(torch.int32) for w in (w1, w3, w2))     # eight E2M1 values a word
    pu = torch.empty(su, 2, P, I, dtype=torch.float32, device=dev)
    pd = torch.empty(sd, P, D, dtype=torch.float32, device=dev)
    common = dict(LANES=lanes, ASM=dev.type == "cuda", SORTED=sorted_, num_warps=warps, **pdl(dev))
    grid_up, grid_down = (P, triton.cdiv(I, rows), su), (P, triton.cdiv(D, rows), sd)
    _fp4_mma_up[grid_up](
        xa.view(torch.int32), xo, flat, order, wts, w1, w3, s1, s3, pu, tile_counters(dev, P * grid_up[1]), ha, ho,
        I, D, k, ku, limit, xa.stride(0) // 2, xo.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1),
        pu.stride(0), pu.stride(1), ha.stride(0), ho.stride(0), ACT=TL_DTYPES[y.dtype], BLOCK_K=bku, SCALE_WORDS=swu,
        **common)
    _fp4_mma_down[grid_down](
        ha.view(torch.int32), ho, flat, order, w2, s2, pd, tile_counters(dev, P * grid_down[1]), y, D, I, kd,
        ha.stride(0) // 2, ho.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), pd.stride(0),
        y.stride(0), BLOCK_K=bkd, SCALE_WORDS=swd, **common)
    return ha, ho
