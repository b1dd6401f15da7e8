"""Kernels built for Hopper (sm_90) on a machine without a GPU: Triton's compiler and its bundled
ptxas/cuobjdump, no device. Each build is specialized as a launch on the H200 would be (every
pointer and the named integers divisible by 16, Triton's own launch-time specialization), so
register counts and instruction streams match a real launch of that Triton version.

Reported per kernel: registers and spilled bytes a thread (cuobjdump -res-usage), and for kernels
that stream weights, the instructions of the K loop's body (the SASS between the loop's head and
its backward branch) per weight element: what a decode GEMV pays in issue slots for each weight
it reads (H200: 132 SMs x 4 warp instructions a clock).

    python benchmarks/sm90_build.py --out benchmarks/results/sm90-build-cpu.json

Triton versions build the same kernel differently, so the figures that predict the GPU come from
the GPU machine's Triton (3.6), installed beside this machine's:

    pip download --no-deps triton==3.6.0 -d /tmp/w && pip install --no-deps --target /tmp/t36 /tmp/w/*.whl
    PYTHONPATH=/tmp/t36:. python benchmarks/sm90_build.py --out benchmarks/results/sm90-build-triton36-cpu.json
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import subprocess

import triton

from benchmarks.sass import NVIDIA_BIN, asm_layouts, build, loop_body, per_weight, resources, tools_present


FP4_UP_SIG = {"xq_ptr": "*bf16", "ids_ptr": "*i64", "order_ptr": "*i32", "wts_ptr": "*fp32", "w1_ptr": "*i32",
              "w3_ptr": "*i32", "s1_ptr": "*u8", "s3_ptr": "*u8", "part_ptr": "*fp32", "cnt_ptr": "*i32", "h_ptr": "*bf16",
              **dict.fromkeys(("I", "D", "k", "k_split"), "i32"), "limit": "fp32",
              **dict.fromkeys(("stride_x", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_ps", "stride_pu",
                               "stride_h"), "i32"),
              **dict.fromkeys(("BLOCK_N", "BLOCK_K", "ASM", "STAGES", "SORTED"), "constexpr")}
FP4_DOWN_SIG = {"h_ptr": "*bf16", "ids_ptr": "*i64", "order_ptr": "*i32", "w2_ptr": "*i32", "s2_ptr": "*u8",
                "part_ptr": "*fp32", "cnt_ptr": "*i32", "y_ptr": "*bf16",
                **dict.fromkeys(("D", "I", "k_split", "stride_h", "stride_we", "stride_wn", "stride_se", "stride_sn",
                                 "stride_ps", "stride_y"), "i32"),
                **dict.fromkeys(("BLOCK_N", "BLOCK_K", "ASM", "STAGES", "SORTED"), "constexpr")}
# Flash's values of these are multiples of 16 (D = 5120, I = 2304, strides in words and scale bytes)
FP4_ALIGNED = ("I", "D", "k_split", "stride_x", "stride_h", "stride_we", "stride_wn", "stride_se", "stride_sn",
               "stride_ps", "stride_pu", "stride_y")
# fp4_mma.py's GEMVs: scale codes as int32 words of four (SCALE_WORDS: flash-slice's D and I are
# multiples of 128), the activations in MMA form (f16 pairs as int32 words, exponent bits)
FP4_MMA_UP_SIG = {"xa_ptr": "*i32", "xo_ptr": "*i32", "ids_ptr": "*i64", "order_ptr": "*i32", "meta_ptr": "*i32",
                  "wts_ptr": "*fp32", "w1_ptr": "*i32", "w3_ptr": "*i32", "s1_ptr": "*i32", "s3_ptr": "*i32",
                  "part_ptr": "*fp32", "cnt_ptr": "*i32", "ha_ptr": "*fp16", "ho_ptr": "*i32",
                  **dict.fromkeys(("n_tiles", "I", "D", "k", "k_split"), "i32"), "limit": "fp32",
                  **dict.fromkeys(("stride_xa", "stride_xo", "stride_we", "stride_wn", "stride_se", "stride_sn",
                                   "stride_ps", "stride_pu", "stride_ha", "stride_ho"), "i32"),
                  **dict.fromkeys(("ACT", "LANES", "COLS", "BLOCK_K", "SCALE_WORDS", "ASM"), "constexpr")}
FP4_MMA_DOWN_SIG = {"ha_ptr": "*i32", "ho_ptr": "*i32", "ids_ptr": "*i64", "order_ptr": "*i32", "meta_ptr": "*i32",
                    "w2_ptr": "*i32", "s2_ptr": "*i32", "part_ptr": "*fp32", "cnt_ptr": "*i32", "y_ptr": "*bf16",
                    **dict.fromkeys(("n_tiles", "D", "I", "k_split", "stride_ha", "stride_ho", "stride_we",
                                     "stride_wn", "stride_se", "stride_sn", "stride_ps", "stride_y"), "i32"),
                    **dict.fromkeys(("LANES", "COLS", "BLOCK_K", "SCALE_WORDS", "ASM"), "constexpr")}
# flash-slice's: multiples of 16 (the scale and exponent rows, I / 128 and I / 32 words, are not)
FP4_MMA_ALIGNED = ("I", "D", "k_split", "stride_xa", "stride_ha", "stride_we", "stride_wn", "stride_ps", "stride_pu",
                   "stride_y")


FP8_GEMM_INTS = ("M", "N", "KB", "KB_SPLIT", "ROWS_G", "stride_xm", "stride_sm", "stride_wn", "stride_wsn",
                 "stride_om", "stride_ps", "stride_pm", "stride_osm")


def fp8_gemm(block_m: int, block_n: int, unroll: int, stages: int, split_k: bool, quant_x: bool, warps: int = 4,
             quant_out: bool = False):
    """The W8A8 GEMM (fp8_gemm.py) at a tile; quant_x: x in bf16, quantized in the GEMM;
    quant_out: the output act-quantized in the epilogue (QUANT_OUT, from bf16)."""
    from custom_ops.triton.fp8_gemm import _fp8_gemm_kernel
    sig = {"x_ptr": "*bf16" if quant_x else "*fp8e4nv", "xs_ptr": "*bf16" if quant_x else "*fp32",
           "w_ptr": "*fp8e4nv", "ws_ptr": "*u8", "o_ptr": "*fp8e4nv" if quant_out else "*bf16", "p_ptr": "*fp32",
           "cnt_ptr": "*i32", "os_ptr": "*fp32", **dict.fromkeys(FP8_GEMM_INTS, "i32"),
           **dict.fromkeys(("BLOCK_M", "BLOCK_N", "UNROLL", "SPLIT_K", "QUANT_X", "QUANT_OUT"), "constexpr")}
    return build(_fp8_gemm_kernel, sig, {"BLOCK_M": block_m, "BLOCK_N": block_n, "UNROLL": unroll,
                                         "SPLIT_K": split_k, "QUANT_X": quant_x, "QUANT_OUT": quant_out},
                 aligned=("N", "ROWS_G", "stride_xm", "stride_wn", "stride_om", "stride_pm"),   # Flash's dense shapes
                 num_warps=warps, num_stages=stages)


def rms_norm_fp8(codes: bool, hc: int, one_pass: bool = True):
    """RMSNorm + the FP8 quant (norm.py `_rms_norm_fp8_kernel`) at Flash's width, one row a
    program, with PDL, as `_launch` starts it at decode: the row in one tile of 16 warps (one_pass) or in
    chunks of 32 groups; the QAT values, or (codes) the E4M3 codes and scales beside the norm,
    of mHC's hc streams collapsed first where hc > 0."""
    from custom_ops.triton.norm import CHUNK, ONE_PASS_MAX, _rms_norm_fp8_kernel
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "q_ptr": "*fp8e4nv" if codes else "*bf16",
           "s_ptr": "*fp32" if codes else "*bf16", "mix_ptr": "*fp32" if hc else "*bf16", "N": "i32", "D": "i32",
           "eps": "fp32", **dict.fromkeys(("stride_x", "stride_xk", "stride_m", "stride_o", "stride_q", "stride_s"),
                                          "i32"),
           **dict.fromkeys(("BLOCK_R", "BLOCK_G", "CODES", "HC", "ONE_PASS", "PDL"), "constexpr")}
    return build(_rms_norm_fp8_kernel, sig, {"BLOCK_R": 1, "BLOCK_G": (ONE_PASS_MAX if one_pass else CHUNK) // 32,
                                             "CODES": codes, "HC": hc, "ONE_PASS": one_pass, "PDL": True},
                 num_warps=16 if one_pass else 4)


