"""The lane-level pieces of fp4_mma.py's GEMVs: a group of 32 weights of 16 rows through two
`mma.sync.m16n8k16` (f16 x f16 -> FP32), and the activation in MMA form.

Lanes: every tensor here is [32 · warps], which Triton lays out one element a lane
(tests/test_kernels_sm90_build.py checks the build), so an inline PTX block sees one lane's
registers, as mma.sync wants. Warp w takes weight rows 16w.. of the program's 16 · warps; lane
l = 4g + t holds rows g and g + 8 (A's rows, and D's) and, for each group of 32, the rows' int32
word t (elements 8t..8t+7). B's column g is the activation of the lane's column (`COLS` = 8: the
tile's pair g; 1: the program's one pair, in every column): lane (g, t) passes its four words of
position t. The first MMA takes the pairs (0, 2) and (1, 3) in the k slots (2t, 2t + 1) and
(2t + 8, 2t + 9), the second (4, 6) and (5, 7); any order of K serves a dot product that A and B
share. D's lane (g, t) holds rows g, g + 8 at columns 2t, 2t + 1: each is added, times its row's
weight scale and its column's activation scale, to an FP32 accumulator by one FMA. Every product
is exact; the tensor cores sum 16 of them at a time (tests/test_fp4_mma_gpu.py bounds it). Under
the interpreter, which runs no PTX, the same sums come from Triton ops.

The activation in MMA form: an FP8-QAT row (E4M3 values q times a UE8M0 scale 2^k a group of 32)
as q in f16 (every E4M3 value is one), each eight elements in the order 0, 2, 1, 3, 4, 6, 5, 7, so
that its int32 words are the f16 pairs (0, 2), (1, 3), (4, 6), (5, 7) that a lane passes; and per
group the FP32 bits (k + 6) << 23. Added to a weight's E8M0 code << 23 they are the bits of the
combined scale 2^(code - 127) · 2^6 · 2^k (2^6: the E4M3 codes of nibbles are 2^-6 times the E2M1
values, fp4.py), a normal FP32 for weight codes of at least 17 (k >= -22: the QAT floors amax at
1e-4) and codes + k up to 248.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.triton.fp4 import _HI_CODES, _LO_CODES, e2m1_word_values
from custom_ops.triton.fp8 import fp8_quant_groups


def _pairs(w: str, out: tuple[str, ...], p: str) -> str:
    """PTX: the int32 word w of eight E2M1 values -> f16 pairs out = ((0, 2), (4, 6), (1, 3), (5, 7)),
    2^-6 times their values (registers a, b, lo, hi declared by the caller)."""
    return "\n".join([_LO_CODES.format(w=w, out="lo"), _HI_CODES.format(w=w, out="hi"),
                      f"mov.b32 {{{p}0, {p}1}}, lo;", f"mov.b32 {{{p}2, {p}3}}, hi;"] +
                     [f"cvt.rn.f16x2.e4m3x2 {o}, {p}{i};" for i, o in enumerate(out)])


def _group_ptx(w0: str, w1: str, b: tuple[str, ...], fmas: list[str]) -> str:
    """A group step: the rows' words w0, w1 decoded, two MMAs on the B words b, then `fmas`."""
    return ("{\n.reg .b32 a, b, lo, hi, p0, p1, p2, p3, q0, q1, q2, q3;\n.reg .b16 u0, u1, u2, u3, v0, v1, v2, v3;\n"
            ".reg .f32 d0, d1, d2, d3, z;\nmov.f32 z, 0f00000000;\n" +
            _pairs(w0, ("p0", "p1", "p2", "p3"), "u") + "\n" + _pairs(w1, ("q0", "q1", "q2", "q3"), "v") + "\n" +
            f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{d0, d1, d2, d3}}, {{p0, q0, p2, q2}}, "
            f"{{{b[0]}, {b[1]}}}, {{z, z, z, z}};\n"
            f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {{d0, d1, d2, d3}}, {{p1, q1, p3, q3}}, "
            f"{{{b[2]}, {b[3]}}}, {{d0, d1, d2, d3}};\n" + "\n".join(fmas) + "\n}")


