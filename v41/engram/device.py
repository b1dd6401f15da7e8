"""Engram, device half (spec §3.2 "Module math"): the gathered table rows of a token's 24
n-gram hashes become one key per residual stream and a shared value, gated per stream."""
from __future__ import annotations

import torch
from torch import nn

from v41.layers import Linear, acc_dtype


class Engram(nn.Module):
    def __init__(self, w: dict, hc: int, eps: float):
        super().__init__()
        self.wkv = Linear(w["engram.wkv"], "fp8")
        # only the product matters; formed and kept in the accumulation dtype, as the spec
        # does (prepare_weights keeps q/k there: a BF16 product moves most elements by an ulp)
        self.wqk = w["engram.q_weight"] * w["engram.k_weight"]
        self.hc, self.eps = hc, eps

    def forward(self, X, rows):
        """X [T, hc, D] residual streams; rows [T, width] dequantized table rows."""
        acc = acc_dtype(X.dtype)
        D = X.shape[-1]
        kv = self.wkv(rows).to(acc)
        key, value = kv[:, : self.hc * D].view(-1, self.hc, D), kv[:, self.hc * D:]
        x = X.to(acc)
        dot = (x * self.wqk.to(acc) * key).sum(-1)
        dot = dot * torch.rsqrt(x.pow(2).mean(-1) + self.eps) * torch.rsqrt(key.pow(2).mean(-1) + self.eps)
        dot = dot / D ** 0.5
        mag = dot.abs().clamp(min=1e-6).sqrt()
        gate = torch.sigmoid(torch.where(dot >= 0, mag, -mag))  # copysign: +0 counts as positive
        return (x + gate[..., None] * value[:, None, :]).to(X.dtype)
