"""DSpark against plain decode at a forced acceptance length (issue 17's benchmark): random-weight
models draft nonsense, so the DSpark variant runs with `--spec-decode-acceptance-length L`
(ATOM's flag, benchmark only: every verify step commits L tokens on average, 1 + accepted
drafts, whatever the target says, the rollback of the rejected rows running as for a real
acceptance) and is timed against plain decode of the same model, variants alternating round by
round, at each batch size. The JSON's "forced_acceptance" (issue 17's field) holds L, and
"measured_acceptance_length" the mean 1 + accepted drafts per verify step of the timed steps.

Each case: `requests` prompts of `--ctx` random tokens are prefilled, one more step runs
untimed, then `--steps` engine steps are timed (wall clock around LLMEngine.step, which copies
the tokens to the host, so the device has finished); tokens_per_s = tokens generated in those
steps / their time, ms_per_step = their median, host_ms_by_phase = each phase's median host time
in those steps (benchmarks/profiling.phases_timed: no profiler; `runner.spec.accept` and `_sample`
include the wait for the device); floor_ms = the step's floor (benchmarks/floor.py: bytes at the
copy rate or GEMM FLOPs at the measured peaks; a DSpark step's verify forward plus its draft) and
floor_tokens_per_s the tokens/s that floor allows at the measured tokens per step: the ratio of
the two variants' floor_tokens_per_s bounds DSpark's speedup for a runtime at its floors (where
a verify step's rows reach more routed experts than one token's, it falls; counted for whole
presets by benchmarks/dspark_floor.py). The weights are loaded once and each variant builds its
engine from them in turn (one engine's compute weights in memory at a time). Both
variants run eager by default; `--no-enforce-eager` compiles both, and `--cudagraph-mode FULL`
(the default on CUDA then) replays plain decode steps, DSpark's verify steps (widths 6 x batch)
and the draft (per request count) as CUDA graphs; TR_HYBRID replays token graphs of every step.
`--weight-format native` runs both variants with the FP8/FP4 weights kept native (issue 16's
kernels: a verify step's expert rows read FP4 instead of bf16).

    python benchmarks/dspark_bench.py --model flash-slice --device cuda --acceptance-length 3.51 --out dspark.json
    python benchmarks/dspark_bench.py --model toy --device cpu --dtype float32 --ctx 24 --steps 3   # smoke
"""
from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import statistics
import time

import torch

from benchmarks.floor import held_state_bytes, step_floor, weight_bytes
from benchmarks.profiling import (SPEC_PHASES, STEP_PHASES, idle_by_phase, kernel_gaps, median_by_phase, phases_timed,
                                  profile_step)
from runtime.engine import EngineArgs, LLMEngine
from runtime.sequence import SamplingParams

K = 5                     # DSpark drafts five tokens
PROFILED = 3              # steps after the timed ones with --profile: profile_step, kernel_gaps, idle_by_phase


def case(eng: LLMEngine, bs: int, ctx: int, steps: int, profile: str | None = None, title: str = "") -> dict:
    """Time `steps` decode steps of `bs` requests after their prompts; `profile`: then one more
    step under torch.profiler, its tables appended to that file (benchmarks/profiling.py), and on
    CUDA one more under the device-only profiler: its idle intervals with the kernels around
    them (`step_gaps`: where the device waits for the host inside a step), and one more under
    the host and device profiler: that idle time by the host phase it waited for (`step_idle`)."""
    g = torch.Generator().manual_seed(bs)
    vocab = min(120000, eng.cfg.vocab_size)
    # none finishes while measured
    p = SamplingParams(max_tokens=(steps + PROFILED + 1) * (K + 1) + 1, ignore_eos=True)
    seqs = [eng.add_request(torch.randint(3, vocab, (ctx,), generator=g).tolist(), p) for _ in range(bs)]
    while any(s.num_computed < s.num_prompt_tokens for s in seqs):
        eng.step()
    eng.step()
    spec = eng.runner.spec
    before = dict(spec.stats) if spec is not None else None
    n0 = sum(len(s.completion_token_ids) for s in seqs)
    ts = []
    with phases_timed(eng, STEP_PHASES + (SPEC_PHASES if spec is not None else ())) as host:
        for _ in range(steps):
            t = time.perf_counter()
            eng.step()
            if torch.device(eng.runner.device).type == "cuda":
                torch.cuda.synchronize()
            ts.append(time.perf_counter() - t)
    tokens = sum(len(s.completion_token_ids) for s in seqs) - n0
    assert not any(s.is_finished for s in seqs), "a request finished while timed"
    gaps = idle = {}
    if profile:
        phases = STEP_PHASES + (SPEC_PHASES if spec is not None else ())
        profile_step(eng, title, profile, phases)
        gaps = kernel_gaps(eng.step, top=8)
        idle = idle_by_phase(eng, phases)
        assert not any(s.is_finished for s in seqs), "a request finished while profiled"
    for s in seqs:
        eng.abort(s.request_id)
    out = {"requests": bs, "tokens_per_s": round(tokens / sum(ts), 2), "ms_per_step": round(statistics.median(ts) * 1e3, 3),
           "tokens_per_step": round(tokens / steps / bs, 3), "host_ms_by_phase": median_by_phase(host)}
    if gaps:
        out["step_gaps"] = gaps
    if idle:
        out["step_idle"] = idle
    out |= floor(eng, bs, ctx, out["tokens_per_step"])
    if spec is not None:
        drafts = spec.stats["drafts"] - before["drafts"]
        accepted = spec.stats["accepted"] - before["accepted"]
        out["measured_acceptance_length"] = round(1 + accepted / max(drafts, 1), 3)
    return out


