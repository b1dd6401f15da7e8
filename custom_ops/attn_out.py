"""Attention output, first half (spec §3.3 j): inverse RoPE of the attention output at the query
position, then the grouped low-rank projection wo_a ("tgi,goi->tgo"). The reference impl is the
end of v41.attention.Attention.forward, written with the same calls."""
from __future__ import annotations

import torch

from custom_ops.registry import define
from custom_ops.rope import apply_rope
from v41 import quant


@define("inv_rope_wo_a(Tensor o, Tensor cos, Tensor sin, Tensor positions, Tensor wo_a, "
        "Tensor(a!) out) -> ()")
def inv_rope_wo_a(o, cos, sin, positions, wo_a, out) -> None:
    """o [T, H, d] attention output; wo_a [G, R, (H/G)*d]; out [T, G*R] <- per group g:
    W_g · (inverse-RoPE'd o of g's heads, flattened)."""
    T, G = o.shape[0], wo_a.shape[0]
    o = apply_rope(o, cos, sin, positions, True).view(T, G, -1)
    z = quant.einsum("tgi,goi->tgo", o, wo_a).flatten(1)
    out.copy_(z.view(out.shape))