FP8_GEMV_INTS = ("M", "N", "K", "K_SPLIT", "ROWS_G", "stride_xm", "stride_sm", "stride_wn", "stride_wsn", "stride_om",
                 "stride_ps", "stride_pm", "stride_osm")


def fp8_gemv(rows: int, block_n: int, block_k: int, quant_x: bool, warps: int = 4, asm: bool = True, stages: int = 3,
             prefetch: bool = False, quant_out: bool = False, tma: bool = False):
    """The W8A8 GEMV (fp8_gemm.py `_fp8_gemv_kernel`) with split-K; quant_x: x in bf16; prefetch:
    the next K block's weights loaded during this one's products (PREFETCH, with PDL); quant_out:
    the output act-quantized in the epilogue; tma: the weights through a tensor descriptor (TMA)."""
    from custom_ops.triton.fp8_gemv import _fp8_gemv_kernel
    w_ty = f"tensordesc<i32[{block_n}, {block_k // 4}]>" if tma else "*i32"
    sig = {"x_ptr": "*bf16" if quant_x else "*fp8e4nv", "xs_ptr": "*bf16" if quant_x else "*fp32", "w_ptr": w_ty,
           "ws_ptr": "*u8", "o_ptr": "*fp8e4nv" if quant_out else "*bf16", "p_ptr": "*fp32", "cnt_ptr": "*i32",
           "os_ptr": "*fp32", **dict.fromkeys(FP8_GEMV_INTS, "i32"),
           **dict.fromkeys(("ROWS", "BLOCK_N", "BLOCK_K", "SPLIT_K", "QUANT_X", "ASM", "STAGES", "QUANT_OUT"),
                           "constexpr")}
    return build(_fp8_gemv_kernel, sig, {"ROWS": rows, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": True,
                                         "QUANT_X": quant_x, "ASM": asm, "STAGES": stages, "PREFETCH": prefetch,
                                         "PDL": prefetch, "QUANT_OUT": quant_out, "TMA": tma},
                 aligned=("N", "K", "K_SPLIT", "ROWS_G", "stride_xm", "stride_wn", "stride_om", "stride_pm"),
                 num_warps=warps)


