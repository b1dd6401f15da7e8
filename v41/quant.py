"""Reference FP8 / FP4 formats of DeepSeek-V4.1 (spec/model.md §2.4, §4, §5.2).

Element formats
  E4M3   OCP float8_e4m3fn: bias 7, 3 mantissa bits, no infinities. Normals 2^-6 .. 448,
         subnormal quantum 2^-9. We round to nearest even and saturate to ±448.
  E2M1   FP4 magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}; nearest even, saturating at ±6.
         A 4-bit code is the magnitude index 0..7 with bit 3 the sign. Two codes go in a byte,
         element 2k in the low nibble; checkpoints store the bytes as I8.
  E8M0   (UE8M0) an unsigned power-of-two scale: code c means 2^(c-127); 255 is NaN.

Block formats (s = scale, q = element values, dequantized value = q * s)
  FP8 activations / SWA KV   groups of 32 along the last dim, s = pow2ceil(max(amax, 1e-4) / 448)
  FP4 index keys / queries   groups of 32, s = pow2ceil(max(amax, 6*2^-126) / 6)
  FP4 compressed main KV     groups of 16, s = round_e4m3(max(amax, 6*2^-9) / 6), q from x / s
  FP8 index plane (runtime)  one power-of-two scale per row, as FP8 activations with group = row
  FP8 weights                E4M3 [n, k] + E8M0 scale per 32x32 block [ceil(n/32), ceil(k/32)]
  FP4 routed-expert weights  packed E2M1 [n, k/2] + E8M0 scale per 1x32 along k [n, k/32]

Exactness. Every rounding is done arithmetically in the input's own dtype (float32 for
bfloat16 / float16 inputs, cast back at the end): the binade comes from the exponent bits, the
value is divided by a power-of-two quantum (exact), rounded by torch.round (half to even) and
multiplied back. Nothing goes through `.to(torch.float8_e4m3fn)`, which converts via float32: a
float64 value just above a rounding tie would first collapse onto the tie and then round the
wrong way. So a float64 oracle sees exactly the grid the spec defines. Powers of two are built
from their bit pattern rather than pow/exp2, whose vectorized versions need not be exact, and
binades are read from the bits rather than torch.frexp. Both in the working dtype's own integer
width: this code is traced and compiled, and on an H200 (torch 2.11, Triton 3.6) Inductor's
kernels for the frexp / int64-shift / float64-bitcast form gave results that depended on the
autotuned block size (benchmarks/results/compile-quant-configs-h200.json).

Function results come back in the input dtype: float64, float32 or bfloat16 hold every q, s and
q * s exactly. (float16 cannot hold the 2^-126 FP4 scale floor.)
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _get_current_dispatch_mode

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6 * 2.0**-126     # smallest scale 2^-126, the smallest normal float32
FP4_E4M3_AMAX_FLOOR = 6 * 2.0**-9  # smallest scale 2^-9, the smallest nonzero E4M3
FP4_WEIGHT_GROUP = 32
E8M0_NAN = 255
# (mantissa bits, smallest normal exponent, largest value) of the element grids
E4M3_GRID = (3, -6, E4M3_MAX)
E2M1_GRID = (1, 0, E2M1_MAX)


# ---------------------------------------------------------------------------------------------
# scalars and element grids

def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


# float dtype -> (integer dtype of its width, mantissa bits, exponent bias)
_BITS = {torch.float32: (torch.int32, 23, 127), torch.float64: (torch.int64, 52, 1023)}


def _exp2(n: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2**n for an integer tensor n, exactly, in `dtype`, built from the bits of `dtype` (float32:
    n in [-126, 127], float64: [-1022, 1023]); other dtypes build in float64 and cast, which is
    exact wherever 2**n is representable there."""
    if dtype not in _BITS:
        return _exp2(n, torch.float64).to(dtype)
    it, mant, bias = _BITS[dtype]
    return ((n.to(it) + bias) << mant).view(dtype)


