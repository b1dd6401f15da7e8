"""The Engram gate (spec §3.2) -> `v41::engram_gate`.

After its wkv GEMM, `Engram.forward` splits the row into one key per residual stream and a
shared value, takes each stream's normalized dot product with its key, maps it through
sign(d)*sqrt(|d|) and a sigmoid, and adds the gated value to the stream. f32 shown, hc = 4:

    before:
        kv = mm(q8(rows), permute(wkv))
        key = view(slice(kv, 1, 0, 256), [s0, 4, 64]); value = slice(kv, 1, 256, END)
        dot = sum(mul(mul(X, wqk), key), [-1])
        dot = div(mul(mul(dot, rsqrt(add(mean(pow(X, 2), [-1]), eps))), rsqrt(...key...)), 8.0)
        mag = sqrt(clamp_min(abs(dot), 1e-6))
        Y = add(X, mul(unsqueeze(sigmoid(where(ge(dot, 0), mag, neg(mag))), -1),
                       unsqueeze(value, 1)))
    after:
        Y = auto_functionalized(v41.engram_gate, X=X, kv=kv, wqk=wqk, eps=1e-20,
                                out=empty([s0, 4, 64]))[1]
"""
from __future__ import annotations

import torch

from passes.base import PatternPass, call, ns, rand
from v41.engram.device import Engram


def _identity(t):
    return t


class EngramGate(PatternPass):
    name = "engram_gate"
    ops = ("engram_gate",)

    def register(self, pm):
        cfg, dt = self.cfg, self.dtype
        hc, eps, D = cfg.hc_mult, cfg.rms_norm_eps, 48

        def gate(X, kv, wqk):
            return Engram.forward(ns(wkv=_identity, wqk=wqk, hc=hc, eps=eps), X, kv)

        def gate_fused(X, kv, wqk):
            return call("engram_gate", X, kv, wqk, eps, torch.empty_like(X))[0]

        # wqk is kept in the accumulation dtype (the spec forms q_weight * k_weight in FP32)
        self.add(pm, gate, gate_fused, [rand(10, hc, D, dtype=dt), rand(10, (hc + 1) * D, dtype=dt),
                                        rand(hc, D, dtype=self.acc)])


def make(cfg, dtype, lowering="auto"):
    return EngramGate(cfg, dtype, lowering)
