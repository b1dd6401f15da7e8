"""The native-format GEMMs (custom_ops/gemm.py) under the Triton interpreter: the Triton impls
against the reference (dequantize, multiply in FP32) on the same quantized inputs, FP8 loads and
FP8 dots included (the interpreter runs them), outputs poisoned with NaN first.

The bound. Every product of an E4M3·2^a activation and an E4M3·2^b or E2M1·2^b weight is exact
in FP32 (at most 4 x 4 significant bits), and the power-of-two scale promotion is exact, so the
kernel and the reference are two FP32 summations of the same K exact products. A summation of
K terms in any order (any tree) is within γ_K·S of the exact sum, S = Σ|products|, γ_K =
K·u/(1-K·u), u = 2^-24 (Higham, Accuracy and Stability, §4.2). So each is within γ_K·S of the
float64 product and the two within 2·γ_K·S; a bf16 output adds one rounding, 2^-8 of |exact|.
Inputs whose partial sums are all exact (tests/kernel_cases.py, `exact`) must match bitwise.

As in test_kernels_cpu.py, unless this process runs with TRITON_INTERPRET=1 the module reruns
itself in a subprocess with it set, programs in order and reversed.
"""
from __future__ import annotations

import itertools
import os

import pytest

from tests.kernel_cases import run_under_interpreter

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if not INTERPRETED:
    @pytest.mark.parametrize("order", ["forward", "reversed"])
    def test_native_gemm_under_triton_interpreter(order):
        run_under_interpreter(__file__, order, timeout=900)

