"""The native GEMM and mHC kernels built for Hopper (sm_90) on this CPU machine: Triton lowers them
to a cubin with its bundled ptxas, no GPU needed. The interpreter tests run the kernels' Python,
not their compilation; this catches what only the compiler refuses (a non-constexpr global, a
branch whose sides disagree in type, an FP8 conversion the target lacks) before a GPU run."""
import os

import pytest

triton = pytest.importorskip("triton", reason="builds Triton kernels: needs the triton package (the test extra)")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 turns the kernels into interpreter functions, which Triton cannot "
                "compile; this module runs in the suite's normal process", allow_module_level=True)
from benchmarks import sass as S  # noqa: E402
from benchmarks import sm90_build as B  # noqa: E402

if not S.tools_present():
    pytest.skip(f"this Triton build ships no CUDA ptxas/cuobjdump in {S.NVIDIA_BIN} (not a CUDA build)",
                allow_module_level=True)

from custom_ops.triton.fp8_gemm import _tiles  # noqa: E402
from custom_ops.triton.mhc import _mhc_coef_kernel  # noqa: E402

build, registers = S.build, S.registers


@pytest.mark.parametrize("M", [1, 64, 2048])
@pytest.mark.parametrize("split_k", [False, True])
@pytest.mark.parametrize("quant_x", [False, True])
def test_fp8_gemm_builds_for_hopper(M, split_k, quant_x):
    """Every width's default tile, with and without split-K and the in-GEMM act quant
    (fp8_linear's path "mma" at one row; built here at every width all the same)."""
    block_n, unroll, stages = _tiles(M)
    assert 0 < registers(B.fp8_gemm(min(64, max(16, M)), block_n, unroll, stages, split_k, quant_x)) <= 255


@pytest.mark.parametrize("e8m0", [True, False])
def test_dequant_builds_for_hopper(e8m0):
    """Path 'bf16's decode of a weight's codes (E8M0 block scales) or an activation's (FP32 group
    scales) into bf16 values."""
    from custom_ops.triton.fp8_gemm import _dequant_kernel
    sig = {"q_ptr": "*fp8e4nv", "s_ptr": "*u8" if e8m0 else "*fp32", "o_ptr": "*bf16",
           **dict.fromkeys(("R", "C", "stride_q", "stride_s", "stride_o"), "i32"),
           **dict.fromkeys(("SCALE_ROWS", "E8M0", "BLOCK_R", "BLOCK_C"), "constexpr")}
    k = build(_dequant_kernel, sig, {"SCALE_ROWS": 32 if e8m0 else 1, "E8M0": e8m0, "BLOCK_R": 32, "BLOCK_C": 128},
              aligned=("C", "stride_q", "stride_s", "stride_o"))
    assert 0 < registers(k) <= 255


def test_fp8_gemv_builds_for_hopper():
    """The W8A8 GEMV at 1 and 2 rows, x quantized inside or not: no spills, the weights decoded
    by the hardware's FP8 conversion, its loads pipelined, and at its default tile fewer
    instructions a weight than the GEMM's decode tile in the same build (which pads the row to
    16); with x quantized inside (the model's fp8_linear at one row) under 60% of them."""
    rows = B.dense_decode_rows()
    for quant_x in (False, True):
        gemm, *gemvs = [r for r in rows if r["quant_x"] == quant_x]
        assert all(r["spilled_bytes"] == 0 for r in gemvs), gemvs
        assert all(r["loop_opcodes"].get("F2FP.F16.E4M3.UNPACK_B") for r in gemvs), gemvs
        # the pipelined loop's weight words arrive by asynchronous copies (cp.async), one stage's do not
        assert all(bool(r["loop_async_copies"]) == (r["num_stages"] > 1) for r in gemvs), gemvs
        default = gemvs[-1]
        assert default["thread_instructions_per_weight"] < (0.6 if quant_x else 1) * \
            gemm["thread_instructions_per_weight"], (gemm, default)


