"""Sentinel-aware row scatter: the one way rows enter rings, owner pages and index planes."""
from __future__ import annotations

import torch

from custom_ops.registry import define


@define("scatter_rows(Tensor(a!) dst, Tensor rows, Tensor dest) -> ()")
def scatter_rows(dst: torch.Tensor, rows: torch.Tensor, dest: torch.Tensor) -> None:
    """dst[dest[t]] = rows[t] for every dest[t] >= 0. `dst` is a flat row view of a plane
    ([N, ...]); -1 marks a padding token or a row nobody keeps. Destinations are unique."""
    keep = dest >= 0
    rows = rows[keep].to(dst.dtype)
    if dst.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):  # no index kernels for fp8
        dst, rows = dst.view(torch.uint8), rows.view(torch.uint8)
    dst.index_copy_(0, dest[keep], rows)
