"""The native-format GEMMs compiled for the GPU (run on the H200 with
`pytest -m gpu tests/test_native_gemm_gpu.py`): real FP8 MMA, Flash shapes, decode widths 1..64
and a prefill width, outputs NaN-poisoned, against the reference on the same quantized inputs.

The bound is tests/test_native_gemm.py's, γ_K·S from the float64 product (S = Σ|products|),
plus an allowance for the FP8 MMA itself: Hopper's FP8 tensor cores are reported to keep fewer
accumulator bits inside one instruction (DeepGEMM's reason for promoting every 128 K); the
kernel promotes to FP32 every 32 K, so one instruction's sum is at most 32 products, taken
here as good to 2^-13 of its Σ|products|. This allowance is an assumption the first GPU run
checks: if it fails, the printed worst ratio is the measured one.
"""
from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import require_compiled_kernels

pytestmark = pytest.mark.gpu

require_compiled_kernels()

import custom_ops  # noqa: E402,F401
import custom_ops.triton  # noqa: E402,F401  (registers the CUDA impls)
from custom_ops import gemm as ref  # noqa: E402
from custom_ops import registry  # noqa: E402
from tests.kernel_cases import fp8_gemm_case, fp8_grouped_case, w4a8_case  # noqa: E402
from v41 import quant  # noqa: E402

DEV = "cuda"
U = 2.0**-24
MMA_REL = 2.0**-13


def test_registry_picks_triton():
    sel = registry.selected()
    assert all(sel[f"v41::{n}"]["cuda"] == "triton" for n in ref.NATIVE_OPS)
    assert ref.native_weights(DEV, torch.bfloat16)


def test_fp8_act_quant_codes_equal_the_reference():
    """The act quant's E4M3 codes and scales, bit for bit the reference's on the GPU: a million
    random values, and groups whose small negative values round to zero (code 0x80, -0, as
    torch.copysign keeps it; the interpreter cannot show this, its negation is numpy's)."""
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(1024, 1280, device=DEV, generator=g) * 3
    x[:8, ::32] = 400.0                              # rows whose groups hold -1e-6 and -0.0
    x[:8, 1::32], x[:8, 2::32], x[:8, 3::32] = -1e-6, -0.0, 1e-6
    x = x.bfloat16()
    q, s = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=DEV), torch.empty(1024, 40, device=DEV)
    want_q, want_s = torch.empty_like(q), torch.empty_like(s)
    torch.ops.v41.fp8_act_quant(x, q, s)
    ref.fp8_act_quant(x, want_q, want_s)
    assert (want_q[:8, 1::32].view(torch.uint8) == 0x80).all()
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)


