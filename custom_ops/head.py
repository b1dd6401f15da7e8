"""The FP32 products of the model's heads (spec: the LM head, DSpark's draft head over the same
weight and its Markov head multiply in FP32): `f32_linear`, x and w widened to out's dtype, x
times w transposed. The weight holds the checkpoint's bf16 values, stored in the activation
dtype (bf16 in a bf16 engine: a bf16·bf16 product is exact in FP32). The reference is that
matmul; an impl may order the sums otherwise, but every product stays exact."""
from __future__ import annotations

import torch

from custom_ops.registry import define


@define("f32_linear(Tensor x, Tensor w, Tensor(a!) out) -> ()")
def f32_linear(x, w, out) -> None:
    """x [M, K] (the activation dtype), w [N, K] (bf16 values, stored bf16 or in out's dtype),
    out [M, N] FP32 (FP64 in the oracle) <- x.to(out.dtype) @ w.to(out.dtype)ᵀ."""
    torch.mm(x.to(out.dtype), w.to(out.dtype).T, out=out)
