"""The native GEMM benchmarks' dry runs (benchmarks/native_gemm_bench.py and its modes,
benchmarks/experts_profile.py): each runs its timed paths on tiny CPU shapes under the Triton
interpreter in a fresh process, prints its JSON and writes no file. The kernels themselves are
tests/test_native_gemm.py's."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def dry_run(tmp_path, script: str, *args) -> dict:
    """benchmarks/<script> --dry-run in a fresh interpreter: the JSON it prints (it writes no file)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dest = tmp_path / "out.json"
    r = subprocess.run([sys.executable, f"benchmarks/{script}", "--dry-run", "--out", str(dest), *args],
                       cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert not dest.exists()
    return json.loads(r.stdout)


# the experts' paths at each width, and past one token the tensor-core GEMVs a pair a program
SLICE_ROWS = [(1, "gemv", None), (1, "mma", None), (1, "tiles", None),
              (6, "gemv", None), (6, "mma", None), (6, "tiles", None), (6, "mma", 1)]


def test_bench_dry_run(tmp_path):
    """benchmarks/native_gemm_bench.py --dry-run runs every timed path (both GEMMs, wo_a grouped
    and per group, cuBLAS bf16, _scaled_mm, the copy and read rates, the experts' 'tiles' path, a prefill tile) on
    tiny CPU shapes, prints its JSON and writes no file."""
    res = dry_run(tmp_path, "native_gemm_bench.py")
    plain = [row for row in res["dense"] if row["gemm"] == "tiny"]
    assert [row["M"] for row in plain] == [1, 3, 40]
    assert [("linear_us" in row, "quant_then_gemm_us" in row) for row in plain] == [(True, True)] * 2 + [(False,) * 2]
    assert [(row["gemm"], row["M"]) for row in res["dense"] if "groups" in row] == [
        ("wo_a_grouped", 1), ("wo_a_per_group", 1), ("wo_a_grouped", 3), ("wo_a_per_group", 3)]
    assert [row["M"] for row in res["experts"] if "path" not in row] == [1, 3, 40]
    assert [(row["M"], row["path"], row.get("mma_cols")) for row in res["experts"] if "path" in row] == SLICE_ROWS
    assert "scaled_mm_us" in plain[-1] and res["fp8_peak_TFLOPs"] > 0
    assert all(row["us"] > 0 and row["weight_bytes"] > 0 for row in res["dense"] + res["experts"] + res["sweep"])
    assert [(row["gemm"], row["M"]) for row in res["sweep"]] == [("tiny", 1), ("tiny", 40), ("experts_w4a8", 1),
                                                                 ("experts_w4a8", 40)]
    assert [row["knobs"] for row in res["sweep"][2:]] == [{"path": "tiles"}, {"path": "tiles"}]
    assert res["sweep"][1]["knobs"] == {"path": "bf16"}        # the prefill sweep's last: the MMA on bf16 values
    # one row: the MMA tiles where the GEMV is the default, on codes and from bf16 x
    assert res["sweep"][0]["knobs"] == {"path": "mma"} and res["sweep"][0]["linear_us"] > 0
    assert res["read_rate_TBps"] > 0
    assert all(row["pct_read"] > 0 for row in res["dense"] + res["experts"] + res["sweep"])


def test_bench_one_row(tmp_path):
    """--one-row: the dense GEMMs at one row and their sweep, nothing else (a short device call);
    --knobs: the sweep's knobs given instead; --dense-widths: other widths than one row."""
    res = dry_run(tmp_path, "native_gemm_bench.py", "--one-row", "--knobs", '[{"path": "gemv", "split_k": 2}]')
    assert [(row["gemm"], row["M"]) for row in res["dense"]] == [("tiny", 1)]
    assert not res["experts"] and [(row["gemm"], row["M"], row["knobs"]) for row in res["sweep"]] == \
        [("tiny", 1, {"path": "gemv", "split_k": 2})]
    assert res["dense"][0]["pct_read"] > 0 and res["sweep"][0]["linear_us"] > 0
    res = dry_run(tmp_path, "native_gemm_bench.py", "--one-row", "--dense-widths", "1,3")     # --dense-widths
    assert [(row["gemm"], row["M"]) for row in res["dense"]] == [("tiny", 1), ("tiny", 3)]


def test_gemv_chain_dry_run(tmp_path):
    """benchmarks/gemv_chain_bench.py --dry-run: a layer's chain of producers and GEMVs (the norm
    with the act quant, the act-quant kernel, a GEMV whose epilogue writes the next one's codes)
    under each knob variant and without dependent launch, at 3 rows (the MMA kernel) at the
    defaults, and each GEMV alone."""
    res = dry_run(tmp_path, "gemv_chain_bench.py", "--rows", "1,3")
    assert [r["codes_from"] for r in res["chain"]] == ["norm", "quant", "epilogue"]
    chained = [r for r in res["rows"] if "knobs" in r]
    assert [(r["M"], r["knobs"], r["pdl"]) for r in chained] == [
        (1, {}, True), (1, {"prefetch": True}, True), (1, {"prefetch": True, "num_warps": 8}, True),
        (1, {"num_warps": 8}, True), (3, {}, True), (1, {}, False)]
    assert all(r["us_a_layer"] > 0 and r["of_floor"] > 0 for r in chained)
    assert [r["alone"] for r in res["rows"] if "alone" in r] == ["a", "o", "b"]


def test_bench_slice_experts(tmp_path):
    """--slice-experts: flash-slice's expert paths at its widths (two on the CPU: 'gemv', 'mma',
    'tiles', and 'mma' a pair a program past one token) and the 'tiles' path with its sweep's
    knobs (two on the CPU), nothing else (a short device call)."""
    res = dry_run(tmp_path, "native_gemm_bench.py", "--slice-experts")
    assert [(row["M"], row["path"], row.get("mma_cols")) for row in res["experts"]] == SLICE_ROWS
    assert [(row["M"], row["knobs"]) for row in res["sweep"]] == \
        [(T, {"path": "tiles", **kw}) for T in (1, 6) for kw in ({"num_stages": 1}, {"num_stages": 2})]
    assert all(row["us"] > 0 and row["pct_read"] > 0 for row in res["experts"] + res["sweep"])


def test_experts_profile_dry_run(tmp_path):
    """benchmarks/experts_profile.py --dry-run profiles the expert chain on tiny CPU shapes."""
    res = dry_run(tmp_path, "experts_profile.py", "--widths", "1,3", "--calls", "2")
    assert [w["tokens"] for w in res["widths"]] == [1, 3]
    assert all(w["kernels_us"] and w["kernels_sum_us"] > 0 and w["graph_us"] > 0 for w in res["widths"])