def dense_decode_rows() -> list[dict]:
    """The W8A8 GEMM's decode tile (fp8_gemm._tiles at M <= 16: 16 x 64, four K blocks an
    iteration) beside the GEMV at 1 and 2 rows, with split-K, x quantized inside or not:
    instructions a weight in the K loop (the GEMM's are the same at any M up to 16). The GEMV's
    default (fp8_gemm's GEMV_BLOCK_N x GEMV_BLOCK_K, GEMV_STAGES) last."""
    from custom_ops.triton.fp8_gemm import GEMV_BLOCK_K, GEMV_BLOCK_N, GEMV_STAGES
    rows = []
    for quant_x in (False, True):
        k = fp8_gemm(16, 64, 4, 3, True, quant_x)
        rows.append({"kernel": "_fp8_gemm_kernel", "tile": "16x64, 4 K blocks an iteration, split-K",
                     "quant_x": quant_x, "num_warps": 4, **resources(k),
                     "thread_instructions_per_weight": per_weight(loop_body(k), 4, 64 * 4 * 32)})
        for r, bn, bk, stages in ((1, 64, 128, 3), (1, 64, 128, 1), (2, 64, 128, 3), (1, 128, 128, 3),
                                  (1, GEMV_BLOCK_N, GEMV_BLOCK_K, GEMV_STAGES)):
            k = fp8_gemv(r, bn, bk, quant_x, stages=stages)
            body = loop_body(k)
            rows.append({"kernel": "_fp8_gemv_kernel", "tile": f"{r} rows x {bn}x{bk}, split-K", "quant_x": quant_x,
                         "num_warps": 4, "num_stages": stages, **resources(k),
                         "thread_instructions_per_weight": per_weight(body, 4, bn * bk),
                         "loop_async_copies": sum(op.startswith("LDGSTS") for op in body),
                         "loop_opcodes": dict(collections.Counter(body).most_common(8))})
    return rows


