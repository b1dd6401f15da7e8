"""Host overhead of one decode step: CPU time of `Scheduler.schedule()`, the runner's
publication (`ModelRunner.prepare` + the cursor commit), the sampler's bookkeeping
(`SamplingTensors.build`) and `Scheduler.postprocess`, at 1, 64 and 256 running requests of the
toy (half of them sampling with temperature/top-k/top-p and a seed, half greedy). The forward
and the sampling kernels are not run: this measures what the host adds per step. Also per step,
outside the total: the Engram row gather inside `prepare` (a device op; on the CPU it runs on
the host) and a sampling-tensor build for a batch that changed (`sampling_tensors_rebuilt`).

    python benchmarks/host_overhead.py [--steps 200] [--repeats 3] [--out benchmarks/results/host_overhead.json]
    python benchmarks/host_overhead.py --profile 256    # cProfile of those steps, top 25
    python benchmarks/host_overhead.py --against HEAD~1 [--out F]   # A/B in one process

`--against REV`: an engine whose scheduler, runner and sampler classes come from REV's
`runtime/{scheduler,model_runner,sampler}.py` (the rest of the code is the tree's) beside one
of the working tree, both at 256 running requests, measured in alternating blocks of steps in
one process: this machine's speed drifts by up to 1.5x between runs, so only variants measured
together compare.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from contextlib import contextmanager

import torch

from runtime.engine import EngineArgs, LLMEngine
from runtime.sampler import SamplingTensors
from runtime.sequence import SamplingParams

PHASES = ("schedule", "prepare", "sampling_tensors", "postprocess")    # engram_gather: part of prepare


def decoding_engine(n_requests: int, steps: int, weights, model_len: int = 2048) -> LLMEngine:
    """The toy with `n_requests` running, every one past its prompt."""
    gc.collect()                       # the engines of earlier measurements (reference cycles) go first
    eng = LLMEngine(EngineArgs(model="toy", dtype="bfloat16", device="cpu", max_num_seqs=n_requests,
                               max_num_batched_tokens=max(256, n_requests), max_model_len=model_len),
                    weights=weights)
    g = torch.Generator().manual_seed(0)
    for i in range(n_requests):
        sampled = dict(temperature=0.8, top_k=40, top_p=0.9, seed=i) if i % 2 else {}
        eng.add_request(torch.randint(3, 1000, (8,), generator=g).tolist(),
                        SamplingParams(max_tokens=min(4 * steps + 100, model_len - 8), ignore_eos=True, **sampled))
    while any(s.num_computed < s.num_prompt_tokens for s in eng.seqs.values()):
        eng.step()  # prefill until every request is decoding
    eng.sampling_table.last = None    # built by the tree's sampler, whose record REV's may not read
    return eng


def host_step(eng, clock=time.process_time_ns) -> tuple:
    """One decode step's host work; (the batch, the phases' end times from the start). The
    sampling tensors come from the module of the engine's SamplingTable (`--against`)."""
    sch, runner = eng.scheduler, eng.runner
    tensors = sys.modules[type(eng.sampling_table).__module__].SamplingTensors
    t0 = clock()
    sb = sch.schedule()
    t1 = clock()
    runner.prepare(sb)
    runner.commit(sb)
    t2 = clock()
    steady = {"steady": True} if getattr(sb, "steady", False) else {}     # (REV's may not know it)
    tensors.build(sb.seqs, eng.cfg.vocab_size, runner.device, eos_token_id=eng.cfg.eos_token_id,
                  table=eng.sampling_table, slots=sb.slots, **steady)
    t3 = clock()
    sch.postprocess(sb, {s.seq_id: 7 for s in sb.seqs})
    t4 = clock()
    return sb, (t0, t1, t2, t3, t4)


def measure(n_requests: int, steps: int, weights, profile=None) -> dict:
    eng = decoding_engine(n_requests, steps, weights)
    runner = eng.runner
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
        sb, (t0, t1, t2, t3, t4) = host_step(eng, clock)
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


