"""The native GEMM and mHC kernels built for Hopper (sm_90) on this CPU machine: Triton lowers them
to a cubin with its bundled ptxas, no GPU needed. The interpreter tests run the kernels' Python,
not their compilation; this catches what only the compiler refuses (a non-constexpr global, a
branch whose sides disagree in type, an FP8 conversion the target lacks) before a GPU run."""
import os
import subprocess

import pytest

triton = pytest.importorskip("triton", reason="builds Triton kernels: needs the triton package (the test extra)")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 turns the kernels into interpreter functions, which Triton cannot "
                "compile; this module runs in the suite's normal process", allow_module_level=True)
NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
if not all(os.path.exists(os.path.join(NVIDIA_BIN, t)) for t in ("ptxas", "cuobjdump")):
    pytest.skip(f"this Triton build ships no CUDA ptxas/cuobjdump in {NVIDIA_BIN} (not a CUDA build)",
                allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from custom_ops.triton.fp8_gemm import _fp8_gemm_kernel, _tiles  # noqa: E402
from custom_ops.triton.mhc import _mhc_coef_kernel  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
INTS = ("M", "N", "KB", "KB_SPLIT", "ROWS_G", "stride_xm", "stride_sm", "stride_wn", "stride_wsn", "stride_om",
        "stride_ps", "stride_pm")


def build(fn, signature: dict, constexprs: dict, **options):
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=HOPPER,
                          options={"num_warps": 4, **options})


def registers(kernel) -> int:
    """Registers a thread of the built kernel uses (cuobjdump's resource usage)."""
    cuobjdump = os.path.join(NVIDIA_BIN, "cuobjdump")
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"v41-{os.getpid()}.cubin")
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    try:
        out = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(path)
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    assert "LOCAL:0 " in line, line                                  # nothing spilled to local memory
    return int(line.split("REG:")[1].split()[0])


@pytest.mark.parametrize("M", [1, 64, 2048])
@pytest.mark.parametrize("split_k", [False, True])
@pytest.mark.parametrize("quant_x", [False, True])
def test_fp8_gemm_builds_for_hopper(M, split_k, quant_x):
    """Every width's default tile, with and without split-K and the in-GEMM act quant
    (fp8_linear runs that up to 16 rows; built here at every width all the same)."""
    block_n, unroll, stages = _tiles(M)
    sig = {"x_ptr": "*bf16" if quant_x else "*fp8e4nv", "xs_ptr": "*bf16" if quant_x else "*fp32",
           "w_ptr": "*fp8e4nv", "ws_ptr": "*u8", "o_ptr": "*bf16", "p_ptr": "*fp32", "cnt_ptr": "*i32",
           **dict.fromkeys(INTS, "i32"), **dict.fromkeys(("BLOCK_M", "BLOCK_N", "UNROLL", "SPLIT_K", "QUANT_X"),
                                                           "constexpr")}
    k = build(_fp8_gemm_kernel, sig, {"BLOCK_M": min(64, max(16, M)), "BLOCK_N": block_n, "UNROLL": unroll,
                                      "SPLIT_K": split_k, "QUANT_X": quant_x}, num_stages=stages)
    assert 0 < registers(k) <= 255


@pytest.mark.parametrize("block_t,block_s", [(1, 128), (16, 1), (8, 16)])
def test_mhc_coef_builds_for_hopper(block_t, block_s):
    sig = {**dict.fromkeys(("part_ptr", "sq_ptr", "base_ptr", "scale_ptr", "pre_ptr", "post_ptr", "comb_ptr"),
                           "*fp32"),
           **dict.fromkeys(("T", "S", "K", "iters"), "i32"), "hc_eps": "fp32", "norm_eps": "fp32",
           **dict.fromkeys(("stride_ps", "stride_pt", "stride_ss", "stride_pre", "stride_post", "stride_ct",
                            "stride_ci"), "i32"),
           **dict.fromkeys(("HC", "BLOCK_T", "BLOCK_S"), "constexpr")}
    k = build(_mhc_coef_kernel, sig, {"HC": 4, "BLOCK_T": block_t, "BLOCK_S": block_s})
    assert 0 < registers(k) <= 255


