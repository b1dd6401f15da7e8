"""Triton impl of `v41::f32_linear` (custom_ops/head.py is the definition): with x in bf16 the
FP32 weight is split into three bf16 parts on tensor cores (`common.skinny_gemm`'s split_w: the
products exact, FP32 sums), one program per row tile and 64 weight rows, no split of K,
written straight into out. One row stays with the reference, as do other dtypes: on the H200
cuBLAS's GEMV read the 2.65 GB LM head at one row in 621 µs against the split's 640, while from
5 rows the split took 760 µs against cuBLAS's 1,097 (kernels-lm-head-h200.json)."""
from __future__ import annotations

import torch

from custom_ops import head as _ref
from custom_ops.registry import register_impl
from custom_ops.triton.common import skinny_gemm

MIN_ROWS = 2


def triton_f32_linear(x, w, out) -> None:
    """`v41::f32_linear` (same signature)."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.float32 or out.dtype != torch.float32 or \
            x.shape[0] < MIN_ROWS or x.stride(-1) != 1 or not out.is_contiguous():
        return _ref.f32_linear(x, w, out)
    skinny_gemm(x, w, False, split=1, out=out)


register_impl("f32_linear", "triton", triton_f32_linear, device_type="cuda")