FP8_CLOCK_FLOPS = 1261e12 / (132 * 1.98e9)


def dense_prefill_rows() -> list[dict]:
    """The W8A8 GEMM's prefill kernel: the FP8 MMA kernel at its prefill tile (fp8_gemm._tiles:
    64 x 128, one 32-deep K block an iteration, 3 stages): the K loop's issue cycles (warp
    instructions over 4 a cycle) against its tensor cycles at the measured FP8 peak, per iteration."""
    bm, bn, bk, warps = 64, 128, 32, 4
    k = fp8_gemm(bm, bn, 1, 3, False, False)
    body = loop_body(k)
    return [{"kernel": "_fp8_gemm_kernel", "tile": f"{bm}x{bn}x{bk}", "num_warps": warps, **resources(k),
             "thread_instructions_per_weight": per_weight(body, warps, bn * bk),
             "loop_issue_cycles": len(body) * warps / 4,
             "loop_tensor_cycles": round(2 * bm * bn * bk / FP8_CLOCK_FLOPS, 1),
             "loop_mma": sum(op.startswith(("HGMMA", "QGMMA", "HMMA")) for op in body)}]


def skinny_row(w_dtype: str, split_w: bool, bm: int, bn: int, sumsq: bool, stages: int, bk: int = 64) -> dict:
    """common.skinny_gemm_kernel (A bf16, W `w_dtype`) at a bm x bn x bk tile as the launcher
    builds it: its resources, thread instructions a weight of the K loop and the loop's MMAs."""
    from custom_ops.triton.common import skinny_gemm_kernel
    sig = {"a_ptr": "*bf16", "w_ptr": w_dtype, "part_ptr": "*fp32", "sq_ptr": "*fp32",
           **dict.fromkeys(("M", "N", "K", "k_split", "stride_am", "stride_wn", "stride_ps", "stride_pm", "stride_ss"),
                           "i32"), **dict.fromkeys(("BLOCK_M", "BLOCK_N", "BLOCK_K", "SUMSQ", "SPLIT_W", "DOT_F32"), "constexpr")}
    k = build(skinny_gemm_kernel, sig, {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SUMSQ": sumsq,
                                        "SPLIT_W": split_w, "DOT_F32": False},
              aligned=("K", "k_split", "stride_am", "stride_wn", "stride_ps", "stride_pm", "stride_ss"),
              num_stages=stages)
    body = loop_body(k)
    return {"kernel": "skinny_gemm_kernel", "w": w_dtype, "tile": f"{bm}x{bn}x{bk}", "split_w": split_w, "num_warps": 4,
            "num_stages": stages, **resources(k), "thread_instructions_per_weight": per_weight(body, 4, bn * bk),
            "loop_mma": sum(op.startswith(("HGMMA", "HMMA")) for op in body)}


def skinny_rows() -> list[dict]:
    """common.skinny_gemm for the mHC and router projections (W FP32) at the decode tile (16
    rows) and the prefill one (64), N = 32 (mHC's 24 padded), with sums of squares: FP32 FMA
    products ("ieee") or W split into three bf16 parts on tensor cores (split_w)."""
    return [skinny_row("*fp32", split_w, bm, 32, True, 2 if split_w and bm == 16 else 3)
            for split_w in (False, True) for bm in (16, 64)]


def head_rows() -> list[dict]:
    """common.skinny_gemm for the LM head (triton_f32_linear: 64 vocabulary rows a program) at the
    decode tile, 128-wide K blocks, the head held in bf16 (one bf16 dot a K block) beside FP32
    (three)."""
    return [skinny_row("*bf16", True, 16, 64, False, 3, 128), skinny_row("*fp32", True, 16, 64, False, 2, 128)]


