"""The attention's output into the streams and the FFN's input from them -> `v41::hc_expand_norm`.

Inside a layer the attention sublayer ends with `expand` and the FFN starts with
`norm(collapse(X, pre))` of the streams it wrote (spec §3.1). After collapse_norm that is
`hc_expand` then `hc_collapse_norm` reading its output; the fused op computes both in one launch
(custom_ops/triton/norm.py: the streams and the norm bit for bit the two ops'), the streams still
written for their other readers (the next mix, the FFN's expand):

    before:
        Y = auto_functionalized(v41.hc_expand, out_=o, X=X, post=post, comb=comb, Y=empty([s0, 4, 64]))[1]
        x = auto_functionalized(v41.hc_collapse_norm, X=Y, mix=pre, w=w, eps=1e-20, out=empty([s0, 64]))[1]
    after:
        af = auto_functionalized(v41.hc_expand_norm, out_=o, X=X, post=post, comb=comb, pre=pre, w=w,
                                 eps=1e-20, Y=empty([s0, 4, 64]), out=empty([s0, 64]))
        Y, x = af[1], af[2]

Layers are compiled as separate pieces (passes/split.py), so an FFN's expand and the next
layer's input never meet in one graph; the FP8-QAT form (the dequantized model's attention
input) is not fused.
"""
from __future__ import annotations

import torch

from passes.base import PatternPass, call, dedupe_sym_sizes, rand
from passes.mhc import collapsed_row as row


class ExpandNorm(PatternPass):
    name = "expand_norm"
    ops = ("hc_expand", "hc_collapse_norm", "hc_expand_norm")

    def register(self, pm):
        eps, dt, acc, hc = self.cfg.rms_norm_eps, self.dtype, self.acc, self.cfg.hc_mult

        def expand_norm(out_, X, post, comb, pre, w):       # as mhc and collapse_norm emit them
            Y = call("hc_expand", out_, X, post, comb, torch.empty_like(X))[0]
            return Y, call("hc_collapse_norm", Y, pre, w, eps, row(Y))[0]

        def expand_norm_fused(out_, X, post, comb, pre, w):
            return call("hc_expand_norm", out_, X, post, comb, pre, w, eps, torch.empty_like(X), row(X))

        D = 96
        self.add(pm, expand_norm, expand_norm_fused,
                 [rand(8, D, dtype=dt), rand(8, hc, D, dtype=dt), rand(8, hc, dtype=acc), rand(8, hc, hc, dtype=acc),
                  rand(8, hc, dtype=acc), rand(D, dtype=dt)])

    def before(self, graph):
        dedupe_sym_sizes(graph)


def make(cfg, dtype, lowering="auto"):
    return ExpandNorm(cfg, dtype, lowering)
