"""The quantizers as Inductor compiles them for the GPU (run on the H200 with `pytest -m gpu
tests/test_compile_gpu.py`): each quantizer, alone and fed by RMSNorm, compiled with a dynamic
token dim (benchmarks/compile_configs.py). Every autotuned kernel's candidate launch configs must
agree: bit for bit in the quantizers, to FP32 summation order in RMSNorm's mean (measured 4.6e-8).
The old frexp form of the quantizer failed this by up to 117 (compile-quant-configs-h200.json).

Against eager: a quantizer alone matches on all but a few elements (FP4 with an E4M3 scale
divides by the scale, and Triton's FP32 division is not correctly rounded: 0.04% of elements
moved one FP4 step); after RMSNorm, the norm's own last-bit differences move FP8/FP4 roundings
(measured up to 3% of elements, rel_l2 0.04).
"""
from __future__ import annotations

import pytest
import torch

from benchmarks.compile_configs import CASES, inputs, run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fused", [False, True], ids=["alone", "after_rms_norm"])
@pytest.mark.parametrize("name", [n for n in CASES if not n.startswith("frexp")])
def test_compiled_quant_does_not_depend_on_launch_config(name, fused):
    seed = torch.seed() % 2**31
    gen = torch.Generator().manual_seed(seed)
    w = (torch.rand(64, generator=gen) + 0.5).to(torch.bfloat16).cuda()
    row = run(name, CASES[name], fused, inputs(200, 64, gen), w)
    print(seed, row)
    assert row["autotuned_kernels"] > 0
    assert row["worst_config_spread"] < 1e-6, row["config_dependent_kernels"]
    if fused:
        assert row["compiled_vs_eager_rel_l2"] < 0.1
    else:
        assert row["elements_differing"] < 2e-3