@pytest.mark.parametrize("block_m,block_n,warps", [(64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8)])
def test_w4a8_expert_kernels_build_for_hopper(block_m, block_n, warps):
    """The FP8-MMA expert kernels at the default tiles and the prefill sweep's candidates
    (native_gemm_bench.py EXPERT_PREFILL_SWEEP)."""
    from custom_ops.triton.moe_w4a8 import _w4a8_down_kernel, _w4a8_up_kernel
    up = {**dict.fromkeys(("xq_ptr", "w1_ptr", "w3_ptr", "hq_ptr"), "*fp8e4nv"),
          "xs_ptr": "*fp32", "hs_ptr": "*fp32", "wts_ptr": "*fp32",
          **dict.fromkeys(("s1_ptr", "s3_ptr"), "*u8"), "order_ptr": "*i32", "meta_ptr": "*i32",
          **dict.fromkeys(("n_tiles", "I", "KB", "k"), "i32"), "limit": "fp32",
          **dict.fromkeys(("stride_x", "stride_xs", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_h",
                           "stride_hs"), "i32"), **dict.fromkeys(("BLOCK_M", "BLOCK_N", "ACT"), "constexpr")}
    up["w1_ptr"] = up["w3_ptr"] = "*i8"
    k = build(_w4a8_up_kernel, up, {"BLOCK_M": block_m, "BLOCK_N": block_n, "ACT": triton.language.bfloat16},
              num_warps=warps)
    assert 0 < registers(k) <= 255
    down = {"hq_ptr": "*fp8e4nv", "hs_ptr": "*fp32", "w2_ptr": "*i8", "s2_ptr": "*u8", "order_ptr": "*i32",
            "meta_ptr": "*i32", "y_ptr": "*bf16", **dict.fromkeys(("n_tiles", "D", "KB"), "i32"),
            **dict.fromkeys(("stride_h", "stride_hs", "stride_we", "stride_wn", "stride_se", "stride_sn",
                             "stride_y"), "i32"), **dict.fromkeys(("BLOCK_M", "BLOCK_N"), "constexpr")}
    k = build(_w4a8_down_kernel, down, {"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps)
    assert 0 < registers(k) <= 255


@pytest.mark.parametrize("warps", [4, 8])
def test_fp4_gemvs_build_for_hopper(warps):
    """The decode-width FP4 expert GEMVs (moe.py) at their default tile."""
    from custom_ops.triton.moe import FP4_BLOCK_K, FP4_BLOCK_N, _fp4_down_gemv, _fp4_up_gemv
    tiles = {"BLOCK_N": FP4_BLOCK_N, "BLOCK_K": FP4_BLOCK_K}
    up = {"xq_ptr": "*bf16", "ids_ptr": "*i64", "order_ptr": "*i32", **dict.fromkeys(("w1_ptr", "w3_ptr"), "*i8"),
          **dict.fromkeys(("s1_ptr", "s3_ptr"), "*u8"), "part_ptr": "*fp32",
          **dict.fromkeys(("I", "D", "k", "k_split", "stride_x", "stride_we", "stride_wn", "stride_se", "stride_sn",
                           "stride_ps", "stride_pu"), "i32"), **dict.fromkeys(tiles, "constexpr")}
    assert 0 < registers(build(_fp4_up_gemv, up, tiles, num_warps=warps)) <= 255
    down = {"h_ptr": "*bf16", "ids_ptr": "*i64", "order_ptr": "*i32", "w2_ptr": "*i8", "s2_ptr": "*u8",
            "part_ptr": "*fp32", **dict.fromkeys(("D", "I", "k_split", "stride_h", "stride_we", "stride_wn",
                                                   "stride_se", "stride_sn", "stride_ps"), "i32"),
            **dict.fromkeys(tiles, "constexpr")}
    assert 0 < registers(build(_fp4_down_gemv, down, tiles, num_warps=warps)) <= 255


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
    k = build(_inv_rope_wo_a_kernel, sig, {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 64, "SPLITS": splits,
                                           "DOT_F32": False, "PREC": "tf32"}, num_warps=8 if block_m >= 128 else 4)
    assert 0 < registers(k) <= 255