def _binade(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e with |v| in [2^(e-1), 2^e) (torch.frexp's exponent) for the normal float32 / float64 v
    whose bits these are; zero and subnormals give the smallest normal binade's e - 1."""
    _, mant, bias = _BITS[dtype]
    return ((bits >> mant) & (2 * bias + 1)) - (bias - 1)


def _ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """ceil(log2 v) of positive normal v as an integer tensor, exactly."""
    v = v.to(_work_dtype(v.dtype))
    it, mant, _ = _BITS[v.dtype]
    bits = v.view(it)   # once: rms_norm_quant CSEs the graph it matches, not its pattern
    exact = (bits & ((1 << mant) - 1)) == 0   # v is 2^(e-1) itself
    return _binade(bits, v.dtype) - exact.to(it)


def pow2ceil(v: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2 v) exactly (a UE8M0 scale), in v's dtype, for positive normal v."""
    return _exp2(_ceil_log2(v), v.dtype)


def _round_to_grid(x: torch.Tensor, mant_bits: int, min_exp: int, max_val: float) -> torch.Tensor:
    """Round x to nearest even on a sign-magnitude float grid with `mant_bits` mantissa bits and
    smallest normal exponent `min_exp` (evenly spaced subnormals below), saturating at ±max_val."""
    w = x.to(_work_dtype(x.dtype))
    a = w.abs().clamp(max=max_val)  # saturate first: max_val is itself on the grid
    e = _binade(a.view(_BITS[a.dtype][0]), a.dtype)   # a in [2^(e-1), 2^e); 0: min_exp's quantum
    quantum = (e - 1).clamp(min=min_exp) - mant_bits
    # Scaling by a power of two is exact, so torch.round (half to even) sees the true ratio; an
    # even integer multiple of the quantum is an even mantissa, so this is RNE on the grid.
    q = torch.round(a * _exp2(-quantum, w.dtype)) * _exp2(quantum, w.dtype)
    return torch.copysign(q, w).to(x.dtype)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest even onto float8_e4m3fn values, saturating to ±448; in x's dtype."""
    return _round_to_grid(x, *E4M3_GRID)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest even onto ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturating at ±6; in x's dtype."""
    return _round_to_grid(x, *E2M1_GRID)


# ---------------------------------------------------------------------------------------------
# group quantizers along the last dim

def _group_quant(x, group, amax_floor, elem, scale_grid=None):
    """Per `group` elements of the last dim: s = pow2ceil(max(amax, floor) / elem max), or that
    ratio rounded onto `scale_grid`; q = x / s rounded onto the `elem` grid.

    Returns (q [..., D/group, group], s [..., D/group, 1]) in the working dtype. The spec's
    clamp(x / s, ±max) before rounding is implicit: the rounding saturates at the same bound.
    On the CPU outside tracing the same arithmetic runs in numpy (`_group_quant_host`)."""
    if _on_host(x):
        return _group_quant_host(x, group, amax_floor, elem, scale_grid)
    w = x.to(_work_dtype(x.dtype)).unflatten(-1, (-1, group))
    a = w.abs().amax(-1, keepdim=True).clamp(min=amax_floor) / elem[2]
    s = pow2ceil(a) if scale_grid is None else _round_to_grid(a, *scale_grid)
    return _round_to_grid(w / s, *elem), s


def _fp8(x, group):
    return _group_quant(x, group, FP8_AMAX_FLOOR, E4M3_GRID)


def _fp4(x, group):
    return _group_quant(x, group, FP4_AMAX_FLOOR, E2M1_GRID)


def _fp4_e4m3(x, group):
    # True division x / s (not x * (1/s)): the two differ only at E2M1 ties (spec §2.4, open).
    return _group_quant(x, group, FP4_E4M3_AMAX_FLOOR, E2M1_GRID, scale_grid=E4M3_GRID)


# ---- the same on the host ---------------------------------------------------------------------
# A torch op on the CPU costs microseconds of dispatch whatever its size, a numpy ufunc a
# fraction of that, and a quantizer is ~25 elementwise ops on a few rows: on the CPU the
# eager toy spends most of a step here. The numpy functions mirror the torch ones op for op:
# the same IEEE operations in the same dtype (np.rint and torch.round both round half to even),
# so the results are bitwise equal (tests/test_quant.py checks them against each other).

_NP_BITS = {np.dtype(np.float32): (np.int32, 23, 127), np.dtype(np.float64): (np.int64, 52, 1023)}


def _on_host(x: torch.Tensor) -> bool:
    """A plain CPU tensor outside compilation, tracing and torch modes (a fake, functional or
    traced tensor, and a mode that watches the ops, must see the torch ops)."""
    return (type(x) is torch.Tensor and x.device.type == "cpu" and not x.requires_grad
            and not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and not torch._C._is_torch_function_mode_enabled())


def _np_exp2(n: np.ndarray, dtype) -> np.ndarray:
    it, mant, bias = _NP_BITS[dtype]
    return ((n.astype(it) + bias) << mant).view(dtype)


def _np_binade(a: np.ndarray) -> np.ndarray:
    it, mant, bias = _NP_BITS[a.dtype]
    return ((a.view(it) >> mant) & (2 * bias + 1)) - (bias - 1)


def _np_pow2ceil(a: np.ndarray) -> np.ndarray:
    it, mant, _ = _NP_BITS[a.dtype]
    return _np_exp2(_np_binade(a) - ((a.view(it) & ((1 << mant) - 1)) == 0), a.dtype)


def _np_round_to_grid(w: np.ndarray, mant_bits: int, min_exp: int, max_val: float) -> np.ndarray:
    a = np.minimum(np.abs(w), max_val)
    quantum = np.maximum(_np_binade(a) - 1, min_exp) - mant_bits
    return np.copysign(np.rint(a * _np_exp2(-quantum, w.dtype)) * _np_exp2(quantum, w.dtype), w)


def _group_quant_host(x, group, amax_floor, elem, scale_grid=None):
    """`_group_quant` in numpy, for a CPU tensor; torch tensors in and out."""
    w = x.to(_work_dtype(x.dtype)).numpy()
    w = w.reshape(*w.shape[:-1], -1, group)
    with np.errstate(all="ignore"):    # NaN / inf rows propagate, as in torch, unannounced
        a = np.maximum(np.abs(w).max(-1, keepdims=True), amax_floor) / elem[2]
        s = _np_pow2ceil(a) if scale_grid is None else _np_round_to_grid(a, *scale_grid)
        q = _np_round_to_grid(w / s, *elem)
    return torch.from_numpy(q), torch.from_numpy(s)


def _as_pair(x, q, s):
    """(q [..., D], s [..., D/group]) in x's dtype."""
    return q.flatten(-2).to(x.dtype), s.squeeze(-1).to(x.dtype)


def _round_trip(x, q, s):
    return (q * s).flatten(-2).to(x.dtype)


def fp8_act_quant(x: torch.Tensor, group: int = 32):
    """FP8 activation quant: (q holding E4M3 values [..., D], power-of-two s [..., D/group])."""
    return _as_pair(x, *_fp8(x, group))


def fp8_qat(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """FP8 fake-quant round trip q * s, in x's dtype."""
    return _round_trip(x, *_fp8(x, group))


def fp4_act_quant(x: torch.Tensor, group: int = 32):
    """FP4 with UE8M0 scale: (q holding E2M1 values [..., D], power-of-two s [..., D/group])."""
    return _as_pair(x, *_fp4(x, group))


def fp4_qat(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """FP4 (UE8M0 scale) fake-quant round trip q * s, in x's dtype."""
    return _round_trip(x, *_fp4(x, group))


def fp4_e4m3_act_quant(x: torch.Tensor, group: int = 16):
    """FP4 with E4M3 scale (compressed KV): (q holding E2M1 values, E4M3-valued s [..., D/group])."""
    return _as_pair(x, *_fp4_e4m3(x, group))


def fp4_e4m3_qat(x: torch.Tensor, group: int = 16) -> torch.Tensor:
    """FP4 (E4M3 scale) fake-quant round trip q * s, in x's dtype."""
    return _round_trip(x, *_fp4_e4m3(x, group))


def fp8_row_quant(x: torch.Tensor):
    """FP8 index-plane rows: one power-of-two scale per row, i.e. FP8 act quant with
    group = row. Returns (q [..., D], s [..., 1]); callers store s as fp32."""
    return fp8_act_quant(x, group=x.shape[-1])


def fp8_row_qat(x: torch.Tensor) -> torch.Tensor:
    """FP8 index-plane round trip q * s, in x's dtype."""
    return fp8_qat(x, group=x.shape[-1])


def index_query_qat(q: torch.Tensor, fmt: str) -> torch.Tensor:
    """The index query rounded as its scorer reads it against an index plane of format `fmt`:
    FP8 per (token, head) row on an FP8 plane, FP4 per 32 dims on an FP4 one (the published
    model's arithmetic, spec §3.3)."""
    return fp8_row_qat(q) if fmt == "fp8" else fp4_qat(q, 32)


# ---------------------------------------------------------------------------------------------
# codes and storage

def _e2m1_table(dtype, device):
    return torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype, device=device)


def e2m1_encode(values: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (magnitude index | sign << 3) of values rounded RNE onto the grid
    (a no-op for grid values). -0.0 encodes as 8."""
    v = round_e2m1(values.to(_work_dtype(values.dtype)))
    grid = torch.tensor(E2M1_VALUES, dtype=v.dtype, device=v.device)
    magnitude = torch.searchsorted(grid, v.abs().contiguous()).to(torch.uint8)
    return magnitude | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values of uint8 E2M1 codes 0..15, in `dtype`."""
    return _e2m1_table(dtype, codes.device)[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] int8 bytes, element 2k in the low nibble, 2k+1 in the high."""
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] int8 (or uint8) bytes -> [..., K] uint8 codes."""
    p = packed.view(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def e8m0_decode(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2^(code - 127) in `dtype` for uint8 or float8_e8m0fnu codes; code 255 is NaN.
    Code 0 (2^-127) is a subnormal in float32 / bfloat16 and still exact."""
    c = codes.view(torch.uint8)
    s = _exp2(c.to(torch.int64) - 127, torch.float64).to(dtype)   # float64: 2^-127 is a normal
    return s.masked_fill(c == E8M0_NAN, float("nan"))


def e8m0_encode(scales: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu codes of positive power-of-two scales (exact); any other value rounds
    up to the next power of two, the safe direction for a scale. In float64, where code 0's
    2^-127 is a normal number."""
    return (_ceil_log2(scales.double()) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _expand_blocks(scale: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    """Per-block scale [..., ceil(n/b), ceil(k/b)] -> per element [..., n, k]."""
    return scale.repeat_interleave(block, -2).repeat_interleave(block, -1)[..., :n, :k]


def dequant_fp8_block(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                      block: int = 32) -> torch.Tensor:
    """float8_e4m3fn [..., n, k] times its E8M0 per-block scale, in `dtype` (exact)."""
    n, k = w.shape[-2:]
    return w.to(dtype) * _expand_blocks(e8m0_decode(scale, dtype), n, k, block)


def dequant_fp4_expert(w_packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed E2M1 [..., n, k/2] (int8) times E8M0 scale [..., n, k/32] -> [..., n, k] in `dtype`."""
    values = e2m1_decode(unpack_fp4(w_packed), dtype)
    return values * e8m0_decode(scale, dtype).repeat_interleave(FP4_WEIGHT_GROUP, -1)


def quant_fp8_block(w: torch.Tensor, block: int = 32):
    """Inverse of dequant_fp8_block: (float8_e4m3fn [..., n, k], float8_e8m0fnu scale
    [..., ceil(n/b), ceil(k/b)]) with s = pow2ceil(max(block amax, 1e-4) / 448).

    The amax floor is the activation one, so an all-zero block still gets a finite scale. Ragged
    edges are zero-padded into whole blocks, which leaves every block amax unchanged."""
    n, k = w.shape[-2:]
    x = F.pad(w.to(_work_dtype(w.dtype)), (0, -k % block, 0, -n % block))
    blocks = x.unflatten(-1, (-1, block)).unflatten(-3, (-1, block))  # [..., N, b, K, b]
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True).clamp(min=FP8_AMAX_FLOOR)
    s = pow2ceil(amax / E4M3_MAX)
    q = round_e4m3(blocks / s).flatten(-2).flatten(-3, -2)[..., :n, :k]
    return q.to(torch.float8_e4m3fn), e8m0_encode(s.squeeze((-3, -1)))


def quant_fp4_expert(w: torch.Tensor):
    """Inverse of dequant_fp4_expert: (packed int8 [..., n, k/2], float8_e8m0fnu scale
    [..., n, k/32]), quantized exactly like fp4_act_quant with group 32."""
    q, s = fp4_act_quant(w, FP4_WEIGHT_GROUP)
    return pack_fp4(e2m1_encode(q)), e8m0_encode(s)


# ---------------------------------------------------------------------------------------------
# native resident weights

class BlockScaled:
    """A weight kept in its checkpoint format on the device: `q` (float8_e4m3fn [..., n, k], or
    FP4 packed int8 [..., n, k/2]) and its E8M0 `scale` (FP8: per 32x32 block; FP4: per 1x32),
    held as its uint8 codes: Inductor refuses to decompose a functionalized op that reads a
    float8_e8m0fnu tensor (it allows that dtype in views and copies only), and every consumer
    (the native GEMM ops, `e8m0_decode`) reads the codes. `dequant` gives what the reference
    path multiplies."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        if q.dtype not in (torch.float8_e4m3fn, torch.int8):
            raise TypeError(f"BlockScaled.q: float8_e4m3fn or packed-FP4 int8, got {q.dtype}")
        if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
            raise TypeError(f"BlockScaled.scale: float8_e8m0fnu (or its uint8 codes), got {scale.dtype}")
        self.q, self.scale = q, scale.view(torch.uint8)

    @property
    def fmt(self) -> str:
        return "fp8" if self.q.dtype == torch.float8_e4m3fn else "fp4"

    @property
    def shape(self) -> torch.Size:
        """The logical (dequantized) shape."""
        s = self.q.shape
        return s if self.fmt == "fp8" else s[:-1] + (2 * s[-1],)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def to(self, device) -> "BlockScaled":
        return BlockScaled(self.q.to(device), self.scale.to(device))

    def dequant(self, dtype: torch.dtype) -> torch.Tensor:
        if self.fmt == "fp8":
            return dequant_fp8_block(self.q, self.scale, dtype)
        return dequant_fp4_expert(self.q, self.scale, dtype)

    @staticmethod
    def stack(ws: list["BlockScaled"]) -> "BlockScaled":
        return BlockScaled(torch.stack([w.q for w in ws]), torch.stack([w.scale for w in ws]))


# ---- GEMMs -----------------------------------------------------------------------------------

def _in_fp32(a: torch.Tensor) -> bool:
    return a.device.type == "cpu" and a.dtype in (torch.bfloat16, torch.float16)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in a's dtype, as the spec computes a GEMM: products summed in FP32 (FP64 for
    float64) and rounded once. CUDA's half-precision GEMMs do so; a CPU half-precision matmul
    sums in an order of its ISA's kernel (an AVX2 host's bf16 GEMM differs from the FP32 GEMM
    where an AVX-512 host's does not), so on the CPU the operands are multiplied in FP32."""
    return (a.float() @ b.float()).to(a.dtype) if _in_fp32(a) else a @ b


def einsum(eq: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.einsum of two operands in a's dtype, summed as `matmul` sums."""
    return torch.einsum(eq, a.float(), b.float()).to(a.dtype) if _in_fp32(a) else torch.einsum(eq, a, b)
