"""Triton impl of `v41::f32_linear` (custom_ops/head.py is the definition) for the engine's
bf16 head: x in bf16 times the head on tensor cores, exact products and FP32 sums
(`common.skinny_gemm`), one program per row tile and 64 weight rows, no split of K, written
straight into out. Other dtypes stay with the reference."""
from __future__ import annotations

import torch

from custom_ops import head as _ref
from custom_ops.registry import register_impl
from custom_ops.triton.common import skinny_gemm


def triton_f32_linear(x, w, out) -> None:
    """`v41::f32_linear` (same signature)."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or out.dtype != torch.float32 or \
            x.stride(-1) != 1 or not out.is_contiguous():
        return _ref.f32_linear(x, w, out)
    skinny_gemm(x, w, False, split=1, out=out)


register_impl("f32_linear", "triton", triton_f32_linear, device_type="cuda")
