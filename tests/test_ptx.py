"""The FP4 and FP8 kernels' inline PTX (custom_ops/triton/fp4.py, fp8.py), run on the CPU by
a small emulator of the few instructions it uses. The interpreter tests run the kernels' Triton
form instead (the interpreter executes no PTX), and the sm_90 build only shows that ptxas
accepts it; this checks what the PTX computes: every E2M1 nibble, in every position of a word,
decodes to its E4M3 value (2^-6 times the E2M1 value of v41.quant), and every E4M3 byte to its
value, in element order."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="the PTX lives in the Triton kernels' module: needs triton (the test extra)")
from custom_ops.triton import fp4, fp8  # noqa: E402
from v41 import quant  # noqa: E402

M32 = 0xFFFFFFFF


def e4m3(byte: int) -> float:
    return float(torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float())


def run_ptx(src: str, inputs: dict[int, int]) -> dict[int, object]:
    """Execute `src` with operands $i preset from `inputs` (32-bit words); returns every $i."""
    regs: dict[str, object] = {f"${i}": v for i, v in inputs.items()}
    val = lambda x: int(x, 0) if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", x) else regs[x]  # noqa: E731
    body = src.strip().strip("{}")
    for ins in filter(None, (s.strip() for s in body.split(";"))):
        op, args = ins.split(None, 1)
        if op == ".reg":
            continue
        if op == "mov.b32":                                      # mov.b32 {lo, hi}, r: r's low and high halves
            lo, hi, r = re.fullmatch(r"\{\s*(\S+),\s*(\S+)\s*\},\s*(\S+)", args).groups()
            regs[lo], regs[hi] = val(r) & 0xFFFF, val(r) >> 16
            continue
        d, *a = [x.strip() for x in args.split(",")]
        if op == "shl.b32":
            regs[d] = (val(a[0]) << val(a[1])) & M32
        elif op == "shr.b32":                                    # .b32: a logical shift
            regs[d] = (val(a[0]) & M32) >> val(a[1])
        elif op == "and.b32":
            regs[d] = val(a[0]) & val(a[1]) & M32
        elif op == "or.b32":
            regs[d] = (val(a[0]) | val(a[1])) & M32
        elif op == "cvt.rn.f16x2.e4m3x2":                        # the low byte into the low half
            h = val(a[0])
            lo, hi = (np.float16(e4m3(b)).view(np.uint16) for b in (h & 0xFF, h >> 8))
            regs[d] = int(lo) | int(hi) << 16
        elif op == "cvt.f32.f16":
            regs[d] = float(np.uint16(val(a[0])).view(np.float16))
        else:
            raise NotImplementedError(op)
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$")}


def nibble_value(c: int) -> float:
    """E2M1 code c's value times 2^-6, from v41.quant (not from the kernels' helpers)."""
    return float(quant.e2m1_decode(torch.tensor([c], dtype=torch.uint8), torch.float32)) * 2.0**-6


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
