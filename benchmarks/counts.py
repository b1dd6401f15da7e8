"""Figures counted, not measured (no device needed), recorded as a result JSON the docs cite:
the FLOPs a prefill must do with and without decoder bounded replay (flash-slice, per
`bounded_replay_bench.count_flops`) and Flash's weight bytes per GPU (v41.loader.placement).

    python benchmarks/counts.py --out benchmarks/results/counts-20261201.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bounded_replay_bench import count_flops  # noqa: E402
from v41.config import preset  # noqa: E402
from v41.loader.placement import placement  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    cfg = preset("flash-slice")
    flops = []
    for length in (8192, 4096, 1024):
        full, rep = count_flops(cfg, length, False), count_flops(cfg, length, True)
        flops.append({"model": "flash-slice", "tokens": length, "tflops_full": round(full / 1e12, 2),
                      "tflops_replay": round(rep / 1e12, 2), "ratio": round(full / rep, 3)})
    place = []
    for gpus in (4, 8):
        p = placement(preset("flash"), gpus)
        place.append({"model": "flash", "rule": p["rule"], "gpus": gpus,
                      "gib_per_gpu": round(p["gpus"][0]["total"] / 2**30, 2),
                      "host_engram_gib": round(p["host"] / 2**30, 2)})
    res = {"benchmark": "counts", "what": "counted from the configs and checkpoint schemas, no device",
           "date": datetime.date.today().isoformat(), "prefill_flops": flops, "placement": place}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
