"""Triton impl of `v41::scatter_rows` (the reference in custom_ops/cache.py is the definition).

Rows are moved as raw bytes, so every dtype (FP8 and E8M0 planes included) is one kernel: both
sides are viewed as rows of the widest integer unit (8, 4, 2 or 1 bytes) that divides the row
width, the row strides and the base addresses. One program copies one BLOCK-unit chunk of one
source row; a row whose destination is -1 (padding, or a row nobody keeps) loads and stores
nothing, so a captured graph replayed on padding writes nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops import cache as _ref
from custom_ops.registry import register_impl
from custom_ops.triton.common import pdl, pdl_wait

BLOCK = 512                   # units per program
_UNITS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@triton.jit
def _scatter_rows_kernel(dst_ptr, src_ptr, dest_ptr, n_units, stride_dst, stride_src,
                         BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    d = tl.load(dest_ptr + t).to(tl.int64)
    mask = (offs < n_units) & ((tl.zeros([BLOCK], tl.int64) + d) >= 0)
    x = tl.load(src_ptr + t * stride_src + offs, mask=mask)
    tl.store(dst_ptr + d * stride_dst + offs, x, mask=mask)


def _byte_rows(x: torch.Tensor) -> torch.Tensor | None:
    """[N, row bytes] uint8 view of a row tensor whose rows are contiguous, or None."""
    if x.dim() == 1:
        x = x.unsqueeze(1)
    try:
        x = x.view(x.shape[0], -1)
        if x.shape[1] and x.stride(1) != 1:
            return None
        return x.view(torch.uint8)
    except RuntimeError:
        return None


def _units(a: torch.Tensor, b: torch.Tensor):
    width = a.shape[1]
    for size, dtype in _UNITS:
        if all(width % size == 0 and (x.stride(0) % size == 0 or x.shape[0] <= 1)
               and x.data_ptr() % size == 0 for x in (a, b)):
            return a.view(dtype), b.view(dtype)
    raise AssertionError("unreachable: 1-byte units always fit")


def triton_scatter_rows(dst: torch.Tensor, rows: torch.Tensor, dest: torch.Tensor) -> None:
    """`v41::scatter_rows` (same signature): dst[dest[t]] = rows[t] for dest[t] >= 0."""
    T = dest.shape[0]
    if T == 0 or dst.numel() == 0:
        return
    if rows.dtype != dst.dtype:
        rows = rows.to(dst.dtype)
    d8, r8 = _byte_rows(dst), _byte_rows(rows)
    if d8 is None or r8 is None or d8.shape[1] != r8.shape[1] or r8.shape[0] < T:
        return _ref.scatter_rows(dst, rows, dest)
    du, ru = _units(d8, r8)
    dest = dest if dest.stride(0) == 1 else dest.contiguous()
    n = du.shape[1]
    _scatter_rows_kernel[(T, triton.cdiv(n, BLOCK))](du, ru, dest, n, du.stride(0), ru.stride(0),
                                                     BLOCK=BLOCK, num_warps=4, **pdl(du.device))


register_impl("scatter_rows", "triton", triton_scatter_rows, device_type="cuda")
