"""A sublayer's input, the streams' collapse then its RMSNorm -> `v41::hc_collapse_norm(_fp8)`.

`Block.forward` starts each sublayer with `norm(collapse(X, pre))` (spec §3.1), and the final norm
reads the last collapse. After the mhc and rms_norm_quant passes that is two fused ops, the
collapse's [T, D] row written by one launch and read twice by the next; the fused op is one
launch reading the streams (custom_ops/triton/norm.py, the same arithmetic bit for bit):

    before:
        x = auto_functionalized(v41.hc_collapse, X=X, mix=pre, out=empty([s0, 64]))[1]
        y = auto_functionalized(v41.rms_norm, x=x, w=w, eps=1e-20, out=empty([s0, 64]))[1]
        q = auto_functionalized(v41.rms_norm_fp8, x=x, w=w, eps=1e-20, out=empty([s0, 64]))[1]
    after:
        y = auto_functionalized(v41.hc_collapse_norm, X=X, mix=pre, w=w, eps=1e-20, out=empty([s0, 64]))[1]
        q = auto_functionalized(v41.hc_collapse_norm_fp8, X=X, mix=pre, w=w, eps=1e-20,
                                out=empty([s0, 64]))[1]

A collapse read by one norm gives one fused op; read by both (the dequantized model: a bf16
reader beside the FP8 GEMMs), each norm collapses the streams itself (4 x D reads, the row
they replace is written and read twice). A collapse with another reader is left alone.
"""
from __future__ import annotations

import torch

from passes.base import PatternPass, call, dedupe_sym_sizes, rand
from passes.mhc import collapsed_row as row


class CollapseNorm(PatternPass):
    name = "collapse_norm"
    ops = ("hc_collapse", "rms_norm", "rms_norm_fp8", "hc_collapse_norm", "hc_collapse_norm_fp8")

    def register(self, pm):
        eps, dt, hc = self.cfg.rms_norm_eps, self.dtype, self.cfg.hc_mult

        def collapsed(X, mix):          # as passes/mhc.py emits it
            return call("hc_collapse", X, mix, row(X))[0]

        def norms(X, mix, w):           # as passes/rms_norm_quant.py emits them
            x = collapsed(X, mix)
            return (call("rms_norm", x, w, eps, torch.empty_like(x))[0],
                    call("rms_norm_fp8", x, w, eps, torch.empty_like(x))[0])

        def norms_fused(X, mix, w):
            return (call("hc_collapse_norm", X, mix, w, eps, row(X))[0],
                    call("hc_collapse_norm_fp8", X, mix, w, eps, row(X))[0])

        def norm(X, mix, w):
            x = collapsed(X, mix)
            return call("rms_norm", x, w, eps, torch.empty_like(x))[0]

        def norm_fused(X, mix, w):
            return call("hc_collapse_norm", X, mix, w, eps, row(X))[0]

        def quantized(X, mix, w):
            x = collapsed(X, mix)
            return call("rms_norm_fp8", x, w, eps, torch.empty_like(x))[0]

        def quantized_fused(X, mix, w):
            return call("hc_collapse_norm_fp8", X, mix, w, eps, row(X))[0]

        D = 96
        ex = [rand(8, hc, D, dtype=dt), rand(8, hc, dtype=self.acc), rand(D, dtype=dt)]
        self.add(pm, norms, norms_fused, ex)
        self.add(pm, norm, norm_fused, ex)
        self.add(pm, quantized, quantized_fused, ex)

    def before(self, graph):
        dedupe_sym_sizes(graph)


def make(cfg, dtype, lowering="auto"):
    return CollapseNorm(cfg, dtype, lowering)
