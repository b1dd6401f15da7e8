"""Native-format GEMMs (spec §2.5, §3.4): weights stay FP8 / FP4 on the device and the GEMM reads
them as stored. The reference impls dequantize and multiply in the accumulation dtype (FP32 for
bf16/fp32 activations), which is what the dequantized path computes: every product of an
E4M3·2^a activation and an E4M3·2^b or E2M1·2^b weight is exact in FP32, so any impl differs
from it only in the order of the FP32 sums.

- `fp8_act_quant`: the A8 activation quant of spec §2.4 (per 32 along K, UE8M0 scale) as
  E4M3 codes plus FP32 scales, the form the W8A8 GEMM takes.
- `fp8_block_gemm`: out = (q_x·s_x) · (q_w·s_w)ᵀ, W8A8 with 32x32 E8M0 weight blocks; with
  `groups` G, G such GEMMs side by side (wo_a's batched GEMM).
- `fp8_linear`: the two above in one call, x in the activation dtype (what `Linear("fp8")`
  runs; an impl may quantize x inside its GEMM).
- `fp8_block_gemm_act_quant`: `fp8_block_gemm` whose output leaves as the next GEMM's A8
  codes and scales.
- `moe_experts_w4a8`: `v41::moe_experts` with FP4 E2M1 expert weights and E8M0 per-32 scales.

`native_weights` is the one place that decides, at load, whether weights stay native;
`check_native` refuses, at load, a native weight the kernels cannot multiply exactly.
"""
from __future__ import annotations

import torch

from custom_ops import moe as _moe
from custom_ops.registry import define, selected
from v41 import quant

FP8_GROUP = 32
# FP4 experts' largest E8M0 scale code (2^1, weights up to 12) that the Triton tile kernels'
# bf16 decode applies exactly (custom_ops/triton/fp4.py: one bf16 multiply by 2^(code-1))
FP4_MAX_SCALE_CODE = 128
NATIVE_OPS = ("fp8_act_quant", "fp8_block_gemm", "fp8_block_gemm_act_quant", "fp8_linear", "moe_experts_w4a8")


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def act_quant_codes(x):
    """quant.fp8_act_quant(x, 32) as the native GEMMs take it: (float8_e4m3fn codes, float32
    scales)."""
    qv, sv = quant.fp8_act_quant(x, FP8_GROUP)
    return qv.to(torch.float32).to(torch.float8_e4m3fn), sv.to(torch.float32)   # E4M3 values: exact


@define("fp8_act_quant(Tensor x, Tensor(a!) q, Tensor(b!) s) -> ()")
def fp8_act_quant(x, q, s) -> None:
    """x [M, K] (K a multiple of 32); q [M, K] float8_e4m3fn, s [M, K/32] float32 <-
    `act_quant_codes(x)` (q·s is quant.fp8_qat(x))."""
    qv, sv = act_quant_codes(x)
    q.copy_(qv)
    s.copy_(sv)


@define("fp8_block_gemm(Tensor xq, Tensor xs, Tensor w, Tensor ws, Tensor(a!) out, int groups=1) -> ()")
def fp8_block_gemm(xq, xs, w, ws, out, groups=1) -> None:
    """xq [M, G·K] float8_e4m3fn, xs [M, G·K/32] float32; w [G·R, K] float8_e4m3fn, ws
    [⌈G·R/32⌉, ⌈K/32⌉] float8_e8m0fnu; out [M, G·R] <- for each of the G = `groups` groups,
    (xq·xs)[:, gK:(g+1)K] @ (w·ws)[gR:(g+1)R]ᵀ, accumulated in FP32 (FP64 for a float64 out) and
    rounded once to out's dtype. G = 1 is the plain GEMM; wo_a's output groups are the batched
    case (spec §3.3: group g's rows multiply only its own slice of the attention output)."""
    M, G = xq.shape[0], groups
    K, R = gemm_group_shape(xq, w, G)
    acc = _acc(out.dtype)
    x = xq.to(acc) * xs.to(acc).repeat_interleave(FP8_GROUP, -1)
    wd = quant.dequant_fp8_block(w, ws, acc)
    if G == 1:
        out.copy_(x @ wd.T)
    else:
        out.copy_(torch.einsum("mgk,grk->mgr", x.view(M, G, K), wd.view(G, R, K)).reshape(M, G * R))


