"""custom_ops/triton/fp4_mma.py on a GPU (`pytest -m gpu`): the FP4 expert GEMVs on tensor cores at
flash-slice's widths (16 experts, top-6, D = 5120, I = 2304), outputs NaN-poisoned.

Its group step's PTX is checked on the CPU by tests/test_ptx.py's warp emulator, which follows the
PTX ISA's fragment layouts; this runs the hardware's mma.sync. The down GEMV's rows are bounded
against float64 on the same h: γ_I·S (S = Σ|products|; every product is exact, FP32 sums' order
differs) plus 2^-13·S for the tensor cores' own sum of 16 products, as tests/test_native_gemm_gpu.py
allows its FP8 MMA: an assumption this run checks (the failure prints the worst ratio)."""
from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import gamma, require_compiled_kernels, w4a8_case

pytestmark = pytest.mark.gpu

require_compiled_kernels()

import custom_ops  # noqa: E402,F401
from custom_ops import gemm as ref  # noqa: E402
from custom_ops.triton import triton_moe_experts_w4a8  # noqa: E402
from custom_ops.triton.moe import run_experts  # noqa: E402
from v41 import quant  # noqa: E402

E, K_TOP, D, I = 16, 6, 5120, 2304


def cuda(args):
    return tuple(a.cuda() for a in args)


@pytest.mark.parametrize("T,cols", [(1, None), (5, None), (5, 1)])
def test_fp4_mma_down_rows_within_bound(g, T, cols):
    """Each pair's y row against its own h (MMA form, read back) · w2[e] in float64: one pair a
    program, and eight (tiles of one expert's pairs, each a column of the MMAs)."""
    args = cuda(w4a8_case(g, T, E, D, I, K_TOP, dtype=torch.bfloat16, pad_token=False))
    x, ids, wts, w1, s1, w3, s3, w2, s2 = args
    got: list = []
    run_experts(x, ids, wts, w1, w3, w2, tuple(s.view(torch.uint8) for s in (s1, s3, s2)), 1.0e4,
                torch.empty(T, D, device="cuda"), mma=True, mma_cols=cols, hidden=got)
    h, order, y = got
    pairs = ids.reshape(-1)[order.long()]
    valid = pairs >= 0
    w2d = quant.dequant_fp4_expert(w2, s2, torch.float64)[pairs[valid].long()]       # [P, D, I]
    hd = h.double()[valid]
    exact = torch.einsum("pi,pdi->pd", hd, w2d)
    S = torch.einsum("pi,pdi->pd", hd.abs(), w2d.abs())
    yv = y.double()[order.long()][valid]
    assert not yv.isnan().any()
    # y is rounded to bf16: half an ulp of the result on top
    err = (yv - exact).abs() - exact.abs() * 2.0**-8
    assert (err <= (gamma(I) + 2.0**-13) * S + 1e-30).all(), f"worst err / S: {(err / S).max():.3g}"


@pytest.mark.parametrize("T", [1, 6, 16])
def test_fp4_mma_path_meets_reference_and_gemvs(g, T):
    """The whole op on path 'mma' against the reference and the CUDA-core GEMVs ('gemv'): an
    FP32 reordering moves a rare element of h by one E4M3 step, so most rows match closely and
    all of them within 2e-2 (token 0 all padding past one token)."""
    pad = T > 1                         # token 0 all padding, but not the only token
    args = cuda(w4a8_case(g, T, E, D, I, K_TOP, dtype=torch.bfloat16, pad_token=pad))
    r = torch.empty(T, D, device="cuda")
    ref.moe_experts_w4a8(*args, 1.0e4, r)
    outs = {}
    for path in ("mma", "gemv"):
        outs[path] = torch.full((T, D), float("nan"), device="cuda")
        triton_moe_experts_w4a8(*args, 1.0e4, outs[path], path=path)
    for path, out in outs.items():
        assert not out.isnan().any(), path
        row_err = (out - r).double().norm(dim=1) / r.double().norm(dim=1).clamp(min=1e-30)
        assert (row_err[int(pad):] <= 1e-2).float().mean() >= 0.75, path
        assert float((out - r).double().norm() / r.double().norm()) < 2e-2, path
