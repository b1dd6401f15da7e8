"""FP4 (E2M1) weights decoded inside Triton kernels: the shared pieces of the FP4 expert kernels
(moe_gemv.py's GEMVs, moe.py's tile kernels).

Packed E2M1: two values a byte, element 2j in byte j's low nibble and 2j + 1 in its high one,
with an E8M0 scale per 32 along K (v41.quant), read as int32 words of eight values. A nibble
(bit 3 the sign, then a 2-bit exponent and a 1-bit mantissa) becomes the E4M3 code of 2^-6 times
its value: its bits move into E4M3's sign, low exponent bits and top mantissa bit, and 2^-6 is the
bias difference (E2M1's 0.5, its one subnormal, lands on E4M3's subnormal 2^-7), exactly; the FP8
hardware converts the codes, and `e2m1_scale` gives the scale with that 2^6 put back. On CUDA a
word's conversions run in inline PTX, since the instructions spent per weight, not the bytes read,
bound these kernels (benchmarks/sm90_build.py); under the interpreter, which runs no PTX, the same
masks and shifts run as Triton ops. tests/test_ptx.py runs the PTX through an emulator of its
instructions.

The tile kernels' bf16 tiles skip E4M3 and FP32: a nibble's sign bit moves to bf16's bit 15 and
its exponent and mantissa bits to bits 6-8, which makes the bf16 of 2^-126 times its value (E2M1's
0.5 lands on bf16's subnormal 2^-127, its 0 on 0), exactly; one bf16 multiply by 2^(c-1) then
applies the scale 2^(c-127), exact for scale codes c up to 128 (custom_ops.gemm.FP4_MAX_SCALE_CODE,
which `check_native` enforces at load).
"""
from __future__ import annotations

import triton
import triton.language as tl

from custom_ops.triton.fp8 import e4m3_byte, e4m3_word_ptx, e8m0_to_f32


@triton.jit
def e2m1_scale(c):
    """The FP32 multiplier of the E4M3 codes of nibbles (2^-6 times their values) under the int32
    E8M0 scale codes c: 2^6 (the codes' 2^-6 undone) times 2^(c-127); exact for scale codes up to
    248 (2^121)."""
    return e8m0_to_f32(c) * 64.0


# nibbles to E4M3 codes four bytes at once, as PTX lines: the word {w}'s low nibbles' codes into
# {out} (each sign bit up to the byte's bit 7, the magnitude to bits 2-4), and its high nibbles'
_LO_CODES = ("shl.b32 a, {w}, 4; and.b32 a, a, 0x80808080; shl.b32 b, {w}, 2; and.b32 b, b, 0x1C1C1C1C; "
             "or.b32 {out}, a, b;")
_HI_CODES = "and.b32 a, {w}, 0x80808080; shr.b32 b, {w}, 2; and.b32 b, b, 0x1C1C1C1C; or.b32 {out}, a, b;"
# the same on the eight nibbles of an int32 word (byte i: element 2i in its low nibble,
# 2i + 1 in its high one), then each word of codes as E4M3 values: outputs $0..$7 are elements
# 0..7 as E4M3 values (2^-6 times the E2M1 values), $8 the word.
E2M1_WORD_PTX = tl.constexpr("{\n.reg .b32 a, b, lo, hi;\n" + _LO_CODES.format(w="$8", out="lo") + "\n" +
                             _HI_CODES.format(w="$8", out="hi") + "\n" +
                             e4m3_word_ptx("lo", ("$0", "$2", "$4", "$6"), "l") + "\n" +
                             e4m3_word_ptx("hi", ("$1", "$3", "$5", "$7"), "h") + "\n}")


@triton.jit
def e2m1_word_values(w, ASM: tl.constexpr):
    """The eight values of int32 words w of packed E2M1 bytes, in element order, as FP32 E4M3
    values (2^-6 times the E2M1 values). ASM (CUDA): E2M1_WORD_PTX. Else
    (the interpreter runs no PTX) its same shift-and-masks into words of codes (low nibbles, high
    nibbles), then byte by byte."""
    if ASM:
        return tl.inline_asm_elementwise(E2M1_WORD_PTX, "=f,=f,=f,=f,=f,=f,=f,=f,r", [w],
                                         dtype=(tl.float32,) * 8, is_pure=True, pack=1)
    else:
        lo = ((w << 4) & -0x7F7F7F80) | ((w << 2) & 0x1C1C1C1C)      # -0x7F7F7F80: 0x80808080 as int32
        hi = (w & -0x7F7F7F80) | ((w >> 2) & 0x1C1C1C1C)
        return (e4m3_byte(lo, 0), e4m3_byte(hi, 0), e4m3_byte(lo, 1), e4m3_byte(hi, 1),
                e4m3_byte(lo, 2), e4m3_byte(hi, 2), e4m3_byte(lo, 3), e4m3_byte(hi, 3))


