"""Quantizers of the oracle (spec/model.md §2.4, §4), written from the spec.

Every rounding is done arithmetically (frexp, powers of two, `torch.round` = half to even), so
it is exact in float64 as well as float32: nothing passes through a float32 or float8 cast.
The work precision is float64 for float64 inputs and float32 otherwise (a bfloat16 / float16
input is widened exactly); results come back in the input dtype (every quantized value is
representable there).
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # E2M1 magnitudes by 3-bit code


def _work(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float64, torch.float32) else x.to(torch.float32)


def exp2i(e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2**e for an integer tensor e, exact (checked in tests/test_oracle.py)."""
    return torch.exp2(e.to(dtype))


def pow2ceil(v: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2 v) for v > 0, exact: v = m·2**e with m in [0.5, 1)."""
    m, e = torch.frexp(v)
    e = torch.where(m == 0.5, e - 1, e)
    return exp2i(e, v.dtype)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """OCP E4M3 (float8_e4m3fn: bias 7, 3 mantissa bits, max 448), round to nearest even,
    saturating at ±448. Subnormal quantum 2**-9."""
    w = _work(x)
    a = w.abs().clamp(max=E4M3_MAX)
    _, e = torch.frexp(a)                      # a in [2**(e-1), 2**e)
    quantum = exp2i(torch.clamp(e - 4, min=-9), w.dtype)
    r = torch.round(a / quantum) * quantum
    return torch.copysign(r, w).to(x.dtype)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """E2M1 (FP4) round to nearest even, saturating at ±6: magnitudes {0,.5,1,1.5,2,3,4,6}."""
    w = _work(x)
    a = w.abs().clamp(max=E2M1_MAX)
    quantum = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)).to(w.dtype)
    r = torch.round(a / quantum) * quantum
    return torch.copysign(r, w).to(x.dtype)


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    if x.shape[-1] % group:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the group {group}")
    return _work(x).reshape(*x.shape[:-1], x.shape[-1] // group, group)


def fp8_qat(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """FP8 act quant round trip `act_quant(x, group, ue8m0)`: per group amax = max(|x|, 1e-4),
    s = pow2ceil(amax/448), q = e4m3(clamp(x/s, ±448)); returns q·s in x.dtype.
    With group = x.shape[-1] it is the one-pow2-scale-per-row FP8 of the runtime's index plane."""
    g = _groups(x, group)
    amax = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4)
    s = pow2ceil(amax / E4M3_MAX)
    q = round_e4m3(torch.clamp(g / s, -E4M3_MAX, E4M3_MAX))
    return (q * s).reshape(x.shape).to(x.dtype)


def fp4_qat_ue8m0(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """FP4 round trip with a power-of-two scale `fp4_act_quant(x, 32)`: amax = max(|x|, 6·2**-126),
    s = pow2ceil(amax/6), q = e2m1(clamp(x/s, ±6)); returns q·s."""
    g = _groups(x, group)
    amax = g.abs().amax(dim=-1, keepdim=True).clamp(min=6.0 * 2.0 ** -126)
    s = pow2ceil(amax / E2M1_MAX)
    q = round_e2m1(torch.clamp(g / s, -E2M1_MAX, E2M1_MAX))
    return (q * s).reshape(x.shape).to(x.dtype)


def fp4_qat_e4m3(x: torch.Tensor, group: int = 16) -> torch.Tensor:
    """FP4 round trip with an E4M3 scale `fp4_act_quant(x, 16, scale_dtype=e4m3)`:
    amax = max(|x|, 6·2**-9), s = e4m3(amax/6) (not a power of two), q = e2m1(clamp(x/s, ±6))
    with a TRUE division x/s (spec §2.4 "Open": division, everywhere); returns q·s."""
    g = _groups(x, group)
    amax = g.abs().amax(dim=-1, keepdim=True).clamp(min=6.0 * 2.0 ** -9)
    s = round_e4m3(amax / E2M1_MAX)
    q = round_e2m1(torch.clamp(g / s, -E2M1_MAX, E2M1_MAX))
    return (q * s).reshape(x.shape).to(x.dtype)


# ---- checkpoint formats -------------------------------------------------------------------

def e8m0_decode(scale: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """E8M0 (float8_e8m0fnu or its raw bytes): 2**(code-127); code 255 = NaN."""
    code = scale.view(torch.uint8).to(torch.int64) if scale.element_size() == 1 else scale.to(torch.int64)
    v = exp2i(code - 127, dtype)
    return torch.where(code == 255, torch.full_like(v, float("nan")), v)


def e4m3_decode(w: torch.Tensor, dtype=torch.float64) -> torch.Tensor:
    """float8_e4m3fn bytes → values (exact; code 0x7f/0xff = NaN)."""
    return w.view(torch.float8_e4m3fn).to(dtype)


def dequant_fp8_block(w: torch.Tensor, scale: torch.Tensor, dtype=torch.float64, block: int = 32) -> torch.Tensor:
    """FP8 E4M3 weight [n, k] × E8M0 scale [ceil(n/32), ceil(k/32)] per 32×32 block."""
    n, k = w.shape
    s = e8m0_decode(scale, dtype)
    s = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return e4m3_decode(w, dtype) * s


def dequant_fp4_packed(w: torch.Tensor, scale: torch.Tensor, dtype=torch.float64, group: int = 32) -> torch.Tensor:
    """Packed E2M1 [n, k/2] (element 2i in the low nibble, 2i+1 in the high; bit 3 = sign)
    × E8M0 scale [n, k/32] per 1×32 group along k."""
    b = w.view(torch.uint8).to(torch.int64)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(b.shape[0], -1)   # [n, k]
    mag = torch.tensor(FP4_VALUES, dtype=dtype)[codes & 7]
    vals = torch.where((codes & 8) != 0, -mag, mag)
    s = e8m0_decode(scale, dtype).repeat_interleave(group, 1)[:, : vals.shape[1]]
    return vals * s


def dequant_fp8_rows(w: torch.Tensor, scale: torch.Tensor, dtype=torch.float64, group: int = 32) -> torch.Tensor:
    """Engram table rows: FP8 [.., d] × E8M0 [.., d/32] per 32 along the row."""
    s = e8m0_decode(scale, dtype).repeat_interleave(group, -1)
    return e4m3_decode(w, dtype) * s
