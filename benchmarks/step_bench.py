"""Engine step latency on a GPU (flash-slice, bf16, random weights): decode steps at batch 1,
16 and 64 (contexts of 1,024 tokens) and prefill steps of 1x4096 and 8x1024 tokens, timed with
CUDA events after warm-up, median of several steps. The variants (eager, compiled) share one
engine and its weights (flash-slice's 62 GB of bf16 weights fit once on an H200, not twice):
the runner's forward is switched between the eager model and the compiled segments, case by
case, so they alternate in one run. `--profile DIR` also writes a torch.profiler table of one
decode step (batch 1) and one prefill step (1x4096) per variant: where the time goes.

    python benchmarks/step_bench.py --variants eager,compiled --out benchmarks/results/step-h200.json
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import statistics
import time

import torch

from runtime.engine import EngineArgs, LLMEngine
from runtime.piece_check import METRICS, by_piece, compare_pieces
from runtime.sequence import SamplingParams


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


def profile(eng, kind: str, path: str) -> None:
    """One step under torch.profiler: a table of device and host time per op."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    g = torch.Generator().manual_seed(7)
    n, length = (1, 1024) if kind == "decode" else (1, 4096)
    seqs = [eng.add_request(torch.randint(3, 120000, (length,), generator=g).tolist(),
                            SamplingParams(max_tokens=8, ignore_eos=True)) for _ in range(n)]
    if kind == "decode":
        while any(s.num_computed < s.num_prompt_tokens for s in seqs):
            eng.step()
        eng.step()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        eng.step()
        torch.cuda.synchronize()
    for s in seqs:
        eng.abort(s.request_id)
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))
        f.write("\n\n")
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))


def prefill_logits(eng, ids) -> torch.Tensor:
    """Logits of every prompt row of one prefill step."""
    eng.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))
    sb = eng.scheduler.schedule()
    lg = eng.runner.run(sb, all_rows=True)
    eng.scheduler.postprocess(sb, {s.seq_id: 0 for s in sb.seqs})
    while eng.has_unfinished():
        eng.step()
    return lg.float()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flash-slice")
    ap.add_argument("--variants", default="eager")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--profile", default=None, help="directory for per-variant profiler tables")
    ap.add_argument("--out", default="benchmarks/results/step-h200.json")
    ap.add_argument("--dump-dir", default=None, help="the compile's graphs, passes and output code")
    a = ap.parse_args()
    args = EngineArgs(model=a.model, device="cuda", dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=8192,
                      max_model_len=4352, enable_prefix_caching=False, dump_dir=a.dump_dir)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    res = {"benchmark": "engine_step", "model": a.model, "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": __import__("triton").__version__,
           "date": datetime.date.today().isoformat(),
           "method": "CUDA events around LLMEngine.step (host + device), median after warm-up; variants "
                     "share one engine (forward switched), alternating case by case",
           "compile": None, "agreement": None, "results": []}

    def save():      # after every result: a run cut short keeps what it measured
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)

    t0 = time.perf_counter()
    eng = LLMEngine(args)
    runner = eng.runner
    print(f"engine ready in {time.perf_counter() - t0:.1f}s", flush=True)
    variants = a.variants.split(",")
    forwards = {"eager": runner.model}

    def use(v):
        runner.use_forward(forwards[v], static_shapes=v == "compiled")

    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
        profile(eng, "decode", os.path.join(a.profile, "profile-eager-decode.txt"))
    if "compiled" in variants:
        from runtime.compile import CompileConfig, compile_runner
        cargs = dataclasses.replace(args, enforce_eager=False)
        res["compile"] = compile_runner(runner, cargs, CompileConfig.from_engine_args(cargs, runner.max_tokens))
        forwards["compiled"] = runner.forward
        print(f"compiled: {json.dumps(res['compile'], default=str)}", flush=True)
        save()
        ids = torch.randint(3, 120000, (512,), generator=torch.Generator().manual_seed(1)).tolist()
        use("eager")
        e = prefill_logits(eng, ids)
        use("compiled")
        with compare_pieces(runner.forward, eager_twice=True, reference=True) as rows:
            c = prefill_logits(eng, ids)
            decode_ms(eng, 4, 64, 3)
        worst = by_piece(rows)
        res["agreement"] = {
            "pieces": worst, **{f"pieces_max_{k}": max(w[k] for w in worst.values()) for k in METRICS},
            "logits_tokens": len(ids), "logits_rel_l2": ((c - e).norm() / e.norm()).item(),
            "logits_argmax_equal": (c.argmax(-1) == e.argmax(-1)).float().mean().item(),
            "note": "pieces: each compiled layer piece vs its Dynamo graph run eagerly on the same "
                    "inputs (a 512-token prefill, 3 decode steps of 4 requests), and the graph run "
                    "twice (the floor set by ops that are not deterministic) and on the ops' "
                    "reference impls (vs_reference, eager_vs_reference); logits: whole "
                    "model, which random weights make chaotic (runtime/piece_check.py)"}
        print(f"compiled vs eager: pieces max rel_l2 {res['agreement']['pieces_max_rel_l2']:.3g}, "
              f"logits rel_l2 {res['agreement']['logits_rel_l2']:.3g}", flush=True)
        save()
    cases = [("decode", bs, 1024) for bs in (1, 16, 64)] + [("prefill", 1, 4096), ("prefill", 8, 1024)]
    for kind, n, length in cases:
        for v in variants:  # alternate variants case by case
            use(v)
            ms = decode_ms(eng, n, length, a.steps) if kind == "decode" else prefill_ms(eng, n, length, 3)
            res["results"].append({"variant": v, "step": kind, "requests": n, "tokens_each": length,
                                   "ms": round(ms, 3)})
            print(json.dumps(res["results"][-1]), flush=True)
            save()
    if a.profile:
        for v in variants:
            use(v)
            for kind in ("decode", "prefill"):
                if (v, kind) != ("eager", "decode"):
                    profile(eng, kind, os.path.join(a.profile, f"profile-{v}-{kind}.txt"))

if __name__ == "__main__":
    main()
