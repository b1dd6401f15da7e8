"""Where one call of the FP4 experts (`v41::moe_experts_w4a8`, Flash's 384 experts top-6) spends
its device time: each kernel of the chain (routing sort, activation quantization, the up and
down GEMMs, their split-K sums, the reduction) under torch.profiler, at decode widths.

    python benchmarks/experts_profile.py     # CUDA: writes benchmarks/results/experts-profile-h200.json
    python benchmarks/experts_profile.py --dry-run   # CPU, Triton interpreter, tiny shapes, prints only

Per width: the kernels' device time per call (mean over `--calls` profiled calls after a
warm-up), their sum, and the call's time replayed from a CUDA graph (as native_gemm_bench.py
times it): the difference is what launching the chain costs beyond its kernels.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from native_gemm_bench import EXPERTS, TINY_EXPERTS, device_for, emit, experts_native, timer  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU under the Triton interpreter, tiny shapes; prints only")
    p.add_argument("--widths", default="1,64", help="token counts, comma-separated")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--experts", type=int, default=None, help="routed experts E (default: Flash's 384)")
    p.add_argument("--paths", default="auto", help="comma-separated: auto (the op's choice), gemv, mma")
    p.add_argument("--out", default="benchmarks/results/experts-profile-h200.json")
    return p.parse_args(argv)


def kernel_times(fn, calls: int, dev: str) -> dict:
    """{kernel name: device microseconds per call} (under --dry-run: the CPU ops' own time, the
    interpreted Triton kernels inside them)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        if dev == "cuda":
            torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if dev == "cuda" and e.device_type.name != "CUDA":
            continue                # the ops that launched them: their device time is the kernels'
        us = e.device_time_total if dev == "cuda" else e.self_cpu_time_total
        if us > 0:
            out[e.key] = us / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main(argv=None) -> dict:
    args = parse(argv)
    dev = device_for(args.dry_run)
    import torch

    import custom_ops  # noqa: F401
    import custom_ops.triton  # noqa: F401  (registers the CUDA impls)
    from custom_ops.triton import triton_moe_experts_w4a8
    from custom_ops.triton.moe_w4a8 import expert_path
    E, k, D, I = TINY_EXPERTS if args.dry_run else EXPERTS
    E = args.experts or E
    timed = timer(dev)
    g = torch.Generator(device=dev).manual_seed(0)
    w1, w3, w2 = experts_native(E, I, D, dev), experts_native(E, I, D, dev), experts_native(E, D, I, dev)
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)", "torch": torch.__version__,
           "triton": __import__("triton").__version__, "date": datetime.date.today().isoformat(),
           "experts": {"E": E, "top_k": k, "D": D, "I": I}, "widths": []}
    for T in (int(w) for w in args.widths.split(",")):
        x = torch.randn(T, D, device=dev, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(T)])
        wts = torch.rand(T, k, device=dev, generator=g)
        o = torch.empty(T, D, dtype=torch.float32, device=dev)

        for path in args.paths.split(","):
            def call():
                triton_moe_experts_w4a8(x, ids, wts, w1[0], w1[1], w3[0], w3[1], w2[0], w2[1], 10.0, o,
                                        path=None if path == "auto" else path)
            call()                                          # compile and autotune outside the profile
            kernels = kernel_times(call, args.calls, dev)
            res["widths"].append({"tokens": T, "path": path if path != "auto" else expert_path(T, T * k),
                                  "kernels_us": {n: round(v, 2) for n, v in kernels.items()},
                                  "kernels_sum_us": round(sum(kernels.values()), 2),
                                  "graph_us": round(timed(call, 1), 2)})
            print(T, res["widths"][-1]["path"], res["widths"][-1]["graph_us"], file=sys.stderr, flush=True)
    emit(res, args)
    return res


if __name__ == "__main__":
    main()
