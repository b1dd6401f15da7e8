"""The mHC chain of every sublayer (spec §3.1) -> `v41::mhc_mix`, `v41::hc_collapse`,
`v41::hc_expand`.

`Block.forward` runs, per sublayer: the mix coefficients of the residual streams
(`MHC.forward`: one projection of the flattened streams scaled by their RMS, sigmoid gates
`pre`/`post`, a softmax then Sinkhorn's alternating column/row normalizations), the collapse of
the streams into the sublayer's input and the expansion of its output back into the streams.
f32 shown, hc = 4, 20 Sinkhorn iterations:

    before:
        xf = view(X, [s0, 256]); m = mul(mm(xf, permute(fn)), rsqrt(add(mean(pow(xf, 2)), eps)))
        pre = add(sigmoid(add(mul(slice(m, 1, 0, 4), select(scale, 0, 0)), slice(base, 0, 0, 4))), 1e-6)
        post = mul(sigmoid(...slice(m, 1, 4, 8)...), 2)
        c = view(add(mul(slice(m, 1, 8, END), select(scale, 0, 2)), slice(base, 0, 8, END)), [s0, 4, 4])
        c = add(div(exp(sub(c, amax(c))), sum(...)), 1e-6); c = div(c, add(sum(c, [-2]), 1e-6))
        ... 19 x { div(c, add(sum(c, [-1]), 1e-6)); div(c, add(sum(c, [-2]), 1e-6)) } ...
        x = view(bmm(view(mix, [s0, 1, 4]), X), [s0, 64])  # collapse
        Y = add(mul(unsqueeze(post, -1), unsqueeze(out, 1)),
                permute(bmm(permute(comb), X)))            # expand
    after:
        af = auto_functionalized(v41.mhc_mix, X=X, fn=fn, base=base, scale=scale, iters=20,
                                 hc_eps=1e-6, norm_eps=1e-20, pre=empty([s0, 4]),
                                 post=empty([s0, 4]), comb=empty([s0, 4, 4]))
        pre, post, comb = af[1], af[2], af[3]
        x = auto_functionalized(v41.hc_collapse, X=X, mix=mix, out=empty([s0, 64]))[1]
        Y = auto_functionalized(v41.hc_expand, out_=out, X=X, post=post, comb=comb,
                                Y=empty([s0, 4, 64]))[1]
"""
from __future__ import annotations

import torch

from passes.base import PatternPass, call, ns, rand
from v41.mhc import MHC, collapse, expand


class MHCPass(PatternPass):
    name = "mhc"
    ops = ("mhc_mix", "hc_collapse", "hc_expand")

    def register(self, pm):
        cfg, dt, acc = self.cfg, self.dtype, self.acc
        hc, iters, hc_eps, norm_eps = cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        D = 48

        # comb first: the matcher walks its first output down from a candidate node (linear) and
        # finds the others by searching up from what that matched; that search enumerates every
        # path through the pattern, and through Sinkhorn's chain (each step reads `c` twice) that
        # is 2^40 paths whenever a candidate fails. From `m` up to pre/post it is a few steps.
        def mix(X, fn, base, scale):
            pre, post, comb = MHC.forward(ns(fn=fn, base=base, scale=scale, hc=hc, iters=iters,
                                             hc_eps=hc_eps, norm_eps=norm_eps), X)
            return comb, pre, post

        def mix_fused(X, fn, base, scale):
            T = X.shape[0]
            pre = X.new_empty((T, hc), dtype=fn.dtype)
            post = X.new_empty((T, hc), dtype=fn.dtype)
            comb = X.new_empty((T, hc, hc), dtype=fn.dtype)
            pre, post, comb = call("mhc_mix", X, fn, base, scale, iters, hc_eps, norm_eps, pre, post, comb)
            return comb, pre, post

        def collapse_fused(X, w):
            return call("hc_collapse", X, w, X.new_empty((X.shape[0], X.shape[2])))[0]

        def expand_fused(out, X, post, comb):
            return call("hc_expand", out, X, post, comb, torch.empty_like(X))[0]

        n = hc * (hc + 2)
        X = rand(10, hc, D, dtype=dt)
        self.add(pm, mix, mix_fused, [X, rand(n, hc * D, dtype=acc), rand(n, dtype=acc), rand(3, dtype=acc)])
        self.add(pm, collapse, collapse_fused, [X, rand(10, hc, dtype=acc)])
        self.add(pm, expand, expand_fused, [rand(10, D, dtype=dt), X, rand(10, hc, dtype=acc),
                                            rand(10, hc, hc, dtype=acc)])


def make(cfg, dtype, lowering="auto"):
    return MHCPass(cfg, dtype, lowering)
