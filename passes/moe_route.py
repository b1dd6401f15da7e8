"""The MoE router (spec §3.4) -> `v41::moe_route`; the routed experts are already one op
(`v41::moe_experts`), which this pass leaves alone.

`v41.moe_route.route` (what `MoE.route` runs): FP32 scores of the router GEMM, sqrt(softplus), a
stable descending sort of the biased scores for the top-k ids (ties to the smaller expert id),
the unbiased scores of those experts, normalized and scaled. f32 shown, 8 experts, top 2:

    before:
        s = sqrt(softplus(mm(x, permute(gate))))            # softplus: where(mul(s,1) > 20, ...)
        srt = sort.stable(add(s, bias), stable=True, dim=-1, descending=True)
        ids = slice(srt[1], 1, 0, 2)
        w = gather(s, 1, ids); w = mul(div(w, add(sum(w, [-1], True), 1e-20)), 1.5)
        moe_experts(x, ids, w, ...)
    after:
        af = auto_functionalized(v41.moe_route, x=x, gate=gate, bias=bias, top_k=2,
                                 route_scale=1.5, ids=empty([s0, 2], int64), weights=empty([s0, 2]))
        ids, w = af[1], af[2]
        moe_experts(x, ids, w, ...)
"""
from __future__ import annotations

import torch

from passes.base import PatternPass, call, rand
from v41.moe_route import route as moe_route


class MoERoute(PatternPass):
    name = "moe_route"
    ops = ("moe_route",)

    def register(self, pm):
        cfg, dt, acc = self.cfg, self.dtype, self.acc
        E = cfg.n_routed_experts
        # backbone layers route with num_experts_per_tok (draft stages are not in these graphs)
        k, scale = cfg.num_experts_per_tok, cfg.routed_scaling_factor

        def route(x, gate, bias):
            return moe_route(x, gate, bias, k, scale)

        def route_fused(x, gate, bias):
            T = x.shape[0]
            ids = x.new_empty((T, k), dtype=torch.int64)
            w = x.new_empty((T, k), dtype=gate.dtype)
            return tuple(call("moe_route", x, gate, bias, k, scale, ids, w))

        self.add(pm, route, route_fused, [rand(10, 48, dtype=dt), rand(E, 48, dtype=acc), rand(E, dtype=acc)])


def make(cfg, dtype, lowering="auto"):
    return MoERoute(cfg, dtype, lowering)