def floor(eng: LLMEngine, bs: int, ctx: int, tokens_per_step: float) -> dict:
    """The step's floor (benchmarks/floor.py) and the tokens/s it would allow at the measured
    tokens per step: plain, a decode step; DSpark, its verify forward (1 + K rows a request, each
    sampled) and the draft's (K rows a request; its context rings' bytes left out)."""
    model, state = eng.runner.model, held_state_bytes(eng.runner.cache.geo, bs, ctx)
    spec = eng.runner.spec
    if spec is None:
        ms = step_floor(model, "decode", bs, ctx, state)["floor_ms"]
        parts = {}
    else:
        verify = step_floor(model, "verify", bs, 1 + K, state)["floor_ms"]
        draft = step_floor(spec.draft, "verify", bs, K, 0)["floor_ms"]
        ms, parts = verify + draft, {"floor_ms_verify": verify, "floor_ms_draft": draft}
    return {"floor_ms": round(ms, 4), **parts, "floor_tokens_per_s": round(tokens_per_step * bs / ms * 1e3, 2)}


def engine_args(a, variant: str) -> EngineArgs:
    spec = ({"speculative_method": "dspark", "spec_decode_acceptance_length": a.acceptance_length}
            if variant == "dspark" else {})
    batch = max(a.batch_sizes)
    return EngineArgs(model=a.model, device=a.device, dtype=a.dtype, load_format="dummy" if a.dummy else "auto",
                      max_num_seqs=batch, max_num_batched_tokens=max(a.max_num_batched_tokens, batch * (K + 1)),
                      max_model_len=a.ctx + (a.steps + PROFILED + 1) * (K + 1) + 8, enable_prefix_caching=False,
                      num_pages=a.num_pages, enforce_eager=a.enforce_eager, cudagraph_mode=a.cudagraph_mode,
                      weight_format=a.weight_format, **spec)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="flash-slice")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--dummy", action=argparse.BooleanOptionalAction, default=True,
                    help="random weights of the preset (default; --no-dummy: the checkpoint at --model)")
    ap.add_argument("--acceptance-length", type=float, default=3.51,
                    help="mean tokens a DSpark verify step commits, 1 + accepted drafts, 1..6 (default 3.51, "
                         "the recipe's; --spec-decode-acceptance-length of the engine)")
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--ctx", type=int, default=1024, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per case")
    ap.add_argument("--rounds", type=int, default=2, help="the variants in turn, this many times")
    ap.add_argument("--variants", type=lambda s: s.split(","), default=["plain", "dspark"],
                    help="plain, dspark or both (default), in this order each round")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--weight-format", default="dequant", choices=["dequant", "native"])
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--cudagraph-mode", default=None, help="NONE, FULL or TR_HYBRID (with --no-enforce-eager)")
    ap.add_argument("--num-pages", type=int, default=None, help="KV pages (default: sized from GPU memory)")
    ap.add_argument("--out", default=None, help="write the JSON here (default: print it only)")
    ap.add_argument("--profile", default=None,
                    help="after each case's timed steps, one more under torch.profiler, appended to this file")
    a = ap.parse_args(argv)
    if not a.variants or set(a.variants) - {"plain", "dspark"}:
        ap.error(f"--variants {','.join(a.variants)}: expected plain, dspark or plain,dspark")
    cuda = torch.device(a.device).type == "cuda"
    triton = importlib.metadata.version("triton") if importlib.util.find_spec("triton") else None
    res = {"benchmark": "dspark_vs_plain", "model": a.model, "dtype": a.dtype,
           "device": torch.cuda.get_device_name() if cuda else a.device, "torch": torch.__version__,
           "triton": triton, "date": datetime.date.today().isoformat(), "forced_acceptance": a.acceptance_length,
           "weight_format": a.weight_format,
           "context_tokens": a.ctx, "steps": a.steps,
           "forward": "eager" if a.enforce_eager else f"compiled, cudagraph_mode {a.cudagraph_mode or 'default'}",
           "method": "wall clock around LLMEngine.step (tokens copied to the host each step), median step and "
                     "tokens over the timed steps, after the prompts and one untimed step; both variants "
                     "with the same forward (see 'forward'); "
                     "dspark with --spec-decode-acceptance-length (benchmark only); variants alternate by round",
           "results": []}

    def save():
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)

    args = engine_args(a, "plain")
    cfg, _ = args.admit()
    weights = args.load_weights(cfg)       # one load for both variants (their weight formats are the same)
    for r in range(a.rounds):
        for variant in a.variants:
            eng = LLMEngine(engine_args(a, variant), weights=weights)
            res.setdefault("weights_gb", {})[variant] = round(weight_bytes(eng.runner.model) / 1e9, 6)
            for bs in a.batch_sizes:
                row = {"variant": variant, "forced_acceptance": a.acceptance_length if variant == "dspark" else None,
                       **case(eng, bs, a.ctx, a.steps, a.profile, f"{variant}, {bs} request(s), round {r}"),
                       "round": r}
                res["results"].append(row)
                print(json.dumps(row), flush=True)
                save()
            assert eng.bm.all_free, "pages or slots leaked"
            del eng
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    save()
    return res


if __name__ == "__main__":
    main()
