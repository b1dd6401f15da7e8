"""Dequantized (bf16) against native weights in one run (issue 16): two `step_bench.py --worker`
processes on the same GPU, one engine each (flash-slice: 62 GB of bf16 weights and 22 GB native
fit side by side on an H200, not in one engine), built and compiled at the same time, then
given the same cases in turn, the two variants alternating case by case.

    python benchmarks/weight_formats_bench.py --out benchmarks/results/native-weights-flash-slice-h200.json
    python benchmarks/weight_formats_bench.py --dry-run     # the toy on the CPU, eager: prints only

Writes `{"weights_gb": {"bf16": x, "native": y}, "results": [{"variant": "bf16"|"native", "step",
"requests", "tokens_each", "ms", "device_ms", "floor_ms", ...}]}`: each row is step_bench's (its
`graphs` field the worker's own variant, e.g. full), `floor_ms` from benchmarks/floor.py.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import side_by_side  # noqa: E402

NAMES = {"dequant": "bf16", "native": "native"}
CASES = [("decode", 1, 1024), ("decode", 16, 1024), ("decode", 64, 1024), ("prefill", 1, 4096), ("prefill", 8, 1024)]
DRY_CASES = [("decode", 1, 64), ("decode", 4, 64), ("prefill", 2, 100)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="flash-slice")
    ap.add_argument("--variant", default="full", help="step_bench's variant each worker runs")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--num-pages", type=int, default=1024,
                    help="KV pages of each engine (both share the GPU: neither may size its pool from memory)")
    ap.add_argument("--out", default="benchmarks/results/native-weights-flash-slice-h200.json")
    ap.add_argument("--profile", default=None,
                    help="after the cases, each engine profiles a batch-1 decode step in turn into PROFILE.<format>.txt")
    ap.add_argument("--dry-run", action="store_true", help="toy, CPU, eager, small cases; writes nothing")
    a = ap.parse_args(argv)
    tree = os.path.dirname(side_by_side.HERE)
    res = {"benchmark": "weight_formats", "model": "toy" if a.dry_run else a.model,
           "date": datetime.date.today().isoformat(),
           "method": "two step_bench workers on one device, one engine per weight format, the cases "
                     "given to each in turn (variants alternating case by case); CUDA events around "
                     "LLMEngine.step, median after warm-up; device_ms: the device busy time of one more step, overlapping kernels counted once"}
    side_by_side.run({NAMES[f]: side_by_side.worker(tree, f, a) for f in NAMES}, DRY_CASES if a.dry_run else CASES,
                     res, None if a.dry_run else a.out, a.profile)
    if a.dry_run:
        print(json.dumps(res, default=str))
    return res


if __name__ == "__main__":
    main()
