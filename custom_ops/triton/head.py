"""Triton impl of `v41::f32_linear` (custom_ops/head.py is the definition) for the engine's
bf16 head: x in bf16 times the head on tensor cores, exact products and FP32 sums
(`common.skinny_gemm`), one program per row tile and 64 weight rows, no split of K, written
straight into out, 128-wide K blocks; from CUBLAS_ROWS rows cuBLAS's bf16 GEMM with an FP32
output (the same exact products and FP32 sums) is faster. On the H100 the 1.32 GB bf16 head
took 434 µs at one row (the FP32 head's cuBLAS GEMV: 871), 459 at 64 (cuBLAS 496), and at 96
cuBLAS 492 against 590 (kernels-lm-head-h100.json). Other dtypes stay with the reference."""
from __future__ import annotations

import torch

from custom_ops import head as _ref
from custom_ops.registry import register_impl
from custom_ops.triton.common import skinny_gemm

CUBLAS_ROWS = 65


def triton_f32_linear(x, w, out) -> None:
    """`v41::f32_linear` (same signature)."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or out.dtype != torch.float32 or \
            x.stride(-1) != 1 or not out.is_contiguous():
        return _ref.f32_linear(x, w, out)
    if x.shape[0] >= CUBLAS_ROWS:
        torch.mm(x, w.T, out_dtype=torch.float32, out=out)
    else:
        skinny_gemm(x, w, False, split=1, out=out, block_k=128)


register_impl("f32_linear", "triton", triton_f32_linear, device_type="cuda")
