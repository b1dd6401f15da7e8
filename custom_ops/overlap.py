"""Ops that let the routed experts run beside the shared expert (passes/moe_overlap.py makes
them from the experts' op and the sum that meets the shared expert's output).

- `moe_experts_w4a8_fork` / `moe_experts_fork`: `moe_experts_w4a8` / `moe_experts` (native /
  dequantized experts), which an impl may run on a second stream, beside
  the work after it, up to the `join` of its out. `after` is left unchanged: it is the first
  tensor that work reads, declared written here so that the compiler schedules the work after
  the fork (a data dependency, which no reordering for memory or locality can undo).
- `join`: `out` is complete from here on. `keep` holds what the fork reads (their memory stays
  theirs until here, though the first stream may be done with them) and what the work beside it
  made (so the join comes after that work).

The reference impls call the experts' op at the fork (its selected impl) and do nothing at the
join, so the arithmetic is the experts' op's, bit for bit, on every device.
"""
from __future__ import annotations

import torch

from custom_ops.registry import define


@define("moe_experts_w4a8_fork(Tensor x, Tensor ids, Tensor weights, Tensor w1, Tensor s1, Tensor w3, "
        "Tensor s3, Tensor w2, Tensor s2, float limit, Tensor(a!) out, Tensor(b!) after) -> ()")
def moe_experts_w4a8_fork(x, ids, weights, w1, s1, w3, s3, w2, s2, limit, out, after) -> None:
    """`moe_experts_w4a8(x, ..., out)`; `after` unchanged."""
    torch.ops.v41.moe_experts_w4a8(x, ids, weights, w1, s1, w3, s3, w2, s2, limit, out)


@define("moe_experts_fork(Tensor x, Tensor ids, Tensor weights, Tensor w1, Tensor w3, Tensor w2, float limit, "
        "Tensor(a!) out, Tensor(b!) after) -> ()")
def moe_experts_fork(x, ids, weights, w1, w3, w2, limit, out, after) -> None:
    """`moe_experts(x, ..., out)`; `after` unchanged."""
    torch.ops.v41.moe_experts(x, ids, weights, w1, w3, w2, limit, out)


@define("join(Tensor(a!) out, Tensor[] keep) -> ()")
def join(out, keep) -> None:
    """Nothing to compute: `out` is complete once the work a fork started beside has ended."""
