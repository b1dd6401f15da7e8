"""Host overhead of one decode step: CPU time of `Scheduler.schedule()`, the runner's
publication (`ModelRunner.prepare` + the cursor commit), the sampler's bookkeeping
(`SamplingTensors.build`) and `Scheduler.postprocess`, at 1, 64 and 256 running requests of the
toy (half of them sampling with temperature/top-k/top-p and a seed, half greedy). The forward
and the sampling kernels are not run: this measures what the host adds per step. Also per step,
outside the total: the Engram row gather inside `prepare` (a device op; on the CPU it runs on
the host) and a sampling-tensor build for a batch that changed (`sampling_tensors_rebuilt`).

    python benchmarks/host_overhead.py [--steps 200] [--repeats 3] [--out benchmarks/results/host_overhead.json]
    python benchmarks/host_overhead.py --profile 256    # cProfile of those steps, top 25
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import statistics
import time

import torch

from runtime.engine import EngineArgs, LLMEngine
from runtime.sampler import SamplingTensors
from runtime.sequence import SamplingParams

PHASES = ("schedule", "prepare", "sampling_tensors", "postprocess")    # engram_gather: part of prepare


def measure(n_requests: int, steps: int, weights, profile=None) -> dict:
    gc.collect()                       # the engines of earlier measurements (reference cycles) go first
    eng = LLMEngine(EngineArgs(model="toy", dtype="bfloat16", device="cpu", max_num_seqs=n_requests,
                               max_num_batched_tokens=max(256, n_requests), max_model_len=2048),
                    weights=weights)
    g = torch.Generator().manual_seed(0)
    for i in range(n_requests):
        sampled = dict(temperature=0.8, top_k=40, top_p=0.9, seed=i) if i % 2 else {}
        eng.add_request(torch.randint(3, 1000, (8,), generator=g).tolist(),
                        SamplingParams(max_tokens=4 * steps + 100, ignore_eos=True, **sampled))
    while any(s.num_computed < s.num_prompt_tokens for s in eng.seqs.values()):
        eng.step()  # prefill until every request is decoding
    sch, runner = eng.scheduler, eng.runner
    vocab, eos = eng.cfg.vocab_size, eng.cfg.eos_token_id
    times, phases = [], {k: [] for k in (*PHASES, "engram_gather", "sampling_tensors_rebuilt")}
    clock = time.process_time_ns
    # the Engram row gather is a device op of the forward's input (one kernel launch on CUDA);
    # on the CPU it runs on the host inside `prepare`: timed apart so both figures show
    gathers, gather = [], runner.gather_engram

    def timed_gather(*a):
        t = clock()
        out = gather(*a)
        gathers.append(clock() - t)
        return out
    runner.gather_engram = timed_gather
    if profile is not None:
        profile.enable()
    for _ in range(steps):
        t0 = clock()
        sb = sch.schedule()
        t1 = clock()
        runner.prepare(sb)
        runner.commit(sb)
        t2 = clock()
        SamplingTensors.build(sb.seqs, vocab, runner.device, eos_token_id=eos, table=eng.sampling_table, slots=sb.slots)
        t3 = clock()
        sch.postprocess(sb, {s.seq_id: 7 for s in sb.seqs})
        t4 = clock()
        times.append((t4 - t0) / 1e6)
        phases["engram_gather"].append(gathers[-1] / 1e6)
        for k, a, b in zip(PHASES, (t0, t1, t2, t3), (t1, t2, t3, t4)):
            phases[k].append((b - a) / 1e6)
        assert sb.scheduled_bs == n_requests and sb.scheduled_tokens == n_requests, (sb.scheduled_bs, sb.scheduled_tokens)
    if profile is not None:
        profile.disable()
    runner.gather_engram = gather
    for _ in range(50):    # a step whose batch changed builds the sampling tensors afresh: timed apart
        eng.sampling_table.last = None
        t5 = clock()
        SamplingTensors.build(sb.seqs, vocab, runner.device, eos_token_id=eos, table=eng.sampling_table, slots=sb.slots)
        phases["sampling_tensors_rebuilt"].append((clock() - t5) / 1e6)
    host_only = [t - g for t, g in zip(times, phases["engram_gather"])]
    return {"running_requests": n_requests, "steps": steps, "median_ms": statistics.median(times),
            "median_ms_without_engram_gather": statistics.median(host_only),
            "p90_ms": sorted(times)[int(0.9 * len(times))], "min_ms": min(times),
            "median_ms_by_phase": {k: round(statistics.median(v), 4) for k, v in phases.items()}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="benchmarks/results/host_overhead.json")
    ap.add_argument("--profile", type=int, default=None, metavar="N", help="cProfile N running requests only")
    ap.add_argument("--repeats", type=int, default=3, help="whole measurements; the median one is reported")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from v41.config import preset
    from v41.loader import dummy_weights
    weights = dummy_weights(preset("toy"), progress=False)
    if a.profile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        measure(a.profile, a.steps, weights, prof)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    load = [os.getloadavg()[0]]        # other work on the machine inflates CPU time: recorded
    runs = {n: [] for n in (1, 64, 256)}
    for _ in range(a.repeats):         # interleaved, so a burst of other work hits every count
        for n in runs:
            runs[n].append(measure(n, a.steps, weights))
    rows = []
    for n, rs in runs.items():         # the repeat with the median median, and every repeat's median
        rs = sorted(rs, key=lambda r: r["median_ms"])
        rows.append({**rs[len(rs) // 2], "repeat_medians_ms": [round(r["median_ms"], 4) for r in rs]})
    load.append(os.getloadavg()[0])
    for r in rows:
        print(f"{r['running_requests']:4d} running: median {r['median_ms']:.3f} ms  p90 {r['p90_ms']:.3f} ms  "
              f"without the Engram gather {r['median_ms_without_engram_gather']:.3f} ms  "
              f"{r['median_ms_by_phase']}  repeats {r['repeat_medians_ms']}")
    res = {"benchmark": "host_overhead",
           "what": "CPU time per decode step of schedule + prepare/commit + SamplingTensors.build + postprocess "
                   "(toy; half the requests seeded top-k/top-p sampling, half greedy; no forward, no sampling kernels); "
                   "engram_gather is the Engram row gather op inside prepare (a device kernel on CUDA, host work "
                   "on the CPU), also given subtracted (median_ms_without_engram_gather)",
           "device": f"cpu ({platform.processor() or platform.machine()}), 1 torch thread",
           "torch": torch.__version__, "numpy": __import__("numpy").__version__,
           "python": platform.python_version(), "date": datetime.date.today().isoformat(),
           "load_average_1min_before_after": load, "cores": os.cpu_count(), "results": rows}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
