"""Host overhead of one decode step: CPU time of `Scheduler.schedule()` plus the runner's
metadata publication (`ModelRunner.prepare` + the cursor commit), at 1, 64 and 256 running
requests of the toy. The forward is not run: this measures what the host adds per step.

    python benchmarks/host_overhead.py [--steps 200] [--out benchmarks/results/host_overhead.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch

from runtime.engine import EngineArgs, LLMEngine
from runtime.sequence import SamplingParams


def measure(n_requests: int, steps: int, weights) -> dict:
    eng = LLMEngine(EngineArgs(model="toy", dtype="bfloat16", device="cpu", max_num_seqs=n_requests,
                               max_num_batched_tokens=max(256, n_requests), max_model_len=2048),
                    weights=weights)
    g = torch.Generator().manual_seed(0)
    for _ in range(n_requests):
        eng.add_request(torch.randint(3, 1000, (8,), generator=g).tolist(),
                        SamplingParams(max_tokens=4 * steps + 100, ignore_eos=True))
    while any(s.num_computed < s.num_prompt_tokens for s in eng.seqs.values()):
        eng.step()  # prefill until every request is decoding
    sch, runner = eng.scheduler, eng.runner
    times = []
    for _ in range(steps):
        t0 = time.process_time_ns()
        sb = sch.schedule()
        runner.prepare(sb)
        runner.commit(sb)
        times.append((time.process_time_ns() - t0) / 1e6)
        assert sb.scheduled_bs == n_requests and sb.scheduled_tokens == n_requests, (sb.scheduled_bs, sb.scheduled_tokens)
        sch.postprocess(sb, {s.seq_id: 7 for s in sb.seqs})
    return {"running_requests": n_requests, "steps": steps, "median_ms": statistics.median(times),
            "p90_ms": sorted(times)[int(0.9 * len(times))], "min_ms": min(times)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="benchmarks/results/host_overhead.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from v41.config import preset
    from v41.loader import dummy_weights
    weights = dummy_weights(preset("toy"), progress=False)
    rows = [measure(n, a.steps, weights) for n in (1, 64, 256)]
    for r in rows:
        print(f"{r['running_requests']:4d} running: median {r['median_ms']:.3f} ms  p90 {r['p90_ms']:.3f} ms")
    res = {"benchmark": "host_overhead", "what": "CPU time of schedule + metadata publication per decode step (toy)",
           "device": f"cpu ({platform.processor() or platform.machine()}), 1 torch thread",
           "torch": torch.__version__, "date": datetime.date.today().isoformat(), "results": rows}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
