"""The ratio-2 compressor pool with FP32 tails carried across forwards (spec §3.3 c).

Groups are the non-overlapping pairs {2j, 2j+1}. A group is emitted on the token that completes
it (odd position), one output row per token, so the output has the token batch's shape; rows of
even positions are zero and never written anywhere. A group whose first token was computed by
an earlier forward reads that token's projections from the request's tail.
"""
from __future__ import annotations

import torch

from custom_ops.registry import define


@define("compress_pool(Tensor v, Tensor g, Tensor positions, Tensor batch_ids, Tensor tail_src, "
        "Tensor tail_dst, Tensor(a!) tail_v, Tensor(b!) tail_g, Tensor(c!) out) -> ()")
def compress_pool(v, g, positions, batch_ids, tail_src, tail_dst, tail_v, tail_g, out) -> None:
    """v, g: [T, d] projections (accumulation dtype). tail_src[t]: the tail row token t pairs
    with (-1: its partner is token t-1 of this batch). tail_dst[t]: the tail row that keeps
    token t's projections for the next forward (-1: none). tail_v/tail_g: [slots, d]."""
    closes = (batch_ids >= 0) & (positions % 2 == 1)
    from_tail = tail_src >= 0
    prev_v = torch.cat([v[:1], v[:-1]])
    prev_g = torch.cat([g[:1], g[:-1]])
    src = tail_src.clamp(min=0)
    first_v = torch.where(from_tail[:, None], tail_v[src].to(v.dtype), prev_v)
    first_g = torch.where(from_tail[:, None], tail_g[src].to(g.dtype), prev_g)
    w = torch.softmax(torch.stack([first_g, g]), dim=0)  # per channel over the pair
    pooled = (torch.stack([first_v, v]) * w).sum(0)
    out.copy_(torch.where(closes[:, None], pooled, torch.zeros_like(pooled)))
    keep = tail_dst >= 0
    tail_v.index_copy_(0, tail_dst[keep], v[keep].to(tail_v.dtype))
    tail_g.index_copy_(0, tail_dst[keep], g[keep].to(tail_g.dtype))
