"""The native-format dense GEMMs (custom_ops/gemm.py; the experts: test_native_experts.py) under
the Triton interpreter: the Triton impls against the reference (dequantize, multiply in FP32) on
the same quantized inputs, FP8 loads and FP8 dots included (the interpreter runs them), outputs
poisoned with NaN first.

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

import pytest

from tests.kernel_cases import INTERPRETED, interpreter_reruns

pytest.importorskip("triton")

if not INTERPRETED:
    test_native_gemm_under_triton_interpreter = interpreter_reruns(__file__, timeout=900)

else:
    import torch

    from tests import program_order
    program_order.apply()

    import custom_ops  # noqa: F401
    from custom_ops import gemm as ref
    from custom_ops import registry
    from custom_ops.triton import (triton_fp8_act_quant, triton_fp8_block_gemm, triton_fp8_block_gemm_act_quant,
                                   triton_fp8_linear)
    from custom_ops.triton.fp8 import tile_counters
    from custom_ops.triton.fp8_gemm import quantizes_inside
    import triton
    import triton.language as tl

    from custom_ops.triton.fp8 import e8m0_to_f32
    from tests.kernel_cases import fp8_gemm_case, fp8_grouped_case, gamma, rne_bf16_casts
    from v41 import quant

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
            # path 'bf16' (bf16 outputs only): the exact sums rounded once
            out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
            triton_fp8_block_gemm(xq, xs, w, ws, out, path="bf16")
            assert torch.equal(out, r.bfloat16())

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("M,G,kw", [(1, 1, {}), (7, 1, {"split_k": 3}), (16, 3, {}), (5, 3, {"split_k": 2}),
                                        (33, 1, {}), (33, 3, {"split_k": 2}), (1, 1, {"path": "mma"}),
                                        (2, 3, {"split_k": 2}), (3, 1, {"path": "gemv"}), (1, 1, {"path": "bf16"}),
                                        (33, 1, {"path": "bf16"}), (33, 3, {"path": "bf16"})])
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

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("M,G,kw", [(1, 1, {}), (1, 1, {"split_k": 3}), (1, 3, {"split_k": 2}),
                                        (7, 1, {"path": "gemv", "block_m": 4, "block_n": 32}),
                                        (7, 3, {}), (33, 1, {"split_k": 3}), (2, 1, {"path": "mma"})])
    def test_fp8_block_gemm_act_quant(g, monkeypatch, dtype, M, G, kw):
        """The act quant in the GEMM's epilogue: the codes and scales are bit for bit those of
        the same GEMM's output (same tiles: the same sums) in `dtype`, act-quantized by the
        reference; on exactly summable inputs also those of the reference GEMM's output (bf16
        rounded to nearest even, as on a GPU). Every code and scale written, split or not,
        grouped or not."""
        rne_bf16_casts(monkeypatch)
        R, K = 64, 256
        for exact in (False, True):
            xq, xs, w, ws = fp8_grouped_case(g, M, G, R, K, exact=exact)
            y = torch.empty(M, G * R, dtype=dtype)
            triton_fp8_block_gemm(xq, xs, w, ws, y, G, **kw)
            want_q, want_s = torch.empty(M, G * R, dtype=torch.float8_e4m3fn), torch.empty(M, G * R // 32)
            ref.fp8_act_quant(y, want_q, want_s)
            q = torch.full((M, G * R), float("nan")).to(torch.float8_e4m3fn)
            s = torch.full((M, G * R // 32), float("nan"))
            triton_fp8_block_gemm_act_quant(xq, xs, w, ws, dtype, q, s, G, **kw)
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s), exact
            if exact:
                ref_q, ref_s = torch.empty_like(q), torch.empty_like(s)
                ref.fp8_block_gemm_act_quant(xq, xs, w, ws, dtype, ref_q, ref_s, G)
                assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
            assert not tile_counters(q.device, 0).any()

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
        the act-quant kernel first for wider x and for a wide N. At 64-row tiles wq_a's 20 tiles
        quantize 102,400 elements of x inside; shared_w1's 36 would quantize 184,320."""
        from custom_ops.triton import fp8_gemm
        assert fp8_gemm.GEMV_BLOCK_N == 64
        assert [quantizes_inside(1, N, K) for N, K in ((1280, 5120), (2304, 5120), (5120, 8192), (32768, 1280))] == \
            [True, False, False, False]
        assert not quantizes_inside(2, 1280, 5120)
        calls = []
        monkeypatch.setattr(fp8_gemm, "triton_fp8_act_quant",
                            lambda *a: calls.append(a[0].shape) or triton_fp8_act_quant(*a))
        monkeypatch.setattr(fp8_gemm, "FUSED_QUANT_WORK", 320 * 4)           # four 64-row tiles of K = 320
        for M, N in ((1, 256), (1, 384), (3, 96)):
            _, _, w, ws = fp8_gemm_case(g, 1, N, 320)
            x = torch.randn(M, 320, generator=g).bfloat16()
            fp8_gemm.triton_fp8_linear(x, w, ws, torch.empty(M, N, dtype=torch.bfloat16))
        assert calls == [(1, 320), (3, 320)]

    @pytest.mark.parametrize("M,kw", [(1, {"split_k": 3, "block_k": 64}), (2, {"block_k": 32}),
                                      (1, {"split_k": 5, "block_k": 64})])
    def test_fp8_gemv_load_forms_change_no_bit(g, M, kw):
        """The GEMV's register prefetch of the next K block and its weight loads through a
        tensor descriptor (TMA, pipelined) move loads, not sums: the same bits from codes and from
        x in bf16, one split or several, one K block a split or many, N (96) not a multiple of
        the 64-row tile (the descriptor's rows past N read as zeros)."""
        N, K = 96, 320
        xq, xs, w, ws = fp8_gemm_case(g, M, N, K)
        x = (xq.float() * xs.repeat_interleave(32, -1)).bfloat16()
        for run in (lambda o, **k: triton_fp8_block_gemm(xq, xs, w, ws, o, **k),
                    lambda o, **k: triton_fp8_linear(x, w, ws, o, **k)):
            outs = []
            for form in ({"tma": False}, {"prefetch": True}, {"tma": True, "num_stages": 3}):
                outs.append(torch.full((M, N), float("nan"), dtype=torch.bfloat16))
                run(outs[-1], path="gemv", block_n=64, **form, **kw)
            assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])

    def test_fp8_gemv_tma_grouped(g):
        """The TMA loads in a grouped GEMV (wo_a's form): each output tile's descriptor rows inside
        its group, bitwise the plain loads' result."""
        from tests.kernel_cases import fp8_grouped_case
        xq, xs, w, ws = fp8_grouped_case(g, 1, 3, 64, 96)
        outs = []
        for form in ({"tma": False}, {"tma": True, "num_stages": 2}):
            outs.append(torch.full((1, 3 * 64), float("nan"), dtype=torch.bfloat16))
            triton_fp8_block_gemm(xq, xs, w, ws, outs[-1], 3, path="gemv", split_k=2, **form)
        assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1])

    def test_tma_defaults_choose_the_loads(g, monkeypatch):
        """GEMV_TMA and FP4_TMA, the one-row GEMVs' defaults (step_bench --knob-variants sets them):
        on, the FP8 GEMV from codes and the FP4 GEMVs on bf16 activations get tensor descriptors,
        while fp8_linear's GEMV (x quantized inside) and a register-prefetch knob keep the plain
        loads; off, none is made."""
        from custom_ops.triton import fp8_gemm, moe_gemv
        from custom_ops.triton.moe_w4a8 import triton_moe_experts_w4a8
        from tests.kernel_cases import w4a8_case
        made = []
        for mod in (fp8_gemm, moe_gemv):
            real = mod.tma_descriptor
            monkeypatch.setattr(mod, "tma_descriptor", lambda t, block, real=real: made.append(block) or real(t, block))
        xq, xs, w, ws = fp8_gemm_case(g, 1, 96, 320)
        x = (xq.float() * xs.repeat_interleave(32, -1)).bfloat16()
        moe = w4a8_case(g, 1, 7, 192, 96, 3, dtype=torch.bfloat16, pad_token=False)

        def run():
            out = torch.empty(1, 96, dtype=torch.bfloat16)
            triton_fp8_block_gemm(xq, xs, w, ws, out)
            triton_fp8_linear(x, w, ws, out)
            triton_fp8_block_gemm(xq, xs, w, ws, out, prefetch=True)
            triton_moe_experts_w4a8(*moe, 1.0e4, torch.empty(1, 192), path="gemv")
            n, made[:] = len(made), []
            return n
        for on in (False, True):
            monkeypatch.setattr(fp8_gemm, "GEMV_TMA", on)
            monkeypatch.setattr(moe_gemv, "FP4_TMA", on)
            assert run() == (1 + 3 if on else 0)        # the GEMV from codes; w1, w3 and w2

    def test_fp8_gemv_tma_takes_one_row(g):
        """The GEMV's TMA loop reads one row of x a program: asked for at four rows a program it
        is refused by name, while the default there keeps the plain loads."""
        xq, xs, w, ws = fp8_gemm_case(g, 7, 64, 64)
        with pytest.raises(ValueError, match="one row a program, not block_m=4"):
            triton_fp8_block_gemm(xq, xs, w, ws, torch.empty(7, 64), path="gemv", block_m=4, tma=True)

    def test_fp8_block_gemm_unknown_path(g):
        """An unknown path is refused by name (not run as another)."""
        xq, xs, w, ws = fp8_gemm_case(g, 2, 64, 64)
        with pytest.raises(ValueError, match="'gemm' is not 'gemv', 'mma' or 'bf16'"):
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

    def test_dequant_bf16_equals_the_reference_values(g):
        """Path 'bf16's decode: a weight's codes times their 32x32 block scales (40 rows: a partial
        block) and an activation's codes times their group scales, bit for bit the reference's
        values (exact in bf16), every element written."""
        from custom_ops.triton.fp8_gemm import dequant_bf16
        xq, xs, w, ws = fp8_gemm_case(g, 5, 40, 192)
        assert torch.equal(dequant_bf16(w, ws), quant.dequant_fp8_block(w, ws, torch.bfloat16))
        assert torch.equal(dequant_bf16(xq, xs), dequant_act(xq, xs).bfloat16())

    @pytest.mark.parametrize("path", [None, "bf16"])
    def test_fp8_block_gemm_bf16_out(g, monkeypatch, path):
        """bf16 output (the activation dtype of the model): one RNE rounding past the FP32 bound;
        path 'bf16' (x and the weight decoded to bf16 values, then torch's GEMM) likewise."""
        rne_bf16_casts(monkeypatch)
        M, N, K = 24, 72, 192
        xq, xs, w, ws = fp8_gemm_case(g, M, N, K)
        exact, S = exact_and_abs(xq, xs, w, ws)
        r = torch.empty(M, N, dtype=torch.bfloat16)
        out = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
        ref.fp8_block_gemm(xq, xs, w, ws, r)
        triton_fp8_block_gemm(xq, xs, w, ws, out, path=path)
        bound = gamma(K) * S + 2.0**-8 * exact.abs()
        assert ((out.double() - exact).abs() <= bound).all()
        assert (out != r).float().mean() < 0.02

    def test_fp8_block_gemm_scale_codes(g):
        """E8M0 edge codes: 0 (2^-127, subnormal) and 255 (NaN) decode like quant.e8m0_decode.
        Row 2 of x reads only the first K block, so its first 32 outputs are that block's sums at
        scale 2^-127 alone, which a wrong decode would miss by their own size. Against the exact
        sums, within FP32 summation in any order (a row whose second block's products cancel to
        zero leaves the first block's ~1e-35 terms below an FP32 sum's rounding, so the reference
        GEMM may give 0 there) plus the rounding of a block sum scaled into the subnormals."""
        xq, xs, w, ws = fp8_gemm_case(g, 4, 64, 64)
        xq[2, 32:] = 0
        codes = ws.view(torch.uint8).clone()
        codes[0, 0], codes[1, 1] = 0, 255
        ws2 = codes.view(torch.float8_e8m0fnu)
        out = torch.empty(4, 64)
        triton_fp8_block_gemm(xq, xs, w, ws2, out)
        assert out[:, 32:].isnan().all() and not out[:, :32].isnan().any()
        exact, S = exact_and_abs(xq, xs, w, ws2)
        bound = gamma(64) * S[:, :32] + 2.0**-149
        assert ((out[:, :32].double() - exact[:, :32]).abs() <= bound).all()
        assert (exact[2, :32].abs() < 1e-30).all() and (S[2, :32] > 0).all()

    @triton.jit
    def _decode_kernel(c_ptr, scale_ptr):
        c = tl.load(c_ptr + tl.arange(0, 256))
        tl.store(scale_ptr + tl.arange(0, 256), e8m0_to_f32(c))

    def test_scale_decoder():
        """Every E8M0 code (0 the subnormal 2^-127, 255 NaN) to its FP32 value (the FP4 values'
        decoder: test_native_experts.py's test_fp4_tile_dequantizes_exactly)."""
        c = torch.arange(256, dtype=torch.int32)
        scale = torch.empty(256)
        _decode_kernel[(1,)](c, scale)
        want = c.to(torch.uint8).view(torch.float8_e8m0fnu).float()
        assert torch.equal(scale[:255], torch.where(c[:255] == 0, 2.0**-127, want[:255]))
        assert scale[255].isnan()

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
