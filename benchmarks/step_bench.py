"""Engine step latency on a GPU (flash-slice, bf16, random weights): decode steps at batch 1,
16 and 64 (contexts of 1,024 tokens) and prefill steps of 1x4096 and 8x1024 tokens, timed with
CUDA events after warm-up, median of several steps. Variants (eager, compiled) alternate in one
run when more than one is given.

    python benchmarks/step_bench.py --variants eager --out benchmarks/results/step-h200.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import torch

from runtime.engine import EngineArgs, LLMEngine
from runtime.sequence import SamplingParams

VARIANTS = {"eager": {"enforce_eager": True}, "compiled": {"enforce_eager": False, "compilation_level": 3}}


def timed(fn) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def decode_ms(eng, bs: int, ctx: int, steps: int) -> float:
    g = torch.Generator().manual_seed(bs)
    seqs = [eng.add_request(torch.randint(3, 120000, (ctx,), generator=g).tolist(),
                            SamplingParams(max_tokens=steps + 4, ignore_eos=True)) for _ in range(bs)]
    while any(s.num_computed < s.num_prompt_tokens for s in seqs):
        eng.step()
    ts = [timed(eng.step) for _ in range(steps)]
    for s in seqs:
        eng.abort(s.request_id)
    return statistics.median(ts[2:])


def prefill_ms(eng, n: int, length: int, reps: int) -> float:
    ts = []
    g = torch.Generator().manual_seed(n * length)
    for _ in range(reps):
        seqs = [eng.add_request(torch.randint(3, 120000, (length,), generator=g).tolist(),
                                SamplingParams(max_tokens=1, ignore_eos=True)) for _ in range(n)]
        ts.append(timed(eng.step))
        while eng.has_unfinished():
            eng.step()
        assert all(s.is_finished for s in seqs)
    return statistics.median(ts[1:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flash-slice")
    ap.add_argument("--variants", default="eager")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default="benchmarks/results/step-h200.json")
    a = ap.parse_args()
    engines = {}
    for v in a.variants.split(","):
        t0 = time.perf_counter()
        engines[v] = LLMEngine(EngineArgs(model=a.model, device="cuda", dtype="bfloat16", max_num_seqs=64,
                                          max_num_batched_tokens=8192, max_model_len=4352,
                                          enable_prefix_caching=False, **VARIANTS[v]))
        print(f"{v}: engine ready in {time.perf_counter() - t0:.1f}s", flush=True)
    rows = []
    cases = [("decode", bs, 1024) for bs in (1, 16, 64)] + [("prefill", 1, 4096), ("prefill", 8, 1024)]
    for kind, n, length in cases:
        for v, eng in engines.items():  # alternate variants case by case
            ms = decode_ms(eng, n, length, a.steps) if kind == "decode" else prefill_ms(eng, n, length, 3)
            rows.append({"variant": v, "step": kind, "requests": n, "tokens_each": length, "ms": round(ms, 3)})
            print(json.dumps(rows[-1]), flush=True)
    res = {"benchmark": "engine_step", "model": a.model, "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": __import__("triton").__version__,
           "date": datetime.date.today().isoformat(),
           "method": "CUDA events around LLMEngine.step (host + device), median after warm-up", "results": rows}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
