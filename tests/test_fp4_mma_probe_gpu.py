"""benchmarks/fp4_mma_probe.py on a GPU (`pytest -m gpu`): the probe's rows against float64.
Its group step's PTX is checked on the CPU by tests/test_ptx.py's warp emulator, which follows
the PTX ISA's fragment layouts; this runs the hardware's mma.sync on the same scheme."""
from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import gamma
from v41 import quant

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("K", [128, 2304])
def test_fp4_mma_probe_rows_equal_float64(g, K):
    """128 rows of packed E2M1 weights with E8M0 scales against an activation exact in f16:
    every row's sum within γ_K of float64's Σ|terms| (the products are exact, only the FP32
    sums' order and rounding differ), every row written."""
    from benchmarks.fp4_mma_probe import WARPS, _fp4_mma_down, lane_words
    N = 128
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    scales = torch.randint(118, 131, (N, K // 32), generator=g, dtype=torch.uint8)
    x = torch.randint(-8, 9, (K,), generator=g) * torch.pow(2.0, torch.randint(-6, 4, (K,), generator=g))
    w = quant.e2m1_decode(codes, torch.float64) * quant.e8m0_decode(scales, torch.float64).repeat_interleave(32, 1)
    terms = w * x.double()
    words = quant.pack_fp4(codes).view(torch.int32).cuda()
    y = torch.full((N,), float("nan"), device="cuda")
    _fp4_mma_down[(N // 64, 1)](lane_words(x).cuda(), words, scales.cuda(), y, K, words.stride(0),
                                scales.stride(0), LANES=32 * WARPS, num_warps=WARPS)
    err = (y.cpu().double() - terms.sum(1)).abs()
    assert not y.isnan().any()
    assert (err <= gamma(K) * terms.abs().sum(1) + 1e-30).all(), err.max()
