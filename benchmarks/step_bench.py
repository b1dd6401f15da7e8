"""Engine step latency on a GPU (flash-slice, bf16, random weights): decode steps at batch 1,
16 and 64 (contexts of 1,024 tokens) and prefill steps of 1x4096 and 8x1024 tokens, timed with
CUDA events after warm-up, median of several steps, each case beside the device's busy time in
more steps of it under torch.profiler (`device_ms`, overlapping kernels counted once; decode: the
median of three; wall / device says how host-bound it is; `kernels`: their count; `step_idle`:
one more step's device idle time (from the step's host start) by the host phase it waited for; `replayed`: of the timed and the
profiled steps, how many replayed; FULL: `graph_ms`, the width's graphs replayed back to back, timed with
CUDA events, and `graph_gaps`, one replay's device span, busy and idle time and its largest idle
intervals);
decode cases also carry each engine phase's median host time over the timed steps
(`host_ms_by_phase`, benchmarks/profiling.phases_timed: no profiler), and every case its floor
(`floor_ms`: the bytes it must read or its GEMM FLOPs at the measured peaks, benchmarks/floor.py).
The variants share one engine and its weights (flash-slice's 62 GB of bf16 weights fit once on
an H200, not twice): eager, compiled (the compiled segments), full (compiled + the FULL CUDA
graphs captured at decode sizes 1-64; prefill runs compiled), tr_hybrid (a second compile cut at
the splitting ops, its token pieces captured at buckets 1-512; the 1x512 prefill replays, larger
steps run that compile without graphs). They alternate case by case.
`--weight-format native` runs the same with the FP8/FP4 weights kept native. `--knob-variants`
adds FULL-graph variants of the same compile, each captured with some kernel launchers' module
constants set and its steps run with them set (so its prefill steps, which no graph holds, take
them too): a kernel default against its alternative in one engine, one compile, not one a tree. `--profile FILE`
also appends torch.profiler tables of one decode step (batch 1 and 64; `--decode-only`: each of
`--batches`) and one prefill step (1x4096) and one more prefill step's host Python under cProfile,
the engine's phases (schedule, prepare, run, sample, logprobs, postprocess) as named ranges,
per variant: where the time goes.

    python benchmarks/step_bench.py --variants eager,compiled,full,tr_hybrid --out benchmarks/results/graphs-flash-slice-h200.json
    python benchmarks/step_bench.py --weight-format native --variants full --decode-only --no-agreement \
        --knob-variants '{"tma": {"custom_ops.triton.fp8_gemm.GEMV_TMA": true}}'
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import datetime
import importlib
import json
import logging
import statistics
import sys
import time

import torch

from benchmarks.floor import held_state_bytes, step_floor, weight_bytes
from benchmarks.profiling import (host_profile_step, idle_by_phase, kernel_gaps, kernel_time, median_by_phase,
                                  phases_timed, profile_step)
from runtime.cuda_graph import CUDAGraphRunner
from runtime.engine import EngineArgs, LLMEngine
from runtime.piece_check import METRICS, by_piece, compare_pieces
from runtime.sequence import SamplingParams


# tokens a decode request may make beyond the measured steps: a batch's prompts prefill in
# chunks (64 x 1,024 tokens: eight steps at 8,192 a step), and the first ones decode meanwhile;
# a request that finished inside the measured steps would shrink the batch they measure
DECODE_MARGIN = 64


def timed(fn) -> float:
    if not torch.cuda.is_available():      # --dry-run on the CPU: the code path, host time
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def add_random(eng, n: int, length: int, g: torch.Generator, max_tokens: int) -> list:
    """`n` requests of `length` random token ids (from `g`), each making up to `max_tokens`."""
    return [eng.add_request(torch.randint(3, min(120000, eng.cfg.vocab_size), (length,), generator=g).tolist(),
                            SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for _ in range(n)]


def decode_ms(eng, bs: int, ctx: int, steps: int) -> tuple[float, float, dict, dict]:
    """(wall ms median, kernel ms: the median of three more steps', median host ms per phase of
    the timed steps, {kernels: their median count, on CUDA one more step's idle time by host
    phase (`step_idle`), and with graphs how many of those steps replayed, graph_ms}) of decode
    steps at batch `bs`."""
    g = torch.Generator().manual_seed(bs)
    seqs = add_random(eng, bs, ctx, g, steps + DECODE_MARGIN)
    while any(s.num_computed < s.num_prompt_tokens for s in seqs):
        eng.step()
    graphs = eng.runner.graphs
    before = graphs.replays if graphs is not None else 0
    with phases_timed(eng) as host:
        ts = [timed(eng.step) for _ in range(steps)]
    timed_end = graphs.replays if graphs is not None else 0
    profiled = [kernel_time(eng.step) for _ in range(3)]
    idle = idle_by_phase(eng)       # one more step: the device's idle time by the host phase it waited for
    if any(s.is_finished for s in seqs):
        raise RuntimeError(f"decode at batch {bs}: a request finished inside the measured steps")
    dev = statistics.median(ms for ms, _ in profiled)
    extra = {"kernels": statistics.median(n for _, n in profiled)} | ({"step_idle": idle} if idle else {})
    if graphs is not None:
        extra["replayed"] = [timed_end - before, graphs.replays - timed_end]
    if isinstance(graphs, CUDAGraphRunner):
        chain = graphs.graphs[graphs.sizes[bisect.bisect_left(graphs.sizes, bs)]]
        extra.update(graph_ms=round(graph_ms(chain), 3), graph_gaps=kernel_gaps(chain.replay, top=8))
    for s in seqs:
        eng.abort(s.request_id)
    return statistics.median(ts[2:]), dev, median_by_phase(host), extra


def graph_ms(chain, reps: int = 10) -> float:
    """Device ms of one forward's graphs replayed back to back (CUDA events, no profiler): the
    graph's span with no host in it. The replays rewrite what the last step wrote."""
    for _ in range(3):
        chain.replay()
    return timed(lambda: [chain.replay() for _ in range(reps)]) / reps