def test_fp8_gemv_prefetch_builds_for_hopper():
    """The GEMV with the next K block's weights loaded during this one's products, at the tiles
    native_gemm_bench sweeps it (a 128-row tile at 8 warps, a 64-row tile at 4): no spills, from
    codes and from bf16 x; the words stay in registers (no cp.async). At the 128-row tile and 4
    warps, x quantized inside, it spills (16 bytes a thread)."""
    from custom_ops.triton.fp8_gemm import GEMV_BLOCK_K
    for quant_x in (False, True):
        for block_n, warps in ((128, 8), (64, 4)):
            k = B.fp8_gemv(1, block_n, GEMV_BLOCK_K, quant_x, warps=warps, stages=1, prefetch=True)
            assert 0 < registers(k) <= 255
            assert "cp.async" not in k.asm["ptx"] and "griddepcontrol.wait" in k.asm["ptx"]


def test_fp8_prefill_kernel_builds_for_hopper():
    """The W8A8 GEMM's prefill kernel builds without spills and multiplies with warpgroup MMA;
    its K loop issues more cycles of instructions than its FP8 tensor work takes (the per-32
    promotion: why it reaches a fraction of the FP8 peak, docs/kernels.md)."""
    (mma,) = B.dense_prefill_rows()
    assert mma["spilled_bytes"] == 0 and mma["loop_mma"], mma
    assert mma["loop_issue_cycles"] > mma["loop_tensor_cycles"], mma


def test_skinny_gemm_builds_for_hopper():
    """The mHC / router projection at its decode and prefill tiles: the split weight's build
    multiplies on tensor cores without spills, in fewer instructions a weight than FP32 FMAs."""
    rows = B.skinny_rows()
    fma, split = [r for r in rows if not r["split_w"]], [r for r in rows if r["split_w"]]
    assert all(r["spilled_bytes"] == 0 for r in rows), rows
    assert all(r["loop_mma"] for r in split) and not any(r["loop_mma"] for r in fma), rows
    assert all(s["thread_instructions_per_weight"] < f["thread_instructions_per_weight"] for s, f in zip(split, fma))


def test_bf16_head_builds_for_hopper():
    """The LM head's tile with the head in bf16: no spills, and its K loop issues a third of the
    MMAs of the FP32 head's three-part split."""
    bf16, f32 = B.head_rows()
    assert bf16["spilled_bytes"] == f32["spilled_bytes"] == 0, (bf16, f32)
    assert bf16["loop_mma"] > 0 and 3 * bf16["loop_mma"] == f32["loop_mma"], (bf16, f32)


@pytest.mark.parametrize("block_t,block_s,warps", [(1, 128, 4), (1, 128, 1), (16, 1, 4), (8, 16, 4)])
def test_mhc_coef_builds_for_hopper(block_t, block_s, warps):
    """The coefficient program at a decode token (its 80 splits in one load; at one warp, the
    COEF_WARPS knob, its sums need no barrier) and at prefill tiles: no spills."""
    sig = {**dict.fromkeys(("part_ptr", "sq_ptr", "base_ptr", "scale_ptr", "pre_ptr", "post_ptr", "comb_ptr"),
                           "*fp32"),
           **dict.fromkeys(("T", "S", "K", "iters"), "i32"), "hc_eps": "fp32", "norm_eps": "fp32",
           **dict.fromkeys(("stride_ps", "stride_pt", "stride_ss", "stride_pre", "stride_post", "stride_ct",
                            "stride_ci"), "i32"),
           **dict.fromkeys(("HC", "BLOCK_T", "BLOCK_S"), "constexpr")}
    k = build(_mhc_coef_kernel, sig, {"HC": 4, "BLOCK_T": block_t, "BLOCK_S": block_s}, num_warps=warps)
    if warps == 1:
        assert not any(op.startswith("BAR") for op in S.opcodes(k))
    assert 0 < registers(k) <= 255