else:
    import torch

    from tests import program_order
    program_order.apply()

    import custom_ops  # noqa: F401
    from custom_ops import gemm as ref
    from custom_ops import registry
    from custom_ops.triton import triton_fp8_act_quant, triton_fp8_block_gemm, triton_fp8_linear, \
        triton_moe_experts_w4a8
    from custom_ops.triton.fp8 import tile_counters
    from custom_ops.triton.fp8_gemm import quantizes_inside
    import triton
    import triton.language as tl

    from custom_ops.triton.fp8 import e8m0_to_f32
    from custom_ops.triton.fp4 import e2m1_e4m3
    from custom_ops.triton.moe import run_experts
    from tests.kernel_cases import fp8_gemm_case, fp8_grouped_case, rne_bf16_casts, w4a8_case
    from v41 import quant

    U = 2.0**-24

    def gamma(k: int) -> float:
        return k * U / (1 - k * U)

    def dequant_act(q, s):
        return q.double() * s.double().repeat_interleave(32, -1)

    def exact_and_abs(xq, xs, w, ws):
        """(float64 product, Σ|products|) of the dequantized operands."""
        x, wd = dequant_act(xq, xs), quant.dequant_fp8_block(w, ws, torch.float64)
        return x @ wd.T, x.abs() @ wd.abs().T

    # ---- fp8_act_quant ---------------------------------------------------------------------
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_fp8_act_quant(g, dtype):
        x = (torch.randn(37, 160, generator=g) * torch.exp2(torch.randint(-12, 8, (37, 5), generator=g))
             .repeat_interleave(32, -1)).to(dtype)
        x[3, :32] = 0                                                 # the amax floor
        q, s = torch.empty(37, 160, dtype=torch.float8_e4m3fn), torch.empty(37, 5)
        ref.fp8_act_quant(x, q, s)
        assert torch.equal(dequant_act(q, s).to(dtype), quant.fp8_qat(x))
        q2, s2 = torch.full_like(q, float("nan")), torch.full_like(s, float("nan"))
        triton_fp8_act_quant(x, q2, s2)
        assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)

    # ---- fp8_block_gemm --------------------------------------------------------------------
    @pytest.mark.parametrize("M", [1, 2, 7, 16, 33, 64, 2048])
    def test_fp8_block_gemm_exact(g, M):
        """Exactly summable inputs: kernel == reference == float64, bitwise (N ragged: 80 is not
        a multiple of the 64-wide tile, 40 not of the 32-row scale block)."""
        for N, K in ((80, 256), (40, 64)):
            if M == 2048 and N == 80:
                continue
            xq, xs, w, ws = fp8_gemm_case(g, M, N, K, exact=True)
            exact, _ = exact_and_abs(xq, xs, w, ws)
            r = torch.empty(M, N)
            ref.fp8_block_gemm(xq, xs, w, ws, r)
            assert torch.equal(r.double(), exact)
            # K = 256: 8 blocks, 4 per iteration, as 4 + 4; K = 64: 2 blocks, 1 per iteration, 2 splits
            # of 1; the GEMV (by default at one row) and the MMA tiles at every width up to 16
            paths = ("gemv", "mma") if M <= 16 else (None,)
            for split_k, path in itertools.product((1, 3), paths):
                out = torch.full((M, N), float("nan"))
                triton_fp8_block_gemm(xq, xs, w, ws, out, split_k=split_k, path=path)
                assert torch.equal(out, r), (split_k, path)
                # the last split of each tile summed it and left its counter at zero for the next call
                assert not tile_counters(out.device, 0).any()

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("M,G,kw", [(1, 1, {}), (7, 1, {"split_k": 3}), (16, 3, {}), (5, 3, {"split_k": 2}),
                                        (33, 1, {}), (33, 3, {"split_k": 2}), (1, 1, {"path": "mma"}),
                                        (2, 3, {"split_k": 2}), (3, 1, {"path": "gemv"})])
    def test_fp8_linear_equals_quant_then_gemm(g, dtype, M, G, kw):
        """`fp8_linear` on x in the activation dtype == `fp8_act_quant` then `fp8_block_gemm`,
        bitwise: x quantized inside the GEMV (or, path "mma" at one row, the MMA tile) gives the
        act-quant kernel's codes and scales and the same sums; the reference likewise."""
        N, K = 96, 320
        x = (torch.randn(M, G * K, generator=g) *
             torch.exp2(torch.randint(-6, 6, (M, G * K // 32), generator=g)).repeat_interleave(32, -1)).to(dtype)
        x[0, :32] = 0                                                   # the amax floor
        _, _, w, ws = fp8_gemm_case(g, 1, G * N, K)
        q, s = torch.empty(M, G * K, dtype=torch.float8_e4m3fn), torch.empty(M, G * K // 32)
        triton_fp8_act_quant(x, q, s)
        want = torch.full((M, G * N), float("nan"), dtype=dtype)
        triton_fp8_block_gemm(q, s, w, ws, want, G, **kw)
        out = torch.full_like(want, float("nan"))
        triton_fp8_linear(x, w, ws, out, G, **kw)
        assert not want.isnan().any() and torch.equal(out, want)
        r1, r2 = torch.empty_like(want), torch.empty_like(want)
        ref.fp8_linear(x, w, ws, r1, G)
        ref.fp8_act_quant(x, q, s)
        ref.fp8_block_gemm(q, s, w, ws, r2, G)
        assert torch.equal(r1, r2)

    def test_fp8_block_gemm_split_k_sums_every_split(g, monkeypatch):
        """Split-K partials are summed only once every split has stored its own: with the
        partial buffer NaN-poisoned at allocation, a sum that ran early would carry NaN (the
        interpreter runs the programs one after another, in grid order and reversed)."""
        real_empty = torch.empty
        monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
        for M, N, K, split_k in ((1, 80, 256, 2), (7, 40, 320, 5)):
            xq, xs, w, ws = fp8_gemm_case(g, M, N, K, exact=True)
            exact, _ = exact_and_abs(xq, xs, w, ws)
            out = torch.full((M, N), float("nan"))
            triton_fp8_block_gemm(xq, xs, w, ws, out, split_k=split_k)
            assert torch.equal(out.double(), exact)
            assert not tile_counters(out.device, 0).any()

    @pytest.mark.parametrize("M", [1, 7, 33])
    def test_fp8_block_gemm_grouped(g, M):
        """groups = 3 (wo_a's form): x [M, 3·K], w [3·R, K]; group g's output columns are x's g-th
        slice times w's g-th rows. Exactly summable inputs: kernel == reference == float64 per
        group, bitwise, with 64-wide tiles narrowed to the group's 32 rows, split or not."""
        G, R, K = 3, 32, 256
        xq, xs, w, ws = fp8_grouped_case(g, M, G, R, K, exact=True)
        x, wd = dequant_act(xq, xs), quant.dequant_fp8_block(w, ws, torch.float64)
        exact = torch.cat([x[:, i * K:(i + 1) * K] @ wd[i * R:(i + 1) * R].T for i in range(G)], -1)
        r = torch.empty(M, G * R)
        ref.fp8_block_gemm(xq, xs, w, ws, r, G)
        assert torch.equal(r.double(), exact)
        for split_k, path in ((1, None), (3, None)):
            out = torch.full((M, G * R), float("nan"))
            triton_fp8_block_gemm(xq, xs, w, ws, out, G, split_k=split_k, path=path)
            assert torch.equal(out, r), (split_k, path)
        with pytest.raises(ValueError, match="not 2 groups"):
            ref.fp8_block_gemm(xq, xs, w, ws, r, 2)

    @pytest.mark.parametrize("M,kw", [(1, {}), (5, {"block_n": 32}), (16, {"block_m": 16}),
                                      (64, {"block_n": 128}), (64, {"block_m": 32, "block_n": 32}),
                                      (1, {"split_k": 4}), (7, {"split_k": 10}), (33, {"split_k": 3}),
                                      (33, {"unroll": 2, "split_k": 3}), (2, {"unroll": 5}),
                                      (1, {"path": "mma"}), (2, {"path": "mma", "split_k": 2}),
                                      (3, {"path": "gemv"}), (7, {"path": "gemv", "block_m": 4, "block_n": 32}),
                                      (1, {"block_k": 64, "split_k": 2}), (2, {"block_k": 128})])
    def test_fp8_block_gemm_bound(g, M, kw):
        N, K = 96, 320
        xq, xs, w, ws = fp8_gemm_case(g, M, N, K)
        exact, S = exact_and_abs(xq, xs, w, ws)
        r, out = torch.empty(M, N), torch.full((M, N), float("nan"))
        ref.fp8_block_gemm(xq, xs, w, ws, r)
        triton_fp8_block_gemm(xq, xs, w, ws, out, **kw)
        assert not out.isnan().any()
        bound = gamma(K) * S
        assert ((out.double() - exact).abs() <= bound).all()
        assert ((out.double() - r.double()).abs() <= 2 * bound).all()

    def test_fp8_linear_quantizes_inside_only_where_little_is_quantized(g, monkeypatch):
        """The rule (`quantizes_inside`) at Flash's one-row shapes, and the launches it makes:
        the act-quant kernel first for wider x and for a wide N."""
        from custom_ops.triton import fp8_gemm
        assert [quantizes_inside(1, N, K) for N, K in ((1280, 5120), (2304, 5120), (5120, 8192), (32768, 1280))] == \
            [True, True, False, False]
        assert not quantizes_inside(2, 1280, 5120)
        calls = []
        monkeypatch.setattr(fp8_gemm, "triton_fp8_act_quant",
                            lambda *a: calls.append(a[0].shape) or triton_fp8_act_quant(*a))
        monkeypatch.setattr(fp8_gemm, "FUSED_QUANT_WORK", 320 * 2)           # two 128-row tiles of K = 320
        for M, N in ((1, 256), (1, 384), (3, 96)):
            _, _, w, ws = fp8_gemm_case(g, 1, N, 320)
            x = torch.randn(M, 320, generator=g).bfloat16()
            fp8_gemm.triton_fp8_linear(x, w, ws, torch.empty(M, N, dtype=torch.bfloat16))
        assert calls == [(1, 320), (3, 320)]

    @pytest.mark.parametrize("M,kw", [(1, {"split_k": 3, "block_k": 64}), (2, {"block_k": 32}),
                                      (1, {"split_k": 5, "block_k": 64})])
    def test_fp8_gemv_prefetch_changes_no_bit(g, M, kw):
        """The GEMV's register prefetch of the next K block moves loads, not sums: the same bits
        from codes and from x in bf16, one split or several, one K block a split or many."""
        N, K = 96, 320
        xq, xs, w, ws = fp8_gemm_case(g, M, N, K)
        x = (xq.float() * xs.repeat_interleave(32, -1)).bfloat16()
        for run in (lambda o, **k: triton_fp8_block_gemm(xq, xs, w, ws, o, **k),
                    lambda o, **k: triton_fp8_linear(x, w, ws, o, **k)):
            outs = []
            for prefetch in (False, True):
                outs.append(torch.full((M, N), float("nan"), dtype=torch.bfloat16))
                run(outs[-1], path="gemv", prefetch=prefetch, **kw)
            assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1])

    def test_fp8_block_gemm_unknown_path(g):
        """An unknown path is refused by name (not run as another)."""
        xq, xs, w, ws = fp8_gemm_case(g, 2, 64, 64)
        with pytest.raises(ValueError, match="'gemm' is not"):
            triton_fp8_block_gemm(xq, xs, w, ws, torch.empty(2, 64), path="gemm")

    def test_split_k_fills_the_sms_at_decode_widths(monkeypatch):
        """Flash's wq_a at M = 1 (20 tiles of 64 over N = 1280, 160 K blocks) splits into two
        waves over 132 SMs; a GEMM with tiles for every SM does not split; CPU never does."""
        from types import SimpleNamespace

        from custom_ops.triton.fp8 import split_count
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
        cuda = torch.device("cuda")
        assert split_count(20, 160, 1, 5120, cuda) == 14 and split_count(20, 6, 1, 192, cuda) == 1
        # under 4 tiles per SM at least 4 splits (wq_b, 16384x4096 at M = 1), unless the FP32
        # partials would outweigh half the weight (wq_b at M = 64); 4 tiles per SM: no split
        assert split_count(512, 40, 1, 1280, cuda) == 4 and split_count(256, 128, 1, 4096, cuda) == 4
        assert split_count(512, 40, 64, 1280, cuda) == 1 and split_count(528, 160, 1, 5120, cuda) == 1
        assert split_count(20, 160, 1, 5120, torch.device("cpu")) == 1

    def test_fp8_block_gemm_bf16_out(g, monkeypatch):
        """bf16 output (the activation dtype of the model): one RNE rounding past the FP32 bound."""
        rne_bf16_casts(monkeypatch)
        M, N, K = 24, 72, 192
        xq, xs, w, ws = fp8_gemm_case(g, M, N, K)
        exact, S = exact_and_abs(xq, xs, w, ws)
        r = torch.empty(M, N, dtype=torch.bfloat16)
        out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
        ref.fp8_block_gemm(xq, xs, w, ws, r)
        triton_fp8_block_gemm(xq, xs, w, ws, out)
        bound = gamma(K) * S + 2.0**-8 * exact.abs()
        assert ((out.double() - exact).abs() <= bound).all()
        assert (out != r).float().mean() < 0.02

    def test_fp8_block_gemm_scale_codes(g):
        """E8M0 edge codes: 0 (2^-127, subnormal) and 255 (NaN) decode like quant.e8m0_decode."""
        xq, xs, w, ws = fp8_gemm_case(g, 4, 64, 64)
        codes = ws.view(torch.uint8).clone()
        codes[0, 0], codes[1, 1] = 0, 255
        ws2 = codes.view(torch.float8_e8m0fnu)
        r, out = torch.empty(4, 64), torch.empty(4, 64)
        ref.fp8_block_gemm(xq, xs, w, ws2, r)
        triton_fp8_block_gemm(xq, xs, w, ws2, out)
        assert out[:, 32:].isnan().all() and not out[:, :32].isnan().any()
        assert torch.allclose(out[:, :32], r[:, :32], rtol=1e-6, atol=0)

    @triton.jit
    def _decode_kernel(c_ptr, scale_ptr, e2m1_ptr):
        c = tl.load(c_ptr + tl.arange(0, 256))
        tl.store(scale_ptr + tl.arange(0, 256), e8m0_to_f32(c))
        tl.store(e2m1_ptr + tl.arange(0, 256), e2m1_e4m3(c & 15).to(tl.float8e4nv, bitcast=True).to(tl.float32))

    def test_decoders():
        """The kernels' decoders: every E8M0 code (0 the subnormal 2^-127, 255 NaN) to its FP32
        value, every E2M1 code to the E4M3 code of 2^-6 times its value (v41.quant's)."""
        c = torch.arange(256, dtype=torch.int32)
        scale, e2m1 = torch.empty(256), torch.empty(256)
        _decode_kernel[(1,)](c, scale, e2m1)
        want = c.to(torch.uint8).view(torch.float8_e8m0fnu).float()
        assert torch.equal(scale[:255], torch.where(c[:255] == 0, 2.0**-127, want[:255]))
        assert scale[255].isnan()
        assert torch.equal(e2m1 * 64, quant.e2m1_decode((c & 15).to(torch.uint8), torch.float32))

    # ---- moe_experts_w4a8 ------------------------------------------------------------------
    def pair_experts(ids, order):
        return ids.reshape(-1)[order.long()]

    def w4a8_expert_gemms(x, ids, wts, w1, s1, w3, s3, w2, s2, limit, **kw):
        """(h: w2's input rows in expert order, y: the per-pair outputs, order) of the op."""
        got: list = []
        scales = tuple(s.view(torch.uint8) for s in (s1, s3, s2))
        run_experts(x, ids, wts, w1, w3, w2, scales, limit, torch.empty(x.shape), hidden=got,
                    **{"block_k": 64, **kw})
        h, order, y = got
        return h, y, order

    @pytest.mark.parametrize("T,kw", [(1, {}), (6, {"block_m": 16, "block_n_up": 32, "block_n_down": 32}),
                                      (6, {"block_k": 32}), (16, {"block_k": 128}), (24, {"block_m": 64}),
                                      (6, {"block_k": 32, "splits": 2}), (9, {"block_k": 32, "splits": 2}),
                                      (3, {"num_stages": 1})])
    def test_w4a8_down_gemm_bound(g, T, kw):
        """The down GEMM alone: each pair's y against its own h codes · w2[e] in float64 (split-K:
        the splits' FP32 sums added in order, within the same bound)."""
        E, D, I, k = 5, 96, 64, 3
        args = w4a8_case(g, T, E, D, I, k)
        x, ids, wts, w1, s1, w3, s3, w2, s2 = args
        h, y, order = w4a8_expert_gemms(*args, 1.0, **kw)
        valid = (ids.reshape(-1) >= 0).nonzero().squeeze(1)
        e = ids.reshape(-1)[valid]
        w2d = quant.dequant_fp4_expert(w2, s2, torch.float64)[e]          # [P, D, I]
        sorted_row = torch.empty_like(order)
        sorted_row[order.long()] = torch.arange(order.numel(), dtype=order.dtype)
        h = h.double()[sorted_row[valid].long()]                            # [P, I]
        exact = torch.einsum("pi,pdi->pd", h, w2d)
        S = torch.einsum("pi,pdi->pd", h.abs(), w2d.abs())
        assert not y[valid].isnan().any()
        assert ((y[valid].double() - exact).abs() <= gamma(I) * S).all()

    @pytest.mark.parametrize("kw", [{}, {"block_k": 32, "splits": 2}], ids=["one-split", "split-k"])
    def test_w4a8_up_gemm_exact_inputs(g, kw):
        """Exactly summable inputs: the kernel's h (w2's quantized input) equals the reference's
        (fp8_qat of silu(g)·u·w with g, u exact), except where the pre-quant value sits within a
        few FP32 ulps of an FP8 rounding point (silu's exp may differ by an ulp): at most one
        element in a thousand, and then by one E4M3 step. Split-K sums exact partials: the same."""
        T, E, D, I, k, limit = 24, 6, 64, 96, 2, 1.0e4
        args = w4a8_case(g, T, E, D, I, k, exact=True)
        x, ids, wts, w1, s1, w3, s3, w2, s2 = args
        h, _, order = w4a8_expert_gemms(*args, limit, **kw)
        h = h.double()
        pe = pair_experts(ids, order)
        live = pe >= 0
        tok = (order.long() // k)[live]
        e = pe[live]
        w1d, w3d = (quant.dequant_fp4_expert(w, s, torch.float32)[e] for w, s in ((w1, s1), (w3, s3)))
        gg = torch.einsum("pd,pid->pi", x[tok], w1d).clamp(max=limit)
        uu = torch.einsum("pd,pid->pi", x[tok], w3d).clamp(-limit, limit)
        pre = torch.nn.functional.silu(gg) * uu * wts.reshape(-1)[order.long()][live, None]
        want = quant.fp8_qat(pre).double()
        diff = (h[live] != want)
        assert diff.float().mean() <= 1e-3
        assert ((h[live] - want).abs()[diff] <= want.abs()[diff] * 2.0**-3 + 1e-30).all()

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("T, path", [(1, None), (5, None), (5, "gemv"), (24, None), (12, "gemv"),
                                         (256, None), (1, "mma"), (1, "tiles"), (24, "tiles"), (256, "tiles")])
    def test_moe_experts_w4a8(g, monkeypatch, dtype, T, path):
        """The whole op against the reference: token 0 all padding (its row exactly 0; not at
        T = 1), expert E-1 empty, ragged groups. An FP32 reordering can move w2's pre-quant input across an FP8
        rounding point, which moves that token's row by one E4M3 step of one element; most rows
        match to FP32 rounding."""
        rne_bf16_casts(monkeypatch)
        E, D, I, k = 7, 64, 96, 3
        pad = T > 1
        args = w4a8_case(g, T, E, D, I, k, dtype=dtype, pad_token=pad)
        r = torch.empty(T, D)
        out = torch.full((T, D), float("nan"))
        ref.moe_experts_w4a8(*args, 1.5, r)
        triton_moe_experts_w4a8(*args, 1.5, out, path=path)
        assert not out.isnan().any() and (out[0] == 0).all() == pad
        row_err = (out - r).double().norm(dim=1) / r.double().norm(dim=1).clamp(min=1e-30)
        tight = 1e-5 if dtype == torch.float32 else 1e-2
        assert (row_err[int(pad):] <= tight).float().mean() >= 0.75
        assert float((out - r).double().norm() / r.double().norm()) < 2e-2

    @pytest.mark.parametrize("kw", [{"splits": 3, "num_stages": 1}, {"splits": 2, "block_k": 32}],
                             ids=["split3-unpipelined", "split2-k32"])
    def test_moe_experts_w4a8_tiles_split_k(g, monkeypatch, kw):
        """The 'tiles' path with K split (the up GEMM's D = 192 in 3 splits of 64, the down's
        I = 96 in 3 of 32; or each in 2 splits of 32-wide blocks), unpipelined or not: the FP32
        partials summed in split order, every output written. Only the order of the FP32 sums
        differs from the unsplit tiles, so most rows agree with theirs to FP32 rounding (an FP8
        step of w2's input can move one element of a row), and all with the reference's
        tolerance."""
        rne_bf16_casts(monkeypatch)
        T, E, D, I, k = 24, 7, 192, 96, 3
        args = w4a8_case(g, T, E, D, I, k, dtype=torch.float32)
        r, whole = torch.empty(T, D), torch.full((T, D), float("nan"))
        ref.moe_experts_w4a8(*args, 1.5, r)
        triton_moe_experts_w4a8(*args, 1.5, whole, path="tiles")
        from custom_ops.triton import moe as moe_kernels
        grids = {}

        class Recorded:        # a kernel whose launches' grids are kept
            def __init__(self, name):
                self.name, self.kernel = name, getattr(moe_kernels, name)

            def __getitem__(self, grid):
                grids.setdefault(self.name, []).append(grid)
                return self.kernel[grid]
        for name in ("_moe_up_kernel", "_moe_up_sum_kernel", "_moe_down_kernel", "_moe_down_sum_kernel"):
            monkeypatch.setattr(moe_kernels, name, Recorded(name))
        out = torch.full((T, D), float("nan"))
        triton_moe_experts_w4a8(*args, 1.5, out, path="tiles", **kw)
        assert (grids["_moe_up_kernel"][0][2], grids["_moe_down_kernel"][0][2]) == (kw["splits"],) * 2
        assert len(grids["_moe_up_sum_kernel"]) == len(grids["_moe_down_sum_kernel"]) == 1
        assert not out.isnan().any()
        row_err = (out - whole).double().norm(dim=1) / whole.double().norm(dim=1).clamp(min=1e-30)
        assert (row_err <= 1e-5).float().mean() >= 0.75
        assert float((out - r).double().norm() / r.double().norm()) < 2e-2

    def test_moe_experts_w4a8_gemv_split_k(g, monkeypatch):
        """The FP4 GEMVs with K split (the up GEMM's D = 192 in 3 splits of 64, the down's I = 96
        in 3 of 32; a padding token among the pairs): each (row, N block)'s last split sums the
        partials in split order and finishes the row (the up GEMMs' epilogue, the down's
        rounding), so the GEMVs are the op's only GEMM launches; every counter is back at zero,
        the rows meet the reference and a second call repeats the bits."""
        from custom_ops.triton import moe as moe_kernels
        from custom_ops.triton import moe_gemv
        from custom_ops.triton.fp8 import tile_counters
        rne_bf16_casts(monkeypatch)
        T, E, D, I, k = 6, 7, 192, 96, 3
        args = w4a8_case(g, T, E, D, I, k, dtype=torch.float32, pad_token=True)
        r = torch.empty(T, D)
        ref.moe_experts_w4a8(*args, 1.5, r)
        launched = []

        class Recorded:
            def __init__(self, module, name):
                self.name, self.kernel = name, getattr(module, name)

            def __getitem__(self, grid):
                launched.append((self.name, grid))
                return self.kernel[grid]
        for module, name in ((moe_gemv, "_fp4_up_gemv"), (moe_gemv, "_fp4_down_gemv"),
                             (moe_kernels, "_moe_up_sum_kernel"), (moe_kernels, "_moe_down_sum_kernel")):
            monkeypatch.setattr(module, name, Recorded(module, name))
        outs = []
        for _ in range(2):
            outs.append(torch.full((T, D), float("nan")))
            triton_moe_experts_w4a8(*args, 1.5, outs[-1], path="gemv", splits=3, block_k=32)
        assert [(n, grid[2]) for n, grid in launched] == [("_fp4_up_gemv", 3), ("_fp4_down_gemv", 3)] * 2
        assert not tile_counters(r.device, T * k * D // 32).any()
        out = outs[0]
        assert torch.equal(outs[1], out) and not out.isnan().any() and (out[0] == 0).all()
        row_err = (out - r).double().norm(dim=1) / r.double().norm(dim=1).clamp(min=1e-30)
        assert (row_err[1:] <= 1e-5).float().mean() >= 0.75
        assert float((out - r).double().norm() / r.double().norm()) < 2e-2

    @pytest.mark.parametrize("T,kw", [(1, {}), (2, {"splits": 3, "block_k": 32}), (1, {"splits": 1, "block_k": 32})])
    def test_fp4_gemv_prefetch_changes_no_bit(g, T, kw):
        """The FP4 GEMVs' prefetch of the next K block moves loads, not sums: the same bits (one
        token's unsorted pairs and several tokens' sorted ones, one K block a split or many)."""
        E, D, I, k = 7, 192, 96, 3
        args = w4a8_case(g, T, E, D, I, k, dtype=torch.float32)
        outs = []
        for prefetch in (False, True):
            outs.append(torch.full((T, D), float("nan")))
            triton_moe_experts_w4a8(*args, 1.5, outs[-1], path="gemv", prefetch=prefetch, **kw)
        assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1])

    def test_tile_counters_grow_and_keep_their_buffers():
        """A split-K call needing more counters than the largest buffer gets a larger one (the
        FP4 GEMVs forced at 2,048 tokens: 98,304 tiles); earlier buffers stay, as a captured CUDA
        graph keeps their addresses, and later smaller calls share the largest."""
        from custom_ops.triton import fp8
        dev = torch.device("cpu")
        first = fp8.tile_counters(dev, 10)
        big = fp8.tile_counters(dev, 98_304 + first.numel())
        assert big.numel() >= 98_304 + first.numel() and not big.any()
        assert fp8.tile_counters(dev, 10) is big and any(b is first for b in fp8._COUNTERS[dev])

    def test_moe_experts_w4a8_splits_k_by_shape(g, monkeypatch):
        """The op's default split-K: about 4 K blocks of 128 a split, set by the GEMM's K alone (D =
        1024: the up GEMVs in 2 splits, the down GEMVs whole), and the op still gives the
        reference's rows."""
        from custom_ops.triton.moe_gemv import FP4_BLOCK_K, fp4_splits
        assert FP4_BLOCK_K == 128
        assert (fp4_splits(1024, 128), fp4_splits(96, 128), fp4_splits(5120, 128)) == (2, 1, 10)
        rne_bf16_casts(monkeypatch)
        T, E, D, I, k = 2, 5, 1024, 64, 3
        args = w4a8_case(g, T, E, D, I, k, dtype=torch.float32)
        r, out = torch.empty(T, D), torch.full((T, D), float("nan"))
        ref.moe_experts_w4a8(*args, 1.5, r)
        triton_moe_experts_w4a8(*args, 1.5, out)
        assert not out.isnan().any()
        assert float((out - r).double().norm() / r.double().norm()) < 2e-2

    def test_moe_experts_w4a8_mma_knobs(g):
        """The FP8-MMA path's tile knobs partition rows and columns only: each output sums its
        K blocks in the same order, so other tiles, warps and stages give the same bits."""
        args = w4a8_case(g, 24, 7, 64, 96, 3, dtype=torch.float32)
        want, out = torch.full((24, 64), float("nan")), torch.full((24, 64), float("nan"))
        triton_moe_experts_w4a8(*args, 1.5, want, path="mma")
        triton_moe_experts_w4a8(*args, 1.5, out, path="mma", block_m=32, block_n_up=32, block_n_down=32,
                                num_warps=8, num_stages=2)
        assert not want.isnan().any() and torch.equal(out, want)
        with pytest.raises(Exception, match="power of 2"):       # the knobs reach the launch
            triton_moe_experts_w4a8(*args, 1.5, out, path="mma", block_m=24)

    def test_expert_path_by_pairs_per_expert():
        """GEMVs while pairs are few per expert (flash-slice's 16 experts: up to 5 tokens of top-6;
        Flash's 384: up to 64 tokens), the dequantizing MMA tiles beyond."""
        from custom_ops.triton.moe_w4a8 import expert_path
        assert [expert_path(6 * t, 16) for t in (1, 5, 6, 64, 341)] == ["gemv"] * 2 + ["tiles"] * 3
        assert [expert_path(6 * t, 384) for t in (1, 64, 65, 8191)] == ["gemv"] * 2 + ["tiles"] * 2

    def test_moe_experts_w4a8_default_tiles(g, monkeypatch):
        """Past the GEMVs the op's default runs the 'tiles' path at run_experts' tiles (the tile
        kernels get no other knobs) and gives the reference's output within its tolerance (as
        above). Tile shapes partition rows and columns only, so the output alone cannot tell the
        paths apart."""
        from custom_ops.triton import moe_w4a8
        calls = []
        real = moe_w4a8.run_experts
        monkeypatch.setattr(moe_w4a8, "run_experts", lambda *a, **kw: (calls.append(kw), real(*a, **kw)))
        E, D, I, k, T = 3, 64, 96, 2, 24
        args = w4a8_case(g, T, E, D, I, k, dtype=torch.float32)
        out, r = torch.full((T, D), float("nan")), torch.empty(T, D)
        triton_moe_experts_w4a8(*args, 1.5, out)
        assert calls == [{"tiles": True}]
        ref.moe_experts_w4a8(*args, 1.5, r)
        assert not out.isnan().any() and float((out - r).double().norm() / r.double().norm()) < 2e-2

    def test_moe_experts_w4a8_unknown_path(g):
        args = w4a8_case(g, 2, 3, 32, 32, 2)
        with pytest.raises(ValueError, match="'tile' is not"):
            triton_moe_experts_w4a8(*args, 1.0, torch.empty(2, 32), path="tile")

    def test_moe_experts_w4a8_no_tokens(g):
        args = w4a8_case(g, 4, 3, 32, 32, 2)
        ids = torch.full_like(args[1], -1)
        out = torch.full((4, 32), float("nan"))
        triton_moe_experts_w4a8(args[0], ids, *args[2:], 1.0, out)
        assert (out == 0).all()

    # ---- registry --------------------------------------------------------------------------
    def test_native_ops_registered():
        sel = registry.selected()
        for name in ref.NATIVE_OPS:
            assert sel[f"v41::{name}"] == {"cpu": "reference", "cuda": "triton"}
        assert not ref.native_weights("cpu", torch.bfloat16)
        assert not ref.native_weights("cuda", torch.float64)
        assert ref.native_weights("cuda", torch.bfloat16)
        with registry.using("reference", "cuda", names=("fp8_block_gemm",)):
            assert not ref.native_weights("cuda", torch.bfloat16)
