"""Triton impls of `v41::engram_gather` and `v41::engram_gate` (custom_ops/engram.py is the
definition).

engram_gather: grid (tokens, hash-head tiles); a program takes BLOCK_H of the token's n hash
ids, loads each row's d FP8 bytes and d/32 E8M0 bytes (as uint8) and decodes them exactly in
FP32 from the bits (E4M3: (8+m)·2^(e-10), subnormals m·2^-9, 0x7F/0xFF NaN; E8M0: 2^(c-127),
code 0 the subnormal 2^-127, 255 NaN), one multiply, one rounding to the output dtype: the
reference's byte-table decode. Flash: n = 24, d = 256 -> [4, 256] tiles, 6 programs per token.
The tables must be device memory: a host-resident table (Flash keeps them mapped on the host)
falls back to the reference, which gathers on the host.

engram_gate: grid (tokens, hc streams); a program walks D twice in BLOCK_D chunks: first Σ
x·w·key, Σx², Σkey² (FP32), then gate = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)) with
dot scaled by both rsqrt norms and 1/sqrt(D), and out = x + gate·value rounded once (the value
row is shared by the hc programs of a token, read from L2). Flash: D = 5120, chunks of 1024.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops import engram as _ref
from custom_ops.registry import register_impl
from custom_ops.triton.common import TL_DTYPES, pdl, pdl_wait, pow2

GATHER_TILE = 1024            # decoded elements per program
GATE_BLOCK_D = 1024


@triton.jit
def decode_e4m3(b):
    """FP32 value of float8_e4m3fn bytes (uint8/int32 tensor), exactly."""
    c = b.to(tl.int32) & 0xFF
    e = (c >> 3) & 15
    m = c & 7
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, (8 + m).to(tl.float32) * pow2(e - 10))
    mag = tl.where((e == 15) & (m == 7), float("nan"), mag)
    return tl.where((c & 0x80) != 0, -mag, mag)


@triton.jit
def decode_e8m0(b):
    """2^(code-127) in FP32 (code 0: the subnormal 2^-127; 255: NaN)."""
    c = b.to(tl.int32) & 0xFF
    v = (c << 23).to(tl.float32, bitcast=True)
    v = tl.where(c == 0, (c + 0x400000).to(tl.float32, bitcast=True), v)
    return tl.where(c == 255, float("nan"), v)


@triton.jit
def _engram_gather_kernel(table_ptr, scale_ptr, ids_ptr, out_ptr, n, d,
                          stride_tab, stride_sc, stride_it, stride_ot,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_D)
    hmask = hh < n
    m = hmask[:, None] & (c < d)[None, :]
    row = tl.load(ids_ptr + t * stride_it + hh, mask=hmask, other=0).to(tl.int64)
    q = tl.load(table_ptr + row[:, None] * stride_tab + c[None, :], mask=m, other=0)
    s = tl.load(scale_ptr + row[:, None] * stride_sc + (c // 32)[None, :], mask=m, other=127)
    v = decode_e4m3(q) * decode_e8m0(s)
    tl.store(out_ptr + t * stride_ot + hh.to(tl.int64)[:, None] * d + c[None, :],
             v.to(out_ptr.dtype.element_ty), mask=m)


def triton_engram_gather(table, scale, ids, out) -> None:
    """`v41::engram_gather` (same signature)."""
    T, n = ids.shape
    d = table.shape[1]
    if table.device.type != out.device.type or scale.device.type != out.device.type or \
            out.dtype not in TL_DTYPES or d % 32 or table.element_size() != 1 or \
            table.stride(1) != 1 or scale.stride(-1) != 1:
        return _ref.engram_gather(table, scale, ids, out)
    if T == 0 or n == 0:
        return
    ids = ids.to(out.device, non_blocking=True)
    ids = ids if ids.stride(1) == 1 else ids.contiguous()
    dst = out if out.stride(1) == 1 else torch.empty_like(out, memory_format=torch.contiguous_format)
    tab, sc = table.view(torch.uint8), scale.view(torch.uint8)
    bd = triton.next_power_of_2(d)
    bh = max(1, min(triton.next_power_of_2(n), GATHER_TILE // bd))
    _engram_gather_kernel[(T, triton.cdiv(n, bh))](
        tab, sc, ids, dst, n, d, tab.stride(0), sc.stride(0), ids.stride(0), dst.stride(0),
        BLOCK_H=bh, BLOCK_D=bd, num_warps=4, **pdl(tab.device))
    if dst is not out:
        out.copy_(dst)


@triton.jit
def _engram_gate_kernel(x_ptr, kv_ptr, wqk_ptr, out_ptr, D, eps, sqrt_d,
                        stride_xt, stride_xc, stride_kv, stride_w, stride_ot, stride_oc,
                        HC: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    x_row = x_ptr + t * stride_xt + ch * stride_xc
    k_row = kv_ptr + t * stride_kv + ch * D
    w_row = wqk_ptr + ch * stride_w
    dot = tl.zeros([BLOCK_D], tl.float32)
    sx = tl.zeros([BLOCK_D], tl.float32)
    sk = tl.zeros([BLOCK_D], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        c = d0 + cols
        m = c < D
        x = tl.load(x_row + c, mask=m, other=0.0).to(tl.float32)
        key = tl.load(k_row + c, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_row + c, mask=m, other=0.0).to(tl.float32)
        dot += x * w * key
        sx += x * x
        sk += key * key
    s = tl.sum(dot, axis=0)
    s = s * tl.rsqrt(tl.sum(sx, axis=0) / D + eps) * tl.rsqrt(tl.sum(sk, axis=0) / D + eps)
    s = s / sqrt_d
    mag = tl.sqrt(tl.maximum(tl.abs(s), 1e-6))
    gate = tl.sigmoid(tl.where(s >= 0, mag, -mag))
    v_row = kv_ptr + t * stride_kv + HC * D
    o_row = out_ptr + t * stride_ot + ch * stride_oc
    for d0 in range(0, D, BLOCK_D):
        c = d0 + cols
        m = c < D
        x = tl.load(x_row + c, mask=m, other=0.0).to(tl.float32)
        v = tl.load(v_row + c, mask=m, other=0.0).to(tl.float32)
        tl.store(o_row + c, (x + gate * v).to(out_ptr.dtype.element_ty), mask=m)


def triton_engram_gate(X, kv, wqk, eps, out) -> None:
    """`v41::engram_gate` (same signature)."""
    T, hc, D = X.shape
    if X.dtype not in TL_DTYPES or kv.dtype not in TL_DTYPES or wqk.dtype not in TL_DTYPES or \
            out.dtype != X.dtype or kv.shape[1] != (hc + 1) * D or \
            not all(t.stride(-1) == 1 for t in (X, kv, wqk, out)):
        return _ref.engram_gate(X, kv, wqk, eps, out)
    if T == 0:
        return
    bd = min(GATE_BLOCK_D, triton.next_power_of_2(D))
    _engram_gate_kernel[(T, hc)](X, kv, wqk, out, D, eps, float(D ** 0.5),
                                 X.stride(0), X.stride(1), kv.stride(0), wqk.stride(0),
                                 out.stride(0), out.stride(1), HC=hc, BLOCK_D=bd, num_warps=4, **pdl(X.device))


register_impl("engram_gather", "triton", triton_engram_gather, device_type="cuda")
register_impl("engram_gate", "triton", triton_engram_gate, device_type="cuda")
