"""The FP8 pieces the Triton GEMM kernels share (fp8_gemm.py, fp8_gemv.py, fp4.py, moe_w4a8.py,
attn_out.py): E8M0 scales and E4M3 codes decoded (four to an int32 word in inline PTX on CUDA),
the activation quant's groups of 32, and split-K's end of a program: FP32 partials, per-tile
arrival counters, the last split's ordered sum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.triton.common import group_exponent, pow2, round_e4m3

GROUP = 32
GROUP_K = tl.constexpr(GROUP)   # the same width inside kernels (compiled Triton reads only constexpr globals)
SPLIT_TILES = 32768           # counters made at first use (the FP4 down GEMVs at 384 pairs: 384 x 80)
_COUNTERS: dict = {}          # (device, stream) -> its counter buffers, the largest last


@triton.jit
def e8m0_to_f32(c):
    """2^(c-127) as FP32 for int32 E8M0 codes c: 1..254 from the bits, 0 the subnormal 2^-127,
    255 NaN."""
    v = tl.where(c == 0, 0x400000, c << 23).to(tl.float32, bitcast=True)
    return tl.where(c == 255, float("nan"), v)


@triton.jit
def fp8_quant_groups(y, AXIS: tl.constexpr):
    """(E4M3 values q, scales 2^k) of FP32 `y` whose axis AXIS is one group of 32: q·2^k is
    common.fp8_qat_groups(y), i.e. v41.quant.fp8_qat; the scales keep AXIS with size 1."""
    k = group_exponent(tl.max(tl.abs(y), axis=AXIS, keep_dims=True))
    return round_e4m3(y * pow2(-k)), pow2(k)


def e4m3_word_ptx(w: str, outs: tuple[str, ...], p: str = "") -> str:
    """PTX lines: the four E4M3 codes of the 32-bit register w (byte i: element i) into the FP32
    registers outs, by the hardware's E4M3 pair -> f16x2 conversion twice, then f16 -> f32; the
    lines' own registers are named with the prefix p."""
    return "\n".join([f".reg .b16 {p}l0, {p}l1, {p}x0, {p}x1, {p}x2, {p}x3;", f".reg .b32 {p}f0, {p}f1;",
                      f"mov.b32 {{{p}l0, {p}l1}}, {w};",
                      f"cvt.rn.f16x2.e4m3x2 {p}f0, {p}l0;", f"cvt.rn.f16x2.e4m3x2 {p}f1, {p}l1;",
                      f"mov.b32 {{{p}x0, {p}x1}}, {p}f0;", f"mov.b32 {{{p}x2, {p}x3}}, {p}f1;"] +
                     [f"cvt.f32.f16 {o}, {p}x{i};" for i, o in enumerate(outs)])


# an int32 word $4 of four E4M3 codes -> their FP32 values $0..$3
E4M3_WORD_PTX = tl.constexpr("{\n" + e4m3_word_ptx("$4", ("$0", "$1", "$2", "$3")) + "\n}")


