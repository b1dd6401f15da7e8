"""The fused ops the compile passes lower the model to (custom_ops/norm.py, rope.py, attn_out.py,
mhc.py, moe.py, engram.py), on the CPU.

(a) Each reference impl equals the eager model's own composition bitwise, in float64, float32
    and bfloat16, on fresh random inputs (seed printed; V41_TEST_SEED pins one).
(b) Each Triton impl (custom_ops/triton) under the Triton interpreter, FP32 and tiny shapes,
    against the reference impl: outputs poisoned first (every element must be written), fresh
    random inputs every run, ‖out−ref‖/‖ref‖ < 1e-5, routing ids exact. An FP8 QAT may round
    differently where its input sits within a few FP32 ulps (1e-6 relative) of a grid midpoint
    (or its group amax/448 of a power of two): the two impls sum in different orders, so their
    FP32 inputs to the quantizer can differ by an ulp. Such elements (tokens, for the experts)
    are identified from the reference's own pre-quant values and excluded from the 1e-5 check;
    everything else must meet it. Routing near-ties (distinct biased scores within 1e-5) are
    excluded likewise; exact ties (duplicated router rows) must resolve to the smaller id.
(c) torch.library.opcheck passes for every fused op (and the two existing ops given Triton
    impls here: moe_experts, engram_gather).

TRITON_INTERPRET must be set before triton is imported, so (b) runs in a subprocess with it set
(as tests/test_kernels_cpu.py does), once with the grid's programs in order and once reversed
(tests/program_order.py); in that subprocess this module defines only the (b) tests.
"""
from __future__ import annotations

