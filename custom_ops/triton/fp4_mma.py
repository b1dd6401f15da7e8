"""The FP4 expert GEMVs on tensor cores (`moe_experts_w4a8` path 'mma'): the W4A8 expert GEMMs at
decode widths with each group of 32 weights of 16 rows multiplied by two `mma.sync.m16n8k16`
(f16 x f16 -> FP32; fp4_mma_lanes.py) instead of a conversion and an FFMA a weight: in the sm_90
builds under Triton 3.6 their K loops issue 53-65% of the instructions a weight of
moe_gemv.py's (`fp4-mma-triton36-cpu.json`), and the instructions, not the bytes, bound those
GEMVs. A program takes 16 · warps weight rows of one expert against the activations of its
columns: one pair in every column at one token (COLS 1: a program a pair, as moe_gemv.py's), or
up to eight pairs of the expert, one a column, from moe_tiles.expert_tiles' 8-row tiles (COLS 8):
one pass over the expert's weights decodes them once for all of them.

The activations arrive in MMA form (fp4_mma_lanes.py: exact f16 E4M3 values in the fragments' k
order, each group's scale as exponent bits): `mma_act` for x, the up GEMV's epilogue for h.
K is split as moe_gemv.py's, each split's FP32 partials stored at (sorted row, weight row) and
summed in split order by the split that counts last at its (program row, N block): there the up
GEMV's epilogue (moe_tiles.swiglu_values) stores h in MMA form, the down GEMV's sum is rounded
into y at the pairs' rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.triton.common import TL_DTYPES, pdl, pdl_wait
from custom_ops.triton.fp4 import word_aligned
from custom_ops.triton.fp4_mma_lanes import act_words, group_step, store_mma_act
from custom_ops.triton.fp8 import tile_counters
from custom_ops.triton.moe_gemv import fp4_splits, k_split
from custom_ops.triton.moe_tiles import expert_tiles, swiglu_values

MMA_WARPS = 4           # 64 weight rows a program
MMA_BLOCK_K = 128       # four groups a K step; one int32 word of scale codes a row
MMA_COLS = 8            # pairs a tile past one token (mma.sync's N)


@triton.jit
def program_rows(ids_ptr, meta_ptr, n_tiles, COLS: tl.constexpr):
    """(first row, end row, expert) of this program: COLS 1, the pair numbered by the program;
    else its tile of expert_tiles (sorted rows; end <= first past the real tiles)."""
    if COLS == 1:
        ra = tl.program_id(0)
        return ra, ra + 1, tl.load(ids_ptr + ra).to(tl.int64)
    else:
        tile = tl.program_id(0)
        return tl.load(meta_ptr + n_tiles + tile), tl.load(meta_ptr + 2 * n_tiles + tile), \
            tl.load(meta_ptr + tile).to(tl.int64)


@triton.jit
def pairs_of(order_ptr, rows, mask, COLS: tl.constexpr):
    """The pairs at rows (COLS 1: the rows are the pairs; else sorted rows of order)."""
    if COLS == 1:
        return rows.to(tl.int64)
    else:
        return tl.load(order_ptr + rows, mask=mask, other=0).to(tl.int64)


@triton.jit
def lane_layout(n0, ra, rb, LANES: tl.constexpr, COLS: tl.constexpr):
    """Each lane's weight rows (g and g + 8 of its warp's 16 from n0), its quad position t, its
    B column's row (COLS 1: ra in every lane) and mask, and the rows of its D columns 2t, 2t + 1
    with their masks."""
    lane = tl.arange(0, LANES)
    g, t = (lane % 32) // 4, lane % 4
    r0 = n0 + (lane // 32) * 16 + g
    if COLS == 1:
        col = tl.full([LANES], 0, tl.int32) + ra
        return r0, r0 + 8, t, col, col < rb, col, col < rb, col, col < rb
    else:
        ca = ra + 2 * t
        return r0, r0 + 8, t, ra + g, ra + g < rb, ca, ca < rb, ca + 1, ca + 1 < rb


@triton.jit
def scale_bits(s_at, sw, c: tl.constexpr, mask, SCALE_WORDS: tl.constexpr):
    """A row's E8M0 code of the c-th group of its K step as FP32 exponent bits: from the K step's
    word of four codes sw (SCALE_WORDS) or loaded as a byte (s_at: the step's first code)."""
    if SCALE_WORDS:
        code = (sw >> (8 * c)) & 0xFF
    else:
        code = tl.load(s_at + c, mask=mask, other=0).to(tl.int32)
    return code << 23


@triton.jit
def scale_word(s_at, mask, SCALE_WORDS: tl.constexpr):
    """The int32 word of a row's four scale codes of this K step at s_at (SCALE_WORDS), else 0 (unread)."""
    if SCALE_WORDS:
        return tl.load(s_at, mask=mask, other=0)
    else:
        return tl.zeros(mask.shape, tl.int32)


@triton.jit
def step_offsets(k0, t, SCALE_WORDS: tl.constexpr):
    """Where K step k0 starts in a lane's rows: its word (t-th of the step's first group), its scale
    code or word of codes, its activation's group."""
    return k0 // 8 + t, k0 // 128 if SCALE_WORDS else k0 // 32, k0 // 32


@triton.jit
def step_words(w, mask, GROUPS: tl.constexpr):
    """A lane's word of each group of a K step of one weight row (w: the row's words at the step,
    step_offsets), [LANES, 2, 2] as `group_word` reads it back (GROUPS 1: the one group's word)."""
    a = tl.load(w, mask=mask, other=0)
    if GROUPS == 1:
        return tl.join(tl.join(a, a), tl.join(a, a))
    else:
        return tl.join(tl.join(a, tl.load(w + 4, mask=mask, other=0)),
                       tl.join(tl.load(w + 8, mask=mask, other=0), tl.load(w + 12, mask=mask, other=0)))


@triton.jit
def step_loads(w0, w1, s0, s1, m0, m1, GROUPS: tl.constexpr, SCALE_WORDS: tl.constexpr):
    """A K step's loads of one weight matrix's two rows of a lane: their `step_words` and their
    scale words (`scale_word`; w0, w1, s0, s1 at the step)."""
    return (step_words(w0, m0, GROUPS), step_words(w1, m1, GROUPS), scale_word(s0, m0, SCALE_WORDS),
            scale_word(s1, m1, SCALE_WORDS))


@triton.jit
def group_word(words, c: tl.constexpr):
    """The word of group c out of `step_words`' words (each lane's own registers)."""
    ab, cd = tl.split(words)
    if c < 2:
        lo, hi = tl.split(ab)
    else:
        lo, hi = tl.split(cd)
    if c % 2 == 0:
        return lo
    else:
        return hi


@triton.jit
def matrix_group(acc00, acc01, acc10, acc11, w0, w1, s0, s1, sw0, sw1, m0, m1, a0, a1, a2, a3, off_a, off_b,
                 c: tl.constexpr, LANES: tl.constexpr, COLS: tl.constexpr, SCALE_WORDS: tl.constexpr,
                 ASM: tl.constexpr):
    """The c-th group of a K step of one weight matrix (the rows' `step_words` w0, w1, their scale
    pointers s0, s1 at the step's start, step_offsets, and scale words sw0, sw1) against the
    lanes' activation words, the columns' exponent bits off_a, off_b."""
    b0 = scale_bits(s0, sw0, c, m0, SCALE_WORDS)
    b1 = scale_bits(s1, sw1, c, m1, SCALE_WORDS)
    return group_step(acc00, acc01, acc10, acc11, group_word(w0, c), group_word(w1, c), a0, a1, a2, a3,
                      (b0 + off_a).to(tl.float32, bitcast=True), (b0 + off_b).to(tl.float32, bitcast=True),
                      (b1 + off_a).to(tl.float32, bitcast=True), (b1 + off_b).to(tl.float32, bitcast=True),
                      LANES, COLS, ASM)


@triton.jit
def store_lanes(p, N, acc00, acc01, acc10, acc11, r0, r1, m0, m1, ca, cam, cb, cbm, t, COLS: tl.constexpr):
    """The lanes' sums at p + column row · N + weight row (COLS 1: lane position 0's; every lane
    of a quad holds them)."""
    if COLS == 1:
        tl.store(p + ca.to(tl.int64) * N + r0, acc00, mask=m0 & cam & (t == 0))
        tl.store(p + ca.to(tl.int64) * N + r1, acc10, mask=m1 & cam & (t == 0))
    else:
        tl.store(p + ca.to(tl.int64) * N + r0, acc00, mask=m0 & cam)
        tl.store(p + cb.to(tl.int64) * N + r0, acc01, mask=m0 & cbm)
        tl.store(p + ca.to(tl.int64) * N + r1, acc10, mask=m1 & cam)
        tl.store(p + cb.to(tl.int64) * N + r1, acc11, mask=m1 & cbm)


@triton.jit
def counted_last(counter):
    """Whether this program counts last at its counter (acq_rel), once all its lanes have stored."""
    tl.debug_barrier()
    return tl.atomic_add(counter, 1, sem="acq_rel") == tl.num_programs(2) - 1


@triton.jit
def split_total(p, stride_ps, offs, mask):
    """The splits' partials at p + offs summed in split order (.cg: from L2, where they were stored)."""
    tot = tl.zeros(offs.shape, tl.float32)
    for sp in range(tl.num_programs(2)):
        tot += tl.load(p + sp * stride_ps + offs, mask=mask, other=0.0, cache_modifier=".cg")
    return tot


@triton.jit
def _mma_act_kernel(x_ptr, a_ptr, o_ptr, D, stride_x, stride_a, stride_o, BLOCK: tl.constexpr,
                    PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64) + tl.zeros([1, 1], tl.int64)
    n0 = tl.program_id(1) * BLOCK
    rn = n0 + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * stride_x + rn[None, :], mask=(rn < D)[None, :], other=0.0).to(tl.float32)
    store_mma_act(v, a_ptr + row * stride_a, o_ptr + row * stride_o, row >= 0, n0, D, BLOCK)


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