@pytest.mark.parametrize("block_m,block_n,block_k,warps,split", [(64, 64, 64, 4, False), (128, 128, 64, 8, False),
                                                                  (16, 64, 64, 4, True), (64, 64, 64, 4, True)])
def test_fp4_tile_kernels_build_for_hopper(block_m, block_n, block_k, warps, split):
    """moe.py's MMA tile kernels on FP4 weights dequantized per tile (the W4A8 op's 'tiles'
    path) at its default tile and the prefill sweep's 128 x 128, and split over K at the
    decode widths' 16-row tiles and at 64: no spills, and the dots run on tensor cores
    (Hopper's warpgroup MMA from 64 rows). Split at 16 rows, the registers stay near the
    unsplit build's (96 and 72 in sm90-build-cpu.json). Unsplit, the K loop spends under 8
    instructions a weight (the tile decoded from int32 words; byte by byte it took 8.2-11.0).
    The weights reach bf16 without FP32 (fp4.e2m1_bf16_tile: bits placed, then a bf16 multiply
    by the scale): no f16 -> FP32 widening or FP32 -> bf16 packing in the loop."""
    for which, per in (("up", 2), ("down", 1)):
        k = B.fp4_tiles(which, block_m, block_n, block_k, warps, split=split)
        assert 0 < registers(k) <= 255
        mma = "HGMMA" if block_m >= 64 else "HMMA"       # a 16-row tile: the warp-level MMA
        body = S.loop_body(k)
        assert any(op.startswith(mma) for op in body)
        assert any(op.startswith("HMUL2.BF16") for op in body)
        assert not any(op.startswith(("HADD2.F32", "F2FP.BF16.F32")) for op in body)
        if split and block_m == 16:
            assert registers(k) <= 128
        if not split:
            assert S.per_weight(body, warps, per * block_n * block_k) < 8


@pytest.mark.parametrize("block_m", [16, 64])
def test_fp4_tiles_read_scale_words_asynchronously(block_m):
    """At the 16- and 64-row tiles the scale codes come as int32 words of four (fp4.scale_words at
    Flash's K): the K loop has no plain global load left (the weights, x and the scales all
    arrive by asynchronous copies); at the decode tile, fewer instructions a weight than with
    byte loads too."""
    for which, per in (("up", 2), ("down", 1)):
        words, bytes_ = (B.tile_row(which, per, block_m, 64, 64, 4, "", scale_bytes=b) for b in (False, True))
        assert words["loop_plain_loads"] == 0 < bytes_["loop_plain_loads"], (words, bytes_)
        if block_m == 16:
            assert words["thread_instructions_per_weight"] < bytes_["thread_instructions_per_weight"]


@pytest.mark.parametrize("asm", [True, False], ids=["ptx", "triton"])
@pytest.mark.parametrize("warps", [4, 8])
def test_fp4_gemvs_build_for_hopper(warps, asm):
    """The decode-width FP4 expert GEMVs (moe.py) at their default tile, with the word unpack's
    PTX (what CUDA runs; ptxas checks it here) and with the interpreter's Triton form. The PTX
    form spends fewer instructions a weight in the K loop."""
    from custom_ops.triton.moe_gemv import FP4_BLOCK_K, FP4_BLOCK_N
    rows = [B.fp4_gemv_row(which, FP4_BLOCK_N, FP4_BLOCK_K, warps, asm) for which in ("up", "down")]
    assert all(0 < r["registers"] <= 255 for r in rows), rows
    if warps == 4:           # the default (8 warps, a sweep candidate, spills 8 bytes in the up GEMV)
        assert all(r["spilled_bytes"] == 0 for r in rows), rows
    if asm:
        assert all(r["thread_instructions_per_weight"] < 7 for r in rows), rows
        assert all(r["loop_opcodes"].get("F2FP.F16.E4M3.UNPACK_B") for r in rows), rows


