"""Manifold-constrained hyper-connections (spec §3.1): the mix coefficients of a sublayer, the
collapse of the residual streams into its input and the expansion of its output back into the
streams. A leaf: the model (v41.model), the ops' reference impls (custom_ops/mhc.py) and the
pattern pass (passes/mhc.py) all import these from here."""
from __future__ import annotations

import torch
from torch import nn


class MHC(nn.Module):
    """Manifold-constrained hyper-connection coefficients of one sublayer (spec §3.1)."""

    def __init__(self, fn, base, scale, hc: int, iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.fn, self.base, self.scale = fn, base, scale
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, iters, hc_eps, norm_eps

    def forward(self, X):
        hc, eps = self.hc, self.hc_eps
        xf = X.flatten(1).to(self.fn.dtype)
        m = (xf @ self.fn.T) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        pre = torch.sigmoid(m[:, :hc] * self.scale[0] + self.base[:hc]) + eps
        post = 2 * torch.sigmoid(m[:, hc:2 * hc] * self.scale[1] + self.base[hc:2 * hc])
        c = (m[:, 2 * hc:] * self.scale[2] + self.base[2 * hc:]).view(-1, hc, hc)
        c = torch.softmax(c, -1) + eps
        c = c / (c.sum(-2, keepdim=True) + eps)
        for _ in range(self.iters - 1):
            c = c / (c.sum(-1, keepdim=True) + eps)
            c = c / (c.sum(-2, keepdim=True) + eps)
        return pre, post, c


def collapse(X, mix):
    """Σ_k mix[k]·X[k] accumulated in FP32, cast once."""
    return torch.einsum("tk,tkd->td", mix, X.to(mix.dtype)).to(X.dtype)


def expand(out, X, post, comb):
    """New stream j = post[j]·out + Σ_i comb[i][j]·X[i]."""
    acc = post.dtype
    y = post[..., None] * out.to(acc)[:, None, :] + torch.einsum("tij,tid->tjd", comb, X.to(acc))
    return y.to(X.dtype)