HOST_PATH = {"runtime/scheduler.py": ("runtime.scheduler", "Scheduler"),
             "runtime/model_runner.py": ("runtime.model_runner", "ModelRunner"),
             "runtime/sampler.py": ("runtime.sampler", "SamplingTable")}


@contextmanager
def classes_of(rev: str):
    """runtime.engine builds its scheduler, runner and sampling table from REV's classes (their
    modules executed from `git show REV:path`, importing the tree's other modules)."""
    import runtime.engine
    saved = {}
    for path, (mod, cls) in HOST_PATH.items():
        src = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout
        m = types.ModuleType(f"{mod}@{rev}")
        m.__file__ = path
        sys.modules[m.__name__] = m            # dataclasses look their module up
        exec(compile(src, f"{rev}:{path}", "exec"), m.__dict__)
        saved[cls] = getattr(runtime.engine, cls)
        setattr(runtime.engine, cls, _older(m, cls))
    try:
        yield
    finally:
        for cls, c in saved.items():
            setattr(runtime.engine, cls, c)


def _older(m, cls: str):
    """REV's class as the tree's engine calls it, for a REV before steady decode: its batches
    are never steady and its Scheduler takes (and ignores) `speculative`."""
    c = getattr(m, cls)
    if cls != "Scheduler" or "speculative" in inspect.signature(c).parameters:
        return c
    m.ScheduledBatch.steady, m.ScheduledBatch.table_rows = False, None

    class Scheduler(c):
        def __init__(self, *a, speculative: bool = False, **k):
            super().__init__(*a, **k)
    return Scheduler


def against(rev: str, n_requests: int, blocks: int, weights) -> dict:
    """Median CPU time per phase of REV's engine and the tree's, alternating blocks of 30 steps."""
    with classes_of(rev):
        engines = {rev: decoding_engine(n_requests, blocks * 30, weights, model_len=4096)}
    engines["tree"] = decoding_engine(n_requests, blocks * 30, weights, model_len=4096)
    got = {k: {p: [] for p in (*PHASES, "total")} for k in engines}
    for b in range(blocks):
        for name in (list(engines) if b % 2 else list(engines)[::-1]):
            for _ in range(30):
                _, t = host_step(engines[name])
                for p, a, z in zip((*PHASES, "total"), (*t[:4], t[0]), (*t[1:], t[4])):
                    got[name][p].append((z - a) / 1e3)
    return {name: {p: round(statistics.median(v), 1) for p, v in d.items()} for name, d in got.items()}


def cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())


def git_head() -> str:
    """HEAD's short hash, marked when the host-path files differ from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", *HOST_PATH], capture_output=True, text=True).stdout
    return head + ("+changes" if dirty else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default="benchmarks/results/host_overhead.json")
    ap.add_argument("--profile", type=int, default=None, metavar="N", help="cProfile N running requests only")
    ap.add_argument("--repeats", type=int, default=3, help="whole measurements; the median one is reported")
    ap.add_argument("--against", metavar="REV", help="A/B against REV's host-path classes, in one process")
    ap.add_argument("--blocks", type=int, default=20, help="--against: alternating blocks of 30 steps")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from v41.config import preset
    from v41.loader import dummy_weights
    weights = dummy_weights(preset("toy"), progress=False)
    if a.against:
        res = {"benchmark": "host_overhead_against", "running_requests": 256, "steps_each": a.blocks * 30,
               "what": "median CPU time (us) per decode step phase of two engines in one process, alternating "
                       "blocks of 30 steps: one built from REV's scheduler, runner and sampler classes, one from the tree",
               "rev": a.against, "tree": git_head(), "cpu_model": cpu_model(),
               "device": f"cpu ({platform.processor() or platform.machine()}), 1 torch thread",
               "torch": torch.__version__, "python": platform.python_version(), "date": datetime.date.today().isoformat(),
               "median_us": against(a.against, 256, a.blocks, weights)}
        print(json.dumps(res["median_us"], indent=1))
        if a.out != ap.get_default("out"):
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
        return
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
           "load_average_1min_before_after": load, "cores": os.cpu_count(), "cpu_model": cpu_model(),
           "commit": git_head(), "results": rows}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
