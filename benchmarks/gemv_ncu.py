"""The one-row weight-streaming kernels, each launched a few times for Nsight Compute: the FP8
GEMV (`v41::fp8_block_gemm` at one row) on Flash's dense shapes and flash-slice's FP4 experts at
one token (`v41::moe_experts_w4a8`, 16 experts, top-6). Their times:
benchmarks/native_gemm_bench.py (--one-row, --slice-experts).

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section LaunchStats --section MemoryWorkloadAnalysis \
        --section ComputeWorkloadAnalysis -k regex:gemv --launch-count 12 \
        python benchmarks/gemv_ncu.py --calls 2                # gemv-ncu-h100.json
    ... python benchmarks/gemv_ncu.py --knobs '{"tma": true, "num_stages": 3}'   # the FP8 GEMV's TMA loads
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {"wq_b": (32768, 1280), "wo_b": (5120, 8192), "wq_a_kv": (1792, 5120), "shared_w13": (4608, 5120)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=4, help="launches of each case (ncu: profile some of them)")
    p.add_argument("--knobs", default="{}", help="JSON knobs for the FP8 GEMV (fp8_gemm._gemm's)")
    args = p.parse_args(argv)
    import json

    import torch

    import custom_ops  # noqa: F401
    import custom_ops.triton  # noqa: F401  (registers the CUDA impls)
    from custom_ops.triton import triton_fp8_block_gemm, triton_moe_experts_w4a8
    from native_gemm_bench import SLICE_EXPERTS, expert_inputs, expert_weights
    from tests.kernel_cases import fp8_gemm_case

    knobs = json.loads(args.knobs)
    g = torch.Generator().manual_seed(0)
    cases = []
    for name, (N, K) in SHAPES.items():
        xq, xs, w, ws = fp8_gemm_case(g, 1, N, K, device="cuda")
        o = torch.empty(1, N, dtype=torch.bfloat16, device="cuda")
        cases.append((f"fp8 {name} {N}x{K}", w.nbytes + ws.nbytes,
                      lambda xq=xq, xs=xs, w=w, ws=ws, o=o: triton_fp8_block_gemm(xq, xs, w, ws, o, **knobs)))
    E, k, D, I = SLICE_EXPERTS
    weights, per_expert = expert_weights(E, D, I, "cuda")
    x, ids, wts, y, hit = expert_inputs(g, 1, E, k, D, "cuda")
    cases.append((f"fp4 experts {hit} of {E}", hit * per_expert,
                  lambda: triton_moe_experts_w4a8(x, ids, wts, *weights, 10.0, y)))
    for name, nbytes, fn in cases:
        for _ in range(args.calls):
            fn()
        torch.cuda.synchronize()
        print(f"{name}: {args.calls} calls, {nbytes / 1e6:.1f} MB of weights each")


if __name__ == "__main__":
    main()