@triton.jit
def word_scale_codes(s_rows, k0, nmask, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_WORDS: tl.constexpr):
    """[BLOCK_N, BLOCK_K / 8] int32 E8M0 codes of K block [k0, k0 + BLOCK_K), one per word of
    weights (a word's eight values share their group of 32). SCALE_WORDS (> 0): s_rows point at
    int32 words of four codes, SCALE_WORDS of them a row per K block (K a multiple of 128 and k0
    counted from a multiple of 128): loads of four bytes, which Triton pipelines as asynchronous
    copies beside the weights' and a byte load it does not. 0: the codes loaded byte by byte."""
    j = tl.arange(0, BLOCK_K // 8)
    g = k0 // 32 + j // 4
    if SCALE_WORDS:
        sw = tl.load(s_rows[:, None] + (k0 // 128 + tl.arange(0, SCALE_WORDS))[None, :], mask=nmask[:, None],
                     other=0x7F7F7F7F)
        sw = tl.reshape(tl.broadcast_to(sw[:, :, None], [BLOCK_N, SCALE_WORDS, BLOCK_K // 8 // SCALE_WORDS]),
                        [BLOCK_N, BLOCK_K // 8])
        return (sw >> (8 * (g % 4))[None, :]) & 0xFF
    else:
        return tl.load(s_rows[:, None] + g[None, :], mask=nmask[:, None], other=127).to(tl.int32)


def scale_words(K: int, block_k: int, k_split: int) -> int:
    """`fp4_tile`'s SCALE_WORDS for a GEMM over K in blocks of block_k, its K split k_split wide:
    the int32 words of scale codes a row per block, or 0 (bytes). Words need K and each split's
    start to be multiples of 128. Read byte by byte, the codes are synchronous loads consumed in
    the iteration that issues them; as words every load of the K loop is asynchronous (Triton
    3.6's sm_90 builds of the 64-row tiles: 0 synchronous loads against 8 and 3 barriers an
    iteration against 7 up / 5 down, tiles-decode-sm90-triton36-cpu.json). On an H100
    (experts-scale-words-h100.json, flash-slice's experts, 64-row tiles, alternating) words took
    96 tokens from 388-393 to 308-316 us and 1,024 from 1,968-1,995 to 1,453-1,470."""
    return max(block_k // 128, 1) if K % 128 == 0 and k_split % 128 == 0 else 0


def word_aligned(*codes) -> bool:
    """Whether each uint8 tensor of scale codes has an int32 view (rows of whole words)."""
    return all(t.stride(-1) == 1 and t.storage_offset() % 4 == 0 and all(s % 4 == 0 for s in t.stride()[:-1])
               for t in codes)


def _bf16_field_lines(out: str, src: str, em_shift: int, sign_shift: int) -> str:
    """PTX: a nibble of each half of src (its bits 0-2 shifted by em_shift land on 6-8, its bit 3
    shifted by sign_shift on 15) as the bf16 bits of out's halves, all else cleared."""
    em = f"shl.b32 t, {src}, {em_shift};" if em_shift >= 0 else f"shr.u32 t, {src}, {-em_shift};"
    sign = f"shl.b32 u, {src}, {sign_shift};" if sign_shift else f"mov.b32 u, {src};"
    return f"{em} and.b32 t, t, 0x01C001C0; {sign} and.b32 u, u, 0x80008000; or.b32 {out}, t, u;"


# two int32 words of packed E2M1 ($8, $9) -> eight bf16 pairs $0..$7: $i holds element i of
# word $8 in its low half and of word $9 in its high one, each the bf16 of 2^-126 times its
# E2M1 value. prmt gathers the words' bytes 0-1 (elements 0-3) as p's halves and bytes 2-3
# (elements 4-7) as q's; element j of a half sits at its bits 4j..4j+3.
E2M1_BF16_PTX = tl.constexpr("\n".join(
    ["{", ".reg .b32 p, q, t, u;", "prmt.b32 p, $8, $9, 0x5410;", "prmt.b32 q, $8, $9, 0x7632;"] +
    [_bf16_field_lines(f"${j + 4 * h}", "pq"[h], 6 - 4 * j, 12 - 4 * j) for j in range(4) for h in range(2)] +
    ["}"]))
BF16X2_MUL_PTX = tl.constexpr("mul.rn.bf16x2 $0, $1, $2;")


@triton.jit
def _nibble_f32(w, i: tl.constexpr):
    """Element i of int32 words w of packed E2M1 as the FP32 of 2^-126 times its value: the
    nibble's sign to bit 31, its exponent and mantissa bits to 22-24 (E2M1_BF16_PTX's places,
    16 up)."""
    n = w >> (4 * i)
    return (((n & 7) << 22) | ((n & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def word_order(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Values 0..7 of each of [BLOCK_N, BLOCK_K / 8] words interleaved: [BLOCK_N, BLOCK_K / 8, 8]
    in K order."""
    # t[n, j, a, b, c] = value 4a + 2b + c of word j: each join adds the innermost axis
    t = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
    return tl.reshape(t, [BLOCK_N, BLOCK_K // 8, 8])


@triton.jit
def e2m1_bf16_tile(w, c, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_N, BLOCK_K] bf16: the int32 words w [BLOCK_N, BLOCK_K / 8] of packed E2M1, each
    value times its word's scale 2^(c-127) (c: int32 codes up to FP4_MAX_SCALE_CODE), exactly.
    ASM (CUDA): E2M1_BF16_PTX, then a bf16 multiply by 2^(c-1) after the interleave (Triton 3.6
    derives no wgmma shared layout when the interleave is the tile's last step); else (the
    interpreter, which flushes bf16 subnormals) the same bits in FP32."""
    if ASM:
        v0, v1, v2, v3, v4, v5, v6, v7 = tl.inline_asm_elementwise(
            E2M1_BF16_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    else:
        v0, v1, v2, v3 = _nibble_f32(w, 0), _nibble_f32(w, 1), _nibble_f32(w, 2), _nibble_f32(w, 3)
        v4, v5, v6, v7 = _nibble_f32(w, 4), _nibble_f32(w, 5), _nibble_f32(w, 6), _nibble_f32(w, 7)
    t = word_order(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_N, BLOCK_K)
    if ASM:
        s = ((c + 126) << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
        t = tl.inline_asm_elementwise(BF16X2_MUL_PTX, "=r,r,r", [t, tl.broadcast_to(s[:, :, None], t.shape)],
                                      dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        t = (t * ((c + 126) << 23).to(tl.float32, bitcast=True)[:, :, None]).to(tl.bfloat16)
    return tl.reshape(t, [BLOCK_N, BLOCK_K])


@triton.jit
def fp4_tile(w_rows, s_rows, k0, nmask, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, OUT: tl.constexpr,
             ASM: tl.constexpr, SCALE_WORDS: tl.constexpr = 0):
    """[BLOCK_K, BLOCK_N] tile in dtype OUT of K block [k0, k0 + BLOCK_K) of the [BLOCK_N] rows of
    packed E2M1 weights (w_rows: each row's int32 words, eight values a word; s_rows: its E8M0
    scales, as `word_scale_codes` reads them), dequantized: each value times its group's scale,
    exactly (an E2M1 value has two significant bits, the scale is a power of two: the product is
    exact in FP32 and in bf16). BLOCK_K is a multiple of 32 dividing K. In bf16, `e2m1_bf16_tile`
    (scale codes up to FP4_MAX_SCALE_CODE); in FP32, each word's eight values from
    `e2m1_word_values` (on CUDA the GEMVs' PTX), interleaved, times its scale (after the
    interleave, as for bf16: Triton 3.6 derives no wgmma shared layout from a join that ends the
    tile)."""
    j = tl.arange(0, BLOCK_K // 8)
    w = tl.load(w_rows[:, None] + (k0 // 8 + j)[None, :], mask=nmask[:, None], other=0)
    c = word_scale_codes(s_rows, k0, nmask, BLOCK_K, BLOCK_N, SCALE_WORDS)
    if OUT == tl.bfloat16:
        return tl.trans(e2m1_bf16_tile(w, c, BLOCK_N, BLOCK_K, ASM))
    v0, v1, v2, v3, v4, v5, v6, v7 = e2m1_word_values(w, ASM)
    t = word_order(v0, v1, v2, v3, v4, v5, v6, v7, BLOCK_N, BLOCK_K) * e2m1_scale(c)[:, :, None]
    return tl.trans(tl.reshape(t.to(OUT), [BLOCK_N, BLOCK_K]))


@triton.jit
def fp4_words_load(w_rows, s_rows, k0, nmask, BLOCK_K: tl.constexpr):
    """The int32 words (eight E2M1 values each) and E8M0 scale codes of K block
    [k0, k0 + BLOCK_K) of the [BLOCK_N] rows of packed weights (w_rows: each row's words;
    s_rows: its scales, one per 32 along K): [BLOCK_N, BLOCK_K / 8] each."""
    j = tl.arange(0, BLOCK_K // 8)
    return (tl.load(w_rows[:, None] + (k0 // 8 + j)[None, :], mask=nmask[:, None], other=0),
            tl.load(s_rows[:, None] + (k0 // 32 + j // 4)[None, :], mask=nmask[:, None], other=127))


@triton.jit
def fp4_words_dot(acc, a_ptr, w, codes, k0, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K / 8] plus, for each int32 word of K block [k0, k0 + BLOCK_K)
    (`fp4_words_load`'s words and scale codes): the FP32 sum of the word's eight products
    a[k]·w[n, k], times its group's scale (`e2m1_scale`). BLOCK_K is a multiple of 32 dividing
    K (no K mask). Each product of an FP8-QAT activation and an E4M3 value is exact and the
    scales are powers of two, so only the order of the FP32 sums differs from the reference;
    the caller sums the words once, after its K loop."""
    j = tl.arange(0, BLOCK_K // 8)
    v0, v1, v2, v3, v4, v5, v6, v7 = e2m1_word_values(w, ASM)
    a = a_ptr + k0 + 8 * j
    part = v0 * tl.load(a).to(tl.float32)[None, :]
    part += v1 * tl.load(a + 1).to(tl.float32)[None, :]
    part += v2 * tl.load(a + 2).to(tl.float32)[None, :]
    part += v3 * tl.load(a + 3).to(tl.float32)[None, :]
    part += v4 * tl.load(a + 4).to(tl.float32)[None, :]
    part += v5 * tl.load(a + 5).to(tl.float32)[None, :]
    part += v6 * tl.load(a + 6).to(tl.float32)[None, :]
    part += v7 * tl.load(a + 7).to(tl.float32)[None, :]
    return acc + part * e2m1_scale(codes.to(tl.int32))


@triton.jit
def bf16_pair_values(w):
    """The two FP32 values of int32 words w of two bf16 (element 2p in the low half)."""
    return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)


@triton.jit
def fp4_groups_dot(acc, a_words, w, codes, ASM: tl.constexpr):
    """`fp4_words_dot` on a K block held as [BLOCK_N, groups, 4] int32 words of weights (four
    words a group of 32) and their scale codes [BLOCK_N, groups, 1]; the activation as int32
    words of bf16 pairs, `a_words` pointing at the block's [1, groups, 4, 4] (word, pair): loaded
    16 bytes a word, one load per word for all rows, where `fp4_words_dot` loads element by
    element. Each word's eight products summed, times its group's scale, into acc [BLOCK_N,
    groups, 4]; the caller sums after its K loop."""
    G: tl.constexpr = w.shape[1]
    pairs = tl.reshape(tl.load(a_words), [1, G, 4, 2, 2])
    even, odd = tl.split(pairs)                    # pairs (0, 2) and (1, 3)
    p0, p2 = tl.split(even)
    p1, p3 = tl.split(odd)
    x0, x1 = bf16_pair_values(p0)
    x2, x3 = bf16_pair_values(p1)
    x4, x5 = bf16_pair_values(p2)
    x6, x7 = bf16_pair_values(p3)
    v0, v1, v2, v3, v4, v5, v6, v7 = e2m1_word_values(w, ASM)
    part = v0 * x0 + v1 * x1 + v2 * x2 + v3 * x3 + v4 * x4 + v5 * x5 + v6 * x6 + v7 * x7
    return acc + part * e2m1_scale(codes.to(tl.int32))