def fp4_tiles(which: str, block_m: int, block_n: int, block_k: int, warps: int, fp4: bool = True,
              split: bool = False, scale_bytes: bool = False):
    """moe.py's MMA tile kernel `which` ('up' or 'down') on FP4 weights dequantized per tile to
    bf16 (run_experts(tiles=True), the W4A8 op's 'tiles' path), PTX codes, the scale codes read
    as run_experts reads them at Flash's K (`fp4.scale_words`: words of four; `scale_bytes`:
    byte by byte); fp4 False: on bf16 weights (the dequantized engine's experts)."""
    from custom_ops.triton.fp4 import scale_words
    from custom_ops.triton.moe import _moe_down_kernel, _moe_up_kernel
    words = 0 if scale_bytes or not fp4 else scale_words(5120 if which == "up" else 2304, block_k, 128)
    consts = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT": split, "DOT_F32": False,
              "PREC": "tf32", "FP4": fp4, "ASM": True, "SCALE_WORDS": words}
    wt = "*i32" if fp4 else "*bf16"     # packed FP4: int32 words
    st = "*i32" if words else "*u8"
    if which == "up":
        fn = _moe_up_kernel
        sig = {"xq_ptr": "*bf16", "w1_ptr": wt, "w3_ptr": wt, "s1_ptr": st, "s3_ptr": st,
               "order_ptr": "*i32", "wts_ptr": "*fp32", "meta_ptr": "*i32", "h_ptr": "*bf16", "part_ptr": "*fp32",
               **dict.fromkeys(("n_tiles", "I", "D", "k", "k_split"), "i32"), "limit": "fp32",
               **dict.fromkeys(("stride_x", "stride_w1e", "stride_w1n", "stride_w3e", "stride_w3n", "stride_se",
                                "stride_sn", "stride_h", "stride_ps", "stride_pu"), "i32")}
    else:
        fn = _moe_down_kernel
        sig = {"h_ptr": "*bf16", "w2_ptr": wt, "s2_ptr": st, "order_ptr": "*i32", "meta_ptr": "*i32",
               "y_ptr": "*bf16", "part_ptr": "*fp32", **dict.fromkeys(("n_tiles", "D", "I", "k_split"), "i32"),
               **dict.fromkeys(("stride_h", "stride_w2e", "stride_w2n", "stride_se", "stride_sn", "stride_y",
                                "stride_ps"), "i32")}
    sig.update(dict.fromkeys(consts, "constexpr"))
    aligned = ("I", "D", "stride_x", "stride_h", "stride_w1e", "stride_w1n", "stride_w3e", "stride_w3n", "stride_w2e",
               "stride_w2n", "stride_se", "stride_sn", "stride_y")
    return build(fn, sig, consts, aligned=aligned, num_warps=warps)


def tile_row(which: str, per: int, block_m: int, block_n: int, block_k: int, warps: int, label: str, **kw) -> dict:
    """A `fp4_tiles` build's row; `per`: weights a tile reads per BLOCK_N x BLOCK_K (2 for up's w1
    and w3)."""
    k = fp4_tiles(which, block_m, block_n, block_k, warps, **kw)
    body = loop_body(k)
    return {"kernel": f"_moe_{which}_kernel {label}", "tile": f"{block_m}x{block_n}x{block_k}", "num_warps": warps,
            **resources(k), "thread_instructions_per_weight": per_weight(body, warps, per * block_n * block_k),
            "tile_rows": block_m, "loop_async_copies": sum(op.startswith("LDGSTS") for op in body),
            "loop_plain_loads": sum(op.startswith("LDG.") for op in body)}


def fp4_gemv(which: str, block_n: int, block_k: int, warps: int, asm: bool = True, stages: int | None = None,
             prefetch: bool = False, tma: bool = False):
    """The decode FP4 expert GEMV `which` ('up' or 'down') built at a tile (prefetch: PREFETCH;
    tma: the weights through tensor descriptors)."""
    from custom_ops.triton.moe_gemv import FP4_STAGES, _fp4_down_gemv, _fp4_up_gemv
    fn, sig = (_fp4_up_gemv, dict(FP4_UP_SIG)) if which == "up" else (_fp4_down_gemv, dict(FP4_DOWN_SIG))
    if tma:
        sig.update({n: f"tensordesc<i32[{block_n}, {block_k // 8}]>" for n in ("w1_ptr", "w3_ptr", "w2_ptr") if n in sig})
    return build(fn, sig, {"BLOCK_N": block_n, "BLOCK_K": block_k, "ASM": asm, "STAGES": stages or FP4_STAGES,
                           "SORTED": True, "PREFETCH": prefetch, "TMA": tma}, aligned=FP4_ALIGNED, num_warps=warps)