def test_fp4_gemvs_prefetch_build_for_hopper():
    """The FP4 GEMVs loading the next K block during this one's products (PREFETCH) build at the
    default tile without spills (the interpreter tests show the same bits)."""
    from custom_ops.triton.moe_gemv import FP4_BLOCK_K, FP4_BLOCK_N
    for which in ("up", "down"):
        assert 0 < registers(B.fp4_gemv(which, FP4_BLOCK_N, FP4_BLOCK_K, 4, prefetch=True)) <= 255


def test_tma_gemvs_build_for_hopper():
    """The one-row GEMVs as they run by default, their weights through tensor descriptors at the
    default tiles and stages (the FP8 GEMV from codes; the FP4 up and down GEMVs): no spills,
    the weight tiles loaded by the copy engine (bulk tensor copies)."""
    from custom_ops.triton.fp8_gemm import GEMV_BLOCK_K, GEMV_BLOCK_N, GEMV_TMA_STAGES
    from custom_ops.triton.moe_gemv import FP4_BLOCK_N, FP4_TMA_BLOCK_K, FP4_TMA_STAGES
    kernels = [B.fp8_gemv(1, GEMV_BLOCK_N, GEMV_BLOCK_K, False, stages=GEMV_TMA_STAGES, tma=True)]
    kernels += [B.fp4_gemv(w, FP4_BLOCK_N, FP4_TMA_BLOCK_K, 4, stages=FP4_TMA_STAGES, tma=True) for w in ("up", "down")]
    for k in kernels:
        assert 0 < registers(k) <= 255
        assert "cp.async.bulk.tensor" in k.asm["ptx"]


@pytest.mark.parametrize("map_cand", [False, True])
def test_index_select_kernels_build_for_hopper(map_cand):
    """The top-k selection's count and write kernels (index.py), which share the threshold
    comparison as a jit helper."""
    from custom_ops.triton.index import SELECT_BLOCK, _select_count_kernel, _select_write_kernel
    count = {"score_ptr": "*fp32", "thr_ptr": "*fp32", "cnt_ptr": "*i32",
             **dict.fromkeys(("width", "n_chunks", "stride_s"), "i32"), "BLOCK": "constexpr"}
    assert 0 < registers(build(_select_count_kernel, count, {"BLOCK": SELECT_BLOCK})) <= 255
    write = {"score_ptr": "*fp32", "thr_ptr": "*fp32", **dict.fromkeys(("need_ptr", "eq_before_ptr",
                                                                         "taken_before_ptr"), "*i32"),
             "out_ptr": "*i64", "cand_ptr": "*i64",
             **dict.fromkeys(("width", "n_chunks", "cand_block", "n_cand", "stride_s", "stride_o", "stride_cand"),
                             "i32"), **dict.fromkeys(("MAP_CAND", "BLOCK"), "constexpr")}
    k = build(_select_write_kernel, write, {"MAP_CAND": map_cand, "BLOCK": SELECT_BLOCK})
    assert 0 < registers(k) <= 255


@pytest.mark.parametrize("bounded,map_cand", [(True, False), (False, True)])
def test_row_select_kernel_builds_for_hopper(bounded, map_cand):
    """One program a row: the radix select's histograms and the column-order write, no spills,
    with programmatic dependent launch on as the GPU launches it."""
    from custom_ops.triton.index import SELECT_BLOCK, _select_row_kernel
    sig = {"score_ptr": "*fp32", "out_ptr": "*i64", "cand_ptr": "*i64", "pos_ptr": "*i64", "bid_ptr": "*i64",
           **dict.fromkeys(("t0", "ratio", "per", "width", "k", "cand_block", "n_cand", "stride_s", "stride_o",
                            "stride_cand"), "i32"), **dict.fromkeys(("BOUNDED", "MAP_CAND", "BLOCK", "PDL"), "constexpr")}
    k = build(_select_row_kernel, sig, {"BOUNDED": bounded, "MAP_CAND": map_cand, "BLOCK": SELECT_BLOCK, "PDL": True})
    assert 0 < registers(k) <= 255


