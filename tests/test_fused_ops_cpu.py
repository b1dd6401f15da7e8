"""The Triton impls of the fused ops (custom_ops/triton) under the Triton interpreter, FP32 and
tiny shapes, against the reference impls (tests/test_fused_ops_reference.py checks those against
the eager model): outputs poisoned first (every element must be written), fresh random inputs
every run, ‖out−ref‖/‖ref‖ < 1e-5, routing ids exact. An FP8 QAT may round differently where its
input sits within a few FP32 ulps (1e-6 relative) of a grid midpoint (or its group amax/448 of a
power of two): the two impls sum in different orders, so their FP32 inputs to the quantizer can
differ by an ulp. Such elements (tokens, for the experts) are identified from the reference's own
pre-quant values and excluded from the 1e-5 check; everything else must meet it. Routing
near-ties (distinct biased scores within 1e-5) are excluded likewise; exact ties (duplicated
router rows) must resolve to the smaller id.

TRITON_INTERPRET must be set before triton is imported, so these run in a subprocess with it set
(as tests/test_kernels_cpu.py does), once with the grid's programs in order and once reversed
(tests/program_order.py); in that subprocess this module defines only the interpreted tests.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import custom_ops  # noqa: F401
from custom_ops import attn_out as ref_attn_out
from custom_ops import engram as ref_engram
from custom_ops import mhc as ref_mhc
from custom_ops import moe as ref_moe
from custom_ops import norm as ref_norm
from custom_ops import rope as ref_rope
from tests.fused_op_cases import assert_qat_close, fp8_near_boundary, rnd, rope_table
from tests.kernel_cases import INTERPRETED, SEED, interpreter_reruns, rel
from v41 import quant

pytest.importorskip("triton")

if not INTERPRETED:
    test_fused_kernels_under_triton_interpreter = interpreter_reruns(__file__, timeout=600, V41_TEST_SEED=str(SEED))

else:
    from tests import program_order
    program_order.apply()
    from custom_ops import registry
    from custom_ops.triton import (triton_engram_gate, triton_engram_gather, triton_hc_collapse,
                                   triton_hc_collapse_rms_norm_act_quant,
                                   triton_hc_expand, triton_inv_rope_wo_a, triton_mhc_mix,
                                   triton_moe_experts, triton_moe_route, triton_rms_norm,
                                   triton_rms_norm_act_quant, triton_rms_norm_fp8, triton_rms_norm_rope_fp8_qat,
                                   triton_rope, triton_rope_fp8_qat)
    from custom_ops.triton.common import fp8_qat as triton_fp8_qat
    from v41.layers import rms_norm as eager_rms_norm

    def nan_like(t):
        return torch.full_like(t, float("nan"))

    # ---- (b) Triton impls against the reference, FP32 -----------------------------------------
    def test_fp8_qat_exact(g):
        """The Triton FP8 quantizer is bit-exact with v41.quant.fp8_qat, ties and scale steps
        included."""
        x = rnd(g, 24, 128) * torch.exp2(torch.randint(-40, 40, (24, 1), generator=g).float())
        x[0, :32] = 448 * 2.0**-5                            # amax/448 exactly a power of two
        x[1, :32] = (torch.arange(32) - 16) * 2.0**-10 + 2.0**-11   # midpoints everywhere
        x[2, :32] = 0.0
        x[3, :32] = torch.randint(-64, 64, (32,), generator=g) * 2.0**-14
        out = nan_like(x)
        triton_fp8_qat(x, out)
        assert torch.equal(out, quant.fp8_qat(x, 32))

    @pytest.mark.parametrize("shape", [(7, 96), (3, 2, 2080), (2, 8224)])   # the last wider than one pass
    def test_rms_norm(g, shape):
        x, w = rnd(g, *shape, scale=2.0), rnd(g, shape[-1])
        ref, out = torch.empty_like(x), nan_like(x)
        ref_norm.rms_norm(x, w, 1e-6, ref)
        triton_rms_norm(x, w, 1e-6, out)
        assert rel(out, ref) < 1e-5
        ref_norm.rms_norm_fp8(x, w, 1e-6, ref)
        out = nan_like(x)
        triton_rms_norm_fp8(x, w, 1e-6, out)
        assert not out.isnan().any()
        assert_qat_close(out, ref, eager_rms_norm(x, w, 1e-6))

    @pytest.mark.parametrize("shape", [(7, 96), (3, 2, 2080), (2, 8224)])
    def test_rms_norm_act_quant(g, shape):
        """The norm within the FP32 rounding of its sum, and beside it exactly the act-quant of
        that norm (codes and scales bit for bit): every element and group scale written."""
        from custom_ops import gemm as ref_gemm
        x, w = rnd(g, *shape, scale=2.0), rnd(g, shape[-1])
        x[0] = 0.0                                  # a zero row: scale floor, zero codes
        ref = torch.empty_like(x)
        ref_norm.rms_norm(x, w, 1e-6, ref)
        out, q = nan_like(x), torch.full(shape, float("nan")).to(torch.float8_e4m3fn)
        s = torch.full((*shape[:-1], shape[-1] // 32), float("nan"))
        triton_rms_norm_act_quant(x, w, 1e-6, out, q, s)
        assert rel(out, ref) < 1e-5
        want_q = torch.empty(q.shape, dtype=q.dtype).view(-1, shape[-1])
        want_s = torch.empty(s.shape).view(-1, shape[-1] // 32)
        ref_gemm.fp8_act_quant(out.view(-1, shape[-1]), want_q, want_s)
        assert torch.equal(q.view(-1, shape[-1]).view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(s.view(-1, shape[-1] // 32), want_s)

    @pytest.mark.parametrize("D", [96, 8224])
    def test_hc_collapse_rms_norm_act_quant(g, D):
        """mHC's collapse, then the norm and its codes: the norm within the FP32 rounding of the
        collapse's and the norm's sums, the codes exactly those of the kernel's own norm; rows
        read in one pass and (8224) in chunks."""
        from custom_ops import gemm as ref_gemm
        from v41.mhc import collapse
        T, hc = 5, 4
        X, mix, w = rnd(g, T, hc, D, scale=2.0), torch.rand(T, hc, generator=g), rnd(g, D)
        X[2] = 0.0
        ref = torch.empty(T, D)
        ref_norm.rms_norm(collapse(X, mix), w, 1e-6, ref)
        out, q = torch.full((T, D), float("nan")), torch.full((T, D), float("nan")).to(torch.float8_e4m3fn)
        s = torch.full((T, D // 32), float("nan"))
        triton_hc_collapse_rms_norm_act_quant(X, mix, w, 1e-6, out, q, s)
        assert rel(out, ref) < 1e-5
        want_q, want_s = torch.empty_like(q), torch.empty_like(s)
        ref_gemm.fp8_act_quant(out, want_q, want_s)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)

    def test_rope(g):
        rope = rope_table()
        T = 6
        pos = torch.randint(0, 512, (T,), generator=g)
        for shape in ((T, 3, 64), (T, 48)):
            x = rnd(g, *shape)
            for inverse in (False, True):
                ref, out = torch.empty_like(x), nan_like(x)
                ref_rope.rope(x, rope.cos, rope.sin, pos, inverse, ref)
                triton_rope(x, rope.cos, rope.sin, pos, inverse, out)
                assert rel(out, ref) < 1e-5
        x = rnd(g, T, 96)
        ref, out = torch.empty_like(x), nan_like(x)
        ref_rope.rope_fp8_qat(x, rope.cos, rope.sin, pos, False, ref)
        triton_rope_fp8_qat(x, rope.cos, rope.sin, pos, False, out)
        assert not out.isnan().any()
        assert_qat_close(out, ref, ref_rope.apply_rope(x, rope.cos, rope.sin, pos, False))
        # the row's RMSNorm first (the window KV row from wkv)
        w = rnd(g, 96)
        x[0] = 0.0
        ref, out = torch.empty_like(x), nan_like(x)
        ref_rope.rms_norm_rope_fp8_qat(x, w, 1e-6, rope.cos, rope.sin, pos, False, ref)
        triton_rms_norm_rope_fp8_qat(x, w, 1e-6, rope.cos, rope.sin, pos, False, out)
        assert not out.isnan().any()
        normed = eager_rms_norm(x, w, 1e-6)
        assert_qat_close(out, ref, ref_rope.apply_rope(normed, rope.cos, rope.sin, pos, False))

    @pytest.mark.parametrize("kw", [{}, {"block_m": 16, "block_n": 16, "block_k": 16},
                                    {"block_m": 16, "block_n": 16, "block_k": 16, "split_k": 4}])
    def test_inv_rope_wo_a(g, kw):
        """Tiles of the default and of 16 (6 K steps of 96 columns, each head's 48 ending in
        rotated columns), and those steps in 3 splits of 2 summed by the last to arrive."""
        rope = rope_table()
        T, H, d, G, R = 19, 4, 48, 2, 24
        o = rnd(g, T, H, d)
        wo_a = rnd(g, G, R, H * d // G, scale=0.1)
        pos = torch.randint(0, 512, (T,), generator=g)
        ref, out = torch.empty(T, G * R), torch.full((T, G * R), float("nan"))
        ref_attn_out.inv_rope_wo_a(o, rope.cos, rope.sin, pos, wo_a, ref)
        triton_inv_rope_wo_a(o, rope.cos, rope.sin, pos, wo_a, out, **kw)
        assert rel(out, ref) < 1e-5

    @pytest.mark.parametrize("split,block_t,block_s,D,dtype", [(None, None, None, 48, torch.float32),
                                                               (3, 4, None, 48, torch.float32),
                                                               (20, 16, 8, 320, torch.float32),
                                                               (20, 1, None, 320, torch.float32),
                                                               (None, None, None, 48, torch.bfloat16)])
    def test_mhc_mix(g, split, block_t, block_s, D, dtype):
        """20 splits summed 8 a load (the last load part masked), and a one-token program's
        default: all 20 in one load; X in bf16: fn split into three bf16 parts."""
        T, hc = 7, 4
        X = rnd(g, T, hc, D).to(dtype)
        fn, base, scale = rnd(g, 24, hc * D, scale=0.05), rnd(g, 24), rnd(g, 3).abs()
        refs = [torch.empty(T, hc), torch.empty(T, hc), torch.empty(T, hc, hc)]
        outs = [nan_like(r) for r in refs]
        ref_mhc.mhc_mix(X, fn, base, scale, 20, 1e-6, 1e-20, *refs)
        triton_mhc_mix(X, fn, base, scale, 20, 1e-6, 1e-20, *outs, split=split, block_t=block_t,
                       block_s=block_s)
        for o, r in zip(outs, refs):
            assert rel(o, r) < 1e-5

    def test_mhc_coef_programs_take_one_token_up_to_the_rule(monkeypatch):
        """The coefficient programs: one token each up to COEF_TOKEN_PROGRAMS tokens (all of a
        token's splits in one load), then token tiles of up to COEF_BLOCK_T."""
        from custom_ops.triton import mhc
        assert [mhc.coef_block_t(T) for T in (1, 6, 64, 512, 513, 4096)] == [1, 1, 1, 1, 16, 16]
        monkeypatch.setattr(mhc, "COEF_TOKEN_PROGRAMS", 0)
        assert [mhc.coef_block_t(T) for T in (1, 6, 16)] == [1, 8, 16]

    @pytest.mark.parametrize("block_t", [16, None])
    def test_mhc_mix_token_tiles(g, block_t):
        """100 tokens: the projection's two 64-token tiles, the coefficients in seven 16-token
        programs or (the default up to COEF_TOKEN_PROGRAMS) a hundred of one token, the last tile
        of each partly masked; a second call gives the same values bit for bit."""
        T, hc, D = 100, 4, 48
        X = rnd(g, T, hc, D).to(torch.bfloat16)
        fn, base, scale = rnd(g, 24, hc * D, scale=0.05), rnd(g, 24), rnd(g, 3).abs()
        refs = [torch.empty(T, hc), torch.empty(T, hc), torch.empty(T, hc, hc)]
        ref_mhc.mhc_mix(X, fn, base, scale, 20, 1e-6, 1e-20, *refs)
        runs = []
        for _ in range(2):
            outs = [nan_like(r) for r in refs]
            triton_mhc_mix(X, fn, base, scale, 20, 1e-6, 1e-20, *outs, split=3, block_t=block_t)
            for o, r in zip(outs, refs):
                assert rel(o, r) < 1e-5
            runs.append(outs)
        assert all(torch.equal(a, b) for a, b in zip(*runs))

    def test_skinny_gemm_split_weight_products_are_exact(g):
        """skinny_gemm with A in bf16 splits each FP32 weight into three bf16 parts whose sum is
        the weight exactly, so every product is exact. Weights of 22 significant bits against
        rows of A with two nonzeros (±1): every partial sum is exact, so the result equals float64
        bitwise (two parts, 16 bits, would not). Random inputs: within γ_3K·Σ|products| of
        float64; A in FP32 takes FP32 products, within γ_K."""
        from custom_ops.triton.common import skinny_gemm
        M, N, K = 6, 24, 640
        w = torch.randint(-2**21, 2**21, (N, K), generator=g).float() * 2.0**-20
        a = torch.zeros(M, K)
        for m in range(M):
            a[m, torch.randperm(K, generator=g)[:2]] = torch.tensor([1.0, -1.0])
        part, _ = skinny_gemm(a.bfloat16(), w, False, split=3)
        assert torch.equal(part.double().sum(0), a.double() @ w.double().T)
        a, w = rnd(g, M, K).bfloat16(), rnd(g, N, K)
        exact, S = a.double() @ w.double().T, a.double().abs() @ w.double().abs().T
        for split_w, aa, terms in ((True, a, 3 * K), (False, a.float(), K)):
            part, _ = skinny_gemm(aa, w, False, split=3, split_w=split_w)
            got = part.double().sum(0)          # 3 partials: 2 more FP32 additions, inside the bound
            assert ((got - exact).abs() <= (terms + 2) * 2.0**-24 * S).all(), split_w
        with pytest.raises(ValueError, match="bf16"):
            skinny_gemm(a.float(), w, False, split_w=True)

    def test_f32_linear(g):
        """The FP32 head op with a bf16 head and x in bf16: the kernel (one bf16 dot a tile: exact
        products, FP32 sums) written into out at one row and several, within γ_K·Σ|products| of
        float64 each and so within 2·γ_K·Σ of the reference (an FP32 matmul of the same exact
        products); exactly summable inputs give the reference's bits. Other dtypes (x in FP32,
        an FP32 head) are the reference's bits."""
        from custom_ops import head as ref_head
        from custom_ops.triton import triton_f32_linear
        N, K = 200, 320
        w = rnd(g, N, K).bfloat16()
        for M, x_dtype, w_ in ((6, torch.bfloat16, w), (1, torch.bfloat16, w), (6, torch.float32, w),
                               (6, torch.bfloat16, w.float())):
            x = rnd(g, M, K).to(x_dtype)
            out, ref = torch.full((M, N), float("nan")), torch.empty(M, N)
            triton_f32_linear(x, w_, out)
            ref_head.f32_linear(x, w_, ref)
            if x_dtype == torch.float32 or w_.dtype == torch.float32:
                assert torch.equal(out, ref)
                continue
            exact = x.double() @ w.double().T
            S = x.double().abs() @ w.double().abs().T
            assert ((out.double() - exact).abs() <= K * 2.0**-24 * S).all()
            assert ((out.double() - ref.double()).abs() <= 2 * K * 2.0**-24 * S).all()
        # integers below 2^8 (exact in bf16) whose every partial sum is exact in FP32: the bits
        xi = torch.randint(-8, 9, (5, K), generator=g).bfloat16()
        wi = torch.randint(-8, 9, (N, K), generator=g).bfloat16()
        out, ref = torch.full((5, N), float("nan")), torch.empty(5, N)
        triton_f32_linear(xi, wi, out)
        ref_head.f32_linear(xi, wi, ref)
        assert torch.equal(out, ref)

    def test_hc_collapse_expand(g):
        T, hc, D = 5, 4, 80
        X = rnd(g, T, hc, D)
        mix = torch.rand(T, hc, generator=g)
        ref, out = torch.empty(T, D), torch.full((T, D), float("nan"))
        ref_mhc.hc_collapse(X, mix, ref)
        triton_hc_collapse(X, mix, out, block_d=32)
        assert rel(out, ref) < 1e-5
        f = rnd(g, T, D)
        post, comb = torch.rand(T, hc, generator=g) * 2, torch.rand(T, hc, hc, generator=g)
        ref, out = torch.empty_like(X), nan_like(X)
        ref_mhc.hc_expand(f, X, post, comb, ref)
        triton_hc_expand(f, X, post, comb, out, block_d=32)
        assert rel(out, ref) < 1e-5

    def strided(t, kind):
        """t's values in another layout: "rev" stores the dims in reverse order (last stride
        != 1), "pad" pads every outer stride by 3 elements; both at storage offset 5."""
        if kind == "rev":
            strides = [math.prod(t.shape[:d]) for d in range(t.dim())]
        else:
            strides = [math.prod(n + 3 for n in t.shape[d + 1:]) if d < t.dim() - 1 else 1
                       for d in range(t.dim())]
        span = 1 + sum((n - 1) * st for n, st in zip(t.shape, strides))
        v = torch.zeros(span + 8, dtype=t.dtype).as_strided(t.shape, strides, 5)
        return v.copy_(t)

    def _layout_cases(g):
        """(name, impl, reference, args, index of the output) for the fused ops without a QAT
        rounding (so any layout gives the same values to FP32 rounding)."""
        T, hc, D = 5, 4, 64
        X, mix, f = rnd(g, T, hc, D), torch.rand(T, hc, generator=g), rnd(g, T, D)
        post, comb = torch.rand(T, hc, generator=g), torch.rand(T, hc, hc, generator=g)
        rope, pos = rope_table(), torch.randint(0, 512, (T,), generator=g)
        fn, base, scale = rnd(g, 24, hc * D, scale=0.05), rnd(g, 24), rnd(g, 3).abs()
        return [
            ("hc_collapse", triton_hc_collapse, ref_mhc.hc_collapse, [X, mix, torch.empty(T, D)], 2),
            ("hc_expand", triton_hc_expand, ref_mhc.hc_expand, [f, X, post, comb, torch.empty_like(X)], 4),
            ("engram_gate", triton_engram_gate, ref_engram.engram_gate,
             [X, rnd(g, T, (hc + 1) * D), rnd(g, hc, D), 1e-6, torch.empty_like(X)], 4),
            ("rms_norm", triton_rms_norm, ref_norm.rms_norm, [f, rnd(g, D), 1e-6, torch.empty_like(f)], 3),
            ("rope", triton_rope, ref_rope.rope,
             [rnd(g, T, 3, D), rope.cos, rope.sin, pos, False, torch.empty(T, 3, D)], 5),
            ("inv_rope_wo_a", triton_inv_rope_wo_a, ref_attn_out.inv_rope_wo_a,
             [rnd(g, T, 4, 48), rope.cos, rope.sin, pos, rnd(g, 2, 24, 96, scale=0.1), torch.empty(T, 48)], 5),
            ("mhc_mix", triton_mhc_mix, ref_mhc.mhc_mix,
             [X, fn, base, scale, 20, 1e-6, 1e-20, torch.empty(T, hc), torch.empty(T, hc),
              torch.empty(T, hc, hc)], 7),
        ]

    @pytest.mark.parametrize("kind", ["rev", "pad"])
    def test_fused_ops_take_any_layout(g, kind):
        """Inductor may hand an op any strides: every tensor argument in turn (outputs too) in
        another layout gives the reference's values."""
        for name, impl, ref_fn, args, o in _layout_cases(g):
            want = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            ref_fn(*want)
            for i, a in enumerate(args):
                if not isinstance(a, torch.Tensor) or a.dim() < 2 or a.dtype != torch.float32:
                    continue
                trial = [b.clone() if isinstance(b, torch.Tensor) else b for b in args]
                trial[i] = strided(a, kind)
                if i == o:
                    trial[i].fill_(float("nan"))
                impl(*trial)
                outs = [o] if name != "mhc_mix" else [7, 8, 9]
                for j in outs:
                    assert rel(trial[j], want[j]) < 1e-5, (name, kind, i, j)

    def _route_inputs(g, T, E, D, dup):
        if dup:
            x = torch.randint(-8, 9, (T, D), generator=g) / 8
            gate = (torch.randint(-8, 9, (E // 2, D), generator=g) / 64).repeat_interleave(2, 0)
            bias = (torch.randint(-2, 3, (E // 2,), generator=g) / 4).repeat_interleave(2, 0)
        else:
            x, gate, bias = rnd(g, T, D), rnd(g, E, D, scale=0.2), rnd(g, E, scale=0.1)
        return x.float(), gate.float(), bias.float()

    def _near_ties(x, gate, bias, k, tol=1e-5):
        """Tokens whose biased scores have two distinct values within tol among the top k+1."""
        s = F.softplus(x @ gate.T).sqrt() + bias
        top = s.sort(-1, descending=True).values[:, : k + 1].double()
        gap = (top[:, :-1] - top[:, 1:]).abs()
        return ((gap > 0) & (gap < tol * top[:, :-1].abs().clamp(min=1e-3))).any(-1)

    @pytest.mark.parametrize("dup", [False, True])
    @pytest.mark.parametrize("split", [None, 2])
    def test_moe_route(g, dup, split):
        T, E, D, k = 13, 24, 64, 5
        x, gate, bias = _route_inputs(g, T, E, D, dup)
        ri, rw = torch.empty(T, k, dtype=torch.long), torch.empty(T, k)
        ref_moe.moe_route(x, gate, bias, k, 1.5, ri, rw)
        ids, w = torch.full((T, k), -7, dtype=torch.long), torch.full((T, k), float("nan"))
        triton_moe_route(x, gate, bias, k, 1.5, ids, w, split=split)
        keep = ~_near_ties(x, gate, bias, k)
        assert keep.sum() >= T - 2
        assert torch.equal(ids[keep], ri[keep])
        assert rel(w[keep], rw[keep]) < 1e-5
        assert (ids >= 0).all() and not w.isnan().any()

    def _expert_h(x, ids, weights, w1, w3, limit):
        """The reference's pre-quant input of w2, per (token, slot), and the relative error to
        allow in it: an FP32 dot of K terms is good to about one ulp of the sum of |terms|, so a
        dot that cancels (|sum| << sum of |terms|) carries a larger relative error."""
        xq = quant.fp8_qat(x)
        e = ids.clamp(min=0)
        g = torch.einsum("td,tkid->tki", xq, w1[e]).clamp(max=limit)
        u = torch.einsum("td,tkid->tki", xq, w3[e]).clamp(-limit, limit)

        def cond(w):
            xd, wd = xq.double(), w[e].double()
            return (torch.einsum("td,tkid->tki", xd.abs(), wd.abs())
                    / torch.einsum("td,tkid->tki", xd, wd).abs().clamp(min=1e-30))
        tol = (2.0**-24 * torch.maximum(cond(w1), cond(w3))).clamp(min=1e-6)
        return F.silu(g) * u * weights[..., None], tol

    @pytest.mark.parametrize("kw", [{}, {"block_m": 16, "block_n_up": 32, "block_n_down": 16,
                                         "block_k": 16}])
    def test_moe_experts(g, kw):
        T, E, D, I, k = 21, 6, 64, 64, 3
        x = rnd(g, T, D)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        ids[torch.rand(T, k, generator=g) < 0.15] = -1     # padding slots
        ids[3] = -1                                         # a padding token
        ids[ids == 5] = -1                                  # expert 5 gets no token
        weights = torch.rand(T, k, generator=g)
        w1, w3 = rnd(g, E, I, D, scale=0.2), rnd(g, E, I, D, scale=0.2)
        w2 = rnd(g, E, D, I, scale=0.2)
        ref, out = torch.empty(T, D), torch.full((T, D), float("nan"))
        ref_moe.moe_experts(x, ids, weights, w1, w3, w2, 1.0, ref)
        triton_moe_experts(x, ids, weights, w1, w3, w2, 1.0, out, **kw)
        assert not out.isnan().any()
        assert (out[3] == 0).all()
        h, tol = _expert_h(x, ids, weights, w1, w3, 1.0)
        flip = (fp8_near_boundary(h, tol) & (ids >= 0)[..., None]).flatten(1).any(-1)
        assert flip.float().mean() < 0.25
        assert rel(out[~flip], ref[~flip]) < 1e-5
        assert rel(out, ref) < 1e-2

    def test_engram_gather(g):
        rows, d, T, n = 40, 64, 5, 6
        table = torch.randint(0, 256, (rows, d), generator=g, dtype=torch.uint8)
        table[(table & 0x7F) == 0x7F] = 0                   # no NaN codes
        scale = torch.randint(100, 150, (rows, d // 32), generator=g, dtype=torch.uint8)
        scale[0, 0] = 0                                     # the subnormal 2^-127
        ids = torch.randint(0, rows, (T, n), generator=g)
        ids[0, 0] = 0
        table, scale = table.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu)
        ref, out = torch.empty(T, n * d), torch.full((T, n * d), float("nan"))
        ref_engram.engram_gather(table, scale, ids, ref)
        triton_engram_gather(table, scale, ids, out)
        assert torch.equal(out, ref)

    def test_engram_gate(g):
        T, hc, D = 6, 4, 80
        X, kv, wqk = rnd(g, T, hc, D), rnd(g, T, (hc + 1) * D), rnd(g, hc, D)
        X[0] = 0
        ref, out = torch.empty_like(X), nan_like(X)
        ref_engram.engram_gate(X, kv, wqk, 1e-6, ref)
        triton_engram_gate(X, kv, wqk, 1e-6, out)
        assert rel(out, ref) < 1e-5

    def test_registry_selection():
        sel = registry.selected()
        for name in ("rms_norm", "rms_norm_fp8", "rms_norm_act_quant", "hc_collapse_rms_norm_act_quant", "rope",
                     "rope_fp8_qat", "rms_norm_rope_fp8_qat", "inv_rope_wo_a", "mhc_mix", "hc_collapse", "hc_expand",
                     "moe_route", "moe_experts", "engram_gate", "engram_gather", "f32_linear"):
            assert sel[f"v41::{name}"] == {"cpu": "reference", "cuda": "triton"}, name
