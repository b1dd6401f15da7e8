"""benchmarks/fp4_mma_probe.py on a GPU (`pytest -m gpu`): the probe's rows against float64.
Its group step's PTX is checked on the CPU by tests/test_ptx.py's warp emulator, which follows
the PTX ISA's fragment layouts; this runs the hardware's mma.sync on the same scheme. The
bound: γ_K·S (S = Σ|terms|: the products are exact, the FP32 sums' order differs) plus, as
tests/test_native_gemm_gpu.py allows its FP8 MMA, 2^-13·S for the tensor cores' own
accumulation, an assumption this run checks (the failure prints the worst ratio)."""
from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import gamma, require_compiled_kernels
from v41 import quant

pytestmark = pytest.mark.gpu

require_compiled_kernels()


@pytest.mark.parametrize("K", [128, 2304])
def test_fp4_mma_probe_rows_equal_float64(g, K):
    """128 rows of packed E2M1 weights with E8M0 scales against an activation exact in f16:
    every row written, its sum within the module's bound of float64's."""
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
    err, S = (y.cpu().double() - terms.sum(1)).abs(), terms.abs().sum(1)
    assert not y.isnan().any()
    assert (err <= (gamma(K) + 2.0**-13) * S + 1e-30).all(), f"worst err / S: {(err / S).max():.3g}"
