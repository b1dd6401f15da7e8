"""The FP4 and FP8 kernels' inline PTX (custom_ops/triton/fp4.py, fp8.py), run on the CPU by
a small emulator of the few instructions it uses. The interpreter tests run the kernels' Triton
form instead (the interpreter executes no PTX), and the sm_90 build only shows that ptxas
accepts it; this checks what the PTX computes: every E2M1 nibble, in every position of a word,
decodes to its E4M3 value (2^-6 times the E2M1 value of v41.quant), and every E4M3 byte to its
value, in element order. `run_warp` runs a block for a warp's 32 lanes in lockstep, with
mma.sync's fragments as the PTX ISA lays them out (custom_ops/triton/fp4_mma.py's group step)."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="the PTX lives in the Triton kernels' module: needs triton (the test extra)")
from custom_ops.gemm import FP4_MAX_SCALE_CODE  # noqa: E402
from custom_ops.triton import fp4, fp8  # noqa: E402
from v41 import quant  # noqa: E402

M32 = 0xFFFFFFFF


def e4m3(byte: int) -> float:
    return float(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float())


def instructions(src: str) -> list[tuple[str, str]]:
    """(opcode, operands) of each instruction of a PTX block, declarations left out."""
    body = src.strip().strip("{}")
    return [tuple(ins.split(None, 1)) for ins in filter(None, (s.strip() for s in body.split(";")))
            if not ins.startswith(".reg")]


def f16_word(lo: float, hi: float) -> int:
    """A 32-bit register of two f16 values, lo in the low half."""
    return int(np.float16(lo).view(np.uint16)) | int(np.float16(hi).view(np.uint16)) << 16


def f16_halves(word: int) -> tuple[float, float]:
    return tuple(float(np.uint16((word >> s) & 0xFFFF).view(np.float16)) for s in (0, 16))


def bf16_halves(word: int) -> tuple[float, float]:
    return tuple(float(torch.tensor([(word >> s) & 0xFFFF], dtype=torch.int32).to(torch.int16)
                       .view(torch.bfloat16).double()) for s in (0, 16))


def bf16_word(lo: float, hi: float) -> int:
    """A 32-bit register of two bf16 values (float64 rounded once, to nearest even), lo in the low half."""
    h = torch.tensor([lo, hi], dtype=torch.float64).to(torch.bfloat16).view(torch.int16).int() & 0xFFFF
    return int(h[0]) | int(h[1]) << 16


def step(regs: dict, op: str, args: str) -> None:
    """One lane's instruction on its registers (32-bit words, or Python floats for .f32)."""
    val = lambda x: int(x, 0) if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", x) else regs[x]  # noqa: E731
    if op == "mov.b32" and args.startswith("{"):                 # mov.b32 {lo, hi}, r: r's low and high halves
        lo, hi, r = re.fullmatch(r"\{\s*(\S+),\s*(\S+)\s*\},\s*(\S+)", args).groups()
        regs[lo], regs[hi] = val(r) & 0xFFFF, val(r) >> 16
        return
    d, *a = [x.strip() for x in args.split(",")]
    if op == "shl.b32":
        regs[d] = (val(a[0]) << val(a[1])) & M32
    elif op in ("shr.b32", "shr.u32"):                          # logical shifts
        regs[d] = (val(a[0]) & M32) >> val(a[1])
    elif op == "mov.b32":
        regs[d] = val(a[0]) & M32
    elif op == "prmt.b32":                                       # default mode: byte i from selector nibble i
        pool = (val(a[0]) & M32) | (val(a[1]) & M32) << 32       # of {b, a}'s 8 bytes; bit 3: the byte's sign
        picks = [(pool >> (8 * (n & 7))) & 0xFF for n in ((val(a[2]) >> (4 * i)) & 0xF for i in range(4))]
        signs = [(val(a[2]) >> (4 * i + 3)) & 1 for i in range(4)]
        regs[d] = sum(((0xFF if p >> 7 else 0) if sg else p) << (8 * i) for i, (p, sg) in enumerate(zip(picks, signs)))
    elif op == "mul.rn.bf16x2":                                  # each half, rounded to nearest even
        regs[d] = bf16_word(*(x * y for x, y in zip(bf16_halves(val(a[0])), bf16_halves(val(a[1])))))
    elif op == "and.b32":
        regs[d] = val(a[0]) & val(a[1]) & M32
    elif op == "or.b32":
        regs[d] = (val(a[0]) | val(a[1])) & M32
    elif op == "cvt.rn.f16x2.e4m3x2":                            # the low byte into the low half
        h = val(a[0])
        regs[d] = f16_word(e4m3(h & 0xFF), e4m3(h >> 8))
    elif op == "cvt.f32.f16":
        regs[d] = float(np.uint16(val(a[0])).view(np.float16))
    elif op == "mov.f32" and re.fullmatch(r"0f[0-9a-fA-F]{8}", a[0]):
        regs[d] = float(np.uint32(int(a[0][2:], 16)).view(np.float32))
    elif op == "fma.rn.f32":                                     # exact in float64, then one rounding
        regs[d] = float(np.float32(regs[a[0]] * regs[a[1]] + regs[a[2]]))
    else:
        raise NotImplementedError(op)