@pytest.mark.parametrize("block_m,block_n,splits", [(16, 64, 1), (16, 64, 4), (128, 128, 1)])
def test_inv_rope_wo_a_builds_for_hopper(block_m, block_n, splits):
    """The attention output's grouped GEMM at the decode tile, with and without split-K, and at
    the prefill tile."""
    from custom_ops.triton.attn_out import _inv_rope_wo_a_kernel
    sig = {"o_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "w_ptr": "*bf16",
           "out_ptr": "*bf16", "p_ptr": "*fp32", "cnt_ptr": "*i32",
           **dict.fromkeys(("T", "R", "I", "d", "tail0", "K_SPLIT", "stride_ot", "stride_og", "stride_cos",
                            "stride_sin", "stride_wg", "stride_wr", "stride_zt", "stride_ps"), "i32"),
           **dict.fromkeys(("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLITS", "DOT_F32", "PREC"), "constexpr")}
    aligned = ("R", "I", "d", "stride_ot", "stride_og", "stride_cos", "stride_sin", "stride_wg", "stride_wr",
               "stride_zt", "stride_ps")       # Flash's, multiples of 16 as the launcher marks them
    k = build(_inv_rope_wo_a_kernel, sig, {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 64, "SPLITS": splits,
                                           "DOT_F32": False, "PREC": "tf32"}, aligned=aligned,
              num_warps=8 if block_m >= 128 else 4)
    assert 0 < registers(k) <= 255


@pytest.mark.parametrize("one_pass", [True, False])
@pytest.mark.parametrize("codes,hc", [(False, 0), (True, 0), (True, 4)])
def test_rms_norm_fp8_builds_for_hopper(codes, hc, one_pass):
    """RMSNorm + the FP8 quant at Flash's width (one row a program, in one tile or in chunks
    of 32 groups): the QAT values, or the E4M3 codes and scales beside the norm
    (`rms_norm_act_quant`), also of mHC's four streams collapsed first; without spills."""
    k = B.rms_norm_fp8(codes, hc, one_pass)
    assert 0 < registers(k) <= 255 and S.usage(k).get("STACK", 0) == 0 and "griddepcontrol.wait" in k.asm["ptx"]


@pytest.mark.parametrize("norm", [False, True])
def test_rope_fp8_builds_for_hopper(norm):
    """RoPE + FP8 QAT of the window KV row (d = 512, one row a program), with and without the
    row's RMSNorm first (`rms_norm_rope_fp8_qat`): no spills."""
    from custom_ops.triton.rope import _rope_fp8_kernel
    sig = {"x_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "out_ptr": "*bf16",
           "w_ptr": "*bf16" if norm else "*fp32", "R": "i32", "d": "i32", "tail0": "i32", "eps": "fp32",
           **dict.fromkeys(("stride_xt", "stride_xr", "stride_ot", "stride_or", "stride_cos", "stride_sin"), "i32"),
           **dict.fromkeys(("INVERSE", "BLOCK_R", "BLOCK_G", "NORM", "PDL"), "constexpr")}
    k = build(_rope_fp8_kernel, sig, {"INVERSE": False, "BLOCK_R": 1, "BLOCK_G": 16, "NORM": norm, "PDL": True})
    assert 0 < registers(k) <= 255 and S.usage(k).get("STACK", 0) == 0


def test_fp8_gemm_quant_out_builds_for_hopper():
    """The W8A8 GEMV's default tile (one row, split-K) and the GEMM's 16-row decode tile with the
    act quant in the epilogue (`fp8_block_gemm_act_quant`: wo_a's output leaving as wo_b's
    codes): no spills."""
    from custom_ops.triton.fp8_gemm import GEMV_BLOCK_K, GEMV_BLOCK_N
    for k in (B.fp8_gemv(1, GEMV_BLOCK_N, GEMV_BLOCK_K, False, stages=1, quant_out=True),
              B.fp8_gemm(16, 64, 4, 3, True, False, quant_out=True)):
        assert 0 < registers(k) <= 255 and S.usage(k).get("STACK", 0) == 0


