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
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = {"dequant": "bf16", "native": "native"}
CASES = [("decode", 1, 1024), ("decode", 16, 1024), ("decode", 64, 1024), ("prefill", 1, 4096), ("prefill", 8, 1024)]
DRY_CASES = [("decode", 1, 64), ("decode", 4, 64), ("prefill", 2, 100)]


def reply(proc, prefix: str):
    """The JSON after `prefix` on the worker's next line that has it (other lines are its log)."""
    for line in proc.stdout:
        if line.startswith(prefix):
            return json.loads(line[len(prefix):])
    raise RuntimeError(f"step_bench worker exited (rc {proc.wait()}) before a {prefix.strip()} line")


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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(HERE),
                                                                      os.environ.get("PYTHONPATH")]))}
    procs = {}
    for fmt in NAMES:
        cmd = [sys.executable, os.path.join(HERE, "step_bench.py"), "--worker", "--weight-format", fmt,
               "--model", a.model, "--variants", a.variant, "--steps", str(a.steps), "--no-agreement",
               "--num-pages", str(a.num_pages)] + (["--dry-run"] if a.dry_run else [])
        procs[fmt] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        ready = {fmt: reply(p, "READY ") for fmt, p in procs.items()}
        res = {"benchmark": "weight_formats", "model": "toy" if a.dry_run else a.model,
               "date": datetime.date.today().isoformat(),
               "method": "two step_bench workers on one device, one engine per weight format, the cases "
                         "given to each in turn (variants alternating case by case); CUDA events around "
                         "LLMEngine.step, median after warm-up; device_ms: the kernels of one more step",
               "weights_gb": {NAMES[f]: next(iter(r["weights_gb"].values())) for f, r in ready.items()},
               "setup": ready, "results": []}
        res.update({k: ready["native"].get(k) for k in ("device", "torch", "triton")})
        cases = DRY_CASES if a.dry_run else CASES
        for case in cases:
            for fmt, p in procs.items():
                p.stdin.write(json.dumps(case) + "\n")
                p.stdin.flush()
                for row in reply(p, "CASE "):
                    res["results"].append({**row, "graphs": row["variant"], "variant": NAMES[fmt]})
                    print(json.dumps(res["results"][-1]), flush=True)
            if not a.dry_run:
                with open(a.out, "w") as f:          # after every case: a run cut short keeps what it measured
                    json.dump(res, f, indent=1, default=str)
        for fmt, p in procs.items() if a.profile else ():    # one engine at a time: the other one idles
            p.stdin.write(json.dumps({"profile": f"{a.profile}.{NAMES[fmt]}.txt", "case": cases[0]}) + "\n")  # batch 1
            p.stdin.flush()
            reply(p, "CASE ")
    except BaseException:
        for p in procs.values():      # a worker that failed or a stop: the other one goes too
            p.kill()
        raise
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait()
    if a.dry_run:
        print(json.dumps(res, default=str))
    return res



if __name__ == "__main__":
    main()
