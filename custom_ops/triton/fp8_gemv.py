"""The W8A8 GEMV (`v41::fp8_block_gemm` and `v41::fp8_linear` up to fp8_gemm.GEMV_M rows; the
launcher is fp8_gemm._gemm): the weight read as int32 words of four E4M3 codes, converted by the
hardware's FP8 conversion in inline PTX (fp8.E4M3_WORD_PTX; the interpreter's form decodes byte by
byte), multiplied on CUDA cores with x's FP8-QAT values (exact FP32 products), each word's sum
scaled by its block's scale, the words summed after the K loop. Where an MMA tile would hold one
real row in 16, its in-GEMM quantization of x and its padding dominate (benchmarks/sm90_build.py:
10.69 thread instructions a weight in the 16-row tile's K loop with x quantized inside, 4.53 in
the GEMV's 128-row tile); on the H200 it took 0.72-0.81x the MMA kernel's time at one row from bf16 x
(native-gemm-paths-h200.json). Its plain loads are not pipelined by default: three stages (cp.async
through shared memory) made it 1.7-3.1x slower than the MMA kernel in the same run. From codes at
one row its weight tiles come through a tensor descriptor instead (TMA, fp8_gemm.GEMV_TMA), three
deep.
"""
from __future__ import annotations

import triton
import triton.language as tl

from custom_ops.triton.common import group_exponent, next_block, pdl_wait, pow2, round_e4m3
from custom_ops.triton.fp8 import GROUP_K, e4m3_word_values, e8m0_to_f32, store_tile