@define("fp8_block_gemm_act_quant(Tensor xq, Tensor xs, Tensor w, Tensor ws, ScalarType dtype, Tensor(a!) q, "
        "Tensor(b!) s, int groups=1) -> ()")
def fp8_block_gemm_act_quant(xq, xs, w, ws, dtype, q, s, groups=1) -> None:
    """q [M, G·R] float8_e4m3fn, s [M, G·R/32] float32 <- `fp8_act_quant` of `fp8_block_gemm`'s
    output in `dtype`: a GEMM whose only readers are native GEMMs (wo_a's, read by wo_b)."""
    out = torch.empty(xq.shape[0], w.shape[0], dtype=dtype, device=xq.device)
    fp8_block_gemm(xq, xs, w, ws, out, groups)
    fp8_act_quant(out, q, s)


@define("fp8_linear(Tensor x, Tensor w, Tensor ws, Tensor(a!) out, int groups=1) -> ()")
def fp8_linear(x, w, ws, out, groups=1) -> None:
    """x [M, G·K] in the activation dtype; out [M, G·R] <- `fp8_block_gemm` of x's A8 quant
    (`fp8_act_quant`) and the weight, in out's dtype."""
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(x.shape[0], x.shape[1] // FP8_GROUP, dtype=torch.float32, device=x.device)
    fp8_act_quant(x, q, s)
    fp8_block_gemm(q, s, w, ws, out, groups)


def gemm_group_shape(xq, w, groups: int) -> tuple[int, int]:
    """(K, R) of a grouped `fp8_block_gemm`: each group's depth and output rows."""
    K, GR = w.shape[1], w.shape[0]
    if groups < 1 or GR % groups or xq.shape[1] != groups * K:
        raise ValueError(f"fp8_block_gemm: x [{xq.shape[0]}, {xq.shape[1]}] and w [{GR}, {K}] are not "
                         f"{groups} groups (x {groups}·K wide, w's rows a multiple of {groups})")
    return K, GR // groups


@define("moe_experts_w4a8(Tensor x, Tensor ids, Tensor weights, Tensor w1, Tensor s1, Tensor w3, "
        "Tensor s3, Tensor w2, Tensor s2, float limit, Tensor(a!) out) -> ()")
def moe_experts_w4a8(x, ids, weights, w1, s1, w3, s3, w2, s2, limit, out) -> None:
    """`v41::moe_experts` on FP4 experts: w1/w3 [E, I, D/2], w2 [E, D, I/2] packed E2M1 (int8),
    s1/s3 [E, I, D/32], s2 [E, D, I/32] float8_e8m0fnu; the experts dequantized to x's dtype
    (exact) and run by the moe_experts reference."""
    deq = [quant.dequant_fp4_expert(w, s, x.dtype) for w, s in ((w1, s1), (w3, s3), (w2, s2))]
    _moe.moe_experts(x, ids, weights, *deq, limit, out)


def check_native(scale_name: str, w: quant.BlockScaled) -> None:
    """Refuse native FP4 expert weights whose scales the native kernels do not apply exactly
    (codes above FP4_MAX_SCALE_CODE, NaN's 255 among them), naming the scale tensor."""
    top = int(w.scale.max()) if w.fmt == "fp4" and w.scale.numel() else 0
    if top > FP4_MAX_SCALE_CODE:
        raise ValueError(f"{scale_name}: FP4 scale code {top} (2^{top - 127}) is above {FP4_MAX_SCALE_CODE} "
                         f"(2^{FP4_MAX_SCALE_CODE - 127}), the largest the native expert kernels apply exactly; "
                         "load this checkpoint with dequantized weights")


def native_weights(device, dtype: torch.dtype) -> bool:
    """Whether weights stay FP8/FP4 on `device`: on CUDA, when the op registry runs a non-
    reference impl of every native op (custom_ops.triton imported, V41_OP_BACKEND not forcing
    the reference) and the activations are not float64 (the oracle multiplies dequantized)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda" or dtype == torch.float64:
        return False
    sel = selected()
    return all(sel[f"v41::{n}"].get("cuda", "reference") != "reference" for n in NATIVE_OPS)
