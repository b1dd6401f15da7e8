"""How far the Triton sparse_attn kernel's bf16 rounding is from the reference op's (the spec's
online softmax over 64-row blocks) at Flash widths, on the GPU: relative L2 and the share of
outputs that differ, against the reference in bf16 and both against float64.

    PYTHONPATH=. python benchmarks/attn_rounding.py --out benchmarks/results/attn-rounding-h200.json
"""
from __future__ import annotations

import argparse
import datetime
import json

import torch
import triton

from custom_ops import attention as ref_attn
from custom_ops.triton.attention import triton_sparse_attn
from tests.kernel_cases import flash_width_case


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/attn-rounding-h200.json")
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for holes in (False, True):
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            args, _ = flash_width_case(g, torch.bfloat16, T=a.tokens, H=64, holes=holes)
            args = tuple(x.to(dev) if torch.is_tensor(x) else x for x in args)
            T, H, d = args[0].shape
            ref = torch.empty(T, H, d, dtype=torch.bfloat16, device=dev)
            exact = torch.empty(T, H, d, dtype=torch.float64, device=dev)
            ref_attn.sparse_attn(*args, ref)
            ref_attn.sparse_attn(*[x.double() if torch.is_tensor(x) and x.is_floating_point() else x
                                   for x in args], exact)
            for split_k in (1, 2, 4, None):
                out = torch.full_like(ref, float("nan"))
                triton_sparse_attn(*args, out, split_k=split_k)
                rows.append({"holes": holes, "seed": seed, "split_k": split_k or "auto",
                             "kernel_vs_reference": rel(out, ref),
                             "outputs_differing": float((out != ref).float().mean()),
                             "kernel_vs_float64": rel(out, exact), "reference_vs_float64": rel(ref, exact)})
                print(rows[-1], flush=True)
    res = {"benchmark": "attn_rounding", "what": __doc__.split("\n\n")[0],
           "shape": {"tokens": a.tokens, "heads": 64, "head_dim": 512, "window": 128, "selected": 512},
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": datetime.date.today().isoformat(), "results": rows}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
