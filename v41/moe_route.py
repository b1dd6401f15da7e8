"""The MoE router (spec §3.4): sqrt-softplus scores, experts chosen on the biased scores (ties to
the smaller expert id), weighted by the unbiased ones, normalized and scaled. A leaf: `MoE.route`
(v41.moe), the `v41::moe_route` op's reference impl (custom_ops/moe.py) and the pattern pass
(passes/moe_route.py) all run this function."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def route(x, gate, bias, top_k: int, route_scale: float):
    """Experts are chosen on biased scores, weighted by the unbiased ones; ties go to the
    smaller expert id."""
    s = (x.to(gate.dtype) @ gate.T)
    s = F.softplus(s).sqrt()
    # contiguous: a compiled graph hands the ids to the expert op in the strides they have here
    ids = torch.sort(s + bias, dim=-1, descending=True, stable=True).indices[:, : top_k].contiguous()
    w = s.gather(1, ids)
    return ids, w / (w.sum(-1, keepdim=True) + 1e-20) * route_scale
