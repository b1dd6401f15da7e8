"""A design probe for the FP4 expert GEMVs (moe_gemv.py), built for sm_90 on the CPU: the down
GEMV's K loop with each lane's weight words decoded to f16 pairs and multiplied on tensor cores by
`mma.sync.m16n8k16` (f16 x f16 -> FP32), instead of moe_gemv.py's f16 -> f32 conversion and FFMA
per weight. It prints the loop's thread instructions a weight beside the GEMV's; it is not wired
to any op. Its group step's products are checked on the CPU by tests/test_ptx.py (a warp of
lanes emulated, mma.sync's fragments as the PTX ISA lays them out), not yet on a GPU.

    python benchmarks/fp4_mma_probe.py [--out FILE]     # fp4-mma-probe-triton36-cpu.json: under the
                                                         # GPU's Triton 3.6 (PYTHONPATH to its wheel)

The kernel holds one element per thread: every tensor is [32 * warps] (Triton lays such a tensor
out one element a lane, which the probe checks in its TTGIR), so an inline-PTX block sees one
lane's registers, as `mma.sync` wants. Warp w takes weight rows 16w.. of its 64; lane l = 4g + t
holds rows g and g + 8 (the A fragment's rows, and D's). Per group of 32 along K, lane t of a row
reads the row's int32 word t (elements 8t..8t+7): its low nibbles' E4M3 codes give the f16 pairs
(0, 2) and (4, 6), its high nibbles' (1, 3) and (5, 7) (fp4.py's shift-and-masks, then the
hardware's E4M3 pair -> f16x2). Two MMAs cover the group, the first on pairs (0, 2) and (1, 3) in
A's k slots (2t, 2t+1) and (2t+8, 2t+9), the second on (4, 6) and (5, 7); any order of K serves
the dot product if B's k slots hold the activations in the same order, so the activation arrives
as f16 pairs already in that order (`lane_words`: four int32 words a lane position t a group)
and every column of B is the same activation. D's column 0 is the group's sum for rows g and g + 8; one FMA a row
adds it, times the row's E8M0 scale, to the row's accumulator.
"""
from __future__ import annotations

import argparse
import collections
import re

import triton
import triton.language as tl

from custom_ops.triton.fp4 import _HI_CODES, _LO_CODES

WARPS = 4
BLOCK_N = 16 * WARPS      # weight rows a program
BLOCK_K = 128             # K a loop iteration: four groups of 32


def _pairs(w: str, out: tuple[str, ...], p: str) -> str:
    """PTX: the int32 word w of eight E2M1 values -> f16 pairs out = ((0, 2), (4, 6), (1, 3), (5, 7)),
    2^-6 times their values (registers lo, hi, a, b declared by the caller)."""
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
def _fp4_mma_down(h_ptr, w2_ptr, s2_ptr, y_ptr, k_split, stride_wn, stride_sn, LANES: tl.constexpr):
    """Rows [64·n, 64·n + 64) of one expert's w2 (int32 words; s2 its E8M0 codes) against the
    prepared activation h over the split's K range, into y (FP32, one value a row)."""
    lane = tl.arange(0, LANES)
    g = (lane % 32) // 4
    t = lane % 4
    r0 = tl.program_id(0) * 64 + (lane // 32) * 16 + g
    r1 = r0 + 8
    k_lo = tl.program_id(1) * k_split
    acc0 = tl.zeros([LANES], tl.float32)
    acc1 = tl.zeros([LANES], tl.float32)
    for k0 in range(k_lo, k_lo + k_split, 128):
        sw0 = tl.load((s2_ptr + r0 * stride_sn + k0 // 32).to(tl.pointer_type(tl.int32), bitcast=True))
        sw1 = tl.load((s2_ptr + r1 * stride_sn + k0 // 32).to(tl.pointer_type(tl.int32), bitcast=True))
        for c in tl.static_range(4):
            w0 = tl.load(w2_ptr + r0.to(tl.int64) * stride_wn + k0 // 8 + 4 * c + t)
            w1 = tl.load(w2_ptr + r1.to(tl.int64) * stride_wn + k0 // 8 + 4 * c + t)
            hb = h_ptr + (k0 // 32 + c) * 16 + t * 4
            # fp4.e2m1_scale's 2^(code - 127) · 2^6 as the FP32 bits of exponent code + 6: one IMAD
            # (the same values for codes up to 248, as e2m1_scale's bound)
            f0 = ((((sw0 >> (8 * c)) & 0xFF) + 6) << 23).to(tl.float32, bitcast=True)
            f1 = ((((sw1 >> (8 * c)) & 0xFF) + 6) << 23).to(tl.float32, bitcast=True)
            acc0, acc1 = tl.inline_asm_elementwise(
                GROUP_PTX, "=f,=f,r,r,r,r,r,r,f,f,f,f",
                [w0, w1, tl.load(hb), tl.load(hb + 1), tl.load(hb + 2), tl.load(hb + 3), acc0, acc1, f0, f1],
                dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    tl.store(y_ptr + r0, acc0, mask=t == 0)
    tl.store(y_ptr + r1, acc1, mask=t == 0)


def lane_words(x):
    """The activation x [K] (values exact in f16, K a multiple of 32) as the probe reads it:
    int32 [K / 32, 4, 4], group c's words for lane position t the f16 pairs (0, 2), (1, 3),
    (4, 6), (5, 7) of elements 32c + 8t.., the first of a pair in the low half."""
    import torch
    pairs = x.to(torch.float16).reshape(-1, 4, 8)[..., [0, 2, 1, 3, 4, 6, 5, 7]].contiguous()
    return pairs.view(torch.int32).reshape(-1, 4, 4)


def build():
    """The probe kernel compiled for sm_90 (benchmarks/sm90_build.py's target and marks)."""
    from benchmarks import sm90_build as B
    sig = {"h_ptr": "*i32", "w2_ptr": "*i32", "s2_ptr": "*u8", "y_ptr": "*fp32", "k_split": "i32",
           "stride_wn": "i32", "stride_sn": "i32", "LANES": "constexpr"}
    return B.build(_fp4_mma_down, sig, {"LANES": 32 * WARPS}, aligned=("k_split", "stride_wn", "stride_sn"),
                   num_warps=WARPS)


def layouts(kernel) -> list[str]:
    """The blocked layouts of the kernel's TTGIR."""
    return sorted(set(re.findall(r"#ttg\.blocked<\{[^}]*\}>", kernel.asm["ttgir"])))


def row(kernel) -> dict:
    from benchmarks import sm90_build as B
    body = B.loop_body(kernel)
    return {"kernel": "fp4_mma_probe down", "tile": f"{BLOCK_N}x{BLOCK_K}", "num_warps": WARPS, **B.resources(kernel),
            "loop_warp_instructions": len(body),
            "thread_instructions_per_weight": B.per_weight(body, WARPS, BLOCK_N * BLOCK_K),
            "loop_opcodes": dict(collections.Counter(body).most_common(12)), "layouts": layouts(kernel)}


def main(argv=None) -> dict:
    from benchmarks import sm90_build as B
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not B.tools_present():
        ap.error(f"this Triton build ships no CUDA ptxas/cuobjdump in {B.NVIDIA_BIN}")
    rows = [row(build()), B.fp4_gemv_row("down", 64, 128, 4)]        # the probe, then moe_gemv.py's default
    return B.emit("fp4_mma_probe", __doc__.split("\n\n")[0].replace("\n", " "), rows, a.out)


if __name__ == "__main__":
    main()