def fp4_gemv_row(which: str, block_n: int, block_k: int, warps: int, asm: bool = True,
                 stages: int | None = None, prefetch: bool = False, tma: bool = False) -> dict:
    from custom_ops.triton.moe_gemv import FP4_STAGES
    k = fp4_gemv(which, block_n, block_k, warps, asm, stages, prefetch, tma)
    body = loop_body(k, innermost=tma)
    # elements of w1 and w3, or of w2 (with TMA the up GEMV walks w1, then w3: a loop each)
    weights = (2 if which == "up" and not tma else 1) * block_n * block_k
    return {"kernel": f"_fp4_{which}_gemv", "tile": f"{block_n}x{block_k}", "num_warps": warps, "asm": asm,
            "num_stages": stages or FP4_STAGES, **({"tma": True, "shared_bytes": k.metadata.shared} if tma else {}),
            **resources(k), "loop_warp_instructions": len(body),
            "thread_instructions_per_weight": per_weight(body, warps, weights),
            "loop_async_copies": sum(op.startswith("LDGSTS") for op in body),
            "loop_opcodes": dict(collections.Counter(body).most_common(8))}


def fp4_mma(which: str, cols: int = 1, warps: int = 4):
    """fp4_mma.py's GEMV `which` ('up' or 'down') built as flash-slice launches it, `cols` pairs a
    program."""
    import triton.language as tl

    from custom_ops.triton.fp4_mma import MMA_BLOCK_K, _fp4_mma_down, _fp4_mma_up
    fn, sig = (_fp4_mma_up, FP4_MMA_UP_SIG) if which == "up" else (_fp4_mma_down, FP4_MMA_DOWN_SIG)
    consts = {"LANES": 32 * warps, "COLS": cols, "BLOCK_K": MMA_BLOCK_K, "SCALE_WORDS": True, "ASM": True,
              **({"ACT": tl.bfloat16} if which == "up" else {})}
    return build(fn, sig, consts, aligned=FP4_MMA_ALIGNED, num_warps=warps)


def fp4_mma_row(which: str, cols: int = 1, warps: int = 4) -> dict:
    from custom_ops.triton.fp4_mma import MMA_BLOCK_K
    k = fp4_mma(which, cols, warps)
    body = loop_body(k)
    weights = (2 if which == "up" else 1) * 16 * warps * MMA_BLOCK_K
    return {"kernel": f"_fp4_mma_{which}", "cols": cols, "tile": f"{16 * warps}x{MMA_BLOCK_K}", "num_warps": warps,
            **resources(k),
            "loop_warp_instructions": len(body), "thread_instructions_per_weight": per_weight(body, warps, weights),
            "loop_mma": body.count("HMMA.16816.F32"), "asm_layouts": sorted(asm_layouts(k)),
            "loop_opcodes": dict(collections.Counter(body).most_common(10))}


def tma_rows() -> list[dict]:
    """The one-row GEMVs with their weights through tensor descriptors beside their plain loads:
    the FP8 GEMV at its default tile (from codes) unpipelined and 1-4 stages deep, the FP4 GEMVs
    at 64 x 128 (the plain loads' default), 128 x 128 and 64 x 256 (the TMA loads' default)."""
    from custom_ops.triton.fp8_gemm import GEMV_BLOCK_K, GEMV_BLOCK_N
    rows = []
    for tma, stages in ((False, 1), (True, 1), (True, 3), (True, 4)):
        k = fp8_gemv(1, GEMV_BLOCK_N, GEMV_BLOCK_K, False, stages=stages, tma=tma)
        body = loop_body(k, innermost=True)
        rows.append({"kernel": "_fp8_gemv_kernel", "tile": f"1 row x {GEMV_BLOCK_N}x{GEMV_BLOCK_K}, split-K",
                     "quant_x": False, "num_warps": 4, "num_stages": stages, "tma": tma,
                     "shared_bytes": k.metadata.shared, **resources(k),
                     "thread_instructions_per_weight": per_weight(body, 4, GEMV_BLOCK_N * GEMV_BLOCK_K),
                     "loop_opcodes": dict(collections.Counter(body).most_common(8))})
    for w in ("up", "down"):
        rows.append(fp4_gemv_row(w, 64, 128, 4, stages=1))
        rows += [fp4_gemv_row(w, bn, bk, 4, stages=st, tma=True) for bn, bk, st in
                 ((64, 128, 1), (64, 128, 3), (128, 128, 3), (64, 256, 3))]
    return rows


