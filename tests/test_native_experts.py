"""The W4A8 expert GEMMs (`v41::moe_experts_w4a8`: the FP4 GEMVs, on CUDA cores and on tensor cores,
and the dequantizing MMA tiles)
under the Triton interpreter against the reference on the same quantized inputs,
outputs poisoned with NaN first. The bound is test_native_gemm.py's: every product of an FP8
activation and an E2M1 weight times power-of-two scales is exact in FP32, so the kernel and a
float64 product of the same inputs differ by one FP32 summation of K terms, within γ_K·Σ|products|.

As in test_native_gemm.py, unless this process runs with TRITON_INTERPRET=1 the module reruns
itself in a subprocess with it set, programs in order and reversed.
"""
from __future__ import annotations

import pytest

from tests.kernel_cases import INTERPRETED, interpreter_reruns

pytest.importorskip("triton")

if not INTERPRETED:
    test_native_experts_under_triton_interpreter = interpreter_reruns(__file__, timeout=900)

else:
    import torch

    from tests import program_order
    program_order.apply()

    import custom_ops  # noqa: F401
    from custom_ops import gemm as ref
    from custom_ops.triton import triton_moe_experts_w4a8
    from custom_ops.triton.moe import run_experts
    from tests.kernel_cases import gamma, rne_bf16_casts, w4a8_case
    from v41 import quant

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

    import triton
    import triton.language as tl

    from custom_ops.triton.fp4 import fp4_tile

    @triton.jit
    def _fp4_tile_kernel(w_ptr, s_ptr, out_ptr, K, N_REAL, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         OUT: tl.constexpr, SCALE_WORDS: tl.constexpr):
        rn = tl.arange(0, BLOCK_N)
        nmask = rn < N_REAL
        rk = tl.arange(0, BLOCK_K)
        s_row = K // 128 if SCALE_WORDS else K // 32
        for k0 in range(0, K, BLOCK_K):
            t = fp4_tile(w_ptr + rn * (K // 8), s_ptr + rn * s_row, k0, nmask, BLOCK_K, BLOCK_N, OUT, False,
                         SCALE_WORDS)
            tl.store(out_ptr + rn[None, :] * K + (k0 + rk)[:, None], t)

    @pytest.mark.parametrize("block_k,words", [(64, 0), (64, 1), (128, 1), (256, 2)])
    @pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
    def test_fp4_tile_dequantizes_exactly(g, monkeypatch, out_dtype, block_k, words):
        """`fp4_tile` (the 'tiles' path's dequantization, K blocks of int32 words) gives the
        reference dequantization's bits in element order: every packed byte; to FP32 (through
        E4M3 values) scale codes 0 (the subnormal 2^-127), 1-248 and 255 (NaN), to bf16 (the
        bits placed straight, `fp4.e2m1_bf16_tile`) codes 0-128 (FP4_MAX_SCALE_CODE); rows
        past N are zeros. The scale codes loaded byte by byte or (`words`) as int32 words of
        four, one or two a K block."""
        from custom_ops.gemm import FP4_MAX_SCALE_CODE
        from custom_ops.triton.fp4 import scale_words
        assert scale_words(256, block_k, 256) == words or not words
        rne_bf16_casts(monkeypatch)         # (the interpreter's own cast flushes bf16 subnormals)
        N, K = 16, 256
        packed = torch.arange(N * K // 2, dtype=torch.int32).remainder(256).to(torch.uint8).view(N, K // 2)
        packed = packed[:, torch.randperm(K // 2, generator=g)].contiguous()
        top = 248 if out_dtype == torch.float32 else FP4_MAX_SCALE_CODE
        codes = torch.randint(1, top + 1, (N, K // 32), generator=g, dtype=torch.int32)
        codes[0, 0], codes[1, 1], codes[2, 2] = 0, top, 255 if out_dtype == torch.float32 else 1
        scales = codes.to(torch.uint8)
        want = quant.dequant_fp4_expert(packed.view(torch.int8), scales.view(torch.float8_e8m0fnu), torch.float32)
        out = torch.full((32, K), float("nan"), dtype=out_dtype)      # BLOCK_N rows, N of them real
        _fp4_tile_kernel[(1,)](packed.view(torch.int32), scales.view(torch.int32) if words else scales, out, K, N,
                               BLOCK_N=32, BLOCK_K=block_k, OUT=tl.float32 if out_dtype == torch.float32 else tl.bfloat16,
                               SCALE_WORDS=words)
        got = out[:N].float()
        assert torch.equal(got.isnan(), want.isnan()) and want.isnan().any() == (out_dtype == torch.float32)
        ok = ~want.isnan()
        assert torch.equal(got[ok], want.to(out_dtype).float()[ok])
        assert (out[N:] == 0).all()

    @pytest.mark.parametrize("T,kw", [(1, {}), (6, {"block_m": 16, "block_n_up": 32, "block_n_down": 32}),
                                      (6, {"block_k": 32}), (16, {"block_k": 128}), (24, {"block_m": 64}),
                                      (6, {"block_k": 32, "splits": 2}), (9, {"block_k": 32, "splits": 2}),
                                      (3, {"num_stages": 1}), (1, {"mma": True}), (6, {"mma": True, "splits": 2}),
                                      (9, {"mma": True, "mma_cols": 1})])
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

    @pytest.mark.parametrize("kw", [{}, {"block_k": 32, "splits": 2}, {"mma": True}, {"mma": True, "splits": 2},
                                    {"mma": True, "mma_cols": 1}],
                             ids=["one-split", "split-k", "mma", "mma-split-k", "mma-one-col"])
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
                                         (256, None), (1, "tiles"), (24, "tiles"), (256, "tiles"), (1, "mma"),
                                         (12, "mma")])
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

    def test_scale_words_rule():
        """Words of scale codes where K and the split start are multiples of 128, one word per
        128 of a K block (at least one); bytes otherwise."""
        from custom_ops.triton.fp4 import scale_words
        assert [scale_words(5120, bk, 5120) for bk in (32, 64, 128, 256)] == [1, 1, 1, 2]
        assert scale_words(5120, 64, 2560) == 1 and scale_words(2304, 64, 1152) == 1
        assert scale_words(2304, 64, 1216) == 0 and scale_words(192, 64, 192) == 0

    @pytest.mark.parametrize("kw", [{}, {"splits": 2, "block_k": 128}, {"block_k": 256}, {"block_m": 64}])
    def test_tiles_read_scale_words_where_k_allows(g, monkeypatch, kw):
        """With D and I multiples of 128 the tile kernels, 16 or 64 rows, read the scale codes as int32
        words of four (`fp4.scale_words`: one or, at 256-wide K blocks, two a block; the up GEMM
        split at 128 in the second case): w2's input rows and the
        per-pair outputs equal, bit for bit, those of the same kernels reading them byte by
        byte, and the op stays within the reference's tolerance."""
        from custom_ops.triton import moe as moe_kernels
        T, E, D, I, k = 8, 4, 256, 128, 3
        x, ids, wts, w1, s1, w3, s3, w2, s2 = w4a8_case(g, T, E, D, I, k, dtype=torch.float32)
        scales = tuple(s.view(torch.uint8) for s in (s1, s3, s2))
        words = []
        kernel_words = moe_kernels.scale_words

        def recorded(*a):
            words.append(kernel_words(*a))
            return words[-1]

        def gemms(**patch):
            got = []
            with monkeypatch.context() as m:
                m.setattr(moe_kernels, "scale_words", patch.get("scale_words", recorded))
                out = torch.full((T, D), float("nan"))
                run_experts(x, ids, wts, w1, w3, w2, scales, 1.5, out, tiles=True, hidden=got,
                            **{"block_k": 64, "block_m": 16, **kw})
            return out, got[0], got[2]
        out, h, y = gemms()
        assert words and all(words), words
        out_b, h_b, y_b = gemms(scale_words=lambda *a: 0)
        valid = ids.reshape(-1) >= 0        # rows of padding slots are never written
        n = int(valid.sum())
        assert torch.equal(h[:n], h_b[:n]) and torch.equal(y[valid], y_b[valid]) and torch.equal(out, out_b)
        r = torch.empty(T, D)
        ref.moe_experts_w4a8(x, ids, wts, w1, s1, w3, s3, w2, s2, 1.5, r)
        assert not out.isnan().any() and float((out - r).double().norm() / r.double().norm()) < 2e-2

    def test_tiles_read_scale_codes_off_word_boundaries_as_bytes(g):
        """Scale codes whose rows do not start on a word (a view one byte into its storage) have
        no int32 view: the tile kernels read them byte by byte, with the same outputs."""
        T, E, D, I, k = 8, 4, 256, 128, 3
        x, ids, wts, w1, s1, w3, s3, w2, s2 = w4a8_case(g, T, E, D, I, k, dtype=torch.float32)
        scales = tuple(s.view(torch.uint8) for s in (s1, s3, s2))

        def shifted(t):
            buf = torch.empty(t.numel() + 1, dtype=torch.uint8)[1:].view(t.shape)
            return buf.copy_(t)
        outs = []
        for sc in (scales, tuple(shifted(t) for t in scales)):
            out = torch.full((T, D), float("nan"))
            run_experts(x, ids, wts, w1, w3, w2, sc, 1.5, out, tiles=True, block_k=64, block_m=16)
            outs.append(out)
        assert not outs[0].isnan().any() and torch.equal(outs[0], outs[1])

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

    @pytest.mark.parametrize("D", [96, 2048])
    def test_mma_act_is_fp8_qat_in_mma_form(g, D):
        """`mma_act`: the values of v41.quant.fp8_qat exactly (groups of zeros, tiny and large ones
        among them), each group of eight as the f16 pairs (0, 2), (1, 3), (4, 6), (5, 7) in int32
        words, the group's scale as FP32 exponent bits (k + 6) << 23."""
        from custom_ops.triton.fp4_mma import mma_act
        from custom_ops.triton.fp4_mma_lanes import mma_act_values
        x = torch.randn(3, D, generator=g) * torch.pow(2.0, torch.randint(-30, 20, (3, D // 32, 1), generator=g)
                                                       ).repeat_interleave(32, 2).reshape(3, D)
        x[1, :32] = 0
        a, o = mma_act(x)
        want = quant.fp8_qat(x, 32)
        assert torch.equal(mma_act_values(a, o), want)
        k = (o >> 23) - 6
        q = want.reshape(3, D // 32, 32) * torch.pow(2.0, -k.float())[..., None]
        pairs = q.reshape(3, D // 8, 8)[..., [0, 2, 1, 3, 4, 6, 5, 7]].to(torch.float16)
        assert torch.equal(a.view(torch.int32), pairs.reshape(3, D).contiguous().view(torch.int32))
        assert (q.abs() <= 448).all() and k.min() >= -22

    def test_fp4_mma_gemvs_split_k_with_scale_words(g, monkeypatch):
        """The tensor-core GEMVs with K a multiple of 128 (the rows' scale codes read as int32 words
        of four) and split in two: three launches (the activation to MMA form, up, down); each (row,
        N block)'s last split sums the partials and finishes the row, every counter is back at
        zero, a second call repeats the bits and the rows meet the CUDA-core GEMVs' and the
        reference's."""
        from custom_ops.triton import fp4_mma
        from custom_ops.triton.fp8 import tile_counters
        rne_bf16_casts(monkeypatch)
        T, E, D, I, k = 3, 5, 256, 256, 3
        args = w4a8_case(g, T, E, D, I, k, dtype=torch.float32)
        r, gemv = torch.empty(T, D), torch.full((T, D), float("nan"))
        ref.moe_experts_w4a8(*args, 1.5, r)
        triton_moe_experts_w4a8(*args, 1.5, gemv, path="gemv", splits=2)
        launched = []

        class Recorded:
            def __init__(self, name):
                self.name, self.kernel = name, getattr(fp4_mma, name)

            def __getitem__(self, grid):
                def launch(*a, **kw):
                    launched.append((self.name, grid[2] if len(grid) > 2 else None, kw.get("SCALE_WORDS")))
                    return self.kernel[grid](*a, **kw)
                return launch
        for name in ("_mma_act_kernel", "_fp4_mma_up", "_fp4_mma_down"):
            monkeypatch.setattr(fp4_mma, name, Recorded(name))
        outs = []
        for _ in range(2):
            outs.append(torch.full((T, D), float("nan")))
            triton_moe_experts_w4a8(*args, 1.5, outs[-1], path="mma", splits=2)
        assert launched == [("_mma_act_kernel", None, None), ("_fp4_mma_up", 2, True), ("_fp4_mma_down", 2, True)] * 2
        assert not tile_counters(r.device, T * k * D // 16).any()
        out = outs[0]
        assert torch.equal(outs[1], out) and not out.isnan().any() and (out[0] == 0).all()
        for got in (out, gemv):
            row_err = (got - r).double().norm(dim=1) / r.double().norm(dim=1).clamp(min=1e-30)
            assert (row_err[1:] <= 1e-5).float().mean() >= 0.5
            assert float((got - r).double().norm() / r.double().norm()) < 2e-2

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

    @pytest.mark.parametrize("T,kw", [(1, {"num_stages": 2}), (4, {"splits": 3, "block_k": 32, "num_stages": 1}),
                                      (1, {"block_n_up": 32, "block_n_down": 32, "num_stages": 3})])
    def test_fp4_gemv_tma_loads(g, T, kw):
        """The FP4 GEMVs with their weights loaded through tensor descriptors (bf16 activations):
        on exactly summable inputs every FP32 order gives the same sums, so h (w2's input) and y
        equal the plain loads' bit for bit; one token's unsorted pairs and several tokens'
        sorted ones, one K block a split or many, output blocks past I (96 rows in 64-row
        blocks: the descriptor reads the next expert's rows there, which no store keeps)."""
        E, D, I, k = 7, 192, 96, 3
        args = w4a8_case(g, T, E, D, I, k, exact=True, dtype=torch.bfloat16)
        (h, y, order), (h2, y2, order2) = (w4a8_expert_gemms(*args, 1.0e4, **kw, tma=t) for t in (False, True))
        live, valid = pair_experts(args[1], order) >= 0, args[1].reshape(-1) >= 0     # rows of real pairs
        assert torch.equal(order, order2) and not y[valid].isnan().any()
        assert torch.equal(h[live], h2[live]) and torch.equal(y[valid], y2[valid])

    def test_tile_counters_grow_and_keep_their_buffers():
        """A split-K call needing more counters than the largest buffer gets a larger one (the
        FP4 GEMVs forced at 2,048 tokens: 98,304 tiles); earlier buffers stay, as a captured CUDA
        graph keeps their addresses, and later smaller calls share the largest."""
        from custom_ops.triton import fp8
        dev = torch.device("cpu")
        first = fp8.tile_counters(dev, 10)
        big = fp8.tile_counters(dev, 98_304 + first.numel())
        assert big.numel() >= 98_304 + first.numel() and not big.any()
        assert fp8.tile_counters(dev, 10) is big and any(b is first for b in fp8._COUNTERS[(dev, None)])

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

    def test_expert_path_by_tokens_and_pairs_per_expert():
        """The CUDA-core GEMVs at one token, the tensor-core ones up to 8 tokens (a tile's pairs;
        DSpark's verify at one request is 6) while the pairs are at most DECODE_PAIRS, the
        dequantizing MMA tiles beyond; asked for 'tiles', 16 rows up to 32 pairs an expert
        (flash-slice: 85 tokens), K split in two up to 8 (21 tokens), run_experts' defaults past."""
        from custom_ops.triton.moe_w4a8 import expert_path, tile_knobs
        assert [expert_path(t, 6 * t) for t in (1, 2, 6, 8, 9, 16, 64)] == ["gemv"] + ["mma"] * 3 + ["tiles"] * 3
        assert [expert_path(8, p) for p in (384, 385)] == ["mma", "tiles"]
        split, rows16 = {"block_m": 16, "splits": 2}, {"block_m": 16, "splits": 1}
        assert [tile_knobs(6 * t, 16) for t in (3, 16, 21, 22, 64, 85, 86, 2048)] == \
            [split] * 3 + [rows16] * 3 + [{}] * 2

    @pytest.mark.parametrize("T,knobs", [(13, {"block_m": 16, "splits": 1}), (60, {})], ids=["rows16", "plain"])
    def test_moe_experts_w4a8_default_tiles(g, monkeypatch, T, knobs):
        """Past the GEMVs the op's default runs the 'tiles' path with `tile_knobs`' knobs (8.7
        pairs an expert: 16-row tiles; 40: none, run_experts' tiles) and gives
        the reference's output within its tolerance (as above). Tile shapes partition rows and
        columns only, so the output alone cannot tell the paths apart."""
        from custom_ops.triton import moe_w4a8
        calls = []
        real = moe_w4a8.run_experts
        monkeypatch.setattr(moe_w4a8, "run_experts", lambda *a, **kw: (calls.append(kw), real(*a, **kw)))
        E, D, I, k, T = 3, 64, 96, 2, T
        args = w4a8_case(g, T, E, D, I, k, dtype=torch.float32)
        out, r = torch.full((T, D), float("nan")), torch.empty(T, D)
        triton_moe_experts_w4a8(*args, 1.5, out)
        assert calls == [{"tiles": True, "mma": False, **knobs}]
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
