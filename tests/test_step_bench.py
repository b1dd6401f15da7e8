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


def test_knob_variant_steps_run_with_its_constants(monkeypatch):
    """run_cases: a knob variant's steps (prefill included, which no captured graph holds) see its
    constants; the other variants' see the module's own values."""
    from types import SimpleNamespace

    from benchmarks import step_bench as sb
    seen = []
    monkeypatch.setattr(sb, "step_floor", lambda *a: {})
    monkeypatch.setattr(sb, "held_state_bytes", lambda *a: 0)
    monkeypatch.setattr(sb, "decode_ms", lambda *a: (seen.append(("decode", fp8_gemm.BF16_M)), (1.0, 1.0, None, {}))[1])
    monkeypatch.setattr(sb, "prefill_ms", lambda *a: (seen.append(("prefill", fp8_gemm.BF16_M)), (1.0, 1.0, {}, {}))[1])
    eng = SimpleNamespace(runner=SimpleNamespace(model=None, cache=SimpleNamespace(geo=None)))
    res, default = {"results": []}, fp8_gemm.BF16_M
    sb.run_cases(eng, [("decode", 1, 8), ("prefill", 1, 8)], ["full", "mma"], lambda v: None, 1, res,
                 lambda: None, {"mma": {"custom_ops.triton.fp8_gemm.BF16_M": 1 << 30}})
    assert seen == [("decode", default), ("decode", 1 << 30), ("prefill", default), ("prefill", 1 << 30)]
    assert [r["variant"] for r in res["results"]] == ["full", "mma", "full", "mma"] and fp8_gemm.BF16_M == default