@pytest.mark.parametrize("M", [1, 5, 16, 17, 64])
@pytest.mark.parametrize("N,K,G", [(1280, 5120, 1), (32768, 1280, 1), (8192, 4096, 8)])
def test_fp8_linear_equals_quant_then_gemm(M, N, K, G):
    """`fp8_linear` (x quantized inside the GEMV where `quantizes_inside` says so) gives the bits of
    `fp8_act_quant` then `fp8_block_gemm` at Flash's shapes (wq_a, wq_b, wo_a's 8 groups)."""
    g = torch.Generator(device=DEV).manual_seed(M + N)
    x = (torch.randn(M, G * K, device=DEV, generator=g) * 4).bfloat16()
    _, _, w, ws = fp8_gemm_case(torch.Generator().manual_seed(N), 1, N, K, device=DEV)
    q = torch.empty(M, G * K, dtype=torch.float8_e4m3fn, device=DEV)
    s = torch.empty(M, G * K // 32, device=DEV)
    torch.ops.v41.fp8_act_quant(x, q, s)
    want = torch.empty(M, N, dtype=torch.bfloat16, device=DEV)
    torch.ops.v41.fp8_block_gemm(q, s, w, ws, want, G)
    out = torch.full_like(want, float("nan"))
    torch.ops.v41.fp8_linear(x, w, ws, out, G)
    assert torch.equal(out, want)


@pytest.mark.parametrize("M", [1, 5, 64, 2048])
def test_fp8_block_gemm_grouped(M):
    """wo_a's grouped form at Flash's shape (8 groups of 1024 rows, K = 4096 each): group g's
    columns within the FP32-order bound of x's g-th slice times its rows, as the reference."""
    G, R, K = 8, 1024, 4096
    g = torch.Generator().manual_seed(M)
    xq, xs, w, ws = fp8_grouped_case(g, M, G, R, K, device=DEV)
    x = (xq.double() * xs.double().repeat_interleave(32, -1)).view(M, G, K)
    wd = quant.dequant_fp8_block(w, ws, torch.float64).view(G, R, K)
    exact = torch.einsum("mgk,grk->mgr", x, wd).flatten(1)
    S = torch.einsum("mgk,grk->mgr", x.abs(), wd.abs()).flatten(1)
    out = torch.full((M, G * R), float("nan"), device=DEV)
    torch.ops.v41.fp8_block_gemm(xq, xs, w, ws, out, G)
    r = torch.empty_like(out)
    with registry.using("reference", "cuda", names=("fp8_block_gemm",)):
        torch.ops.v41.fp8_block_gemm(xq, xs, w, ws, r, G)
    bound = (K * U + MMA_REL) * S
    assert not out.isnan().any()
    assert ((out.double() - exact).abs() <= bound).all()
    assert ((r.double() - exact).abs() <= bound).all()
    # the act quant in the epilogue (wo_a's output as wo_b's codes): bit for bit the act quant of
    # the same GEMM's bf16 output
    y = torch.empty(M, G * R, dtype=torch.bfloat16, device=DEV)
    torch.ops.v41.fp8_block_gemm(xq, xs, w, ws, y, G)
    want_q = torch.empty(M, G * R, dtype=torch.float8_e4m3fn, device=DEV)
    want_s = torch.empty(M, G * R // 32, device=DEV)
    ref.fp8_act_quant(y, want_q, want_s)
    q, s = torch.empty_like(want_q), torch.full_like(want_s, float("nan"))
    torch.ops.v41.fp8_block_gemm_act_quant(xq, xs, w, ws, torch.bfloat16, q, s, G)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)


@pytest.mark.parametrize("M", [1, 3, 4, 8, 33, 64, 2048])
@pytest.mark.parametrize("N,K", [(1280, 5120), (5120, 8192), (2304, 5120)])
def test_fp8_block_gemm(M, N, K):
    g = torch.Generator().manual_seed(M * 7 + N)
    xq, xs, w, ws = fp8_gemm_case(g, M, N, K, device=DEV)
    x = xq.double() * xs.double().repeat_interleave(32, -1)
    wd = quant.dequant_fp8_block(w, ws, torch.float64)
    exact, S = x @ wd.T, x.abs() @ wd.abs().T
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.full((M, N), float("nan"), dtype=dtype, device=DEV)
        torch.ops.v41.fp8_block_gemm(xq, xs, w, ws, out)
        r = torch.empty_like(out)
        with registry.using("reference", "cuda", names=("fp8_block_gemm",)):
            torch.ops.v41.fp8_block_gemm(xq, xs, w, ws, r)
        bound = (K * U + MMA_REL) * S + (2.0**-8 * exact.abs() if dtype == torch.bfloat16 else 0)
        err = (out.double() - exact).abs()
        assert not out.isnan().any()
        assert (err <= bound).all(), float((err / bound.clamp(min=1e-300)).max())
        assert ((r.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("path", ["gemv", "mma", "bf16"])
@pytest.mark.parametrize("M", [1, 2, 5, 2048])
def test_fp8_gemm_paths(M, path):
    """Each path at decode and prefill widths, whatever the default picks there: the CUDA-core
    GEMV (its E4M3 PTX decode; the default at one row), the FP8 MMA tiles and cuBLAS on the bf16
    values (its output bf16: one rounding more), on codes and from bf16 x: the GEMV's FP32 sums of
    exact products within γ_K·S, the tensor cores' within the MMA allowance; `fp8_linear` gives
    the bits of quant then GEMM."""
    from custom_ops.triton.fp8_gemm import triton_fp8_block_gemm, triton_fp8_linear
    N, K = 1280, 5120
    g = torch.Generator().manual_seed(M * 3 + len(path))
    xq, xs, w, ws = fp8_gemm_case(g, M, N, K, device=DEV)
    x = xq.double() * xs.double().repeat_interleave(32, -1)
    wd = quant.dequant_fp8_block(w, ws, torch.float64)
    exact, S = x @ wd.T, x.abs() @ wd.abs().T
    out = torch.full((M, N), float("nan"), device=DEV, dtype=torch.bfloat16 if path == "bf16" else torch.float32)
    triton_fp8_block_gemm(xq, xs, w, ws, out, path=path)
    err = (out.double() - exact).abs()
    bound = (K * U + (MMA_REL if path != "gemv" else 0)) * S + (2.0**-8 * exact.abs() if path == "bf16" else 0)
    assert not out.isnan().any()
    assert (err <= bound).all(), float((err / bound.clamp(min=1e-300)).max())
    xb = (torch.randn(M, K, device=DEV, generator=torch.Generator(device=DEV).manual_seed(M)) * 4).bfloat16()
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=DEV)
    sc = torch.empty(M, K // 32, device=DEV)
    torch.ops.v41.fp8_act_quant(xb, q, sc)
    want, got = (torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=DEV) for _ in range(2))
    triton_fp8_block_gemm(q, sc, w, ws, want, path=path)
    triton_fp8_linear(xb, w, ws, got, path=path)
    assert not want.isnan().any() and torch.equal(got, want)


@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("N,K,G", [(32768, 1280, 1), (5120, 8192, 1), (8192, 4096, 8)])
def test_fp8_gemv_tma(N, K, G, stages):
    """The one-row GEMV with its weights loaded through a tensor descriptor (TMA), unpipelined
    and three deep, on Flash's wq_b, wo_b and grouped wo_a shapes: FP32 sums of exact products
    within γ_K·S of the float64 product, every element written."""
    from custom_ops.triton.fp8_gemm import triton_fp8_block_gemm
    g = torch.Generator().manual_seed(N + stages)
    if G == 1:
        xq, xs, w, ws = fp8_gemm_case(g, 1, N, K, device=DEV)
    else:
        xq, xs, w, ws = fp8_grouped_case(g, 1, G, N // G, K, device=DEV)
    Kg = w.shape[1]
    x = (xq.double() * xs.double().repeat_interleave(32, -1)).reshape(G, Kg)
    wd = quant.dequant_fp8_block(w, ws, torch.float64).reshape(G, N // G, Kg)
    exact = torch.einsum("gk,gnk->gn", x, wd).reshape(1, N)
    S = torch.einsum("gk,gnk->gn", x.abs(), wd.abs()).reshape(1, N)
    out = torch.full((1, N), float("nan"), device=DEV)
    triton_fp8_block_gemm(xq, xs, w, ws, out, G, path="gemv", tma=True, num_stages=stages)
    err = (out.double() - exact).abs()
    assert not out.isnan().any()
    assert (err <= Kg * U * S).all(), float((err / (Kg * U * S).clamp(min=1e-300)).max())


@pytest.mark.parametrize("T,kw", [(1, {"num_stages": 1}), (1, {"num_stages": 3}), (6, {"num_stages": 3}),
                                  (1, {"num_stages": 3, "block_n_up": 128, "block_n_down": 128, "splits": 2})])
def test_moe_experts_w4a8_gemv_tma(T, kw):
    """The FP4 GEMVs with their weights loaded through tensor descriptors (TMA), compiled for
    sm_90 with their PTX: within the experts' tolerance of the reference."""
    from custom_ops.triton.moe_w4a8 import triton_moe_experts_w4a8
    args, r, out = experts_case(T)
    triton_moe_experts_w4a8(*args, 10.0, out, path="gemv", tma=True, **kw)
    assert_experts_close(out, r, T)


def experts_case(T):
    """(inputs, reference output, NaN-poisoned output) of a W4A8 expert case with D = 1024, I = 512."""
    g = torch.Generator().manual_seed(T)
    E, D, I, k = 32, 1024, 512, 6
    args = [t.to(DEV) for t in w4a8_case(g, T, E, D, I, k, dtype=torch.bfloat16, pad_token=T > 1)]
    r = torch.empty(T, D, device=DEV)
    with registry.using("reference", "cuda", names=("moe_experts_w4a8",)):
        torch.ops.v41.moe_experts_w4a8(*args, 10.0, r)
    return args, r, torch.full((T, D), float("nan"), device=DEV)


@pytest.mark.parametrize("T", [1, 16, 64, 2048])
def test_moe_experts_w4a8(T):
    args, r, out = experts_case(T)
    torch.ops.v41.moe_experts_w4a8(*args, 10.0, out)
    assert_experts_close(out, r, T)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("T", [1, 16])
def test_moe_experts_w4a8_split_k(T, splits):
    """Both GEMMs split over K (up: 16 K blocks of 64, down: 8) or not, as the decode path runs
    them (the default, fp4_splits, splits the up GEMM in 2 and the down one not at these K)."""
    from custom_ops.triton.moe_w4a8 import triton_moe_experts_w4a8
    args, r, out = experts_case(T)
    triton_moe_experts_w4a8(*args, 10.0, out, splits=splits)
    assert_experts_close(out, r, T)


@pytest.mark.parametrize("path", ["gemv", "tiles"])
@pytest.mark.parametrize("T", [1, 16, 2048])
def test_moe_experts_w4a8_paths(T, path):
    """Each expert path at every width, whatever the default picks there: the FP4 GEMVs and the
    tiles dequantized to bf16 (their PTX code paths included)."""
    from custom_ops.triton.moe_w4a8 import triton_moe_experts_w4a8
    args, r, out = experts_case(T)
    triton_moe_experts_w4a8(*args, 10.0, out, path=path)
    assert_experts_close(out, r, T)


@pytest.mark.parametrize("kw", [{"splits": 4}, {"splits": 4, "num_stages": 1}, {"num_stages": 1}],
                         ids=["split4", "split4-unpipelined", "unpipelined"])
@pytest.mark.parametrize("T", [6, 96])
def test_moe_experts_w4a8_tiles_knobs(T, kw):
    """The 'tiles' path split over K and/or unpipelined (the knobs `native_gemm_bench
    --slice-experts` times) at a verify step's widths, compiled for sm_90 with its PTX."""
    from custom_ops.triton.moe_w4a8 import triton_moe_experts_w4a8
    args, r, out = experts_case(T)
    triton_moe_experts_w4a8(*args, 10.0, out, path="tiles", **kw)
    assert_experts_close(out, r, T)


def assert_experts_close(out, r, T):
    assert not out.isnan().any()
    if T > 1:
        assert (out[0] == 0).all()
    row = (out - r).double().norm(dim=1) / r.double().norm(dim=1).clamp(min=1e-30)
    live = slice(int(T > 1), None)
    assert (row[live] <= 1e-2).float().mean() >= 0.75       # bf16 roundings of g, u, h, y
    assert float((out - r).double().norm() / r.double().norm()) < 2e-2


def test_native_linear_in_the_model():
    """Linear on a native weight (what prepare_weights builds on CUDA) vs the dequantized one."""
    from v41.layers import Linear
    g = torch.Generator().manual_seed(1)
    q, s = quant.quant_fp8_block(torch.randn(2304, 5120, generator=g) * 0.02)
    x = torch.randn(16, 5120, generator=g).to(DEV, torch.bfloat16)
    nat = Linear(quant.BlockScaled(q, s).to(DEV), "fp8")(x)
    deq = Linear(quant.dequant_fp8_block(q, s, torch.bfloat16).to(DEV), "fp8")(x)
    assert float((nat.double() - deq.double()).norm() / deq.double().norm()) < 4e-3
