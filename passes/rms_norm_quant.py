"""RMSNorm, and RMSNorm + the FP8 activation quant of the GEMM that reads it -> `v41::rms_norm`,
`v41::rms_norm_fp8`.

The eager model normalizes (`v41.layers.rms_norm`) and every FP8 `Linear` reading the result
fake-quantizes its input (`v41.quant.fp8_qat`, groups of 32, UE8M0 scale), once per GEMM. The
pass first merges identical pure ops (CSE: `wq_a` and `wkv` read the same quantized x), then
rewrites, f32 shown (bf16 adds the converts to and from float32):

    before:
        pow = pow(x, 2); mean = mean(pow, [-1], True); add = add(mean, 1e-20)
        rsqrt = rsqrt(add); mul = mul(x, rsqrt); y = mul(w, mul)   # rms_norm
        v = view(y, [s0, 2, 32]); amax = amax(abs(v), [-1], True)  # fp8_qat(y)
        ... view.dtype, rshift, and, lshift (power-of-two scale), round, copysign ...
        q = view(mul_s, [s0, 64]); mm(q, w_a)                      # the GEMM
        mm(y, w_c)                                                 # a second reader
    after:
        af = auto_functionalized(v41.rms_norm, x=x, w=w, eps=1e-20, out=empty([s0, 64]))
        y = af[1]
        af_1 = auto_functionalized(v41.rms_norm_fp8, x=x, w=w, eps=1e-20, out=empty([s0, 64]))
        q = af_1[1]
        mm(q, w_a); mm(y, w_c)

A norm read only by the quant becomes `rms_norm_fp8` alone; a norm read by no quant becomes
`rms_norm` alone.
"""
from __future__ import annotations

import torch

from passes.base import PatternPass, call, cse, rand
from v41 import quant
from v41.layers import rms_norm

FP8_GROUP = 32


class RMSNormQuant(PatternPass):
    name = "rms_norm_quant"
    ops = ("rms_norm", "rms_norm_fp8")

    def register(self, pm):
        eps, dt = self.cfg.rms_norm_eps, self.dtype

        def both(x, w):
            y = rms_norm(x, w, eps)
            return y, quant.fp8_qat(y, FP8_GROUP)

        def both_fused(x, w):
            return (call("rms_norm", x, w, eps, torch.empty_like(x))[0],
                    call("rms_norm_fp8", x, w, eps, torch.empty_like(x))[0])

        def quantized(x, w):
            return quant.fp8_qat(rms_norm(x, w, eps), FP8_GROUP)

        def quantized_fused(x, w):
            return call("rms_norm_fp8", x, w, eps, torch.empty_like(x))[0]

        def norm(x, w):
            return rms_norm(x, w, eps)

        def norm_fused(x, w):
            return call("rms_norm", x, w, eps, torch.empty_like(x))[0]

        ex = [rand(8, 96, dtype=dt), rand(96, dtype=dt)]
        self.add(pm, quantized, quantized_fused, ex)
        self.add(pm, both, both_fused, ex)
        self.add(pm, norm, norm_fused, ex)

    def before(self, graph):
        cse(graph)


def make(cfg, dtype, lowering="auto"):
    return RMSNormQuant(cfg, dtype, lowering)