# one column: $0, $1 <- the accumulators $8, $9 of rows g, g + 8 plus their sums times the scales
# $10, $11; $2, $3: the rows' words; $4..$7: the activation's f16 pairs (0, 2), (1, 3), (4, 6), (5, 7)
GROUP_PTX = tl.constexpr(_group_ptx("$2", "$3", ("$4", "$5", "$6", "$7"),
                                    ["fma.rn.f32 $0, d0, $10, $8;", "fma.rn.f32 $1, d2, $11, $9;"]))
# eight columns: $0..$3 <- (row g, col 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1): the accumulators
# $10..$13 plus D times the scales $14..$17; $4, $5: the rows' words; $6..$9: column g's pairs
GROUP8_PTX = tl.constexpr(_group_ptx("$4", "$5", ("$6", "$7", "$8", "$9"),
                                     [f"fma.rn.f32 ${i}, d{i}, ${14 + i}, ${10 + i};" for i in range(4)]))


@triton.jit
def _halves(a):
    """The two f16 values of int32 words a (low half first) as FP32."""
    return ((a & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
            (a >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32))


@triton.jit
def _eight(v0, v1, v2, v3, v4, v5, v6, v7, LANES: tl.constexpr):
    """[LANES, 8] of eight [LANES] tensors (some fixed order of the eight: the same for any call)."""
    return tl.reshape(tl.join(tl.join(tl.join(v0, v1), tl.join(v2, v3)), tl.join(tl.join(v4, v5), tl.join(v6, v7))),
                      [LANES, 8])


@triton.jit
def _lane_values(w, a0, a1, a2, a3, LANES: tl.constexpr):
    """A lane's eight weight values of word w and eight activation values of words a0..a3, as
    [LANES, 8] each, element for element."""
    v0, v1, v2, v3, v4, v5, v6, v7 = e2m1_word_values(w, False)
    x0, x2 = _halves(a0)
    x1, x3 = _halves(a1)
    x4, x6 = _halves(a2)
    x5, x7 = _halves(a3)
    return _eight(v0, v1, v2, v3, v4, v5, v6, v7, LANES), _eight(x0, x1, x2, x3, x4, x5, x6, x7, LANES)


@triton.jit
def _quad_dot(w, a0, a1, a2, a3, LANES: tl.constexpr):
    """GROUP_PTX's sums without PTX: each lane's eight products, summed over its quad (the four
    lanes of one row), for every lane of the quad."""
    v, x = _lane_values(w, a0, a1, a2, a3, LANES)
    s = tl.sum(tl.reshape(tl.sum(v * x, axis=1), [LANES // 4, 4]), axis=1)
    return tl.reshape(tl.broadcast_to(s[:, None], [LANES // 4, 4]), [LANES])


@triton.jit
def _warp_mma(w, a0, a1, a2, a3, LANES: tl.constexpr):
    """GROUP8_PTX's D without PTX, for the rows of words w: lane (g, t)'s (row g · column 2t,
    row g · column 2t + 1), column c being lane (c, t')'s activation."""
    v, x = _lane_values(w, a0, a1, a2, a3, LANES)
    rows = tl.reshape(v, [LANES // 32, 8, 32])               # [warp, g, (t, element)]
    cols = tl.reshape(x, [LANES // 32, 8, 32])               # [warp, c, (t, element)]
    d = tl.sum(rows[:, :, None, :] * cols[:, None, :, :], axis=3)      # [warp, g, c]
    d_even, d_odd = tl.split(tl.reshape(d, [LANES // 32, 8, 4, 2]))     # c = 2t, 2t + 1
    return tl.reshape(d_even, [LANES]), tl.reshape(d_odd, [LANES])


@triton.jit
def group_step(acc00, acc01, acc10, acc11, w0, w1, a0, a1, a2, a3, f00, f01, f10, f11, LANES: tl.constexpr,
               COLS: tl.constexpr, ASM: tl.constexpr):
    """The accumulators (row g at columns 2t and 2t + 1, row g + 8 at both) plus their scales f..
    times the rows' sums over one group of 32: weight words w0, w1 (rows g, g + 8: the lane's word
    t), activation words a0..a3 (its column's pairs at position t). COLS 1: column 0 only
    (acc00, acc10 and f00, f10; the others come back as they were)."""
    if COLS == 1:
        if ASM:
            acc00, acc10 = tl.inline_asm_elementwise(GROUP_PTX, "=f,=f,r,r,r,r,r,r,f,f,f,f",
                                                     [w0, w1, a0, a1, a2, a3, acc00, acc10, f00, f10],
                                                     dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
        else:
            acc00 = tl.fma(_quad_dot(w0, a0, a1, a2, a3, LANES), f00, acc00)
            acc10 = tl.fma(_quad_dot(w1, a0, a1, a2, a3, LANES), f10, acc10)
    else:
        if ASM:
            acc00, acc01, acc10, acc11 = tl.inline_asm_elementwise(
                GROUP8_PTX, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f,f,f,f,f",
                [w0, w1, a0, a1, a2, a3, acc00, acc01, acc10, acc11, f00, f01, f10, f11],
                dtype=(tl.float32,) * 4, is_pure=True, pack=1)
        else:
            d00, d01 = _warp_mma(w0, a0, a1, a2, a3, LANES)
            d10, d11 = _warp_mma(w1, a0, a1, a2, a3, LANES)
            acc00, acc01 = tl.fma(d00, f00, acc00), tl.fma(d01, f01, acc01)
            acc10, acc11 = tl.fma(d10, f10, acc10), tl.fma(d11, f11, acc11)
    return acc00, acc01, acc10, acc11


@triton.jit
def act_words(a_lane, grp, mask):
    """A lane's four words of group grp at its activation row's position (a_lane: the row plus
    4t), as one 16-byte load; zeros where mask is off."""
    v = tl.load((a_lane + grp * 16)[:, None] + tl.arange(0, 4)[None, :], mask=mask[:, None], other=0)
    x02, x13 = tl.split(tl.reshape(v, [v.shape[0], 2, 2]))
    a0, a2 = tl.split(x02)
    a1, a3 = tl.split(x13)
    return a0, a1, a2, a3


@triton.jit
def mma_column(n):
    """Where element n of a row sits in MMA form: bits 0 and 1 of n swapped."""
    return (n & ~3) | ((n & 1) << 1) | ((n >> 1) & 1)


@triton.jit
def store_mma_act(v, a_rows, o_rows, rmask, n0, N, BLOCK: tl.constexpr):
    """FP32 values v [M, BLOCK] of columns n0.. (n0 and BLOCK multiples of 32; those below N
    stored) FP8-quantized per 32 (fp8.fp8_quant_groups: v41.quant.fp8_qat's values) into M
    activation rows in MMA form (a_rows, o_rows: [M, 1] row pointers; rmask [M, 1]): the E4M3
    values as f16 at their columns, each group's exponent bits at o_rows."""
    M: tl.constexpr = v.shape[0]
    q, s = fp8_quant_groups(tl.reshape(v, [M, BLOCK // 32, 32]), 2)
    rn = n0 + tl.arange(0, BLOCK)
    tl.store(a_rows + mma_column(rn)[None, :], tl.reshape(q, [M, BLOCK]).to(tl.float16), mask=rmask & (rn < N)[None, :])
    grp = n0 // 32 + tl.arange(0, BLOCK // 32)
    bits = s.to(tl.int32, bitcast=True) - (121 << 23)          # 2^k's bits (k + 127) << 23 -> (k + 6) << 23
    tl.store(o_rows + grp[None, :], tl.reshape(bits, [M, BLOCK // 32]), mask=rmask & (grp * 32 < N)[None, :])


def mma_act_values(a: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """The FP32 values of activation rows in MMA form (f16 [T, D], exponent bits [T, D / 32])."""
    T, D = a.shape
    q = a.float().reshape(T, D // 8, 8)[..., [0, 2, 1, 3, 4, 6, 5, 7]].reshape(T, D // 32, 32)
    return (q * torch.pow(2.0, (o >> 23).float() - 6)[..., None]).reshape(T, D)