@triton.jit
def _fp8_gemv_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, o_ptr, p_ptr, cnt_ptr, os_ptr, M, N, K, K_SPLIT, ROWS_G,
                     stride_xm, stride_sm, stride_wn, stride_wsn, stride_om, stride_ps, stride_pm, stride_osm,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, QUANT_X: tl.constexpr, ASM: tl.constexpr, STAGES: tl.constexpr,
                     PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False, TMA: tl.constexpr = False,
                     QUANT_OUT: tl.constexpr = False, OUT_DTYPE: tl.constexpr = tl.bfloat16):
    """The W8A8 GEMM on CUDA cores for a few rows of x, program (m, n, s): ROWS rows of x against
    BLOCK_N weight rows over K range [s·K_SPLIT, (s+1)·K_SPLIT) (multiples of BLOCK_K, itself a
    multiple of 32). The weight arrives as int32 words of four E4M3 codes (stride_wn in words).
    Each word's four products with x's FP8-QAT values (x quantized here per 32 with QUANT_X,
    else its codes times its scales: the same values) are summed and scaled by the word's 32x32
    block scale into an FP32 accumulator per word; the words are summed once, after the K loop.
    STAGES > 1 software-pipelines the K loop's loads (the weight words through shared memory).
    PREFETCH: the next K block's weight words and scales are loaded in registers while this one
    is multiplied, the first before `pdl_wait` (constant weights: they may stream while the
    kernel before ends). TMA: w_ptr is a tensor descriptor of the words [N, K / 4] in blocks
    [BLOCK_N, BLOCK_K / 4], whose loads the hardware's copy engine makes into shared memory,
    STAGES of them in flight, with no registers or address arithmetic spent on them. Grouped,
    split-K and the output (QUANT_OUT included) as in `_fp8_gemm_kernel`."""
    if not PREFETCH:
        pdl_wait(PDL)
    W: tl.constexpr = BLOCK_K // 4                      # words a row a K block
    n0 = tl.program_id(1) * BLOCK_N
    rm = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rn = n0 + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    j = tl.arange(0, W)[None, None, :]
    mmask = (rm < M)[:, None, None]
    nmask = (rn < N)[None, :, None]
    k_lo = split * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    x_row = rm.to(tl.int64) * stride_xm + (n0 // ROWS_G).to(tl.int64) * K       # x's columns for this tile
    xs_row = rm.to(tl.int64) * stride_sm + (n0 // ROWS_G).to(tl.int64) * (K // GROUP_K)
    if TMA:
        sums = tma_word_sums(w_ptr, ws_ptr, x_ptr + x_row, xs_ptr + xs_row, n0, N, k_lo, k_hi, stride_wsn, BLOCK_N,
                             BLOCK_K, STAGES, ASM)
    else:
        x_at = x_ptr + x_row[:, None, None] + 4 * j
        xs_at = xs_ptr + xs_row[:, None, None] + j // (GROUP_K // 4)
        w_at = w_ptr + rn.to(tl.int64)[None, :, None] * stride_wn + j
        s_at = ws_ptr + (rn // GROUP_K).to(tl.int64)[None, :, None] * stride_wsn + j // (GROUP_K // 4)
        acc = tl.zeros([ROWS, BLOCK_N, W], tl.float32)
        if PREFETCH:
            w_next = tl.load(w_at + k_lo // 4, mask=nmask, other=0)
            s_next = tl.load(s_at + k_lo // GROUP_K, mask=nmask, other=127)
            pdl_wait(PDL)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            if PREFETCH:
                words, codes = w_next, s_next
                k_next = next_block(k0, k_hi, BLOCK_K)
                w_next = tl.load(w_at + k_next // 4, mask=nmask, other=0)
                s_next = tl.load(s_at + k_next // GROUP_K, mask=nmask, other=127)
            else:
                words = tl.load(w_at + k0 // 4, mask=nmask, other=0)
                codes = tl.load(s_at + k0 // GROUP_K, mask=nmask, other=127)
            w0, w1, w2, w3 = e4m3_word_values(words, ASM)
            sw = e8m0_to_f32(codes.to(tl.int32))
            x0 = tl.load(x_at + k0, mask=mmask, other=0.0).to(tl.float32)
            x1 = tl.load(x_at + k0 + 1, mask=mmask, other=0.0).to(tl.float32)
            x2 = tl.load(x_at + k0 + 2, mask=mmask, other=0.0).to(tl.float32)
            x3 = tl.load(x_at + k0 + 3, mask=mmask, other=0.0).to(tl.float32)
            if QUANT_X:
                x0, x1, x2, x3 = fp8_qat_words(x0, x1, x2, x3, W)
            else:
                sx = tl.load(xs_at + k0 // GROUP_K, mask=mmask, other=0.0)
                x0, x1, x2, x3 = x0 * sx, x1 * sx, x2 * sx, x3 * sx
            acc += (w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3) * sw
        sums = tl.sum(acc, axis=2)
    store_tile(sums, rm, rn, M, N, o_ptr, stride_om, p_ptr, stride_pm, stride_ps, cnt_ptr, os_ptr, stride_osm, SPLIT_K,
               QUANT_OUT, OUT_DTYPE)


@triton.jit
def tma_word_sums(w_desc, ws_ptr, x_row, xs_row, n0, N, k_lo, k_hi, stride_wsn, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr):
    """`_fp8_gemv_kernel`'s sums [1, BLOCK_N] for one row of x from codes (x_row, xs_row: its
    codes and scales from this tile's first column) with the weight words through the tensor
    descriptor w_desc, STAGES deep. The tile is held as [1, 32-row block, its rows, group of 32,
    its words]: the scale codes load once a (row block, group), x as words of four codes, and
    each word's products, scaled, accumulate per word as in the kernel's plain loop; rows past N
    come as zeros."""
    W: tl.constexpr = BLOCK_K // 4
    g5 = tl.arange(0, W // 8)[None, None, None, :, None]
    x5 = x_row.to(tl.pointer_type(tl.int32), bitcast=True) + 8 * g5 + tl.arange(0, 8)[None, None, None, None, :]
    b5 = (n0 // GROUP_K + tl.arange(0, BLOCK_N // 32))[None, :, None, None, None]
    s5 = ws_ptr + b5.to(tl.int64) * stride_wsn + g5
    bmask = b5 < tl.cdiv(N, GROUP_K)
    acc = tl.zeros([1, BLOCK_N // 32, 32, W // 8, 8], tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        words = tl.reshape(w_desc.load([n0, k0 // 4]), [1, BLOCK_N // 32, 32, W // 8, 8])
        w0, w1, w2, w3 = e4m3_word_values(words, ASM)
        sw = e8m0_to_f32(tl.load(s5 + k0 // GROUP_K, mask=bmask, other=127).to(tl.int32))
        x0, x1, x2, x3 = e4m3_word_values(tl.load(x5 + k0 // 4), ASM)
        sx = tl.load(xs_row + k0 // GROUP_K + g5)
        acc += (w0 * (x0 * sx) + w1 * (x1 * sx) + w2 * (x2 * sx) + w3 * (x3 * sx)) * sw
    return tl.reshape(tl.sum(tl.sum(acc, axis=4), axis=3), [1, BLOCK_N])


@triton.jit
def fp8_qat_words(x0, x1, x2, x3, W: tl.constexpr):
    """The FP8-QAT values (`fp8_quant_groups`' q·2^k) of x [.., 1, W] held as four tensors of
    word elements 0..3: each group of 32 is 8 consecutive words."""
    m = tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3)))
    R: tl.constexpr = x0.shape[0]
    k = group_exponent(tl.max(tl.reshape(m, [R, 1, W // (GROUP_K // 4), GROUP_K // 4]), axis=3, keep_dims=True))
    k = tl.reshape(tl.broadcast_to(k, [R, 1, W // (GROUP_K // 4), GROUP_K // 4]), [R, 1, W])
    up, down = pow2(k), pow2(-k)
    return (round_e4m3(x0 * down) * up, round_e4m3(x1 * down) * up, round_e4m3(x2 * down) * up,
            round_e4m3(x3 * down) * up)
