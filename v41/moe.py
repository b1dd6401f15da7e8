"""Mixture of experts (spec §3.4): sqrt-softplus router with a selection bias (v41.moe_route),
W4A8 routed experts (the `v41::moe_experts` op on dequantized experts, `v41::moe_experts_w4a8`
on native FP4 ones) and one FP8 shared expert."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import custom_ops  # noqa: F401
from v41 import quant
from v41.layers import Linear, acc_dtype, stack_rows
from v41.moe_route import route
from v41.parallel import tensor_parallel

ops = torch.ops.v41


class MoE(nn.Module):
    def __init__(self, w: dict, top_k: int, route_scale: float, limit: float):
        super().__init__()
        self.gate = w["gate"]                      # accumulation dtype (FP32 router)
        self.bias = w["gate.bias"]
        self.w1, self.w3, self.w2 = w["experts.w1"], w["experts.w3"], w["experts.w2"]
        self.native = isinstance(self.w1, quant.BlockScaled)
        if self.native:   # plain tensors on the module: packed E2M1 codes and their E8M0 scales
            (self.w1, self.s1), (self.w3, self.s3), (self.w2, self.s2) = (
                (t.q, t.scale) for t in (self.w1, self.w3, self.w2))
        # the shared expert's gate and up projections share their input: one GEMM, rows w1 then w3
        self.s_w13 = Linear(stack_rows(w["shared_experts.w1"], w["shared_experts.w3"]), "fp8")
        self.s_w2 = Linear(w["shared_experts.w2"], "fp8")
        self.top_k, self.route_scale, self.limit = top_k, route_scale, limit
        # tensor parallelism (v41.parallel): this rank's whole experts [first, first + n_local)
        # and/or its rows of the shared expert; the partial sums are all-reduced
        n_experts, self.n_local = self.gate.shape[0], w["experts.w1"].shape[0]
        shared_split = w["shared_experts.w1"].shape[0] < w["experts.w1"].shape[1]
        tp = tensor_parallel()
        self.first = tp.rank * self.n_local if self.n_local < n_experts else None
        self.tp = tp if self.first is not None or shared_split else None
        self.shared_here = shared_split or self.tp is None or tp.rank == 0   # a replicated one counts once

    def route(self, x):
        """(ids, weights) of the experts each token goes to (v41.moe_route.route)."""
        return route(x, self.gate, self.bias, self.top_k, self.route_scale)

    def forward(self, x):
        acc = acc_dtype(x.dtype)
        ids, w = self.route(x)
        if self.first is not None:      # other ranks' experts: -1, which the expert ops skip
            ids = ids - self.first
            ids = ids.masked_fill((ids < 0) | (ids >= self.n_local), -1)
        y = torch.empty(x.shape, dtype=acc, device=x.device)
        if self.native:
            ops.moe_experts_w4a8(x, ids, w, self.w1, self.s1, self.w3, self.s3, self.w2, self.s2,
                                 self.limit, y)
        else:
            ops.moe_experts(x, ids, w, self.w1, self.w3, self.w2, self.limit, y)
        if self.shared_here:
            g, u = self.s_w13(x).to(acc).chunk(2, -1)
            g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
            y = y + self.s_w2((F.silu(g) * u).to(x.dtype)).to(acc)
        return (y if self.tp is None else self.tp.all_reduce(y)).to(x.dtype)