def prefill_ms(eng, n: int, length: int, reps: int) -> tuple[float, float, dict, dict]:
    """(wall ms median, kernel ms of one more, median host ms per phase of the timed steps,
    {`step_idle`: one more step's device idle time by the host phase it waited for}) of steps
    prefilling `n` prompts of `length`."""
    ts, dev, idle, host = [], None, {}, {}
    g = torch.Generator().manual_seed(n * length)
    for rep in range(reps + 2):
        seqs = add_random(eng, n, length, g, 1)
        if rep < reps:
            with phases_timed(eng) as times:
                ts.append(timed(eng.step))
            for k, v in times.items():
                host.setdefault(k, []).extend(v)
        elif rep == reps:
            dev = kernel_time(eng.step)[0]
        else:
            idle = idle_by_phase(eng)
        while eng.has_unfinished():
            eng.step()
        assert all(s.is_finished for s in seqs)
    return statistics.median(ts[1:]), dev, median_by_phase(host), {"step_idle": idle} if idle else {}


def profile(eng, kind: str, path: str, title: str, n: int = 1, order: int = 0, length: int | None = None) -> None:
    """One step under torch.profiler (decode: `n` requests of `length` (1,024) tokens; prefill:
    one of `length` (4,096)), appended to `path` (benchmarks/profiling.py; `order`: that many
    kernels listed in launch order)."""
    g = torch.Generator().manual_seed(7)
    n, length = (n, length or 1024) if kind == "decode" else (1, length or 4096)
    seqs = add_random(eng, n, length, g, DECODE_MARGIN)
    if kind == "decode":
        while any(s.num_computed < s.num_prompt_tokens for s in seqs):
            eng.step()
        eng.step()
    profile_step(eng, title, path, order=order)
    for s in seqs:
        eng.abort(s.request_id)
    if kind == "prefill":       # and one more prefill step's host Python, by function
        (seq,) = add_random(eng, 1, length, g, 1)
        host_profile_step(eng, title, path)
        eng.abort(seq.request_id)


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
    ap.add_argument("--profile", default=None, help="file the per-variant profiler tables are appended to")
    ap.add_argument("--out", default="benchmarks/results/step-h200.json")
    ap.add_argument("--dump-dir", default=None, help="the compile's graphs, passes and output code")
    ap.add_argument("--weight-format", default="dequant", choices=["dequant", "native"])
    ap.add_argument("--num-pages", type=int, default=None, help="KV pages (default: sized from GPU memory)")
    ap.add_argument("--agreement", action=argparse.BooleanOptionalAction, default=True,
                    help="check compiled pieces against eager first (minutes on flash-slice)")
    ap.add_argument("--decode-only", action="store_true",
                    help="the decode cases alone, and of the profiles each of their decode steps'")
    ap.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",") if b], default=[1, 16, 64],
                    help="decode batch sizes (comma-separated; default 1,16,64; empty: prefill cases alone)")
    ap.add_argument("--knob-variants", type=json.loads, default={}, metavar="JSON",
                    help='{name: {"package.module.CONSTANT": value, ...}}: FULL graphs of the compiled forward '
                         'captured again with those constants set, run as variant `name` beside the others '
                         '(one whose capture fails is recorded with its error and left out)')
    ap.add_argument("--dry-run", action="store_true", help="toy, CPU, eager, small cases: the code path only")
    ap.add_argument("--worker", action="store_true",
                    help="after setup print READY, then run the cases given as JSON lines on stdin "
                         "(benchmarks/weight_formats_bench.py)")
    a = ap.parse_args()
    if a.dry_run:
        return dry_run(a)
    args = EngineArgs(model=a.model, device="cuda", dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=8192,
                      max_model_len=4352, enable_prefix_caching=False, dump_dir=a.dump_dir,
                      weight_format=a.weight_format, num_pages=a.num_pages, cudagraph_mode="NONE")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    res = {"benchmark": "engine_step", "model": a.model, "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": __import__("triton").__version__,
           "date": datetime.date.today().isoformat(),
           "method": "CUDA events around LLMEngine.step (host + device), median after warm-up; variants "
                     "share one engine (forward switched), alternating case by case",
           "weight_format": a.weight_format, "compile": None, "graphs": None, "agreement": None, "results": []}

    def save():      # after every result: a run cut short keeps what it measured
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)

    t0 = time.perf_counter()
    eng = LLMEngine(args)
    runner = eng.runner
    res["engine_ready_seconds"] = round(time.perf_counter() - t0, 1)
    print(f"engine ready in {res['engine_ready_seconds']}s", flush=True)
    variants = a.variants.split(",")
    res["weights_gib"] = round((torch.cuda.memory_allocated() - runner.cache.nbytes) / 2**30, 2)
    res["weights_gb"] = {a.weight_format: round(weight_bytes(runner.model) / 1e9, 2)}
    forwards = {"eager": runner.model}
    graphs = {}

    def use(v):
        graphed = v == "full" or v in a.knob_variants
        runner.use_forward(forwards["compiled" if graphed else v], static_shapes=v != "eager")
        runner.graphs = graphs.get(v)

    if a.profile:
        profile(eng, "decode", a.profile, "eager decode, 1 request")
    if "compiled" in variants or "full" in variants:
        from runtime.compile import CompileConfig, compile_runner
        cargs = dataclasses.replace(args, enforce_eager=False)
        res["compile"] = compile_runner(runner, cargs, CompileConfig.from_engine_args(cargs, runner.max_tokens))
        forwards["compiled"] = runner.forward
        print(f"compiled: {json.dumps(res['compile'], default=str)}", flush=True)
        save()
    if "compiled" in forwards and a.agreement:
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
    if "full" in variants:
        graphs["full"] = CUDAGraphRunner(runner, (1, 2, 4, 8, 16, 32, 64))
        use("compiled")
        res["graphs"] = graphs["full"].capture()
        print(f"graphs: {json.dumps(res['graphs'])}", flush=True)
        save()
    for name, constants in a.knob_variants.items():
        if "compiled" not in forwards:
            ap.error("--knob-variants: its graphs capture the compiled forward (add full or compiled to --variants)")
        use("compiled")
        entry = res.setdefault("graphs_knob_variants", {})[name] = {"constants": constants}
        try:
            with module_constants(constants):
                graphs[name] = CUDAGraphRunner(runner, (1, 2, 4, 8, 16, 32, 64))
                entry.update(graphs[name].capture())
            variants.append(name)
        except Exception as e:     # noqa: BLE001 - a knob's kernels failing leaves the other variants' timings
            graphs.pop(name, None)
            entry["error"] = f"{type(e).__name__}: {e}"[:2000]
        print(f"graphs ({name}): {json.dumps(entry)}", flush=True)
        save()
    if "tr_hybrid" in variants:
        from runtime.compile import CompileConfig, compile_runner
        from runtime.token_graphs import TokenGraphRunner, token_buckets
        hargs = dataclasses.replace(args, enforce_eager=False, cudagraph_mode="TR_HYBRID")
        res["compile_tr_hybrid"] = compile_runner(runner, hargs, CompileConfig.from_engine_args(hargs, runner.max_tokens))
        forwards["tr_hybrid"] = runner.forward
        graphs["tr_hybrid"] = TokenGraphRunner(runner, token_buckets(runner.max_tokens))
        use("tr_hybrid")
        res["graphs_tr_hybrid"] = graphs["tr_hybrid"].capture()
        print(f"graphs (tr_hybrid): {json.dumps(res['graphs_tr_hybrid'])}", flush=True)
        save()
    if a.worker:
        return serve_cases(eng, variants, use, a.steps, res)
    cases = [("decode", bs, 1024) for bs in a.batches]
    if a.decode_only:
        profiled = [("decode", bs) for bs in a.batches]
    else:
        cases += [("prefill", 1, 4096), ("prefill", 8, 1024)]
        if "tr_hybrid" in variants:
            cases.append(("prefill", 1, 512))      # the largest token bucket: a prefill that replays
        profiled = [("decode", bs) for bs in (1, 64) if a.batches] + [("prefill", 1)]
    run_cases(eng, cases, variants, use, a.steps, res, save, a.knob_variants)
    if a.profile:
        for v in variants:
            use(v)
            for kind, n in profiled:
                if (v, kind) != ("eager", "decode"):
                    profile(eng, kind, a.profile, f"{v} {kind}, {n} request(s)", n, order=120)


