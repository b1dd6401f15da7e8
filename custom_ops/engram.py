"""Engram ops (spec §3.2). Row gather: FP8 table rows x E8M0 per 32 dims, for the n-gram hash
ids of each token. Tables can be far larger than device memory (host-mapped in Flash), so only
the gathered rows are decoded, through 256-entry byte tables (exact in float32: 4 significant
bits times a power of two). Gate: the module math after the wkv GEMM (per-stream keys, shared
value, sqrt-sigmoid gate), whose reference impl is v41.engram.device.Engram.forward itself."""
from __future__ import annotations

import functools
import weakref
from types import SimpleNamespace

import numpy as np
import torch

from custom_ops.registry import define
from v41 import quant
from v41.engram.device import Engram


@functools.lru_cache(maxsize=None)
def _byte_tables(device: torch.device):
    codes = torch.arange(256, dtype=torch.uint8)
    e4m3 = codes.view(torch.float8_e4m3fn).to(torch.float32)
    return e4m3.to(device), quant.e8m0_decode(codes, torch.float32).to(device)


_SMALL = 1 << 22          # tables up to this many elements are decoded once and kept
_decoded: dict = {}


def _decoded_table(table, scale, dtype):
    """The whole table decoded (exactly, in FP32) and rounded to `dtype`, for small tables (toy,
    flash-slice), keyed by address and version so an in-place change of the table is seen, and
    dropped when the table or its scale is freed.
    Rounding the table once equals rounding each gathered row: the cast is elementwise."""
    key = (table.data_ptr(), tuple(table.shape), table._version, scale.data_ptr(), scale._version, dtype)
    if key not in _decoded:
        val, exp = _byte_tables(table.device)
        rows = val[table.view(torch.uint8).long()].unflatten(-1, (-1, 32))
        if len(_decoded) >= 8:  # a few live tables (one per Engram layer); forget the oldest
            _decoded.pop(next(iter(_decoded)))
        _decoded[key] = (rows * exp[scale.view(torch.uint8).long()][..., None]).flatten(-2).to(dtype)
        # the entry goes with its table and scale: a later tensor at the same address (same
        # shape, version 0: another checkpoint of the preset) must not find this one's rows
        for t in (table, scale):
            weakref.finalize(t, _decoded.pop, key, None)
    return _decoded[key]


@define("engram_gather(Tensor table, Tensor scale, Tensor ids, Tensor(a!) out) -> ()")
def engram_gather(table, scale, ids, out) -> None:
    """table [rows, d] FP8; scale [rows, d/32] E8M0; ids [T, n]; out [T, n*d]."""
    if table.numel() <= _SMALL:
        dec, flat = _decoded_table(table, scale, out.dtype), ids.reshape(-1).to(table.device)
        if out.is_contiguous() and out.device == table.device:     # straight into `out`, no temporary
            torch.index_select(dec, 0, flat, out=out.view(-1, dec.shape[1]))
        else:
            out.copy_(dec.index_select(0, flat).reshape(out.shape))
        return
    val, exp = _byte_tables(table.device)
    if table.device.type == "cpu":  # numpy's take is an order of magnitude faster on the host
        flat = ids.reshape(-1).cpu().numpy()
        rows = np.take(val.numpy(), table.view(torch.uint8).numpy()[flat])
        s = np.take(exp.numpy(), scale.view(torch.uint8).numpy()[flat])
        rows = torch.from_numpy((rows.reshape(len(flat), -1, 32) * s[..., None]).reshape(out.shape))
    else:
        flat = ids.reshape(-1).to(table.device)
        rows = val[table.view(torch.uint8)[flat].long()].unflatten(-1, (-1, 32))
        rows = (rows * exp[scale.view(torch.uint8)[flat].long()][..., None]).reshape(out.shape)
    out.copy_(rows)


def _identity(t):
    return t


@define("engram_gate(Tensor X, Tensor kv, Tensor wqk, float eps, Tensor(a!) out) -> ()")
def engram_gate(X, kv, wqk, eps, out) -> None:
    """X [T, hc, D] residual streams; kv [T, (hc+1)*D] = engram.wkv(rows) (keys of the hc
    streams, then the shared value); wqk [hc, D] = q_weight * k_weight; out [T, hc, D] (X's
    dtype) <- X[c] + gate_c * value."""
    module = SimpleNamespace(wkv=_identity, wqk=wqk, hc=X.shape[1], eps=eps)
    out.copy_(Engram.forward(module, X, kv))