def test_e4m3_codes_keep_the_sign_of_zero():
    """The kernels that write E4M3 codes put the value's sign bit on (round_e4m3): no `0 - x`,
    which Triton makes of `-x` and which turns a negative value rounded to zero into code 0x00
    where the reference keeps -0 (0x80); the interpreter negates with numpy and cannot show it."""
    from custom_ops.triton.fp8_gemm import GEMV_BLOCK_K, GEMV_BLOCK_N, _act_quant_kernel
    act = build(_act_quant_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32",
                                    **dict.fromkeys(("N", "NG", "stride_x", "stride_q", "stride_s"), "i32"),
                                    **dict.fromkeys(("BLOCK_R", "BLOCK_G"), "constexpr")},
                {"BLOCK_R": 2, "BLOCK_G": 32})
    norm = B.rms_norm_fp8(True, 0)
    gemv = B.fp8_gemv(1, GEMV_BLOCK_N, GEMV_BLOCK_K, False, stages=1, quant_out=True)
    assert [S.zero_subtractions(k) for k in (act, norm, gemv)] == [0, 0, 0]


def test_fp4_mma_gemvs_hold_one_element_a_lane():
    """fp4_mma.py's premise: the [32 · warps] tensors its inline mma.sync takes are laid out one
    element a lane, so the PTX sees one lane's registers; the K loop issues two MMAs a group of
    32 and weight matrix (8 a 128-wide step down, 16 up), at one pair a program and eight,
    storing nothing to local memory inside it (ptxas keeps the eight-column up GEMV to 64
    registers: one word stored before the loop, loaded once an iteration), in fewer
    instructions a weight than moe_gemv.py's GEMVs."""
    one = "#ttg.blocked<{sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = [4], order = [0]}>"
    rows = B.fp4_mma_rows()
    for which, mmas in (("up", 16), ("down", 8)):
        gemv = next(r["thread_instructions_per_weight"] for r in rows if r["kernel"] == f"_fp4_{which}_gemv")
        for cols in (1, 8):
            k = B.fp4_mma(which, cols)
            assert S.asm_layouts(k) == {one}
            body = S.loop_body(k)
            assert body.count("HMMA.16816.F32") == mmas and "STL" not in body and body.count("LDL") <= 1
            mma = next(r["thread_instructions_per_weight"] for r in rows
                       if r["kernel"] == f"_fp4_mma_{which}" and r["cols"] == cols)
            assert mma < 0.75 * gemv, (which, cols, mma, gemv)


@pytest.mark.parametrize("block_p,block_e,block_t", [(8, 32, 8), (128, 128, 128)])
def test_expert_tiles_builds_for_hopper(block_p, block_e, block_t):
    """The grouping kernel (a program per BLOCK_P pairs ranking them, the last building the tile
    table) at one decode token's chunks and at full ones, as expert_tiles launches it: no spills."""
    from custom_ops.triton.moe_tiles import _BLOCK_J, _expert_tiles_kernel
    sig = {**dict.fromkeys(("ids_ptr", "order_ptr", "meta_ptr", "bounds_ptr", "tile_end_ptr"), "*i32"),
           **dict.fromkeys(("P", "E", "n_tiles"), "i32"),
           **dict.fromkeys(("BLOCK_M", "BLOCK_P", "BLOCK_E", "BLOCK_T", "BLOCK_J"), "constexpr")}
    k = build(_expert_tiles_kernel, sig, {"BLOCK_M": 8, "BLOCK_P": block_p, "BLOCK_E": block_e, "BLOCK_T": block_t,
                                          "BLOCK_J": min(_BLOCK_J, block_p)}, num_warps=8)
    r = S.resources(k)
    assert 0 < r["registers"] <= 255 and r["spilled_bytes"] == 0, r
