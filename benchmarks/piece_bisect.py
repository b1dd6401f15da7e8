"""Which part of a compiled forward is wrong: the mini model (toy widths, 8 layers, every layer
role) in bf16, compiled once, each compiled layer piece checked against its own graph run
eagerly on the same inputs (runtime/piece_check.py) with every fused op on its selected impl,
then with each op switched to its reference at run time (no recompile), then all reference;
with --passes-off also a second compile without the v41 passes.

    PYTHONPATH=. python benchmarks/piece_bisect.py --device cuda --passes-off --out piece-bisect.json

Each result is the worst relative L2 per piece over one 200-token request and 2 decode steps
(a fresh request each time, on the same engine, so other cache slots).
"""
from __future__ import annotations

import argparse
import datetime
import json
import tempfile
import time
from pathlib import Path

import torch

import runtime.compile as C
from custom_ops import registry
from passes.backend_select import FUSED_OPS
from runtime.engine import EngineArgs, LLMEngine
from runtime.piece_check import by_piece, compare_pieces
from runtime.sequence import SamplingParams
from tests.harness import mini_cfg
from v41.loader import dummy_weights


def build(path, weights, device, backend, passes):
    eng = LLMEngine(EngineArgs(model=path, dtype="bfloat16", device=device, max_num_seqs=4,
                               max_num_batched_tokens=256), weights=weights)
    r = eng.runner
    r.static_shapes = True
    fwd = C.CompiledForward(r.model, r.cache, C.CompileConfig(backend=backend, passes=passes))
    r.forward = fwd
    t = time.perf_counter()
    with torch.inference_mode():
        fwd(C.padding_batch(r, 256), r.cache)
    print(f"compiled in {time.perf_counter() - t:.1f}s, matches {fwd.stats().get('matches')}", flush=True)
    return eng, fwd


def check(eng, fwd, tag, vocab) -> dict:
    ids = torch.randint(3, vocab, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    with compare_pieces(fwd, eager_twice=True) as rows:
        eng.add_request(ids, SamplingParams(max_tokens=3, ignore_eos=True), tag)
        while eng.has_unfinished():
            eng.step()
    worst = {p: {k: round(v, 5) for k, v in w.items() if k in ("rel_l2", "eager_rel_l2")}
             for p, w in by_piece(rows).items()}
    print(tag, json.dumps(worst), flush=True)
    return worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--passes-off", action="store_true", help="also compile without the v41 passes")
    ap.add_argument("--out", default="piece-bisect.json")
    a = ap.parse_args()
    cfg = mini_cfg()
    path = tempfile.mkdtemp()
    Path(path, "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    weights = dummy_weights(cfg, progress=False)
    res = {"benchmark": "piece_bisect", "model": "mini (tests/harness.py mini_cfg)", "device":
           torch.cuda.get_device_name() if a.device == "cuda" else a.device, "torch": torch.__version__,
           "date": datetime.date.today().isoformat(), "backend": a.backend, "results": {}}

    def save():
        Path(a.out).write_text(json.dumps(res, indent=1))

    eng, fwd = build(path, weights, a.device, a.backend, True)
    selected = {op: registry.selected()[f"v41::{op}"].get(a.device, "reference") for op in FUSED_OPS}
    res["selected"] = selected
    res["results"]["all_selected"] = check(eng, fwd, "all_selected", cfg.vocab_size)
    save()
    for op in FUSED_OPS:
        registry.select(op, "reference", a.device)
        res["results"][f"ref_{op}"] = check(eng, fwd, f"ref_{op}", cfg.vocab_size)
        registry.select(op, selected[op], a.device)
        save()
    for op in FUSED_OPS:
        registry.select(op, "reference", a.device)
    res["results"]["all_reference"] = check(eng, fwd, "all_reference", cfg.vocab_size)
    save()
    if a.passes_off:
        eng, fwd = build(path, weights, a.device, a.backend, False)
        res["results"]["no_passes"] = check(eng, fwd, "no_passes", cfg.vocab_size)
        save()


if __name__ == "__main__":
    main()
