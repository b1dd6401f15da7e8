"""What the fused-op tests share (tests/test_fused_ops_reference.py, tests/test_fused_ops_cpu.py):
random inputs (from the `g` fixture's generator), a YaRN rotary table, and the FP8 QAT closeness
check that excuses elements within a few FP32 ulps of a rounding boundary."""
from __future__ import annotations

import torch

from tests.kernel_cases import rel
from v41 import quant

YARN = {"original_max_position_embeddings": 256, "factor": 16, "beta_fast": 32, "beta_slow": 1}
ops = torch.ops.v41


def acc_of(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def rnd(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def rope_table(rot=16, max_pos=512, yarn=True):
    from v41.layers import Rope
    return Rope(rot, 160000.0 if yarn else 10000.0, YARN if yarn else None, max_pos)


def fp8_near_boundary(pre: torch.Tensor, tol=1e-6) -> torch.Tensor:
    """Elements of `pre` ([..., D], D a multiple of 32) whose FP8 QAT (group 32) could change
    under a relative perturbation of `tol` (a float, or a tensor of per-element tolerances shaped
    like `pre`): the value is within tol of a rounding midpoint of its group's grid, or the
    group's amax/448 is within tol of a power of two (a scale step)."""
    w = pre.double().unflatten(-1, (-1, 32))
    tw = torch.as_tensor(tol, dtype=torch.float64).expand_as(pre).unflatten(-1, (-1, 32))
    r = w.abs().amax(-1, keepdim=True).clamp(min=quant.FP8_AMAX_FLOOR) / quant.E4M3_MAX
    lg = torch.log2(r)
    scale_near = (lg - lg.round()).abs() < 2 * tw.amax(-1, keepdim=True)
    s = torch.exp2(torch.ceil(lg))
    v = (w / s).abs().clamp(max=quant.E4M3_MAX)
    e = torch.floor(torch.log2(v.clamp(min=2.0**-30))).clamp(min=-6)
    quantum = torch.exp2(e - 3)
    u = v / quantum
    mid_near = ((u - torch.floor(u)) - 0.5).abs() <= 2 * tw * u + 1e-9
    return (mid_near | scale_near).flatten(-2)


def assert_qat_close(out, ref, pre, tol=1e-5):
    """out == ref to `tol` except at the FP8 rounding boundaries of the reference's pre-quant
    values (within 1e-6 relative: a few FP32 ulps), where the neighbouring grid value is allowed
    too."""
    near = fp8_near_boundary(pre)
    ok = torch.isclose(out.double(), ref.double(), rtol=tol, atol=0) | near
    assert ok.all(), (out[~ok][:8], ref[~ok][:8])
    assert rel(out[~near], ref[~near]) < tol
