"""RoPE ops (spec §2.3): the Rope module's rotation of the last rot dims (interleaved pairs,
FP32 cos/sin tables indexed by absolute position), alone and followed by the FP8 QAT of the
window KV row, also with the row's RMSNorm first (kv_norm -> RoPE -> FP8 QAT, spec §3.3 b). The
reference impls run the eager module's own forward (v41.layers.Rope.forward) on the given
tables and v41.layers.rms_norm."""
from __future__ import annotations

from types import SimpleNamespace

from custom_ops.registry import define
from v41 import quant
from v41.layers import Rope, rms_norm

FP8_GROUP = 32


def apply_rope(x, cos, sin, positions, inverse: bool):
    """Rope.forward with the tables `cos`/`sin` [max_pos, rot/2] (FP32); rot = 2 * cos.shape[-1]."""
    table = SimpleNamespace(cos=cos, sin=sin, rot_dim=2 * cos.shape[-1])
    return Rope.forward(table, x, positions, inverse)


@define("rope(Tensor x, Tensor cos, Tensor sin, Tensor positions, bool inverse, Tensor(a!) out) -> ()")
def rope(x, cos, sin, positions, inverse, out) -> None:
    """x [T, ..., d]; positions [T]; out (x's shape and dtype) <- x with its last rot dims rotated
    (by the conjugate when `inverse`)."""
    out.copy_(apply_rope(x, cos, sin, positions, inverse))


@define("rope_fp8_qat(Tensor x, Tensor cos, Tensor sin, Tensor positions, bool inverse, "
        "Tensor(a!) out) -> ()")
def rope_fp8_qat(x, cos, sin, positions, inverse, out) -> None:
    """fp8_qat(rope(x), 32) over the whole last dim (the window KV row: all 512 dims)."""
    out.copy_(quant.fp8_qat(apply_rope(x, cos, sin, positions, inverse), FP8_GROUP))


@define("rms_norm_rope_fp8_qat(Tensor x, Tensor w, float eps, Tensor cos, Tensor sin, Tensor positions, "
        "bool inverse, Tensor(a!) out) -> ()")
def rms_norm_rope_fp8_qat(x, w, eps, cos, sin, positions, inverse, out) -> None:
    """`rope_fp8_qat` of rms_norm(x, w, eps): the window KV row from its `wkv` projection."""
    rope_fp8_qat(rms_norm(x, w, eps), cos, sin, positions, inverse, out)