@triton.jit
def _fp4_mma_up(xa_ptr, xo_ptr, ids_ptr, order_ptr, meta_ptr, wts_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, part_ptr,
                cnt_ptr, ha_ptr, ho_ptr, n_tiles, I, D, k, k_split, limit, stride_xa, stride_xo, stride_we, stride_wn,
                stride_se, stride_sn, stride_ps, stride_pu, stride_ha, stride_ho, ACT: tl.constexpr,
                LANES: tl.constexpr, COLS: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_WORDS: tl.constexpr,
                ASM: tl.constexpr, PDL: tl.constexpr = False):
    """FP4 up GEMMs, grid (pairs or tiles, I / (LANES / 2), K splits): the program's pairs' token
    rows (MMA form) against LANES / 2 rows of w1[e] and w3[e], the split's FP32 sums into the
    partials [splits, 2, rows, I]; the last split's sums through the SwiGLU epilogue into h's rows
    (MMA form)."""
    pdl_wait(PDL)
    ra, rb, e = program_rows(ids_ptr, meta_ptr, n_tiles, COLS)
    if ra >= rb or e < 0:
        return
    n0 = tl.program_id(1) * (LANES // 2)
    r0, r1, t, col, colm, ca, cam, cb, cbm = lane_layout(n0, ra, rb, LANES, COLS)
    m0, m1 = r0 < I, r1 < I
    # every pointer at the split's first K step, then stepped (step_offsets), not recomputed a group
    k_lo = tl.program_id(2) * k_split
    dw, ds, dg = step_offsets(k_lo, t, SCALE_WORDS)
    a_lane = xa_ptr + (pairs_of(order_ptr, col, colm, COLS) // k) * stride_xa + 4 * t + dg * 16
    o_a = xo_ptr + (pairs_of(order_ptr, ca, cam, COLS) // k) * stride_xo + dg
    o_b = xo_ptr + (pairs_of(order_ptr, cb, cbm, COLS) // k) * stride_xo + dg
    wr0, wr1 = e * stride_we + r0.to(tl.int64) * stride_wn + dw, e * stride_we + r1.to(tl.int64) * stride_wn + dw
    sr0, sr1 = e * stride_se + r0.to(tl.int64) * stride_sn + ds, e * stride_se + r1.to(tl.int64) * stride_sn + ds
    g_0, g_1, u_0, u_1 = w1_ptr + wr0, w1_ptr + wr1, w3_ptr + wr0, w3_ptr + wr1
    gs0, gs1, us0, us1 = s1_ptr + sr0, s1_ptr + sr1, s3_ptr + sr0, s3_ptr + sr1
    step_w, step_s, step_g = step_offsets(BLOCK_K, 0, SCALE_WORDS)
    G: tl.constexpr = BLOCK_K // 32
    g00 = tl.zeros([LANES], tl.float32)
    g01, g10, g11, u00, u01, u10, u11 = g00, g00, g00, g00, g00, g00, g00
    # the weights' words and scale words of the next K step are loaded before this step's MMAs
    # (one step in flight: the loads' latency behind a step's arithmetic)
    k_hi = tl.minimum(D, k_lo + k_split)
    gv0, gv1, gw0, gw1 = step_loads(g_0, g_1, gs0, gs1, m0, m1, G, SCALE_WORDS)
    uv0, uv1, uw0, uw1 = step_loads(u_0, u_1, us0, us1, m0, m1, G, SCALE_WORDS)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        g_0, g_1, u_0, u_1 = g_0 + step_w, g_1 + step_w, u_0 + step_w, u_1 + step_w
        more = tl.full([LANES], BLOCK_K, tl.int32) + k0 < k_hi      # a step after this one
        n0_, n1_ = m0 & more, m1 & more
        ngv0, ngv1, ngw0, ngw1 = step_loads(g_0, g_1, gs0 + step_s, gs1 + step_s, n0_, n1_, G, SCALE_WORDS)
        nuv0, nuv1, nuw0, nuw1 = step_loads(u_0, u_1, us0 + step_s, us1 + step_s, n0_, n1_, G, SCALE_WORDS)
        for c in tl.static_range(G):
            a0, a1, a2, a3 = act_words(a_lane, c, colm)
            off_a, off_b = tl.load(o_a + c, mask=cam, other=0), tl.load(o_b + c, mask=cbm, other=0)
            g00, g01, g10, g11 = matrix_group(g00, g01, g10, g11, gv0, gv1, gs0, gs1, gw0, gw1, m0, m1,
                                              a0, a1, a2, a3, off_a, off_b, c, LANES, COLS, SCALE_WORDS, ASM)
            u00, u01, u10, u11 = matrix_group(u00, u01, u10, u11, uv0, uv1, us0, us1, uw0, uw1, m0, m1,
                                              a0, a1, a2, a3, off_a, off_b, c, LANES, COLS, SCALE_WORDS, ASM)
        gv0, gv1, uv0, uv1, gw0, gw1, uw0, uw1 = ngv0, ngv1, nuv0, nuv1, ngw0, ngw1, nuw0, nuw1
        gs0, gs1, us0, us1 = gs0 + step_s, gs1 + step_s, us0 + step_s, us1 + step_s
        a_lane, o_a, o_b = a_lane + step_g * 16, o_a + step_g, o_b + step_g
    at = part_ptr + tl.program_id(2) * stride_ps
    store_lanes(at, I, g00, g01, g10, g11, r0, r1, m0, m1, ca, cam, cb, cbm, t, COLS)
    store_lanes(at + stride_pu, I, u00, u01, u10, u11, r0, r1, m0, m1, ca, cam, cb, cbm, t, COLS)
    counter = cnt_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    if counted_last(counter):
        rows = ra + tl.arange(0, COLS)
        rmask = rows < rb
        rn = n0 + tl.arange(0, LANES // 2)
        offs = rows.to(tl.int64)[:, None] * I + rn[None, :]
        mask = rmask[:, None] & (rn < I)[None, :]
        g = split_total(part_ptr, stride_ps, offs, mask)
        u = split_total(part_ptr + stride_pu, stride_ps, offs, mask)
        wt = tl.load(wts_ptr + pairs_of(order_ptr, rows, rmask, COLS), mask=rmask, other=0.0).to(tl.float32)
        h = swiglu_values(g, u, wt[:, None], limit, ACT)
        r = rows.to(tl.int64)[:, None]
        store_mma_act(h, ha_ptr + r * stride_ha, ho_ptr + r * stride_ho, rmask[:, None], n0, I, LANES // 2)
        tl.atomic_xchg(counter, 0)


@triton.jit
def _fp4_mma_down(ha_ptr, ho_ptr, ids_ptr, order_ptr, meta_ptr, w2_ptr, s2_ptr, part_ptr, cnt_ptr, y_ptr, n_tiles,
                  D, I, k_split, stride_ha, stride_ho, stride_we, stride_wn, stride_se, stride_sn, stride_ps,
                  stride_y, LANES: tl.constexpr, COLS: tl.constexpr, BLOCK_K: tl.constexpr,
                  SCALE_WORDS: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = False):
    """FP4 down GEMM, grid (pairs or tiles, D / (LANES / 2), K splits): the program's h rows (MMA
    form) against LANES / 2 rows of w2[e], the split's FP32 sums into the partials [splits, rows,
    D]; the last split's sums rounded into y at the pairs' rows."""
    pdl_wait(PDL)
    ra, rb, e = program_rows(ids_ptr, meta_ptr, n_tiles, COLS)
    if ra >= rb or e < 0:
        return
    n0 = tl.program_id(1) * (LANES // 2)
    r0, r1, t, col, colm, ca, cam, cb, cbm = lane_layout(n0, ra, rb, LANES, COLS)
    m0, m1 = r0 < D, r1 < D
    k_lo = tl.program_id(2) * k_split                 # pointers stepped as in _fp4_mma_up
    dw, ds, dg = step_offsets(k_lo, t, SCALE_WORDS)
    a_lane = ha_ptr + col.to(tl.int64) * stride_ha + 4 * t + dg * 16
    o_a, o_b = ho_ptr + ca.to(tl.int64) * stride_ho + dg, ho_ptr + cb.to(tl.int64) * stride_ho + dg
    w0 = w2_ptr + e * stride_we + r0.to(tl.int64) * stride_wn + dw
    w1 = w2_ptr + e * stride_we + r1.to(tl.int64) * stride_wn + dw
    s0 = s2_ptr + e * stride_se + r0.to(tl.int64) * stride_sn + ds
    s1 = s2_ptr + e * stride_se + r1.to(tl.int64) * stride_sn + ds
    step_w, step_s, step_g = step_offsets(BLOCK_K, 0, SCALE_WORDS)
    G: tl.constexpr = BLOCK_K // 32
    acc00 = tl.zeros([LANES], tl.float32)
    acc01, acc10, acc11 = acc00, acc00, acc00
    k_hi = tl.minimum(I, k_lo + k_split)           # the next step's words in flight as in _fp4_mma_up
    v0, v1, sw0, sw1 = step_loads(w0, w1, s0, s1, m0, m1, G, SCALE_WORDS)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w0, w1 = w0 + step_w, w1 + step_w
        more = tl.full([LANES], BLOCK_K, tl.int32) + k0 < k_hi
        nv0, nv1, nsw0, nsw1 = step_loads(w0, w1, s0 + step_s, s1 + step_s, m0 & more, m1 & more, G, SCALE_WORDS)
        for c in tl.static_range(G):
            a0, a1, a2, a3 = act_words(a_lane, c, colm)
            off_a, off_b = tl.load(o_a + c, mask=cam, other=0), tl.load(o_b + c, mask=cbm, other=0)
            acc00, acc01, acc10, acc11 = matrix_group(acc00, acc01, acc10, acc11, v0, v1, s0, s1, sw0, sw1, m0, m1,
                                                      a0, a1, a2, a3, off_a, off_b, c, LANES, COLS, SCALE_WORDS, ASM)
        v0, v1, sw0, sw1 = nv0, nv1, nsw0, nsw1
        s0, s1 = s0 + step_s, s1 + step_s
        a_lane, o_a, o_b = a_lane + step_g * 16, o_a + step_g, o_b + step_g
    store_lanes(part_ptr + tl.program_id(2) * stride_ps, D, acc00, acc01, acc10, acc11, r0, r1, m0, m1, ca, cam,
                cb, cbm, t, COLS)
    counter = cnt_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    if counted_last(counter):
        rows = ra + tl.arange(0, COLS)
        rmask = rows < rb
        rn = n0 + tl.arange(0, LANES // 2)
        mask = rmask[:, None] & (rn < D)[None, :]
        tot = split_total(part_ptr, stride_ps, rows.to(tl.int64)[:, None] * D + rn[None, :], mask)
        pairs = pairs_of(order_ptr, rows, rmask, COLS)
        tl.store(y_ptr + pairs[:, None] * stride_y + rn[None, :], tot.to(y_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counter, 0)


def fp4_mma_gemvs(x, ids, wts, w1, w3, w2, scales, limit, y, splits=None, num_warps=None, cols=None):
    """Steps 1-2 on FP4 experts on tensor cores, three launches (with `cols` 8 a fourth first: the
    pairs' 8-row tiles): x to MMA form (`mma_act`), the up GEMVs into partials, whose last split
    sums them and runs the epilogue -> h (MMA form), the down GEMVs likewise -> y. `cols`: pairs
    a program, 1 or MMA_COLS (default: 1 at one token, whose pairs are distinct experts, else
    MMA_COLS). Returns (h's f16 words, its exponent bits, the pair of each of h's rows: None where
    row r is pair r)."""
    T, D = x.shape
    E, I = w1.shape[:2]
    P, k = ids.numel(), ids.shape[1]
    dev = x.device
    warps = num_warps or MMA_WARPS
    lanes, rows = 32 * warps, 16 * warps
    cols = cols or (1 if T == 1 else MMA_COLS)
    if cols not in (1, MMA_COLS):
        raise ValueError(f"fp4_mma_gemvs: cols {cols} is not 1 or {MMA_COLS}")
    flat = ids.reshape(-1).contiguous()
    if cols == 1:       # each program its own pair: no order or tiles to read (flat stands in for both)
        order, rows_order, meta, n_tiles, programs = None, flat, flat, 0, P
    else:
        order, meta, n_tiles = expert_tiles(ids, E, cols)
        rows_order, programs = order, n_tiles
    xa, xo = mma_act(x)
    ha = torch.empty(P, I, dtype=torch.float16, device=dev)
    ho = torch.empty(P, I // 32, dtype=torch.int32, device=dev)
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
    common = dict(LANES=lanes, COLS=cols, ASM=dev.type == "cuda", num_warps=warps)
    grid_up, grid_down = (programs, triton.cdiv(I, rows), su), (programs, triton.cdiv(D, rows), sd)
    _fp4_mma_up[grid_up](
        xa.view(torch.int32), xo, flat, rows_order, meta, wts, w1, w3, s1, s3, pu,
        tile_counters(dev, programs * grid_up[1]), ha, ho, n_tiles, I, D, k, ku, limit, xa.stride(0) // 2,
        xo.stride(0), w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1), pu.stride(0), pu.stride(1),
        ha.stride(0), ho.stride(0), ACT=TL_DTYPES[y.dtype], BLOCK_K=bku, SCALE_WORDS=swu, **common, **pdl(dev))
    _fp4_mma_down[grid_down](
        ha.view(torch.int32), ho, flat, rows_order, meta, w2, s2, pd, tile_counters(dev, programs * grid_down[1]), y,
        n_tiles, D, I, kd, ha.stride(0) // 2, ho.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        pd.stride(0), y.stride(0), BLOCK_K=bkd, SCALE_WORDS=swd, **common, **pdl(dev))
    return ha, ho, order