import math
import os

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
from tests.kernel_cases import run_under_interpreter
from v41 import quant

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
SEED = int(os.environ.get("V41_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
YARN = {"original_max_position_embeddings": 256, "factor": 16, "beta_fast": 32, "beta_slow": 1}
ops = torch.ops.v41


@pytest.fixture
def g(request):
    seed = SEED + sum(map(ord, request.node.name))
    print(f"seed {seed} (V41_TEST_SEED={SEED})")
    return torch.Generator().manual_seed(seed)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def acc_of(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def rnd(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def rope_table(rot=16, max_pos=512, yarn=True):
    from v41.layers import Rope
    return Rope(rot, 160000.0 if yarn else 10000.0, YARN if yarn else None, max_pos)


def fp8_near_boundary(pre: torch.Tensor, tol=1e-6) -> torch.Tensor:
    """Elements of `pre` ([..., D], D a multiple of 32) whose FP8 QAT (group 32) could change
    under a relative perturbation of `tol` (a float, or a tensor of per-element tolerances shaped
    like `pre`): the value is within tol of a rounding midpoint of its group's grid, or the
    group's amax/448 is within tol of a power of two (a scale step)."""
    w = pre.double().unflatten(-1, (-1, 32))
    tw = torch.as_tensor(tol, dtype=torch.float64).expand_as(pre).unflatten(-1, (-1, 32))
    r = w.abs().amax(-1, keepdim=True).clamp(min=quant.FP8_AMAX_FLOOR) / quant.E4M3_MAX
    lg = torch.log2(r)
    scale_near = (lg - lg.round()).abs() < 2 * tw.amax(-1, keepdim=True)
    s = torch.exp2(torch.ceil(lg))
    v = (w / s).abs().clamp(max=quant.E4M3_MAX)
    e = torch.floor(torch.log2(v.clamp(min=2.0**-30))).clamp(min=-6)
    quantum = torch.exp2(e - 3)
    u = v / quantum
    mid_near = ((u - torch.floor(u)) - 0.5).abs() <= 2 * tw * u + 1e-9
    return (mid_near | scale_near).flatten(-2)


def assert_qat_close(out, ref, pre, tol=1e-5):
    """out == ref to `tol` except at the FP8 rounding boundaries of the reference's pre-quant
    values (within 1e-6 relative: a few FP32 ulps), where the neighbouring grid value is allowed
    too."""
    near = fp8_near_boundary(pre)
    ok = torch.isclose(out.double(), ref.double(), rtol=tol, atol=0) | near
    assert ok.all(), (out[~ok][:8], ref[~ok][:8])
    assert rel(out[~near], ref[~near]) < tol


if not INTERPRETED:
    from v41 import layers
    from v41.engram.device import Engram
    from v41.model import MHC, collapse, expand
    from v41.moe import MoE

    DTYPES = [torch.float64, torch.float32, torch.bfloat16]

    # ---- (a) reference == eager composition, bitwise ------------------------------------------
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("shape", [(7, 96), (5, 3, 64)])
    def test_rms_norm_reference(g, dtype, shape):
        x = rnd(g, *shape, dtype=dtype, scale=3.0)
        w = rnd(g, shape[-1], dtype=dtype)
        eps = 1e-6
        out = torch.empty_like(x)
        ops.rms_norm(x, w, eps, out)
        assert torch.equal(out, layers.RMSNorm(w, eps)(x))
        ops.rms_norm_fp8(x, w, eps, out)
        assert torch.equal(out, quant.fp8_qat(layers.RMSNorm(w, eps)(x), 32))
        # what the eager model computes next: the FP8 Linear of the normed input (its GEMM is
        # quant.matmul's, which a plain CPU bf16 `@` matches on some seeds only: AVX2 hosts)
        W = rnd(g, 40, shape[-1], dtype=dtype)
        assert torch.equal(quant.matmul(out, W.T), layers.Linear(W, "fp8")(layers.RMSNorm(w, eps)(x)))

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("yarn", [False, True])
    def test_rope_reference(g, dtype, yarn):
        rope = rope_table(yarn=yarn)
        T = 9
        pos = torch.randint(0, 512, (T,), generator=g)
        for shape in ((T, 4, 64), (T, 96)):
            x = rnd(g, *shape, dtype=dtype)
            out = torch.empty_like(x)
            for inverse in (False, True):
                ops.rope(x, rope.cos, rope.sin, pos, inverse, out)
                assert torch.equal(out, rope(x, pos, inverse=inverse))
        # the window KV path: kv_norm -> RoPE -> FP8 QAT
        kv = layers.RMSNorm(rnd(g, 96, dtype=dtype), 1e-6)(rnd(g, T, 96, dtype=dtype))
        out = torch.empty_like(kv)
        ops.rope_fp8_qat(kv, rope.cos, rope.sin, pos, False, out)
        assert torch.equal(out, quant.fp8_qat(rope(kv, pos)))

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_inv_rope_wo_a_reference(g, dtype):
        rope = rope_table()
        T, H, d, G, R = 6, 4, 64, 2, 24
        o = rnd(g, T, H, d, dtype=dtype)
        wo_a = rnd(g, G * R, H * d // G, dtype=dtype, scale=0.1).view(G, R, -1)
        pos = torch.randint(0, 512, (T,), generator=g)
        out = torch.empty(T, G * R, dtype=dtype)
        ops.inv_rope_wo_a(o, rope.cos, rope.sin, pos, wo_a, out)
        # the end of Attention.forward (quant.einsum: bf16 operands summed as the FP32 GEMM)
        z = quant.einsum("tgi,goi->tgo", rope(o, pos, inverse=True).view(T, G, -1), wo_a).flatten(1)
        assert torch.equal(out, z)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_mhc_reference(g, dtype):
        T, hc, D = 7, 4, 32
        acc = acc_of(dtype)
        X = rnd(g, T, hc, D, dtype=dtype)
        fn = rnd(g, hc * (hc + 2), hc * D, dtype=acc, scale=0.1)
        base, scale = rnd(g, hc * (hc + 2), dtype=acc), rnd(g, 3, dtype=acc).abs()
        pre, post = torch.empty(T, hc, dtype=acc), torch.empty(T, hc, dtype=acc)
        comb = torch.empty(T, hc, hc, dtype=acc)
        ops.mhc_mix(X, fn, base, scale, 20, 1e-6, 1e-20, pre, post, comb)
        p, q, c = MHC(fn, base, scale, hc, 20, 1e-6, 1e-20)(X)
        assert torch.equal(pre, p) and torch.equal(post, q) and torch.equal(comb, c)
        out = torch.empty(T, D, dtype=dtype)
        ops.hc_collapse(X, pre, out)
        assert torch.equal(out, collapse(X, pre))
        f = rnd(g, T, D, dtype=dtype)
        Y = torch.empty_like(X)
        ops.hc_expand(f, X, post, comb, Y)
        assert torch.equal(Y, expand(f, X, post, comb))

    def _moe(g, dtype, E, D, I, top_k, dup=False):
        acc = acc_of(dtype)
        gate = rnd(g, E, D, dtype=acc, scale=0.2)
        bias = rnd(g, E, dtype=acc, scale=0.1)
        if dup:   # exact ties: pairs of identical router rows with identical biases
            gate = (torch.randint(-8, 9, (E // 2, D), generator=g) / 64).to(acc).repeat_interleave(2, 0)
            bias = (torch.randint(-2, 3, (E // 2,), generator=g) / 4).to(acc).repeat_interleave(2, 0)
        w = {"gate": gate, "gate.bias": bias,
             "experts.w1": rnd(g, E, I, D, dtype=dtype, scale=0.2),
             "experts.w3": rnd(g, E, I, D, dtype=dtype, scale=0.2),
             "experts.w2": rnd(g, E, D, I, dtype=dtype, scale=0.2),
             "shared_experts.w1": rnd(g, I, D, dtype=dtype), "shared_experts.w3": rnd(g, I, D, dtype=dtype),
             "shared_experts.w2": rnd(g, D, I, dtype=dtype)}
        return MoE(w, top_k, 1.5, 10.0)

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("dup", [False, True])
    def test_moe_route_reference(g, dtype, dup):
        T, E, D, k = 11, 8, 32, 3
        moe = _moe(g, dtype, E, D, 32, k, dup)
        x = rnd(g, T, D, dtype=dtype)
        if dup:
            x = (torch.randint(-8, 9, (T, D), generator=g) / 8).to(dtype)
        ids = torch.empty(T, k, dtype=torch.long)
        w = torch.empty(T, k, dtype=acc_of(dtype))
        ops.moe_route(x, moe.gate, moe.bias, k, 1.5, ids, w)
        ri, rw = moe.route(x)
        assert torch.equal(ids, ri) and torch.equal(w, rw)

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_engram_gate_reference(g, dtype):
        T, hc, D, width = 5, 4, 32, 96
        w = {"engram.wkv": rnd(g, (hc + 1) * D, width, dtype=dtype, scale=0.2),
             "engram.q_weight": rnd(g, hc, D, dtype=dtype), "engram.k_weight": rnd(g, hc, D, dtype=dtype)}
        eng = Engram(w, hc, 1e-6)
        X, rows = rnd(g, T, hc, D, dtype=dtype), rnd(g, T, width, dtype=dtype)
        X[0] = 0                                   # dot = +0: the gate's copysign branch
        out = torch.empty_like(X)
        ops.engram_gate(X, eng.wkv(rows), eng.wqk, 1e-6, out)
        assert torch.equal(out, eng(X, rows))

    # ---- (c) opcheck --------------------------------------------------------------------------
    def _opcheck_cases(g):
        rope = rope_table()
        T, hc, D = 4, 4, 32
        x = rnd(g, T, 64)
        pos = torch.randint(0, 512, (T,), generator=g)
        X = rnd(g, T, hc, D)
        fn, base, scale = rnd(g, 24, hc * D, scale=0.1), rnd(g, 24), rnd(g, 3).abs()
        E, I, k = 4, 32, 2
        ids = torch.tensor([[0, 2], [1, -1], [3, 0], [2, 1]])
        # raw bytes (the op reads the FP8 / E8M0 planes as uint8; opcheck's schema check cannot
        # compare float8 tensors)
        table = torch.randint(0, 126, (10, 64), generator=g, dtype=torch.uint8)
        tscale = torch.randint(120, 130, (10, 2), generator=g, dtype=torch.uint8)
        return {
            "rms_norm": (x, rnd(g, 64), 1e-6, torch.empty(T, 64)),
            "rms_norm_fp8": (x, rnd(g, 64), 1e-6, torch.empty(T, 64)),
            "rope": (rnd(g, T, 2, 64), rope.cos, rope.sin, pos, True, torch.empty(T, 2, 64)),
            "rope_fp8_qat": (x, rope.cos, rope.sin, pos, False, torch.empty(T, 64)),
            "inv_rope_wo_a": (rnd(g, T, 2, 64), rope.cos, rope.sin, pos, rnd(g, 2, 16, 64),
                              torch.empty(T, 32)),
            "mhc_mix": (X, fn, base, scale, 20, 1e-6, 1e-20, torch.empty(T, hc), torch.empty(T, hc),
                        torch.empty(T, hc, hc)),
            "hc_collapse": (X, torch.rand(T, hc, generator=g), torch.empty(T, D)),
            "hc_expand": (rnd(g, T, D), X, torch.rand(T, hc, generator=g),
                          torch.rand(T, hc, hc, generator=g), torch.empty(T, hc, D)),
            "moe_route": (rnd(g, T, D), rnd(g, E, D), rnd(g, E), k, 1.5,
                          torch.empty(T, k, dtype=torch.long), torch.empty(T, k)),
            "moe_experts": (rnd(g, T, D), ids, torch.rand(T, k, generator=g), rnd(g, E, I, D),
                            rnd(g, E, I, D), rnd(g, E, D, I), 10.0, torch.empty(T, D)),
            "engram_gate": (X, rnd(g, T, (hc + 1) * D), rnd(g, hc, D), 1e-6, torch.empty(T, hc, D)),
            "engram_gather": (table, tscale, torch.randint(0, 10, (T, 3), generator=g),
                              torch.empty(T, 3 * 64)),
        }

    OPCHECK_OPS = ["rms_norm", "rms_norm_fp8", "rope", "rope_fp8_qat", "inv_rope_wo_a", "mhc_mix",
                   "hc_collapse", "hc_expand", "moe_route", "moe_experts", "engram_gate",
                   "engram_gather"]

    @pytest.mark.parametrize("name", OPCHECK_OPS)
    def test_opcheck(g, name):
        args = _opcheck_cases(g)[name]
        torch.library.opcheck(getattr(ops, name).default, args)

    def test_fused_ops_defined():
        defined = custom_ops.defined()
        for name in OPCHECK_OPS:
            assert f"v41::{name}" in defined

    # ---- (b) in a subprocess under the interpreter ----------------------------------------------
    @pytest.mark.parametrize("order", ["forward", "reversed"])
    def test_fused_kernels_under_triton_interpreter(order):
        pytest.importorskip("triton")
        run_under_interpreter(__file__, order, timeout=600, V41_TEST_SEED=str(SEED))

else:
    pytest.importorskip("triton")
    from tests import program_order
    program_order.apply()
    from custom_ops import registry
    from custom_ops.triton import (triton_engram_gate, triton_engram_gather, triton_hc_collapse,
                                   triton_hc_expand, triton_inv_rope_wo_a, triton_mhc_mix,
                                   triton_moe_experts, triton_moe_route, triton_rms_norm,
                                   triton_rms_norm_fp8, triton_rope, triton_rope_fp8_qat)
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

    @pytest.mark.parametrize("shape", [(7, 96), (3, 2, 2080)])
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

    @pytest.mark.parametrize("kw", [{}, {"block_m": 16, "block_n": 16, "block_k": 16}])
    def test_inv_rope_wo_a(g, kw):
        rope = rope_table()
        T, H, d, G, R = 19, 4, 48, 2, 24
        o = rnd(g, T, H, d)
        wo_a = rnd(g, G, R, H * d // G, scale=0.1)
        pos = torch.randint(0, 512, (T,), generator=g)
        ref, out = torch.empty(T, G * R), torch.full((T, G * R), float("nan"))
        ref_attn_out.inv_rope_wo_a(o, rope.cos, rope.sin, pos, wo_a, ref)
        triton_inv_rope_wo_a(o, rope.cos, rope.sin, pos, wo_a, out, **kw)
        assert rel(out, ref) < 1e-5

    @pytest.mark.parametrize("split,block_t,block_s,D", [(None, None, None, 48), (3, 4, None, 48),
                                                         (20, 16, 8, 320), (20, 1, None, 320)])
    def test_mhc_mix(g, split, block_t, block_s, D):
        """20 splits summed 8 a load (the last load part masked), and a one-token program's
        default: all 20 in one load."""
        T, hc = 7, 4
        X = rnd(g, T, hc, D)
        fn, base, scale = rnd(g, 24, hc * D, scale=0.05), rnd(g, 24), rnd(g, 3).abs()
        refs = [torch.empty(T, hc), torch.empty(T, hc), torch.empty(T, hc, hc)]
        outs = [nan_like(r) for r in refs]
        ref_mhc.mhc_mix(X, fn, base, scale, 20, 1e-6, 1e-20, *refs)
        triton_mhc_mix(X, fn, base, scale, 20, 1e-6, 1e-20, *outs, split=split, block_t=block_t,
                       block_s=block_s)
        for o, r in zip(outs, refs):
            assert rel(o, r) < 1e-5

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
        for name in ("rms_norm", "rms_norm_fp8", "rope", "rope_fp8_qat", "inv_rope_wo_a", "mhc_mix",
                     "hc_collapse", "hc_expand", "moe_route", "moe_experts", "engram_gate",
                     "engram_gather"):
            assert sel[f"v41::{name}"] == {"cpu": "reference", "cuda": "triton"}, name


def test_engram_gather_forgets_a_freed_table():
    """The reference gather decodes a small table once and keys it by address and version. A
    second table of the same shape (another checkpoint of the preset, in one process) can land
    at a freed table's address with version 0: its gather must read its own rows. The cache
    entry goes with its table (deterministic check), and gathers right after a free, tried until
    the allocator reuses the address or 200 times, equal the rows decoded directly."""
    import gc
    ids = torch.arange(20).view(10, 2)

    def make(seed):
        g = torch.Generator().manual_seed(seed)
        t = torch.randint(0, 127, (630, 32), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
        s = torch.randint(120, 130, (630, 1), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        return t, s

    def gathered(t, s):
        out = torch.empty(10, 64)
        torch.ops.v41.engram_gather(t, s, ids, out)
        return out

    def direct(t, s):
        rows = t.float()[ids.reshape(-1)].unflatten(-1, (-1, 32)) * s.float()[ids.reshape(-1)][..., None]
        return rows.flatten(-2).reshape(10, 64)

    t, s = make(1)
    gathered(t, s)
    ptr = t.data_ptr()
    assert any(k[0] == ptr for k in ref_engram._decoded)
    del t, s
    gc.collect()
    assert not any(k[0] == ptr for k in ref_engram._decoded)
    for trial in range(200):
        t1, s1 = make(2 * trial)
        gathered(t1, s1)
        ptr = t1.data_ptr()
        del t1, s1
        t2, s2 = make(2 * trial + 1)
        assert torch.equal(gathered(t2, s2), direct(t2, s2))
        if t2.data_ptr() == ptr:
            break