@triton.jit
def e4m3_byte(codes, i: tl.constexpr):
    """Byte i of int32 words of E4M3 codes, as its FP32 value."""
    return ((codes >> (8 * i)) & 0xFF).to(tl.int8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def e4m3_word_values(w, ASM: tl.constexpr):
    """The four FP32 values of int32 words w of E4M3 codes, in element order. ASM (CUDA):
    E4M3_WORD_PTX; else (the interpreter runs no PTX) byte by byte."""
    if ASM:
        return tl.inline_asm_elementwise(E4M3_WORD_PTX, "=f,=f,=f,=f,r", [w], dtype=(tl.float32,) * 4,
                                         is_pure=True, pack=1)
    else:
        return e4m3_byte(w, 0), e4m3_byte(w, 1), e4m3_byte(w, 2), e4m3_byte(w, 3)


@triton.jit
def store_tile(acc, rm, rn, M, N, o_ptr, stride_om, p_ptr, stride_pm, stride_ps, cnt_ptr, os_ptr, stride_osm,
               SPLIT_K: tl.constexpr, QUANT_OUT: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """The output tile [rm, rn] of program (m, n, split) (rn = n·BLOCK_N + arange): `acc`, or with
    SPLIT_K the sum of the splits' partials (`split_sum`: at p, the tile's counter at cnt_ptr),
    written by `write_tile`."""
    omask = (rm < M)[:, None] & (rn < N)[None, :]
    o_ptrs = o_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    if SPLIT_K:
        p_tile = p_ptr + rm.to(tl.int64)[:, None] * stride_pm + rn[None, :]
        counter = cnt_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        last, tot = split_sum(acc, p_tile, stride_ps, tl.program_id(2), tl.num_programs(2), counter, omask)
        if last:
            write_tile(tot, rm, M, N, o_ptrs, omask, os_ptr, stride_osm, QUANT_OUT, OUT_DTYPE)
    else:
        write_tile(acc, rm, M, N, o_ptrs, omask, os_ptr, stride_osm, QUANT_OUT, OUT_DTYPE)


@triton.jit
def write_tile(y, rm, M, N, o_ptrs, omask, os_ptr, stride_osm, QUANT_OUT: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """The FP32 tile y [BM, BN] of program column n rounded once into o; with QUANT_OUT rounded
    to OUT_DTYPE, then act-quantized (`fp8_quant_groups` per 32 columns, BN a multiple of 32):
    the E4M3 codes into o, the scales into os."""
    if QUANT_OUT:
        BM: tl.constexpr = y.shape[0]
        BN: tl.constexpr = y.shape[1]
        v = tl.reshape(y.to(OUT_DTYPE).to(tl.float32), [BM, BN // GROUP_K, GROUP_K])
        q, s = fp8_quant_groups(v, 2)
        tl.store(o_ptrs, tl.reshape(q, [BM, BN]).to(o_ptrs.dtype.element_ty), mask=omask)
        g = tl.program_id(1) * (BN // GROUP_K) + tl.arange(0, BN // GROUP_K)
        smask = (rm < M)[:, None] & (g < tl.cdiv(N, GROUP_K))[None, :]
        tl.store(os_ptr + rm.to(tl.int64)[:, None] * stride_osm + g[None, :], tl.reshape(s, [BM, BN // GROUP_K]),
                 mask=smask)
    else:
        tl.store(o_ptrs, y.to(o_ptrs.dtype.element_ty), mask=omask)


@triton.jit
def split_sum(acc, p_tile, stride_ps, split, splits, counter, omask):
    """Split-K's end of a program: its FP32 partial `acc` stored at p_tile + split·stride_ps and
    counted in the tile's counter (acq_rel). Returns (whether this split counted last, and there
    the partials summed in ascending split order, the counter zeroed for the next call: every
    split of this launch has counted); the last one's caller stores the sum."""
    tl.store(p_tile + split.to(tl.int64) * stride_ps, acc, mask=omask)
    last = tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1
    tot = tl.zeros_like(acc)
    if last:
        for s in range(splits):
            # .cg: from L2, where the other splits' stores are (not a stale L1 line)
            tot += tl.load(p_tile + s * stride_ps, mask=omask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter, 0)
    return last, tot


@triton.jit
def sum_splits(acc, o_ptrs, p_tile, stride_ps, split, splits, counter, omask):
    """`split_sum`, the last split rounding the sum once into o_ptrs."""
    last, tot = split_sum(acc, p_tile, stride_ps, split, splits, counter, omask)
    if last:
        tl.store(o_ptrs, tot.to(o_ptrs.dtype.element_ty), mask=omask)


def split_count(tiles: int, KB: int, M: int, K: int, device) -> int:
    """Split-K count: enough programs for two waves over the SMs when the output tiles alone
    leave them idle (a decode GEMM at N = 1280 is 20 tiles on 132 SMs), each split keeping at
    least 4 K blocks; under 4 tiles per SM, at least 4 splits where their FP32 partials
    (written and read, 8·M·N bytes a split) stay under half the weight's N·K bytes (H200: 4
    splits took 16384x4096 at M = 1 from 59 to 32 µs; at M = 64 they slowed wq_b, whose
    partials outweigh it, from 38 to 49 µs). KB counts K in blocks of 32."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    n = max(1, min(KB // 4, triton.cdiv(2 * sms, tiles))) if tiles < sms else 1
    return max(n, min(4, KB // 4, K // (16 * M))) if tiles < 4 * sms else n


def tile_counters(device, tiles: int) -> torch.Tensor:
    """The split-K kernels' per-tile arrival counters on `device`: a zeroed buffer of at least
    `tiles`, every counter back at zero when its tile's last split has summed. A call needing
    more than the largest buffer makes a larger one; none is freed, since a CUDA graph that
    captured a kernel keeps its buffer's address. Each stream has its own: kernels on two
    streams may run at once (custom_ops/triton/overlap.py)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    bufs = _COUNTERS.setdefault((device, stream), [])
    if not bufs or bufs[-1].numel() < tiles:
        bufs.append(torch.zeros(max(SPLIT_TILES, triton.next_power_of_2(tiles)), dtype=torch.int32, device=device))
    return bufs[-1]