def fp4_mma_rows() -> list[dict]:
    """The tensor-core GEMVs (one pair a program, and eight) beside moe_gemv.py's defaults, up and
    down: instructions a weight read (a pass serves eight pairs at `cols` 8)."""
    return [row for w in ("up", "down") for row in (fp4_mma_row(w), fp4_mma_row(w, 8), fp4_gemv_row(w, 64, 128, 4))]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--fp4-mma", action="store_true", help="only fp4_mma.py's GEMVs beside moe_gemv.py's")
    ap.add_argument("--tma", action="store_true", help="only the one-row GEMVs' TMA loads beside their plain loads")
    a = ap.parse_args(argv)
    if not tools_present():
        ap.error(f"this Triton build ships no CUDA ptxas/cuobjdump in {NVIDIA_BIN}")
    if a.tma:
        return emit("sm90_build --tma", "the one-row GEMVs with TMA weight loads beside their plain loads, built "
                    "for sm_90 on the CPU", tma_rows(), a.out)
    if a.fp4_mma:
        return emit("sm90_build --fp4-mma", "fp4_mma.py's FP4 expert GEMVs on tensor cores beside moe_gemv.py's, "
                    "built for sm_90 on the CPU", fp4_mma_rows(), a.out)
    rows = [fp4_gemv_row(w, bn, bk, nw, asm, stages=3) for w in ("up", "down") for bn, bk, nw in
            ((64, 128, 4), (32, 256, 4), (64, 128, 8)) for asm in (True, False)]     # pipelined 3 deep
    rows += [fp4_gemv_row(w, 64, 128, 4, True, stages=1) for w in ("up", "down")]     # unpipelined (the default)
    rows += dense_decode_rows() + dense_prefill_rows() + skinny_rows()
    for bm, bn, bk, nw in ((16, 64, 64, 4), (64, 64, 64, 4), (128, 64, 64, 4), (64, 128, 64, 4), (128, 128, 64, 8),
                           (128, 128, 32, 8)):
        for which, per in (("up", 2), ("down", 1)):      # the 'tiles' path: weights dequantized to bf16 per tile
            rows.append(tile_row(which, per, bm, bn, bk, nw, "FP4"))
            if (bm, bn, bk, nw) in ((16, 64, 64, 4), (64, 64, 64, 4), (128, 128, 64, 8)):   # scale codes as bytes
                rows.append(tile_row(which, per, bm, bn, bk, nw, "FP4 scale bytes", scale_bytes=True))
            if (bm, bn, bk, nw) in ((16, 64, 64, 4), (64, 64, 64, 4)):        # split over K (the splits knob)
                rows.append(tile_row(which, per, bm, bn, bk, nw, "FP4 split", split=True))
            if (bm, bn, bk, nw) in ((64, 64, 64, 4), (128, 128, 64, 8)):      # the same tiles on bf16 weights
                rows.append(tile_row(which, per, bm, bn, bk, nw, "bf16", fp4=False))
    return emit("sm90_build", __doc__.split("\n\n")[1].replace("\n", " "), rows, a.out)


def emit(benchmark: str, what: str, rows: list, out: str | None) -> dict:
    """A build-count result (device, versions, date, commit, rows) printed and, with out, written."""
    import torch
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"benchmark": benchmark, "device": "cpu (no GPU): Triton's compiler and bundled ptxas, target sm_90",
           "triton": triton.__version__, "torch": torch.__version__, "date": datetime.date.today().isoformat(),
           "commit": commit, "what": what, "results": rows}
    print(json.dumps(res, indent=1))
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
