"""The W8A8 GEMM at decode widths with the weight as the MMA's left operand (`fp8_gemm._gemm`
path 'swap'): out^T = W · x^T, so a tile's BLOCK_N weight rows are the M of Hopper's warpgroup
MMA (64 rows a warpgroup) and x's rows, up to 16, its N. The other kernels at these widths spend
their issue on the weights: the one-row GEMV converts every weight to FP32 on CUDA cores
(fp8_gemv.py), the MMA kernel pads x to a 16-row left operand and feeds the weight through
registers (`_fp8_gemm_kernel`). Here both operands go from global to shared memory by TMA,
STAGES deep, and from there into the tensor cores; the threads only promote each 32-deep block's
FP32 tile (acc += tile · s_w[n] · s_x[m], both powers of two, as `_fp8_gemm_kernel` does), 16
values a weight row a block. Rows of x past M and weight rows past N load as zeros.
"""
from __future__ import annotations

import triton
import triton.language as tl

from custom_ops.triton.common import pdl_wait
from custom_ops.triton.fp8 import GROUP_K, e8m0_to_f32, store_tile


@triton.jit
def _fp8_swap_kernel(x_desc, xs_ptr, w_desc, ws_ptr, o_ptr, p_ptr, cnt_ptr, os_ptr, M, N, KB, KB_SPLIT, ROWS_G,
                     stride_sm, stride_wsn, stride_om, stride_ps, stride_pm, stride_osm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UNROLL: tl.constexpr, STAGES: tl.constexpr,
                     SPLIT_K: tl.constexpr, PDL: tl.constexpr = False, QUANT_OUT: tl.constexpr = False,
                     OUT_DTYPE: tl.constexpr = tl.bfloat16):
    """Program (m, n, s): x rows [m·BLOCK_M, +BLOCK_M) against weight rows [n·BLOCK_N, +BLOCK_N)
    over K blocks [s·KB_SPLIT, (s+1)·KB_SPLIT), UNROLL of them an iteration (KB and KB_SPLIT
    multiples of UNROLL). x_desc: x's E4M3 codes [M, G·KB·32] in blocks [BLOCK_M, 32]; w_desc:
    the weight's codes [N, KB·32] in blocks [BLOCK_N, 32]. UNROLL 4: the weight's scale codes of
    an iteration are one int32 word a 32-row block. Grouped: the tile's rows belong to group
    n0 // ROWS_G, which reads its own KB blocks of x. Split-K and the output (QUANT_OUT included)
    as in `_fp8_gemm_kernel`."""
    pdl_wait(PDL)
    m0 = tl.program_id(0) * BLOCK_M
    n0 = tl.program_id(1) * BLOCK_N
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    kb_lo = tl.program_id(2) * KB_SPLIT
    x_kb = (n0 // ROWS_G) * KB                              # the group's first K block of x
    sx_ptrs = xs_ptr + rm.to(tl.int64) * stride_sm + x_kb
    rb = n0 // GROUP_K + tl.arange(0, BLOCK_N // GROUP_K)   # the tile's 32-row scale blocks
    sw_ptrs = ws_ptr + rb.to(tl.int64) * stride_wsn
    if UNROLL == 4:
        sw_ptrs = sw_ptrs.to(tl.pointer_type(tl.int32), bitcast=True)
    mmask = rm < M
    bmask = rb < tl.cdiv(N, GROUP_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for kb in tl.range(kb_lo, tl.minimum(kb_lo + KB_SPLIT, KB), UNROLL, num_stages=STAGES):
        if UNROLL == 4:
            sw_words = tl.load(sw_ptrs + kb // 4, mask=bmask, other=0x7F7F7F7F)
        for u in tl.static_range(UNROLL):
            w = w_desc.load([n0, (kb + u) * GROUP_K])
            x = x_desc.load([m0, (x_kb + kb + u) * GROUP_K])
            part = tl.dot(w, tl.trans(x), out_dtype=tl.float32)
            if UNROLL == 4:
                codes = (sw_words >> (8 * u)) & 0xFF
            else:
                codes = tl.load(sw_ptrs + kb + u, mask=bmask, other=127).to(tl.int32)
            sw = tl.reshape(tl.broadcast_to(e8m0_to_f32(codes)[:, None], [BLOCK_N // GROUP_K, GROUP_K]), [BLOCK_N])
            sx = tl.load(sx_ptrs + kb + u, mask=mmask, other=0.0)
            acc += part * (sw[:, None] * sx[None, :])
    store_tile(tl.trans(acc), rm, rn, M, N, o_ptr, stride_om, p_ptr, stride_pm, stride_ps, cnt_ptr, os_ptr,
               stride_osm, SPLIT_K, QUANT_OUT, OUT_DTYPE)