def run_ptx(src: str, inputs: dict[int, int]) -> dict[int, object]:
    """Execute `src` with operands $i preset from `inputs` (32-bit words); returns every $i."""
    regs: dict[str, object] = {f"${i}": v for i, v in inputs.items()}
    for op, args in instructions(src):
        step(regs, op, args)
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$")}


MMA_F16 = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"


def mma_m16n8k16(lanes: list[dict], args: str) -> None:
    """The warp's D = A·B + C, fragments as the PTX ISA lays them out for m16n8k16 with f16 A
    (row) and B (col) and FP32 C, D: lane 4g + t holds A's (g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..),
    (g+8, 2t+8..) as four f16 pairs, B's (2t..2t+1, g), (2t+8.., g) as two, and C's and D's (g, 2t..),
    (g+8, 2t..). The products are exact in float64 and summed there, then rounded once to FP32."""
    d, a, b, c = (v.split(",") for v in re.findall(r"\{([^}]*)\}", args))
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane, regs in enumerate(lanes):
        g, t = divmod(lane, 4)
        for i, r in enumerate(x.strip() for x in a):
            A[g + 8 * (i % 2), 2 * t + 8 * (i // 2) + np.arange(2)] = f16_halves(regs[r])
        for i, r in enumerate(x.strip() for x in b):
            B[2 * t + 8 * i + np.arange(2), g] = f16_halves(regs[r])
        for i, r in enumerate(x.strip() for x in c):
            C[g + 8 * (i // 2), 2 * t + i % 2] = regs[r]
    D = (A @ B + C).astype(np.float32)
    for lane, regs in enumerate(lanes):
        g, t = divmod(lane, 4)
        for i, r in enumerate(x.strip() for x in d):
            regs[r] = float(D[g + 8 * (i // 2), 2 * t + i % 2])


def run_warp(src: str, inputs: list[dict[int, object]]) -> list[dict[int, object]]:
    """`src` run by the 32 lanes of a warp in lockstep, lane i's operands $j from inputs[i]."""
    lanes = [{f"${j}": v for j, v in lane.items()} for lane in inputs]
    for op, args in instructions(src):
        if op == MMA_F16:
            mma_m16n8k16(lanes, args)
        else:
            for regs in lanes:
                step(regs, op, args)
    return [{int(k[1:]): v for k, v in regs.items() if k.startswith("$")} for regs in lanes]


def nibble_value(c: int) -> float:
    """E2M1 code c's value times 2^-6, from v41.quant (not from the kernels' helpers)."""
    return float(quant.e2m1_decode(torch.tensor([c], dtype=torch.uint8), torch.float32)) * 2.0**-6


def mma_form(x: torch.Tensor) -> torch.Tensor:
    """x [K] (values exact in f16) as fp4_mma.py's docstring lays out an activation: int32
    [K / 32, 4, 4], group c's words for lane position t the f16 pairs (0, 2), (1, 3), (4, 6),
    (5, 7) of elements 32c + 8t.., the first of a pair in the low half."""
    pairs = x.to(torch.float16).reshape(-1, 4, 8)[..., [0, 2, 1, 3, 4, 6, 5, 7]].contiguous()
    return pairs.view(torch.int32).reshape(-1, 4, 4)


def words(bits: int):
    """32-bit words of 32 / bits fields: every field value in every place, random fields
    around it; yields (the fields, the word)."""
    g = np.random.default_rng(bits)
    n = 32 // bits
    for place in range(n):
        for v in range(1 << bits):
            fields = [int(f) for f in g.integers(0, 1 << bits, n)]
            fields[place] = v
            yield fields, sum(f << (bits * i) for i, f in enumerate(fields))


def test_word_ptx_decodes_every_nibble_in_every_position():
    """E2M1_WORD_PTX: a word's byte i holds elements 2i (low nibble) and 2i + 1 (high); every
    code 0..15 in each of the eight places."""
    for nibbles, word in words(4):
        out = run_ptx(fp4.E2M1_WORD_PTX.value, {8: word})
        assert [out[i] for i in range(8)] == [nibble_value(c) for c in nibbles], nibbles


def test_bf16_ptx_decodes_every_nibble_in_every_position_of_both_words():
    """E2M1_BF16_PTX (the tile kernels' bf16 tiles): output i holds element i of the first word
    in its low half and of the second in its high one, as the bf16 of 2^-126 times its E2M1
    value (0.5 the subnormal 2^-127); every code in each of the eight places of each word.
    Then BF16X2_MUL_PTX by 2^(c-1) gives the value times its scale 2^(c-127) for every code c
    up to FP4_MAX_SCALE_CODE."""
    e2m1 = lambda c: nibble_value(c) * 2.0**6       # noqa: E731
    pairs = list(words(4))
    for i, (nibbles, word) in enumerate(pairs):
        other_nibbles, other = pairs[-1 - i]
        out = run_ptx(fp4.E2M1_BF16_PTX.value, {8: word, 9: other})
        assert [bf16_halves(out[j]) for j in range(8)] == \
            [(e2m1(a) * 2.0**-126, e2m1(b) * 2.0**-126) for a, b in zip(nibbles, other_nibbles)], nibbles
    for c in range(FP4_MAX_SCALE_CODE + 1):
        s = bf16_word(2.0 ** (c - 1), 2.0 ** (c - 1))
        assert s == ((c + 126) << 7) * 0x10001               # the kernel's bits of 2^(c-1) in each half
        for v in range(16):
            bits = run_ptx(fp4.E2M1_BF16_PTX.value, {8: v, 9: 15 - v})[0]
            got = run_ptx(fp4.BF16X2_MUL_PTX.value, {1: bits, 2: s})[0]
            assert bf16_halves(got) == (e2m1(v) * 2.0 ** (c - 127), e2m1(15 - v) * 2.0 ** (c - 127)), (c, v)


def test_e4m3_word_ptx_decodes_every_byte_in_every_position():
    """E4M3_WORD_PTX (the FP8 GEMV's weights): a word's byte i is element i; all 256 codes in
    each of the four places, the two NaN codes included, against torch's float8_e4m3fn."""
    for bytes_, word in words(8):
        out = run_ptx(fp8.E4M3_WORD_PTX.value, {4: word})
        assert np.array_equal([out[i] for i in range(4)], [e4m3(b) for b in bytes_], equal_nan=True), bytes_


def test_emulator_rejects_what_it_does_not_know():
    """A PTX edit that uses an instruction the emulator lacks fails here rather than passing."""
    with pytest.raises(NotImplementedError):
        run_ptx("{ add.u32 $0, $1, 1; }", {1: 0})


def test_fp4_mma_group_step_sums_each_rows_group():
    """fp4_mma.py's group step, run by a warp: lane 4g + t passes rows g and g + 8's word t of a
    group of 32, its four words of the group's activations in MMA form (`mma_act`) and the rows'
    scales; every lane's two outputs are its rows' accumulators plus scale · Σ_k w[row, k]·x[k]
    (w the E2M1 values times 2^-6)."""
    from custom_ops.triton.fp4_mma_lanes import GROUP_PTX
    g = np.random.default_rng(0)
    codes = g.integers(0, 16, (16, 32))                          # E2M1 codes, rows x K
    x = g.integers(-8, 9, 32) * 2.0 ** g.integers(-6, 4, 32)    # exact in f16
    scale, acc = 2.0 ** g.integers(-4, 4, 16), g.standard_normal(16)
    w = np.array([[nibble_value(int(c)) for c in row] for row in codes])
    word = lambda r, t: sum(int(c) << (4 * i) for i, c in enumerate(codes[r, 8 * t:8 * t + 8]))  # noqa: E731
    xw = mma_form(torch.tensor(x))[0].numpy().view(np.uint32)     # [t, 4] words of the one group
    inputs = []
    for lane in range(32):
        r, t = divmod(lane, 4)
        inputs.append({2: word(r, t), 3: word(r + 8, t), **{4 + i: int(xw[t, i]) for i in range(4)},
                       8: acc[r], 9: acc[r + 8], 10: scale[r], 11: scale[r + 8]})
    want = (acc + scale * (w @ x)).astype(np.float32)
    for lane, out in enumerate(run_warp(GROUP_PTX.value, inputs)):
        r = lane // 4
        assert (out[0], out[1]) == (want[r], want[r + 8]), lane


def test_fp4_mma_group8_step_sums_each_row_and_column():
    """fp4_mma.py's eight-column group step, run by a warp: lane 4g + t passes rows g and g + 8's
    word t, column g's four activation words of position t, and the accumulators and scales of
    its D entries (rows g, g + 8 at columns 2t, 2t + 1); each output is its accumulator plus its
    scale · Σ_k w[row, k]·x[column, k]."""
    from custom_ops.triton.fp4_mma_lanes import GROUP8_PTX
    g = np.random.default_rng(1)
    codes = g.integers(0, 16, (16, 32))
    x = g.integers(-8, 9, (8, 32)) * 2.0 ** g.integers(-6, 4, (8, 32))          # columns x K, exact in f16
    scale, acc = 2.0 ** g.integers(-4, 4, (16, 8)), g.standard_normal((16, 8))
    w = np.array([[nibble_value(int(c)) for c in row] for row in codes])
    word = lambda r, t: sum(int(c) << (4 * i) for i, c in enumerate(codes[r, 8 * t:8 * t + 8]))  # noqa: E731
    xw = [mma_form(torch.tensor(col))[0].numpy().view(np.uint32) for col in x]
    spots = lambda r, t: [(r, 2 * t), (r, 2 * t + 1), (r + 8, 2 * t), (r + 8, 2 * t + 1)]  # noqa: E731
    inputs = []
    for lane in range(32):
        r, t = divmod(lane, 4)
        inputs.append({4: word(r, t), 5: word(r + 8, t), **{6 + i: int(xw[r][t, i]) for i in range(4)},
                       **{10 + i: acc[s] for i, s in enumerate(spots(r, t))},
                       **{14 + i: scale[s] for i, s in enumerate(spots(r, t))}})
    want = (acc + scale * (w @ x.T)).astype(np.float32)
    for lane, out in enumerate(run_warp(GROUP8_PTX.value, inputs)):
        r, t = divmod(lane, 4)
        assert [out[i] for i in range(4)] == [want[s] for s in spots(r, t)], lane
