"""The small numeric pieces every block uses: RMSNorm, the linear flavours of spec §2.5, RoPE
with YaRN. Everything is generic in the activation dtype: a "BF16" point of the spec rounds to
the activation dtype and an "FP32" point computes in `acc_dtype(dtype)`, so the same code runs
bf16 on a GPU and float64 in the exactness tests.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from v41 import quant


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x, weight, eps: float):
    """y = w * x * rsqrt(mean(x^2) + eps) in the accumulation dtype, cast once."""
    xf = x.to(acc_dtype(x.dtype))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(xf.dtype) * y).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """`fp8`: FP8 block weight, the input is FP8-quantized per 32 (A8) first; `bf16`: plain;
    `f32`: input and weight in the accumulation dtype, FP32 output. The weight arrives
    dequantized to the compute dtype, or (`fp8` only) native as a quant.BlockScaled, which runs
    the W8A8 op (weights are prepared once at load: v41.model.prepare_weights)."""

    def __init__(self, weight, kind: str):
        super().__init__()
        assert kind in ("fp8", "bf16", "f32")
        self.kind, self.scale = kind, None
        if isinstance(weight, quant.BlockScaled):
            if kind != "fp8" or weight.fmt != "fp8":
                raise ValueError(f"Linear: a native {weight.fmt} weight needs kind 'fp8', got {kind!r}")
            weight, self.scale = weight.q, weight.scale
        self.weight = weight

    def rows(self, start: int, stop: int | None = None) -> "Linear":
        """The projection onto rows [start, stop) of this one's weight, sharing its memory (one
        part of a `stack_rows` weight); a native weight splits on its 32-row scale blocks."""
        w = self.weight[start:stop]
        if self.scale is not None:
            if start % 32 or (stop is not None and stop % 32 and stop < self.weight.shape[0]):
                raise ValueError(f"Linear.rows({start}, {stop}): FP8 rows split inside a 32-row scale block")
            w = quant.BlockScaled(w, self.scale[start // 32: None if stop is None else -(-stop // 32)])
        return Linear(w, self.kind)

    def forward(self, x):
        if self.scale is not None:
            return fp8_linear(x, self.weight, self.scale)
        if self.kind == "f32":
            return x.to(self.weight.dtype) @ self.weight.T
        if self.kind == "fp8":
            x = quant.fp8_qat(x)
        return quant.matmul(x, self.weight.T)


def stack_rows(*weights):
    """Weights of one input, their rows one after another: a GEMM for several projections, each
    output's dot unchanged. Native ones stack their codes and their 32x32 block scales, so
    each weight's rows must be a whole number of blocks."""
    if isinstance(weights[0], quant.BlockScaled):
        if any(w.q.shape[0] % 32 for w in weights[:-1]):
            raise ValueError(f"stack_rows: FP8 weights of {[w.q.shape[0] for w in weights]} rows do not end "
                             "on 32-row scale blocks")
        return quant.BlockScaled(torch.cat([w.q for w in weights]), torch.cat([w.scale for w in weights]))
    return torch.cat(weights)


def fp8_linear(x, w, scale, groups: int = 1):
    """x @ dequant(w, scale)ᵀ with x FP8-quantized per 32 first, on the native weight: the
    `v41::fp8_linear` op (custom_ops/gemm.py); in x's dtype. With `groups` G, x's last dim
    holds G slices, each multiplied by its G-th of w's rows."""
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    torch.ops.v41.fp8_linear(x2, w, scale, out, groups)
    return out.view(*x.shape[:-1], w.shape[0])


def f32_linear(x, w):
    """x @ wᵀ in the accumulation dtype (the FP32 heads; w may be stored in bf16): the
    `v41::f32_linear` op (custom_ops/head.py)."""
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape[0], w.shape[0], dtype=acc_dtype(w.dtype), device=x.device)
    torch.ops.v41.f32_linear(x2, w, out)
    return out.view(*x.shape[:-1], w.shape[0])


# ---- RoPE -------------------------------------------------------------------------------

def rope_freqs(rot_dim: int, base: float, yarn: dict | None) -> torch.Tensor:
    """Per-pair frequencies, FP32, built exactly as the reference does (spec §2.3)."""
    f = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    if yarn:
        orig, factor = yarn["original_max_position_embeddings"], yarn["factor"]

        def corr(n):
            return rot_dim * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(yarn["beta_fast"])), 0)
        high = min(math.ceil(corr(yarn["beta_slow"])), rot_dim - 1)
        ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp
        f = f / factor * (1 - smooth) + f * smooth
    return f


class Rope(nn.Module):
    """cos/sin table for positions [0, max_pos), FP32 (angle rounded once in FP32, then polar)."""

    def __init__(self, rot_dim: int, base: float, yarn: dict | None, max_pos: int, device=None):
        super().__init__()
        f = rope_freqs(rot_dim, base, yarn)
        ang = torch.outer(torch.arange(max_pos, dtype=torch.float32), f)
        cis = torch.polar(torch.ones_like(ang), ang)
        self.cos, self.sin = cis.real.to(device), cis.imag.to(device)
        self.rot_dim = rot_dim

    def forward(self, x, positions, inverse: bool = False):
        """Rotate the last rot_dim dims of x ([T, ..., d]) at positions [T]; interleaved pairs."""
        acc = acc_dtype(x.dtype)
        shape = (positions.shape[0],) + (1,) * (x.dim() - 2) + (self.rot_dim // 2,)
        cos = self.cos[positions].view(shape).to(acc)
        sin = self.sin[positions].view(shape).to(acc)
        if inverse:
            sin = -sin
        head, tail = x[..., : -self.rot_dim], x[..., -self.rot_dim:].to(acc)
        a, b = tail[..., 0::2], tail[..., 1::2]
        rot = torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
        return torch.cat([head, rot.to(x.dtype)], -1)
