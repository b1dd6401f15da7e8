"""v41.quant: exact FP8 / FP4 rounding, scales, codes and checkpoint block formats.

Oracles: exhaustive grids, torch's own float32 -> float8_e4m3fn cast, a brute-force nearest-even
E2M1 rounding, and hand-computed cases whose arithmetic is written next to the numbers.
"""
import pytest
import torch

from v41.quant import (
    dequant_fp4_expert, dequant_fp8_block, e2m1_decode, e2m1_encode, e8m0_decode, e8m0_encode,
    fp4_act_quant, fp4_e4m3_act_quant, fp4_e4m3_qat, fp4_qat, fp8_act_quant, fp8_qat,
    fp8_row_qat, fp8_row_quant, pack_fp4, pow2ceil, quant_fp4_expert, quant_fp8_block,
    round_e2m1, round_e4m3, unpack_fp4,
)

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
DTYPES = [F64, F32, BF16]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def assert_same(actual, expected):
    """Bitwise-equal values (NaN == NaN) and the same dtype."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)


def all_bf16():
    """Every finite bfloat16 value."""
    x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(BF16)
    return x[torch.isfinite(x)]


def e4m3_grid():
    """All finite non-negative E4M3 values, ascending (codes 0..126), as float64."""
    return torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(F64)


# ---------------------------------------------------------------------------------------------
# E2M1

def test_e2m1_decode_all_16_codes():
    for dtype in DTYPES:
        decoded = e2m1_decode(torch.arange(16, dtype=torch.uint8), dtype)
        assert_same(decoded, t(E2M1 + [-v for v in E2M1], dtype))
    assert torch.signbit(e2m1_decode(t([8]).to(torch.uint8), F32)).item()  # code 8 is -0


def test_e2m1_encode_decode_identity():
    codes = torch.arange(16, dtype=torch.uint8)
    for dtype in DTYPES:
        assert_same(e2m1_encode(e2m1_decode(codes, dtype)), codes)
    grid = t(E2M1 + [-v for v in E2M1[1:]])
    assert_same(e2m1_decode(e2m1_encode(grid), F64), grid)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x, expected", [
    # ties go to the even mantissa (even magnitude index)
    (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
    # off-tie values and saturation
    (0.2, 0.0), (0.3, 0.5), (2.6, 3.0), (5.1, 6.0), (6.0, 6.0), (7.0, 6.0), (1e30, 6.0),
    (float("inf"), 6.0),
])
def test_round_e2m1_ties_and_saturation(dtype, x, expected):
    assert_same(round_e2m1(t([x, -x], dtype)), t([expected, -expected], dtype))


def test_round_e2m1_exhaustive_bf16_against_brute_force():
    x = all_bf16()
    grid = t(E2M1)
    a = x.to(F64).abs().clamp(max=6.0)
    dist = (a[:, None] - grid).abs()  # exact: few-bit operands
    best = dist.min(dim=1, keepdim=True).values
    # among the nearest grid points (two on a tie) take the even index
    idx = torch.where(dist == best, torch.arange(8) % 2, 2).argmin(dim=1)
    expected = torch.copysign(grid[idx], x.to(F64)).to(BF16)
    assert_same(round_e2m1(x), expected)
    assert_same(round_e2m1(x.float()), expected.float())


def test_round_e2m1_float64_just_off_ties():
    eps = 2.0**-40
    ties = t([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert_same(round_e2m1(ties + eps), t([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]))
    assert_same(round_e2m1(ties - eps), t([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]))


# ---------------------------------------------------------------------------------------------
# E4M3

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x, expected", [
    (1 + 1 / 16, 1.0),            # tie between 1 and 1.125 (quantum 1/8): even mantissa 000
    (1 + 3 / 16, 1.25),           # tie between 1.125 and 1.25: even mantissa 010
    (2.0**-10, 0.0),              # half the subnormal quantum 2^-9: tie to 0
    (3 * 2.0**-10, 2.0**-8),      # tie between 2^-9 and 2*2^-9: even is 2^-8
    (2.0**-9, 2.0**-9),           # smallest subnormal
    (2.0**-6, 2.0**-6),           # smallest normal
    (400.0, 384.0),               # [256, 512) has quantum 32: 400/32 = 12.5 -> 12
    (448.0, 448.0), (464.0, 448.0), (500.0, 448.0), (1e30, 448.0), (float("inf"), 448.0),
])
def test_round_e4m3_ties_subnormals_saturation(dtype, x, expected):
    assert_same(round_e4m3(t([x, -x], dtype)), t([expected, -expected], dtype))


def test_round_e4m3_keeps_sign_of_zero_and_nan():
    out = round_e4m3(t([-0.0, -2.0**-11, float("nan")]))
    assert torch.signbit(out[:2]).all() and (out[:2] == 0).all() and out[2].isnan()


def test_round_e4m3_matches_torch_cast():
    gen = torch.Generator().manual_seed(0)
    mids = (e4m3_grid()[:-1] + e4m3_grid()[1:]).float() / 2  # exact in float32
    x = torch.cat([
        all_bf16().float(),
        # random float32 bit patterns with magnitude below 2^10
        torch.randint(0, 0x44800000, (1_000_000,), generator=gen, dtype=torch.int32).view(F32),
        mids, torch.nextafter(mids, t(1e9, F32)), torch.nextafter(mids, t(0.0, F32)),
    ])
    x = torch.cat([x, -x])
    expected = x.to(torch.float8_e4m3fn).float()
    # Older torch casts out-of-range values to NaN instead of saturating: compare where it doesn't.
    keep = ~expected.isnan()
    assert keep.sum() > len(x) // 2
    assert_same(round_e4m3(x)[keep], expected[keep])
    assert_same(round_e4m3(x.double())[keep], expected[keep].double())
    bf = all_bf16()
    keep = ~bf.float().to(torch.float8_e4m3fn).isnan()
    assert_same(round_e4m3(bf)[keep], bf[keep].float().to(torch.float8_e4m3fn).to(BF16))


def test_round_e4m3_float64_is_not_rounded_through_float32():
    x = t([1 + 1 / 16 + 2.0**-40])          # just above the 1 / 1.125 tie
    assert x.float().item() == 1 + 1 / 16    # a float32 round trip lands on the tie ...
    assert_same(round_e4m3(x), t([1.125]))   # ... but the float64 value rounds up
    # every midpoint of the E4M3 grid, nudged by a relative 2^-40 either way
    g = e4m3_grid()
    mids = (g[:-1] + g[1:]) / 2
    assert_same(round_e4m3(mids * (1 + 2.0**-40)), g[1:])
    assert_same(round_e4m3(mids * (1 - 2.0**-40)), g[:-1])
    even = torch.arange(len(mids)) % 2 == 0  # code i even -> the tie goes down to g[i]
    assert_same(round_e4m3(mids), torch.where(even, g[:-1], g[1:]))


# ---------------------------------------------------------------------------------------------
# scales

def test_pow2ceil_powers_of_two_and_neighbours():
    for dtype, lo, hi in [(F32, -125, 126), (F64, -1021, 1022), (BF16, -125, 126)]:
        n = torch.arange(lo, hi + 1)
        p = torch.ldexp(torch.ones(len(n), dtype=F64), n).to(dtype)
        assert_same(pow2ceil(p), p)
        assert_same(pow2ceil(torch.nextafter(p, t(float("inf"), dtype))), 2 * p)
        assert_same(pow2ceil(torch.nextafter(p, t(0.0, dtype))), p)
    assert_same(pow2ceil(t([3.0, 0.3, 1e-4 / 448, 2.0**-126])), t([4.0, 0.5, 2.0**-22, 2.0**-126]))
    # float64 exactness: 1 + 2^-52 is 1.0 after a float32 round trip, whose pow2ceil would be 1
    assert_same(pow2ceil(t([1 + 2.0**-52])), t([2.0]))


def test_amax_floors_for_all_zero_groups():
    for dtype in DTYPES:
        z = torch.zeros(2, 32, dtype=dtype)
        # 2^-23 = 1.19e-7 < 1e-4/448 = 2.23e-7 <= 2^-22 = 2.38e-7
        q, s = fp8_act_quant(z)
        assert_same(s, t([[2.0**-22]] * 2, dtype))
        assert_same(q, z)
        # (6 * 2^-126) / 6 = 2^-126 exactly
        q, s = fp4_act_quant(z)
        assert_same(s, t([[2.0**-126]] * 2, dtype))
        assert_same(q, z)
        # (6 * 2^-9) / 6 = 2^-9, the smallest E4M3 subnormal
        q, s = fp4_e4m3_act_quant(z)
        assert_same(s, t([[2.0**-9] * 2] * 2, dtype))
        assert_same(q, z)
        assert_same(fp8_row_quant(z)[1], t([[2.0**-22]] * 2, dtype))


# ---------------------------------------------------------------------------------------------
# group quantizers, hand-computed

def test_fp8_act_quant_hand_computed():
    x = t([[1.0, -3.0, 100.0, 0.3,
            0.001, 0.002, 0.0, -0.0005]])
    # group 1: amax 100, 100/448 = 0.223 -> s = 0.25; x/s = [4, -12, 400, 1.2]
    #   400 in [256, 512), quantum 32: 12.5 -> 12 (tie, even) -> 384; 1.2 quantum 1/8: 9.6 -> 10 -> 1.25
    # group 2: amax 0.002, 0.002/448 = 4.46e-6, 2^-18 = 3.8e-6 < that <= 2^-17 -> s = 2^-17
    #   0.001 * 2^17 = 131.07 (quantum 16: 8.19 -> 8) -> 128; 0.002 * 2^17 = 262.14 (quantum 32) -> 256
    #   -0.0005 * 2^17 = -65.54 (quantum 8: 8.19 -> 8) -> -64
    q, s = fp8_act_quant(x, group=4)
    assert_same(q, t([[4.0, -12.0, 384.0, 1.25, 128.0, 256.0, 0.0, -64.0]]))
    assert_same(s, t([[0.25, 2.0**-17]]))
    assert_same(fp8_qat(x, group=4), t([[1.0, -3.0, 96.0, 0.3125,
                                         2.0**-10, 2.0**-9, 0.0, -2.0**-11]]))


def test_fp4_act_quant_hand_computed():
    x = t([0.7, -1.3, 2.6, 0.05])
    # amax 2.6, 2.6/6 = 0.433 -> s = 0.5; x/s = [1.4, -2.6, 5.2, 0.1]
    #   1.4 -> 1.5 (tie 1.25 below); 2.6 -> 3 (tie 2.5 below); 5.2 -> 6 (tie 5 below); 0.1 -> 0
    q, s = fp4_act_quant(x, group=4)
    assert_same(q, t([1.5, -3.0, 6.0, 0.0]))
    assert_same(s, t([0.5]))
    assert_same(fp4_qat(x, group=4), t([0.75, -1.5, 3.0, 0.0]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp4_e4m3_scale_hand_computed(dtype):
    x = t([5.0, 1.0, 2.0, -3.0, 0.5, 0.2, 2.03125, 2.84375] + [0.0] * 8, dtype)
    # amax 5, 5/6 = 0.8333 in [0.5, 1), quantum 1/16: 13.33 -> 13 -> s = 13/16 = 0.8125
    # x/s = [6.15 -> 6, 1.23 -> 1, 2.46 -> 2, -3.69 -> -4, 0.615 -> 0.5, 0.246 -> 0,
    #        2.03125/0.8125 = 2.5 exactly -> 2 (tie), 2.84375/0.8125 = 3.5 exactly -> 4 (tie)]
    q, s = fp4_e4m3_act_quant(x)
    assert_same(q, t([6.0, 1.0, 2.0, -4.0, 0.5, 0.0, 2.0, 4.0] + [0.0] * 8, dtype))
    assert_same(s, t([0.8125], dtype))
    # q * 0.8125
    assert_same(fp4_e4m3_qat(x), t([4.875, 0.8125, 1.625, -3.25, 0.40625, 0.0, 1.625, 3.25]
                                   + [0.0] * 8, dtype))


def test_fp8_row_quant_hand_computed():
    x = t([[1000.0, 1.0, -0.5, 3.0], [0.0, 0.0, 0.0, 0.0]])
    # row 0: 1000/448 = 2.23 -> s = 4; x/s = [250 (quantum 16: 15.6 -> 16) -> 256, 0.25, -0.125, 0.75]
    # row 1: floor, s = pow2ceil(1e-4/448) = 2^-22
    q, s = fp8_row_quant(x)
    assert_same(q, t([[256.0, 0.25, -0.125, 0.75], [0.0] * 4]))
    assert_same(s, t([[4.0], [2.0**-22]]))
    assert_same(fp8_row_qat(x), q * s)


# ---------------------------------------------------------------------------------------------
# group quantizers, properties

QUANTIZERS = [(fp8_act_quant, fp8_qat, 32), (fp4_act_quant, fp4_qat, 32),
              (fp4_e4m3_act_quant, fp4_e4m3_qat, 16)]


@pytest.mark.parametrize("quant, qat, group", QUANTIZERS)
def test_group_quant_shapes_dtypes_and_leading_dims(quant, qat, group):
    x = torch.randn(2, 3, 4 * group, generator=torch.Generator().manual_seed(1), dtype=F64) * 10
    for dtype in DTYPES:
        xd = x.to(dtype)
        q, s = quant(xd)
        assert q.shape == xd.shape and s.shape == (2, 3, 4) and q.dtype == s.dtype == dtype
        assert_same(qat(xd), (q.to(F64).unflatten(-1, (4, group)) * s.to(F64)[..., None])
                    .flatten(-2).to(dtype))
        # leading dims are just a batch
        q2, s2 = quant(xd.reshape(6, -1))
        assert_same(q2.reshape(q.shape), q)
        assert_same(s2.reshape(s.shape), s)
    # bfloat16 input = the float32 computation on the same values, cast back
    xb = x.to(BF16)
    assert_same(qat(xb), qat(xb.float()).to(BF16))


@pytest.mark.parametrize("quant, qat, group", QUANTIZERS)
def test_group_quant_idempotent(quant, qat, group):
    x = torch.randn(8, 4 * group, generator=torch.Generator().manual_seed(2), dtype=F64)
    y = qat(x)
    assert_same(qat(y), y)


def group_quant_inputs(dtype):
    """Rows that reach every branch of a group quantizer: every finite bfloat16 value (all
    binades, subnormal and saturating ratios), exact grid midpoints and their neighbours one ulp
    away, all-zero and all-tiny groups (the amax floor), -0.0, and NaN/inf groups."""
    g = torch.Generator().manual_seed(5)
    vals = all_bf16().to(dtype)
    grid = torch.tensor(E2M1 + [448.0, 1.0625, 1.1875, 2.0**-9 * 1.5, 2.0**-10], dtype=dtype)
    mids = torch.cat([grid, grid.nextafter(torch.full_like(grid, 10.0 ** 9)), grid.nextafter(torch.zeros_like(grid))])
    scaled = (mids[None, :] * torch.exp2(torch.arange(-20, 21, 4, dtype=dtype))[:, None]).flatten()
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, float("nan"), float("inf"), -float("inf")], dtype=dtype)
    x = torch.cat([vals, scaled, special, torch.zeros(64, dtype=dtype), torch.full((32,), 1e-7, dtype=dtype),
                   torch.randn(4096, generator=g, dtype=torch.float64).to(dtype) * 100])
    x = x[torch.randperm(len(x), generator=g)]
    return torch.cat([x, torch.zeros(-len(x) % 96, dtype=dtype)]).reshape(-1, 96)


@pytest.mark.parametrize("fmt", ["fp8", "fp4", "fp4_e4m3", "fp8_row"])
@pytest.mark.parametrize("dtype", [F64, F32])
def test_host_group_quant_is_bitwise_the_torch_one(fmt, dtype, monkeypatch):
    """On the CPU outside tracing the group quantizers run in numpy; traced and on the GPU in
    torch. Both, on the same inputs, give the same bits."""
    import v41.quant as Q
    x = group_quant_inputs(dtype)
    quantize = {"fp8": lambda v: Q._fp8(v, 32), "fp4": lambda v: Q._fp4(v, 32),
                "fp4_e4m3": lambda v: Q._fp4_e4m3(v, 16), "fp8_row": lambda v: Q._fp8(v, v.shape[-1])}[fmt]
    assert Q._on_host(x)
    host = quantize(x)
    monkeypatch.setattr(Q, "_on_host", lambda v: False)
    ref = quantize(x)
    for a, b in zip(host, ref):
        assert_same(a, b)
    assert host[0].nan_to_num().abs().max() > 0 and host[0].isnan().any()


def test_host_path_only_for_plain_cpu_tensors():
    import v41.quant as Q
    from torch._subclasses.fake_tensor import FakeTensorMode
    x = torch.randn(2, 32)
    assert Q._on_host(x) and not Q._on_host(x.requires_grad_())
    with FakeTensorMode() as mode:
        assert not Q._on_host(mode.from_tensor(torch.randn(2, 32)))
    class Watching(torch.overrides.TorchFunctionMode):      # as tests/test_sync_free.py counts reads
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    with Watching():
        assert not Q._on_host(x.detach())
    traced = torch.fx.experimental.proxy_tensor.make_fx(lambda v: fp8_qat(v))(torch.randn(2, 32))
    assert any(n.target == torch.ops.aten.round.default for n in traced.graph.nodes)


def test_fp8_qat_float64_does_not_cross_a_boundary():
    # s = pow2ceil(448/448) = 1 for every group; 1 + 1/16 + 2^-40 must round up to 1.125
    x = t([[448.0, 1 + 1 / 16 + 2.0**-40] + [0.0] * 30])
    assert fp8_qat(x)[0, 1].item() == 1.125


# ---------------------------------------------------------------------------------------------
# storage: packing, E8M0, checkpoint blocks

def test_pack_fp4_nibble_order():
    packed = pack_fp4(t([[1, 2, 0xF, 0x8]]).to(torch.uint8))
    # element 0 in the low nibble: [1, 2] -> 0x21; [15, 8] -> 0x8F = -113 as int8
    assert packed.dtype == torch.int8
    assert packed.tolist() == [[0x21, 0x8F - 256]]
    assert_same(unpack_fp4(packed), t([[1, 2, 0xF, 0x8]]).to(torch.uint8))


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 16, (3, 5, 64), generator=torch.Generator().manual_seed(3),
                          dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (3, 5, 32)
    assert_same(unpack_fp4(packed), codes)


@pytest.mark.parametrize("dtype", DTYPES)
def test_e8m0_decode(dtype):
    codes = t([0, 127, 128, 254, 255]).to(torch.uint8)
    expected = t([2.0**-127, 1.0, 2.0, 2.0**127, float("nan")], dtype)
    assert_same(e8m0_decode(codes, dtype), expected)
    assert_same(e8m0_decode(codes.view(torch.float8_e8m0fnu), dtype), expected)


def test_e8m0_encode():
    codes = torch.arange(255, dtype=torch.uint8)
    for dtype in DTYPES:
        encoded = e8m0_encode(e8m0_decode(codes, dtype))
        assert encoded.dtype == torch.float8_e8m0fnu
        assert_same(encoded.view(torch.uint8), codes)
    # non-powers round up: 3 -> 4 = 2^2 (code 129); 0.75 -> 1 (127); 1 + 2^-40 -> 2 (128)
    assert e8m0_encode(t([3.0, 0.75, 1 + 2.0**-40])).view(torch.uint8).tolist() == [129, 127, 128]


def test_dequant_fp8_block_hand_computed():
    # n = 33, k = 40: scale blocks [2, 2], the last row / last 8 columns are partial blocks
    w = torch.zeros(33, 40)
    w[0, 0], w[0, 35], w[32, 0], w[32, 39], w[31, 31] = 1.5, -2.0, 448.0, 0.0625, 2.0**-9
    codes = t([[128, 126], [120, 130]]).to(torch.uint8)  # scales [[2, 0.5], [2^-7, 8]]
    out = dequant_fp8_block(w.to(torch.float8_e4m3fn), codes.view(torch.float8_e8m0fnu), F64)
    expected = torch.zeros(33, 40, dtype=F64)
    expected[0, 0] = 3.0           # 1.5 * 2
    expected[0, 35] = -1.0         # -2 * 0.5
    expected[32, 0] = 3.5          # 448 * 2^-7
    expected[32, 39] = 0.5         # 0.0625 * 8
    expected[31, 31] = 2.0**-8     # 2^-9 * 2 (still block [0, 0])
    assert_same(out, expected)


def test_dequant_fp4_expert_hand_computed():
    # n = 1, k = 64: two scale groups. Codes 3 (1.5), 9 (-0.5) -> byte 0x93; 7 (6), 15 (-6) -> 0xF7
    packed = torch.zeros(1, 32, dtype=torch.uint8)
    packed[0, 0], packed[0, 16] = 0x93, 0xF7
    scale = t([[128, 125]]).to(torch.uint8).view(torch.float8_e8m0fnu)  # [2, 0.25]
    out = dequant_fp4_expert(packed.view(torch.int8), scale, F32)
    expected = torch.zeros(1, 64)
    expected[0, :2] = t([3.0, -1.0])      # [1.5, -0.5] * 2
    expected[0, 32:34] = t([1.5, -1.5])   # [6, -6] * 0.25
    assert_same(out, expected)


def test_fp8_block_exact_round_trip():
    # grid weights whose every 32x32 block holds a 448: quant must recover codes and scales
    gen = torch.Generator().manual_seed(4)
    n, k = 70, 100  # ragged: 3 x 4 blocks
    codes = torch.randint(0, 127, (2, n, k), generator=gen, dtype=torch.uint8)
    codes |= torch.randint(0, 2, codes.shape, generator=gen, dtype=torch.uint8) << 7  # signs
    codes[..., ::32, ::32] = 126  # 448
    w = codes.view(torch.float8_e4m3fn)
    scale = torch.randint(110, 150, (2, 3, 4), generator=gen, dtype=torch.uint8)
    scale = scale.view(torch.float8_e8m0fnu)
    dense = dequant_fp8_block(w, scale, F64)
    w2, scale2 = quant_fp8_block(dense)
    assert w2.dtype == torch.float8_e4m3fn and scale2.dtype == torch.float8_e8m0fnu
    assert_same(w2.view(torch.uint8), w.view(torch.uint8))
    assert_same(scale2.view(torch.uint8), scale.view(torch.uint8))
    assert_same(dequant_fp8_block(w2, scale2, BF16), dense.to(BF16))  # exact in bf16 too


def test_fp8_block_round_trip_error_bound():
    w = torch.randn(70, 100, generator=torch.Generator().manual_seed(5), dtype=F64)
    w[:32, :32] = 0.0  # an all-zero block
    q, s = quant_fp8_block(w)
    assert s.view(torch.uint8)[0, 0].item() == 127 - 22  # the 1e-4 floor: 2^-22
    dense = dequant_fp8_block(q, s, F64)
    step = dequant_fp8_block(torch.ones_like(q), s, F64)  # per-element scale
    # E4M3 keeps 4 significant bits (relative error <= 2^-4); subnormals err by <= 2^-10 * s
    assert ((dense - w).abs() <= w.abs() * 2.0**-4 + step * 2.0**-10).all()
    assert_same(dequant_fp8_block(*quant_fp8_block(dense), F64), dense)


def test_fp4_expert_exact_round_trip():
    gen = torch.Generator().manual_seed(6)
    codes = torch.randint(0, 16, (2, 5, 96), generator=gen, dtype=torch.uint8)
    codes[..., ::32] = 7  # a 6 in every group fixes s = pow2ceil(6 s / 6) = s
    scale = torch.randint(100, 150, (2, 5, 3), generator=gen, dtype=torch.uint8)
    scale = scale.view(torch.float8_e8m0fnu)
    dense = dequant_fp4_expert(pack_fp4(codes), scale, F64)
    packed, scale2 = quant_fp4_expert(dense)
    assert packed.dtype == torch.int8 and packed.shape == (2, 5, 48)
    # codes include 8 (-0): dequant, x / s and rounding all keep the sign of zero
    assert_same(unpack_fp4(packed), codes)
    assert_same(scale2.view(torch.uint8), scale.view(torch.uint8))


def test_fp4_expert_matches_fp4_qat():
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(7))
    for dtype in DTYPES:
        wd = w.to(dtype)
        assert_same(dequant_fp4_expert(*quant_fp4_expert(wd), dtype), fp4_qat(wd, 32))


def test_e4m3_times_e8m0_scales_are_exact_in_bf16():
    """fp8_gemm's 'bf16' path feeds the tensor cores E4M3 values times their E8M0 scales in bf16:
    every finite E4M3 value times 2^(c - 127) is exact in FP32 and in bf16 for codes 3..246 (below,
    a subnormal value's last bit falls under bf16's 2^-133; above, 448 · 2^120 overflows), and
    not at the two ends' neighbours."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(F64)
    v = v[v.isfinite()]
    for c in (2, *range(3, 247), 247):
        exact = v * 2.0 ** (c - 127)
        ok = torch.equal((v.float() * 2.0 ** (c - 127)).to(BF16).to(F64), exact)
        assert ok == (3 <= c <= 246), c
