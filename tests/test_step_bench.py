"""benchmarks/step_bench.py's --knob-variants: the module constants a variant's graphs are
captured under are set inside the block and restored after it, also when it fails; a name the
module lacks is refused before anything is set."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from benchmarks.step_bench import module_constants  # noqa: E402
from custom_ops.triton import fp8_gemm, moe_gemv  # noqa: E402


def test_module_constants_set_and_restore():
    before = (fp8_gemm.GEMV_TMA, moe_gemv.FP4_TMA_STAGES)
    with pytest.raises(RuntimeError, match="inside"):
        with module_constants({"custom_ops.triton.fp8_gemm.GEMV_TMA": not before[0],
                               "custom_ops.triton.moe_gemv.FP4_TMA_STAGES": 4}):
            assert (fp8_gemm.GEMV_TMA, moe_gemv.FP4_TMA_STAGES) == (not before[0], 4)
            raise RuntimeError("inside")
    assert (fp8_gemm.GEMV_TMA, moe_gemv.FP4_TMA_STAGES) == before


def test_module_constants_refuse_an_unknown_name():
    before = fp8_gemm.GEMV_TMA
    with pytest.raises(ValueError, match="has no GEMV_TMAX"):
        with module_constants({"custom_ops.triton.fp8_gemm.GEMV_TMA": not before,
                               "custom_ops.triton.fp8_gemm.GEMV_TMAX": True}):
            pass
    assert fp8_gemm.GEMV_TMA == before
