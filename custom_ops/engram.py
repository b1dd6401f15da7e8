"""Engram row gather: FP8 table rows x E8M0 per 32 dims, for the n-gram hash ids of each token."""
from __future__ import annotations

from custom_ops.registry import define
from v41 import quant


@define("engram_gather(Tensor table, Tensor scale, Tensor ids, Tensor(a!) out) -> ()")
def engram_gather(table, scale, ids, out) -> None:
    """table [rows, d] FP8; scale [rows, d/32] E8M0; ids [T, n]; out [T, n*d]."""
    flat = ids.reshape(-1).to(table.device)
    rows = table[flat].to(out.dtype).unflatten(-1, (-1, 32))
    s = quant.e8m0_decode(scale[flat], out.dtype)
    out.copy_((rows * s[..., None]).reshape(out.shape).to(out.device))
