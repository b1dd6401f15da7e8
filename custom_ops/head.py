"""The FP32 products of the model's heads (spec: the LM head, and DSpark's draft head over the
same weight, multiply in FP32): `f32_linear`, x in the activation dtype widened to the weight's
dtype, times the weight transposed. The reference is that matmul; an impl may order the FP32
sums otherwise, but every product stays exact (x·w of a widened bf16 x and an FP32 w)."""
from __future__ import annotations

import torch

from custom_ops.registry import define


@define("f32_linear(Tensor x, Tensor w, Tensor(a!) out) -> ()")
def f32_linear(x, w, out) -> None:
    """x [M, K] (the activation dtype), w [N, K] (FP32; FP64 in the oracle); out [M, N] in w's
    dtype <- x.to(w.dtype) @ wᵀ."""
    torch.mm(x.to(w.dtype), w.T, out=out)
