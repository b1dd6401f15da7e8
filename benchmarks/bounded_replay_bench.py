"""Decoder SWA bounded replay against the full prefill (issue 15), compiled, on a GPU: prefill
steps of 1x8192, 1x4096 and 8x1024 tokens, the two variants alternating in one engine (the
runner's replay switch is flipped between cases: flash-slice's weights fit once), timed with CUDA
events after warm-up, median of several steps; beside each ratio the FLOP count both variants
must do (`count_flops`: weight GEMMs, attention over window + selected rows, index scoring over
the visible compressed rows).

    python benchmarks/bounded_replay_bench.py --out benchmarks/results/bounded-replay-flash-slice-h200.json
    python benchmarks/bounded_replay_bench.py --dry-run      # toy on the CPU: the code path, no JSON
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
from v41.loader.schema import checkpoint_schema

CASES = ((1, 8192), (1, 4096), (8, 1024))


def count_flops(cfg, length: int, replay: bool) -> float:
    """FLOPs of one prompt's prefill of `length` tokens (multiply-adds x 2), per layer: the weight
    GEMMs of the rows that run each weight, attention over each query's window and selected rows,
    and index scoring over the compressed rows a query sees."""
    topo, schema = cfg.topology, checkpoint_schema(cfg)
    W, b, last = cfg.sliding_window, topo.boundary, topo.n_backbone - 1
    tail = min(length, W) if replay else length
    total = 0.0
    for spec in topo.backbone:
        l = spec.layer
        decoder = l >= b
        rows = tail if decoder else length
        queries = 1 if replay and l == last else rows
        for name, t in schema.items():
            if not name.startswith(f"layers.{l}.") or t.kind == "e8m0" or len(t.logical or t.shape) != 2:
                continue
            out, inp = t.logical or t.shape
            part = name.split(".", 2)[2]
            if ".experts." in part:       # each row uses num_experts_per_tok of n_routed_experts
                n = cfg.n_routed_experts if l < cfg.num_hidden_layers else cfg.dspark_n_routed_experts
                k = cfg.num_experts_per_tok if l < cfg.num_hidden_layers else cfg.dspark_num_experts_per_tok
                r = queries * k / n
            elif part.startswith(("attn.compressor.", "attn.indexer.wk")):
                r = length                # the global KV: every row, replay or not
            elif part.startswith(("attn.wkv", "attn.wq_a")):
                r = rows                  # window KV of every row the layer holds (one GEMM with wq_a)
            else:
                r = queries
            total += 2 * out * inp * r
        window = min(W, tail if decoder else length)
        sel = cfg.index_topk if spec.ratio else 0
        total += 4 * cfg.num_attention_heads * cfg.head_dim * queries * (window + sel)
        if spec.scores:                   # each query scores every compressed row it sees
            seen = length / spec.ratio
            total += 2 * cfg.index_n_heads * cfg.index_head_dim * queries * seen
    return total


def prefill_ms(eng, n: int, length: int, reps: int, cuda: bool) -> float:
    g = torch.Generator().manual_seed(n * length)
    ts = []
    for _ in range(reps):
        seqs = [eng.add_request(torch.randint(3, eng.cfg.vocab_size - 3, (length,), generator=g).tolist(),
                                SamplingParams(max_tokens=1, ignore_eos=True)) for _ in range(n)]
        if cuda:
            a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            eng.step()
            z.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(z))
        else:
            t0 = time.perf_counter()
            eng.step()
            ts.append((time.perf_counter() - t0) * 1e3)
        while eng.has_unfinished():
            eng.step()
        assert all(s.is_finished for s in seqs)
    return statistics.median(ts[1:] if len(ts) > 1 else ts)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="flash-slice")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--num-pages", type=int, default=None, help="KV pages (default: sized from GPU memory)")
    ap.add_argument("--dry-run", action="store_true", help="toy on the CPU, small cases, no JSON")
    a = ap.parse_args(argv)
    cases = ((1, 96), (2, 40)) if a.dry_run else CASES
    model = "toy" if a.dry_run else a.model
    cuda = torch.cuda.is_available() and not a.dry_run
    longest = max(n * length for n, length in cases)
    eng = LLMEngine(EngineArgs(model=model, dtype="bfloat16", device="cuda" if cuda else "cpu",
                               enforce_eager=not cuda, max_num_seqs=8, max_num_batched_tokens=longest,
                               max_model_len=max(length for _, length in cases) + 16,
                               enable_prefix_caching=False, cudagraph_mode="NONE", num_pages=a.num_pages))   # prefill: never graphed
    rows = []

    def save():      # after every case: a run cut short keeps what it measured
        if a.out and not a.dry_run:
            res = {"benchmark": "bounded_replay", "model": model, "compiled": True,
                   "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": __import__("triton").__version__, "date": datetime.date.today().isoformat(),
                   "results": rows}
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)

    for n, length in cases:
        for variant in ("replay", "full", "replay", "full"):     # alternating; the second pair is kept
            eng.set_decoder_replay(variant == "replay")
            ms = prefill_ms(eng, n, length, a.reps, cuda)
            rows = [r for r in rows if (r["variant"], r["requests"], r["tokens_each"]) != (variant, n, length)]
            rows.append({"variant": variant, "requests": n, "tokens_each": length, "ms": round(ms, 3),
                         "gflops": round(n * count_flops(eng.cfg, length, variant == "replay") / 1e9, 1)})
        full, rep = (next(r for r in rows if r["variant"] == v and (r["requests"], r["tokens_each"]) == (n, length))
                     for v in ("full", "replay"))
        print(f"{n}x{length}: replay {rep['ms']:.1f} ms, full {full['ms']:.1f} ms, measured "
              f"{full['ms'] / rep['ms']:.2f}x, FLOP ratio {full['gflops'] / rep['gflops']:.2f}x", flush=True)
        save()


if __name__ == "__main__":
    main()