@contextlib.contextmanager
def module_constants(constants: dict):
    """Set each "package.module.NAME" to its value inside the block (the module must already
    have NAME), restoring them after."""
    saved = []
    try:
        for path, value in constants.items():
            mod, _, name = path.rpartition(".")
            m = importlib.import_module(mod)
            if not hasattr(m, name):
                raise ValueError(f"--knob-variants: {mod} has no {name}")
            saved.append((m, name, getattr(m, name)))
            setattr(m, name, value)
        yield
    finally:
        for m, name, value in reversed(saved):
            setattr(m, name, value)


def run_cases(eng, cases, variants, use, steps: int, res: dict, save, knob_variants: dict | None = None) -> None:
    """Each case in every variant, the variants alternating case by case; a knob variant's
    steps run with its module constants set."""
    for kind, n, length in cases:
        floor = step_floor(eng.runner.model, kind, n, length, held_state_bytes(eng.runner.cache.geo, n, length))
        for v in variants:
            use(v)
            with module_constants((knob_variants or {}).get(v, {})):
                if kind == "decode":
                    ms, dev, host, extra = decode_ms(eng, n, length, steps)
                else:
                    ms, dev, host, extra = prefill_ms(eng, n, length, 3)
            res["results"].append({"variant": v, "step": kind, "requests": n, "tokens_each": length,
                                   "ms": round(ms, 3), "device_ms": round(dev, 3), **floor,
                                   **({"host_ms_by_phase": host} if host is not None else {}), **extra})
            print(json.dumps(res["results"][-1]), flush=True)
            save()


