"""RMSNorm ops (spec §2.2, §2.4): the norm alone, and the norm followed by the FP8 activation
quant of the GEMM that reads it: as the dequantized QAT value in x's dtype (`rms_norm_fp8`), or
as the E4M3 codes and scales a native W8A8 GEMM takes (`rms_norm_act_quant`, also from mHC's
collapse of the residual streams: `hc_collapse_rms_norm_act_quant`). The reference
impls are the eager model's own functions (v41.layers.rms_norm, v41.quant.fp8_qat) and the
native GEMM's quant (custom_ops.gemm.fp8_act_quant), so a fused graph computes exactly what the
eager model does."""
from __future__ import annotations

from custom_ops.gemm import fp8_act_quant
from custom_ops.registry import define
from v41.mhc import collapse
from v41 import quant
from v41.layers import rms_norm as _rms_norm

FP8_GROUP = 32


@define("rms_norm(Tensor x, Tensor w, float eps, Tensor(a!) out) -> ()")
def rms_norm(x, w, eps, out) -> None:
    """x [..., D], w [D]; out (x's shape and dtype) <- w * x * rsqrt(mean(x^2) + eps)."""
    out.copy_(_rms_norm(x, w, eps))


@define("rms_norm_fp8(Tensor x, Tensor w, float eps, Tensor(a!) out) -> ()")
def rms_norm_fp8(x, w, eps, out) -> None:
    """fp8_qat(rms_norm(x, w, eps), 32): RMSNorm then the FP8 act-quant round trip of the next
    GEMM's input (per 32 along D, UE8M0 scale), in x's dtype."""
    out.copy_(quant.fp8_qat(_rms_norm(x, w, eps), FP8_GROUP))


@define("rms_norm_act_quant(Tensor x, Tensor w, float eps, Tensor(a!) out, Tensor(b!) q, Tensor(c!) s) -> ()")
def rms_norm_act_quant(x, w, eps, out, q, s) -> None:
    """out <- rms_norm(x, w, eps) (x's shape and dtype); q [..., D] float8_e4m3fn, s [..., D/32]
    float32 <- `fp8_act_quant` of out: the A8 input of every native GEMM reading the norm."""
    out.copy_(_rms_norm(x, w, eps))
    fp8_act_quant(out.view(-1, out.shape[-1]), q.view(-1, q.shape[-1]), s.view(-1, s.shape[-1]))


@define("hc_collapse_rms_norm_act_quant(Tensor X, Tensor mix, Tensor w, float eps, Tensor(a!) out, "
        "Tensor(b!) q, Tensor(c!) s) -> ()")
def hc_collapse_rms_norm_act_quant(X, mix, w, eps, out, q, s) -> None:
    """`rms_norm_act_quant` of mHC's collapse of the streams X [T, hc, D] by mix [T, hc]
    (`hc_collapse`): the sublayer's normed input and its A8 codes, the collapse not stored."""
    rms_norm_act_quant(collapse(X, mix), w, eps, out, q, s)
