"""custom_ops/triton/overlap.py on a GPU (`pytest -m gpu`): flash-slice's routed experts at one and
six tokens forked onto the second stream while the first runs the shared expert's split-K FP8
GEMVs (each stream with its own arrival counters), joined; every output equals, bit for bit, the
same ops run one after the other on one stream, eagerly and replayed from a CUDA graph on new
inputs (the graph holds the experts as a branch beside the GEMVs)."""
from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import fp8_gemm_case, require_compiled_kernels, w4a8_case

pytestmark = pytest.mark.gpu

require_compiled_kernels()

import custom_ops.triton  # noqa: E402,F401  (registers the CUDA impls)
from custom_ops.registry import selected  # noqa: E402

ops = torch.ops.v41
E, K_TOP, D, I = 16, 6, 5120, 2304


def _inputs(g, T):
    experts = [a.cuda() for a in w4a8_case(g, T, E, D, I, K_TOP, dtype=torch.bfloat16, pad_token=False)]
    shared = [a.cuda() for a in fp8_gemm_case(g, T, 2 * I, D)] + [a.cuda() for a in fp8_gemm_case(g, T, D, I)]
    return experts, shared


def _layer(experts, shared, fork: bool):
    """The experts' sum plus the two shared GEMVs' outputs (the second on the first's rows only
    to keep its K): forked and joined, or in order."""
    xq1, xs1, w13, ws13, xq2, xs2, w2, ws2 = shared
    T = experts[0].shape[0]
    y = torch.empty(T, D, device="cuda")
    a = torch.empty(T, 2 * I, dtype=torch.bfloat16, device="cuda")
    b = torch.empty(T, D, dtype=torch.bfloat16, device="cuda")
    if fork:
        ops.moe_experts_w4a8_fork(*experts, 10.0, y, xq1)
    else:
        ops.moe_experts_w4a8(*experts, 10.0, y)
    ops.fp8_block_gemm(xq1, xs1, w13, ws13, a)
    ops.fp8_block_gemm(xq2, xs2, w2, ws2, b)
    if fork:
        ops.join(y, [experts[0], experts[1], experts[2], a, b])
    return y + b.float(), a


@pytest.mark.parametrize("T", [1, 6])
def test_fork_equals_in_order_eager_and_graphed(g, T):
    assert all(selected()[f"v41::{op}"]["cuda"] == "triton"
               for op in ("moe_experts_w4a8_fork", "join", "moe_experts_w4a8", "fp8_block_gemm"))
    experts, shared = _inputs(g, T)
    ref = _layer(experts, shared, fork=False)
    got = _layer(experts, shared, fork=True)
    torch.cuda.synchronize()
    assert not ref[0].isnan().any() and all(torch.equal(r, o) for r, o in zip(ref, got))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _layer(experts, shared, fork=True)
    for _ in range(3):           # new activations and routing in the captured buffers
        _, ids, wts = w4a8_case(g, T, E, 32, 32, K_TOP, dtype=torch.bfloat16, pad_token=False)[:3]
        experts[0].copy_(torch.randn(T, D, generator=g).to(torch.bfloat16))
        experts[1].copy_(ids)
        experts[2].copy_(wts)
        for xq, xs, K in ((shared[0], shared[1], D), (shared[4], shared[5], I)):
            q, s = fp8_gemm_case(g, T, 32, K)[:2]
            xq.copy_(q)
            xs.copy_(s)
        graph.replay()
        ref = _layer(experts, shared, fork=False)
        torch.cuda.synchronize()
        assert all(torch.equal(r, o) for r, o in zip(ref, out))
