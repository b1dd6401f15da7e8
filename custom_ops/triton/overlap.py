"""CUDA impls of custom_ops/overlap.py's ops: the fork enqueues the routed experts on a second
stream of the device (one for the process, so CUDA graphs captured with it replay it) after
what the current stream has enqueued; the join makes the current stream wait for it. Under CUDA
graph capture the second stream joins the capture at the fork's wait and leaves it at the join,
so the graph holds the experts as a branch beside the work between the two. The experts'
temporaries are allocated on the second stream, whose freed blocks only its own later work
reuses; the split-K kernels' arrival counters are the stream's own (fp8.tile_counters)."""
from __future__ import annotations

import torch

from custom_ops.registry import register_impl

_SIDE: dict = {}              # device -> its second stream


def side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


def _beside(experts, x, *args) -> None:
    """experts(x, *args) (the op: its selected impl) on x's device's second stream, after what
    its current stream holds."""
    side = side_stream(x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        experts(x, *args)


def triton_moe_experts_w4a8_fork(x, ids, weights, w1, s1, w3, s3, w2, s2, limit, out, after) -> None:
    """`v41::moe_experts_w4a8_fork` (same signature)."""
    _beside(torch.ops.v41.moe_experts_w4a8, x, ids, weights, w1, s1, w3, s3, w2, s2, limit, out)


def triton_moe_experts_fork(x, ids, weights, w1, w3, w2, limit, out, after) -> None:
    """`v41::moe_experts_fork` (same signature)."""
    _beside(torch.ops.v41.moe_experts, x, ids, weights, w1, w3, w2, limit, out)


def triton_join(out, keep) -> None:
    """`v41::join` (same signature)."""
    torch.cuda.current_stream(out.device).wait_stream(side_stream(out.device))


register_impl("moe_experts_w4a8_fork", "triton", triton_moe_experts_w4a8_fork, device_type="cuda")
register_impl("moe_experts_fork", "triton", triton_moe_experts_fork, device_type="cuda")
register_impl("join", "triton", triton_join, device_type="cuda")
