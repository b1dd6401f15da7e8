"""Where a FULL-graph decode step's wall time goes, on the device clock (flash-slice, bf16).

Per decode step, CUDA events at the step's start (A), just before the graph launch (B), just
after the launch returns (C) and after the step (D); an event enqueued while the device is idle
fires at once, so A->B is the host's schedule + prepare (or the prepare's copies, if longer),
B->C the launch plus the graph's run, C->D the LM head, sampling, the ids copy and the host's
post work. Beside them: the graph's span replayed back to back (no launch exposed), its summed
kernel time and kernel count (torch.profiler), the host time of `replay()`. `--host-profile FILE`
appends a cProfile of further steps per batch size (the host's functions, by own time).

    python benchmarks/decode_timeline.py --out $OUT/decode-timeline.json [--host-profile $OUT/host.txt]
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import pstats
import statistics
import time

import torch

from benchmarks.profiling import kernel_time
from runtime.engine import EngineArgs, LLMEngine
from runtime.sequence import SamplingParams


def ev():
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    return e


def host_profile(eng, bs: int, steps: int, path: str) -> None:
    """cProfile of `steps` decode steps at the batch now running, appended to `path`."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(steps):
        eng.step()
    prof.disable()
    out = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(40)
    with open(path, "a") as f:
        f.write(f"==== {bs} request(s), {steps} FULL decode steps\n{out.getvalue()}\n")


def timeline(eng, bs: int, steps: int, host_path: str | None = None) -> dict:
    g = torch.Generator().manual_seed(bs)
    seqs = [eng.add_request(torch.randint(3, 120000, (1024,), generator=g).tolist(),
                            SamplingParams(max_tokens=steps + 64, ignore_eos=True)) for _ in range(bs)]
    while any(s.num_computed < s.num_prompt_tokens for s in seqs):
        eng.step()
    graphs = eng.runner.graphs
    replay, marks = graphs.replay, {}

    def marked(width, *a, **k):
        marks["B"] = ev()
        t = time.perf_counter()
        out = replay(width, *a, **k)
        marks["replay_host_ms"] = (time.perf_counter() - t) * 1e3
        marks["C"] = ev()
        marks["width"] = width
        return out
    graphs.replay = marked
    rows = []
    for i in range(steps):
        torch.cuda.synchronize()
        a = ev()
        t = time.perf_counter()
        eng.step()
        host = (time.perf_counter() - t) * 1e3
        d = ev()
        torch.cuda.synchronize()
        rows.append(dict(wall=a.elapsed_time(d), host=host, AB=a.elapsed_time(marks["B"]),
                         BC=marks["B"].elapsed_time(marks["C"]), CD=marks["C"].elapsed_time(d),
                         replay_host=marks["replay_host_ms"]))
    del graphs.replay
    width = marks["width"]
    g_ = graphs.graphs[width]
    for _ in range(3):
        g_.replay()
    torch.cuda.synchronize()
    s = ev()
    for _ in range(10):
        g_.replay()
    e = ev()
    torch.cuda.synchronize()
    graph_kernel_ms, graph_kernels = kernel_time(g_.replay)
    step_kernel_ms, step_kernels = kernel_time(eng.step)
    if host_path:
        host_profile(eng, bs, 20, host_path)
    for q in seqs:
        eng.abort(q.request_id)
    med = {k: round(statistics.median(r[k] for r in rows[2:]), 3) for k in rows[0]}
    return {"requests": bs, "width": width, "median_ms": med, "graph_back_to_back_ms": round(s.elapsed_time(e) / 10, 3),
            "graph_kernel_ms": round(graph_kernel_ms, 3), "graph_kernels": graph_kernels,
            "step_kernel_ms": round(step_kernel_ms, 3), "step_kernels": step_kernels}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flash-slice")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default="decode-timeline.json")
    ap.add_argument("--host-profile", default=None, help="file a cProfile of decode steps is appended to")
    a = ap.parse_args()
    args = EngineArgs(model=a.model, device="cuda", dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=8192,
                      max_model_len=4352, enable_prefix_caching=False, enforce_eager=False, cudagraph_mode="FULL")
    t0 = time.perf_counter()
    eng = LLMEngine(args)
    res = {"benchmark": "decode_timeline", "model": a.model, "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": __import__("triton").__version__,
           "date": datetime.date.today().isoformat(), "engine_ready_seconds": round(time.perf_counter() - t0, 1),
           "graphs": eng.graph_report, "results": []}
    for bs in (1, 16, 64):
        res["results"].append(timeline(eng, bs, a.steps, a.host_profile))
        print(json.dumps(res["results"][-1]), flush=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