def serve_cases(eng, variants, use, steps: int, res: dict) -> None:
    """Worker mode: `READY {setup}` once, then for each JSON line [kind, requests, tokens] on
    stdin `CASE [results]` (one per variant), and for each line {"profile": path, "case": [kind,
    requests, tokens]} `CASE []` after profiling that step of the first variant (`profile`, the
    first 120 kernels in order), until stdin closes."""
    keys = ("device", "torch", "triton", "weights_gb", "weights_gib", "compile", "graphs", "engine_ready_seconds")
    print("READY " + json.dumps({k: res.get(k) for k in keys}, default=str), flush=True)
    for line in sys.stdin:
        req, out = json.loads(line), {"results": []}
        if isinstance(req, dict):
            (kind, n, length), v = req["case"], variants[0]
            use(v)
            profile(eng, kind, req["profile"], f"{v} {kind}, {n} request(s)", n, order=120, length=length)
        else:
            run_cases(eng, [tuple(req)], variants, use, steps, out, lambda: None)
        print("CASE " + json.dumps(out["results"]), flush=True)


def dry_run(a) -> None:
    """The toy on the CPU, eager, small cases, both weight formats (--worker: its own format,
    cases from stdin): prints, writes nothing."""
    for fmt in (a.weight_format,) if a.worker else ("dequant", "native"):
        eng = LLMEngine(EngineArgs(model="toy", device="cpu", dtype="float32", max_num_seqs=4,
                                   max_num_batched_tokens=256, max_model_len=320, weight_format=fmt))
        if a.worker:
            return serve_cases(eng, ["eager"], lambda v: None, 4,
                               {"device": "cpu (dry run)", "torch": torch.__version__,
                                "weights_gb": {fmt: round(weight_bytes(eng.runner.model) / 1e9, 6)}})
        res = {"results": []}
        print(fmt, f"{weight_bytes(eng.runner.model) / 1e6:.2f} MB of weights")
        run_cases(eng, [("decode", 1, 64), ("decode", 4, 64), ("prefill", 2, 100)], ["eager"],
                  lambda v: None, 4, res, lambda: None)
        print(fmt, "ok")


if __name__ == "__main__":
    main()
