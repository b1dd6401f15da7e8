"""Pieces shared by the fused-op kernels (norm, rope, attn_out, mhc, moe, engram).

FP8 QAT in Triton, bit-exact with v41.quant.fp8_qat on FP32 values: per group of 32,
`s = pow2ceil(max(amax, 1e-4) / 448)` with the division rounded to nearest (`div_rn`: Triton's
plain `/` is an approximate divide on CUDA and could move amax/448 across a power of two), the
power of two read from the bits; `q = RNE_e4m3(min(|x/s|, 448))` by the add-and-subtract trick:
with quantum 2^qe for the value's binade (qe = max(floor(log2 a), -6) - 3), `(a + 2^(qe+23)) -
2^(qe+23)` rounds a to a multiple of 2^qe, half to even, in one FP32 add (the constant is data
dependent, so nothing folds it); x/s is x·2^-k, exact.

Skinny GEMM: `partial[s, m, n] = Σ_{k in split s} A[m, k]·W[n, k]` (optionally the split's
Σ A[m, k]² as well) for the narrow FP32 projections (mHC coefficients: N = hc·(hc+2) = 24;
router scores: N = experts). The K dimension is split across programs so that a decode step
(M = 1..64) still spreads the weight read over the GPU; a second kernel sums the splits in a
fixed order (deterministic for a given M).

Programmatic dependent launch (Hopper and later): a kernel launched with `**pdl(device)` may
start while the kernel before it finishes, its programs placed as that kernel's last ones run.
It must call `pdl_wait(PDL)` before its first access to anything a kernel writes or reads; only
constant weights may be loaded before it. `pdl_wait` also lets the next such kernel launch, so
each launch overlaps the tail of the one before. The wait returns when the previous kernel has
completed and its writes are visible; that kernel itself waited for the one before it, so
everything earlier in the stream is complete too.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:                          # a Triton without grid dependency control
    gdc_wait = gdc_launch_dependents = None

E4M3_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
_sm_count: dict[int, int] = {}
_pdl: dict[int, bool] = {}

TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4                           # the interpreter: a few programs are enough
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _sm_count:
        _sm_count[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _sm_count[i]


def pdl(device: torch.device) -> dict:
    """The launch arguments of a kernel that calls `pdl_wait(PDL)`: programmatic dependent launch
    on a CUDA device of compute capability 9 or more, nothing elsewhere (the interpreter) or with
    V41_PDL=0 (a profile's per-kernel durations then exclude the waits)."""
    if device.type != "cuda" or gdc_wait is None or os.environ.get("V41_PDL", "1") == "0":
        return {}
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _pdl:
        _pdl[i] = torch.cuda.get_device_capability(i)[0] >= 9
    return {"PDL": True, "launch_pdl": True} if _pdl[i] else {}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Under programmatic dependent launch (`pdl`): wait for the previous kernel to complete,
    then let the next one launch. A no-op otherwise."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def next_block(k0, k_hi, BLOCK_K: tl.constexpr):
    """The K block a prefetching loop loads while it multiplies block k0: the next one, or past
    the split's last block that last block again (in bounds; the loop ends before using it)."""
    return tl.minimum(k0 + BLOCK_K, k_hi - BLOCK_K)


def tma_descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor | None:
    """A tensor descriptor of the 2-D `t` read in `block`s (a kernel's TMA loads, captured by
    value in a CUDA graph), or None where the copy engine cannot read it: rows not contiguous,
    base or row stride not a multiple of 16 bytes."""
    if t.dim() != 2 or t.stride(1) != 1 or t.data_ptr() % 16 or t.stride(0) * t.element_size() % 16:
        return None
    return TensorDescriptor.from_tensor(t, block)


def dot_precision(t: torch.Tensor) -> str:
    """`input_precision` of tl.dot for operands of t's dtype: FP32 operands get full-precision
    products (the reference's FP32 GEMMs, no TF32); BF16 operands are exact either way."""
    return "ieee" if t.dtype == torch.float32 or t.device.type == "cpu" else "tf32"


def rows2d(t: torch.Tensor, width: int) -> torch.Tensor | None:
    """[N, width] view with unit last stride (no copy), or None."""
    try:
        v = t.view(-1, width)
    except RuntimeError:
        return None
    if width > 1 and v.stride(1) != 1:
        return None
    return v


# ---- FP8 QAT ---------------------------------------------------------------------------------

@triton.jit
def pow2(k):
    """2^k as FP32 for int32 k in [-126, 127], from the bits."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def ceil_log2(v):
    """ceil(log2 v) of positive normal FP32 v, exactly."""
    b = v.to(tl.int32, bitcast=True)
    e = ((b >> 23) & 0xFF) - 127
    return e + ((b & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def round_e4m3(v):
    """v (FP32) rounded to nearest even onto the float8_e4m3fn grid, saturating at ±448; FP32."""
    a = tl.minimum(tl.abs(v), 448.0)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127      # floor(log2 a); -127 for 0
    qe = tl.maximum(e, -6) - 3
    c = pow2(qe + 23)
    r = (a + c) - c
    # v's sign bit onto r, as torch.copysign: a negative v that rounds to zero keeps its -0 (code
    # 0x80). Triton compiles `-r` to `0 - r` on the GPU, which gives +0 there
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def group_exponent(amax):
    """k of the FP8 QAT scale 2^k of groups whose largest magnitude is amax (v41.quant.fp8_qat:
    amax floored at 1e-4, k = ceil(log2(amax / 448)))."""
    amax = tl.maximum(amax, 1e-4)
    return ceil_log2(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)))


@triton.jit
def fp8_qat_groups(y, AXIS: tl.constexpr):
    """FP8 QAT round trip of FP32 `y` whose axis AXIS is one group of 32 (E4M3 values times the
    UE8M0 group scale), exactly v41.quant.fp8_qat."""
    k = group_exponent(tl.max(tl.abs(y), axis=AXIS, keep_dims=True))
    return round_e4m3(y * pow2(-k)) * pow2(k)


@triton.jit
def _fp8_qat_kernel(x_ptr, out_ptr, N, NG, stride_x, stride_o,
                    BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    gs = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    j = tl.arange(0, 32)
    r = rows.to(tl.int64)[:, None, None]
    col = gs[None, :, None] * 32 + j[None, None, :]
    mask = (rows < N)[:, None, None] & (gs < NG)[None, :, None] & (j < 32)[None, None, :]
    y = tl.load(x_ptr + r * stride_x + col, mask=mask, other=0.0).to(tl.float32)
    q = fp8_qat_groups(y, 2)
    tl.store(out_ptr + r * stride_o + col, q.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_qat(x: torch.Tensor, out: torch.Tensor) -> None:
    """out <- v41.quant.fp8_qat(x, 32) for FP32/BF16 x [..., D], D a multiple of 32."""
    D = x.shape[-1]
    x2 = rows2d(x, D)
    if x2 is None:
        x2 = x.reshape(-1, D).contiguous()
    o2 = rows2d(out, D)
    dst = o2 if o2 is not None else torch.empty(x2.shape, dtype=out.dtype, device=out.device)
    N, NG = x2.shape[0], D // 32
    if N:
        BLOCK_G = min(triton.next_power_of_2(NG), 32)
        BLOCK_R = max(1, 64 // BLOCK_G)
        grid = (triton.cdiv(N, BLOCK_R), triton.cdiv(NG, BLOCK_G))
        _fp8_qat_kernel[grid](x2, dst, N, NG, x2.stride(0), dst.stride(0),
                              BLOCK_R=BLOCK_R, BLOCK_G=BLOCK_G, num_warps=4, **pdl(x2.device))
    if o2 is None:
        out.copy_(dst.view(out.shape))


# ---- split-K skinny GEMM ---------------------------------------------------------------------

@triton.jit
def _dot_exact(a, w, acc, DOT_F32: tl.constexpr):
    """acc + a·w of bf16 tiles with exact products: on tensor cores, or (DOT_F32) as FP32 FMAs."""
    if DOT_F32:
        acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def skinny_gemm_kernel(a_ptr, w_ptr, part_ptr, sq_ptr, M, N, K, k_split,
                       stride_am, stride_wn, stride_ps, stride_pm, stride_ss,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SUMSQ: tl.constexpr, SPLIT_W: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr = False):
    """partial[s, m, n] = Σ_{k in [s·k_split, (s+1)·k_split)} A[m, k]·W[n, k] in FP32 with
    full-precision products; with SUMSQ the programs of the first N tile also write
    sq[s, m] = Σ A[m, k]². SPLIT_W (A in bf16): each FP32 weight tile splits exactly into three
    bf16 tiles (w = w1 + w2 + w3: each rounding leaves a remainder of at most 16, then 8,
    significant bits), a bf16 weight is its own one part; their bf16 dots with A run on tensor
    cores and give exact products. Else A is read as FP32 and the dot is FP32 FMAs ("ieee").
    DOT_F32: SPLIT_W's dots in FP32 (the interpreter; the same exact products)."""
    pdl_wait(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    s = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    k0 = s * k_split
    k1 = tl.minimum(k0 + k_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    sq = tl.zeros([BLOCK_M], tl.float32)
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    for kk in range(k0, k1, BLOCK_K):
        ks = kk + rk
        kmask = ks < k1
        a = tl.load(a_rows + ks[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        wt = tl.load(w_cols + ks[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
        if SPLIT_W:
            w1 = wt.to(tl.bfloat16)
            acc = _dot_exact(a, w1, acc, DOT_F32)
            if w_ptr.dtype.element_ty == tl.float32:       # the FP32 weight's two remainders
                r = wt - w1.to(tl.float32)
                w2 = r.to(tl.bfloat16)
                acc = _dot_exact(a, w2, acc, DOT_F32)
                acc = _dot_exact(a, (r - w2.to(tl.float32)).to(tl.bfloat16), acc, DOT_F32)
        else:
            acc = tl.dot(a.to(tl.float32), wt.to(tl.float32), acc, input_precision="ieee")
        if SUMSQ:
            af = a.to(tl.float32)
            sq += tl.sum(af * af, axis=1)
    p = part_ptr + s.to(tl.int64) * stride_ps + rm.to(tl.int64)[:, None] * stride_pm + rn[None, :]
    tl.store(p, acc, mask=mmask[:, None] & nmask[None, :])
    if SUMSQ:
        if pid_n == 0:
            tl.store(sq_ptr + s.to(tl.int64) * stride_ss + rm, sq, mask=mmask)


def skinny_gemm(a: torch.Tensor, w: torch.Tensor, sumsq: bool, *, block_m: int | None = None,
                block_n: int | None = None, block_k: int = 64, split: int | None = None,
                split_w: bool | None = None, out: torch.Tensor | None = None, num_stages: int | None = None):
    """A [M, K] (unit last stride), W [N, K] FP32 or bf16 -> (partial [S, M, N] FP32, sq [S, M]
    FP32 or None). S from the SM count unless `split` is given. `split_w` (default: A in bf16):
    bf16 dots on tensor cores, an FP32 weight split into three bf16 parts
    (`skinny_gemm_kernel`). `out` (contiguous FP32 [M, N], with split 1): the one partial is
    written there."""
    M, K = a.shape
    N = w.shape[0]
    if w.stride(-1) != 1:
        w = w.contiguous()
    split_w = a.dtype == torch.bfloat16 if split_w is None else split_w
    if split_w and a.dtype != torch.bfloat16:
        raise ValueError(f"skinny_gemm: the split weight needs A in bf16, got {a.dtype}")
    bm = block_m or (16 if M <= 16 else 32 if M <= 32 else 64)
    bn = block_n or min(triton.next_power_of_2(max(N, 16)), 64)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    if split is None:
        split = max(1, min(triton.cdiv(2 * num_sms(a.device), tiles), K // (4 * block_k)))
    k_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    S = triton.cdiv(K, k_split)
    if out is not None and S != 1:
        raise ValueError(f"skinny_gemm: an out tensor takes one split, not {S}")
    part = out.view(1, M, N) if out is not None else torch.empty(S, M, N, dtype=torch.float32, device=a.device)
    sq = torch.empty(S, M, dtype=torch.float32, device=a.device) if sumsq else part
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), S)
    skinny_gemm_kernel[grid](a, w, part, sq, M, N, K, k_split, a.stride(0), w.stride(0),
                             part.stride(0), part.stride(1), sq.stride(0),
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block_k, SUMSQ=sumsq,
                             SPLIT_W=split_w, DOT_F32=not a.is_cuda, num_warps=4,
                             # the FP32 split's 16-row tile spills 16 bytes a thread at 3 stages (sm_90 build)
                             num_stages=num_stages or (2 if split_w and bm == 16 and w.dtype == torch.float32 else 3),
                             **pdl(a.device))
    return part, (sq if sumsq else None)
