"""mHC ops (spec §3.1): the per-sublayer mix coefficients (projection, sigmoid gates, softmax and
Sinkhorn), the collapse of the residual streams into a sublayer input and the expansion of a
sublayer output back into the streams. The reference impls are v41.mhc's MHC, collapse and
expand."""
from __future__ import annotations

from custom_ops.registry import define
from v41.mhc import MHC, collapse, expand


@define("mhc_mix(Tensor X, Tensor fn, Tensor base, Tensor scale, int iters, float hc_eps, "
        "float norm_eps, Tensor(a!) pre, Tensor(b!) post, Tensor(c!) comb) -> ()")
def mhc_mix(X, fn, base, scale, iters, hc_eps, norm_eps, pre, post, comb) -> None:
    """X [T, hc, D]; fn [hc*(hc+2), hc*D], base [hc*(hc+2)], scale [3] (accumulation dtype);
    pre/post [T, hc], comb [T, hc, hc] (fn's dtype) <- MHC(X)."""
    p, q, c = MHC(fn, base, scale, X.shape[1], iters, hc_eps, norm_eps)(X)
    pre.copy_(p)
    post.copy_(q)
    comb.copy_(c)


@define("hc_collapse(Tensor X, Tensor mix, Tensor(a!) out) -> ()")
def hc_collapse(X, mix, out) -> None:
    """X [T, hc, D], mix [T, hc]; out [T, D] (X's dtype) <- Σ_k mix[k]·X[k] in mix's dtype."""
    out.copy_(collapse(X, mix))


@define("hc_expand(Tensor out_, Tensor X, Tensor post, Tensor comb, Tensor(a!) Y) -> ()")
def hc_expand(out_, X, post, comb, Y) -> None:
    """out_ [T, D] sublayer output, X [T, hc, D], post [T, hc], comb [T, hc, hc];
    Y [T, hc, D] (X's dtype) <- stream j = post[j]·out_ + Σ_i comb[i][j]·X[i]."""
    Y.copy_(expand(out_, X, post, comb))
