"""custom_ops/triton/overlap.py on a GPU (`pytest -m gpu`): flash-slice's routed experts at one and
six tokens, native (FP4) and dequantized (bf16), forked onto the second stream while the first
runs the shared expert's split-K FP8 GEMVs (each stream with its own arrival counters), joined;
every output equals, bit for bit, the same ops run one after the other on one stream, eagerly
and replayed from a CUDA graph on new inputs (the graph holds the experts as a branch beside
the GEMVs)."""
from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import fp8_gemm_case, require_compiled_kernels, w4a8_case

pytestmark = pytest.mark.gpu

require_compiled_kernels()

import custom_ops.triton  # noqa: E402,F401  (registers the CUDA impls)
from custom_ops.registry import selected  # noqa: E402
from v41 import quant  # noqa: E402

ops = torch.ops.v41
E, K_TOP, D, I = 16, 6, 5120, 2304


# format -> (the experts' op, its fork)
OPS = {"native": ("moe_experts_w4a8", "moe_experts_w4a8_fork"), "dequant": ("moe_experts", "moe_experts_fork")}


@pytest.fixture(scope="module")
def expert_weights():
    """(native: w1, s1, w3, s3, w2, s2; dequant: w1, w3, w2 in bf16) on the GPU, made once."""
    w1, s1, w3, s3, w2, s2 = (a.cuda() for a in w4a8_case(torch.Generator().manual_seed(0), 1, E, D, I, K_TOP)[3:])
    dequant = [quant.dequant_fp4_expert(w, s, torch.bfloat16) for w, s in ((w1, s1), (w3, s3), (w2, s2))]
    return {"native": [w1, s1, w3, s3, w2, s2], "dequant": dequant}


def _activations(g, T):
    """The experts' x, ids and weights and the shared GEMVs' (codes, scales) of their inputs."""
    _, ids, wts = w4a8_case(g, T, E, 32, 32, K_TOP, dtype=torch.bfloat16, pad_token=False)[:3]
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    return [a.cuda() for a in (x, ids, wts, *fp8_gemm_case(g, T, 32, D)[:2], *fp8_gemm_case(g, T, 32, I)[:2])]


def _inputs(g, T, weights):
    x, ids, wts, xq1, xs1, xq2, xs2 = _activations(g, T)
    w13, ws13 = (a.cuda() for a in fp8_gemm_case(g, 1, 2 * I, D)[2:])
    w2, ws2 = (a.cuda() for a in fp8_gemm_case(g, 1, D, I)[2:])
    return [x, ids, wts, *weights], [xq1, xs1, w13, ws13, xq2, xs2, w2, ws2]


def _layer(experts, shared, fmt: str, fork: bool):
    """The experts' sum plus the two shared GEMVs' outputs (the second on the first's rows only
    to keep its K): forked and joined, or in order."""
    xq1, xs1, w13, ws13, xq2, xs2, w2, ws2 = shared
    T = experts[0].shape[0]
    y = torch.empty(T, D, device="cuda")
    a = torch.empty(T, 2 * I, dtype=torch.bfloat16, device="cuda")
    b = torch.empty(T, D, dtype=torch.bfloat16, device="cuda")
    plain, forked = (getattr(ops, name) for name in OPS[fmt])
    if fork:
        forked(*experts, 10.0, y, xq1)
    else:
        plain(*experts, 10.0, y)
    ops.fp8_block_gemm(xq1, xs1, w13, ws13, a)
    ops.fp8_block_gemm(xq2, xs2, w2, ws2, b)
    if fork:
        ops.join(y, [experts[0], experts[1], experts[2], a, b])
    return y + b.float(), a


@pytest.mark.parametrize("fmt", list(OPS))
@pytest.mark.parametrize("T", [1, 6])
def test_fork_equals_in_order_eager_and_graphed(g, T, fmt, expert_weights):
    assert all(selected()[f"v41::{op}"]["cuda"] == "triton" for op in (*OPS[fmt], "join", "fp8_block_gemm"))
    experts, shared = _inputs(g, T, expert_weights[fmt])
    ref = _layer(experts, shared, fmt, fork=False)
    got = _layer(experts, shared, fmt, fork=True)
    torch.cuda.synchronize()
    assert not ref[0].isnan().any() and all(torch.equal(r, o) for r, o in zip(ref, got))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _layer(experts, shared, fmt, fork=True)
    for _ in range(3):           # new activations and routing in the captured buffers
        for old, new in zip(experts[:3] + shared[:2] + shared[4:6], _activations(g, T)):
            old.copy_(new)
        graph.replay()
        ref = _layer(experts, shared, fmt, fork=False)
        torch.cuda.synchronize()
        assert all(torch.equal(r, o) for r, o in zip(ref, out))
