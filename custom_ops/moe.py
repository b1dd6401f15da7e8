"""Routing and routed experts (spec §3.4). Routing: sqrt-softplus scores, experts chosen on the
biased scores (ties to the smaller expert id), weighted by the unbiased ones, normalized and
scaled (the reference impl is v41.moe_route.route, the function MoE.route runs). Experts: W4A8
SwiGLU experts with the clamp, routing weight applied before the down projection's activation
quant, outputs accumulated in ascending expert id."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from custom_ops.registry import define
from v41 import quant
from v41.moe_route import route


@define("moe_experts(Tensor x, Tensor ids, Tensor weights, Tensor w1, Tensor w3, Tensor w2, "
        "float limit, Tensor(a!) out) -> ()")
def moe_experts(x, ids, weights, w1, w3, w2, limit, out) -> None:
    """x [T, D]; ids/weights [T, k] (ids -1 for padding); w1/w3 [E, I, D], w2 [E, D, I]
    dequantized; out [T, D] (accumulation dtype) <- sum of the selected experts' outputs."""
    out.zero_()
    acc = out.dtype
    # FP8 groups run along a row, so quantizing every row once equals quantizing each expert's
    # rows; the down projection's inputs are likewise quantized together (one call, not one
    # per expert: on the CPU a quant costs per call, not per row)
    xq = quant.fp8_qat(x)
    experts = torch.unique(ids[ids >= 0]).tolist()
    rows = [(ids == e).nonzero(as_tuple=True) for e in experts]
    h = []
    for e, (t, slot) in zip(experts, rows):
        g = quant.matmul(xq[t], w1[e].T).to(acc)
        u = quant.matmul(xq[t], w3[e].T).to(acc).clamp(-limit, limit)
        h.append(F.silu(g.clamp(max=limit)) * u * weights[t, slot, None].to(acc))
    if not h:
        return
    hq = quant.fp8_qat(torch.cat(h).to(x.dtype)).split([len(t) for t, _ in rows])
    for e, (t, _), he in zip(experts, rows, hq):
        out.index_add_(0, t, quant.matmul(he, w2[e].T).to(acc))


@define("moe_route(Tensor x, Tensor gate, Tensor bias, int top_k, float route_scale, "
        "Tensor(a!) ids, Tensor(b!) weights) -> ()")
def moe_route(x, gate, bias, top_k, route_scale, ids, weights) -> None:
    """x [T, D]; gate [E, D], bias [E] (accumulation dtype); ids [T, top_k] (int64),
    weights [T, top_k] (gate's dtype) <- MoE.route(x)."""
    i, w = route(x, gate, bias, top_k, route_scale)
    ids.copy_(i)
    weights.copy_(w)
