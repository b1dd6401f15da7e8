"""Do Inductor's GPU kernels for the quantizers depend on their launch config? Each quantizer,
alone and fed by RMSNorm (the fused form the model has), is compiled for CUDA with the token
dim dynamic; every autotuned kernel also runs each candidate config on clones of its arguments
(runtime/piece_check.launch_configs), and the compiled result is compared with eager bit for bit.

`frexp_fp8_qat` is the form v41/quant.py had until 2026-12-01 (binade from torch.frexp, 2^n from
int64 bits viewed as float64): the reproducer of what that form compiled to.

    PYTHONPATH=. python benchmarks/compile_configs.py --out compile-quant-configs.json
"""
from __future__ import annotations

import argparse
import datetime
import json

import torch

from runtime.piece_check import launch_configs, rel_l2
from v41 import quant
from v41.layers import rms_norm


def frexp_fp8_qat(x, group=32):
    w = x.float().unflatten(-1, (-1, group))
    amax = w.abs().amax(-1, keepdim=True).clamp(min=quant.FP8_AMAX_FLOOR)

    def exp2(n):
        return ((n.to(torch.int64) + 1023) << 52).view(torch.float64).float()
    m, e = torch.frexp(amax / quant.E4M3_MAX)
    s = exp2(e - (m == 0.5).to(e.dtype))
    v = w / s
    a = v.abs().clamp(max=quant.E4M3_MAX)
    quantum = (torch.frexp(a)[1] - 1).clamp(min=-6) - 3
    q = torch.copysign(torch.round(a * exp2(-quantum)) * exp2(quantum), v)
    return (q * s).flatten(-2).to(x.dtype)


CASES = {
    "frexp_fp8_qat": frexp_fp8_qat,
    "fp8_qat": quant.fp8_qat,
    "fp8_row_qat": quant.fp8_row_qat,
    "fp4_qat": quant.fp4_qat,
    "fp4_e4m3_qat": quant.fp4_e4m3_qat,
}


def inputs(tokens: int, width: int, gen) -> torch.Tensor:
    """Rows over many binades, a zero row and a row below the amax floor."""
    x = torch.randn(tokens, width, generator=gen) * torch.exp2(torch.randint(-20, 12, (tokens, 1), generator=gen))
    x[0] = 0
    x[1] = 1e-5
    return x.to(torch.bfloat16).cuda()


def run(name, fn, fused, x, w):
    f = (lambda x, w: fn(rms_norm(x, w, 1e-6))) if fused else (lambda x, w: fn(x))
    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(x, 0)
    with torch.compiler.config.patch(force_disable_caches=True), launch_configs() as kernels:
        got = torch.compile(f, fullgraph=True)(x, w)
    want = f(x, w)
    spread = {k["kernel"]: max(k["configs"].values()) for k in kernels}
    return {"case": name, "rms_norm_before": fused, "tokens": x.shape[0], "width": x.shape[1],
            "autotuned_kernels": len(kernels), "worst_config_spread": max(spread.values(), default=0.0),
            "config_dependent_kernels": {k: v for k, v in spread.items() if v > 0},
            "compiled_vs_eager_rel_l2": rel_l2(got.float(), want.float()),
            "elements_differing": (got != want).double().mean().item()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="compile-quant-configs.json")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    x = inputs(200, 64, gen)
    w = (torch.rand(64, generator=gen) + 0.5).to(torch.bfloat16).cuda()
    rows = []
    for name, fn in CASES.items():
        for fused in (False, True):
            rows.append(run(name, fn, fused, x.clone(), w))
            print(json.dumps(rows[-1]), flush=True)
    res = {"benchmark": "compile_configs", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "date": datetime.date.today().isoformat(),
           "method": __doc__.strip().split("\n\n")[0], "results": rows}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
