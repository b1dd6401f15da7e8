"""Programmatic dependent launch on the GPU (run on the H100/H200 with
`pytest -m gpu tests/test_pdl_gpu.py`): a chain of v41 kernels, each reading at once what the one
before wrote, gives the same bits launched with it and without it, eager and replayed from a
CUDA graph. Before every run each buffer of the chain is poisoned with NaN, outside the graph, so
a kernel that read its input before the kernel writing it had finished would carry a NaN or
another value to the end. The split-K GEMVs share their arrival counters along the chain, so a
launch that ran ahead of the previous one's reset would show as well."""
from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import fp8_gemm_case, require_compiled_kernels

pytestmark = pytest.mark.gpu

require_compiled_kernels()

import custom_ops  # noqa: E402,F401
import custom_ops.triton  # noqa: E402,F401  (registers the CUDA impls)
from custom_ops.triton import common  # noqa: E402
from custom_ops.triton.fp8_gemm import triton_fp8_linear  # noqa: E402
from custom_ops.triton.norm import triton_rms_norm  # noqa: E402

DEV = "cuda"
D = 5120
# GEMVs of Flash's widths (one row: the chain's input is each GEMV's x), three times over
SHAPES = [(D, D), (16384, D), (D, 16384), (1280, D), (D, 1280)] * 3


def chain(x, layers):
    """x -> GEMV -> RMS norm -> GEMV -> ...; every output into the layer's own buffers."""
    h = x
    for w, ws, norm_w, y, n in layers:
        triton_fp8_linear(h, w, ws, y)
        triton_rms_norm(y, norm_w, 1e-6, n)
        h = n
    return h


def poison(layers):
    for *_, y, n in layers:
        y.fill_(float("nan"))
        n.fill_(float("nan"))


def run(monkeypatch, pdl_on: bool, graph: bool, x, layers) -> list:
    """The chain's outputs: one eager run, or 20 replays of a captured graph, each after poisoning."""
    monkeypatch.setattr(common, "_pdl", {torch.cuda.current_device(): pdl_on})
    if not graph:
        poison(layers)
        return [chain(x, layers).clone()]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(x, layers)                                 # compiled and warm before the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain(x, layers)
    outs = []
    for _ in range(20):
        poison(layers)
        g.replay()
        outs.append(out.clone())
    torch.cuda.synchronize()
    return outs


def test_a_dependent_chain_gives_the_same_bits_with_and_without_pdl(monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9 or common.gdc_wait is None:
        pytest.skip("programmatic dependent launch needs sm_90 and a Triton with grid dependency control")
    g = torch.Generator().manual_seed(0)
    layers = []
    for n, k in SHAPES:
        _, _, w, ws = fp8_gemm_case(g, 1, n, k, device=DEV)
        norm_w = torch.rand(n, generator=g).add(0.5).bfloat16().to(DEV)
        layers.append((w, ws, norm_w, *(torch.empty(1, n, dtype=torch.bfloat16, device=DEV) for _ in range(2))))
    x = torch.randn(1, D, generator=g).bfloat16().to(DEV)
    (want,) = run(monkeypatch, False, False, x, layers)
    assert not want.isnan().any()
    assert torch.equal(run(monkeypatch, True, False, x, layers)[0], want)
    for pdl_on in (False, True):
        for got in run(monkeypatch, pdl_on, True, x, layers):
            assert torch.equal(got, want), pdl_on
