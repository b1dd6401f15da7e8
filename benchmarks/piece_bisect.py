"""Which part of a compiled forward is wrong: the mini model (toy widths, 8 layers, every layer
role) in bf16, compiled once, each compiled layer piece checked against its own graph run
eagerly on the same inputs (runtime/piece_check.py) with every fused op on its selected impl,
then with each op switched to its reference at run time (no recompile), then all reference;
with --passes-off also a compile without the v41 passes, with --backends more compiles through
other backends (post_grad_eager: the passes without Inductor's code generation; aot_eager: AOT's
graph run eagerly), with --inductor more compiles under other Inductor configs (buffer reuse
off, padding off, ...).

    PYTHONPATH=. python benchmarks/piece_bisect.py --device cuda --passes-off \
        --backends post_grad_eager,aot_eager --out piece-bisect.json

On the CPU the ops run their reference impls; `--triton-on-cpu` runs the Triton impls there
instead, under the interpreter (start with TRITON_INTERPRET=1), with the key splits the GPU
would choose (`--sms`): what the kernels' own BF16 rounding does to the check, no GPU needed.

Each result is the worst per piece over one 200-token request and 2 decode steps (a fresh
request each time, on the same engine, so other cache slots): `rel_l2` compiled vs eager
(float outputs; `ids_differing`: integer outputs),
`eager_rel_l2` eager vs eager (the nondeterminism floor), `vs_reference` / `eager_vs_reference`
compiled / eager vs the graph run with every op on its reference impl. `outputs` breaks each
piece's worst call down per output (which output, how many rows differ).
"""
from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch._inductor.config

import runtime.compile as C
from custom_ops import registry
from passes.backend_select import FUSED_OPS
from runtime.engine import EngineArgs, LLMEngine
from runtime.piece_check import METRICS, by_piece, compare_pieces, rel_l2
from runtime.sequence import SamplingParams
from tests.harness import mini_cfg
from v41.loader import dummy_weights


def build(path, weights, device, backend, passes):
    eng = LLMEngine(EngineArgs(model=path, dtype="bfloat16", device=device, max_num_seqs=4,
                               max_num_batched_tokens=256), weights=weights)
    r = eng.runner
    fwd = C.CompiledForward(r.model, r.cache, C.CompileConfig(backend=backend, passes=passes))
    r.use_forward(fwd, static_shapes=True)
    t = time.perf_counter()
    with torch.inference_mode():
        fwd(r.padding_batch(256), r.cache)
    print(f"compiled in {time.perf_counter() - t:.1f}s, matches {fwd.stats().get('matches')}", flush=True)
    return eng, fwd


def outputs(record: dict) -> list[dict]:
    """Per output of a saved call: dtype, shape, relative L2 (share of differing elements for
    integer outputs), share of rows (dim 0) with any difference above 1% of the output's range."""
    out = []
    for i, (c, e) in enumerate(zip(record["compiled"], record["eager"])):
        row = {"output": i, "dtype": str(c.dtype).replace("torch.", ""), "shape": list(c.shape),
               "rel_l2": round(rel_l2(c, e), 5)}
        if c.dim() and c.numel():
            d = (c.double() - e.double()).abs() if c.is_floating_point() else (c != e).double()
            tol = 0.01 * e.double().abs().max().item() if c.is_floating_point() else 0.0
            row["rows_differing"] = round((d.reshape(len(d), -1).amax(1) > tol).double().mean().item(), 4)
        out.append(row)
    return out


def check(eng, fwd, tag, vocab, save_dir=None) -> dict:
    ids = torch.randint(3, vocab, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    sub = Path(save_dir, tag) if save_dir else None
    with compare_pieces(fwd, eager_twice=True, reference=True, save_dir=sub) as rows:
        eng.add_request(ids, SamplingParams(max_tokens=3, ignore_eos=True), tag)
        while eng.has_unfinished():
            eng.step()
    worst = {p: {k: round(v, 5) for k, v in w.items() if k in METRICS} for p, w in by_piece(rows).items()}
    if sub:
        for p in worst:
            worst[p]["outputs"] = outputs(torch.load(sub / f"{p}.pt", weights_only=False))
    print(tag, json.dumps(worst), flush=True)
    return worst


def triton_on_cpu(sms: int) -> None:
    """Register every Triton impl for CPU tensors too (the interpreter runs them)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--triton-on-cpu: start with TRITON_INTERPRET=1 (set before triton is imported)")
    import custom_ops.triton as impls
    import custom_ops.triton.common as common
    common.num_sms = lambda device: sms
    for qual in registry.defined():
        name = qual.split("::")[1]
        if fn := getattr(impls, f"triton_{name}", None):
            registry.register_impl(name, "triton", fn, device_type="cpu")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--passes-off", action="store_true", help="also compile without the v41 passes")
    ap.add_argument("--backends", default="", help="also compile through these backends, comma-separated")
    ap.add_argument("--inductor", default="", help="also compile with these Inductor configs, e.g. "
                    "'allow_buffer_reuse=False,inplace_buffers=False;comprehensive_padding=False'")
    ap.add_argument("--save-dir", default=None, help="keep each piece's worst call here (per setting)")
    ap.add_argument("--triton-on-cpu", action="store_true", help="CPU: the Triton impls, interpreted")
    ap.add_argument("--sms", type=int, default=132, help="with --triton-on-cpu: SM count for key splits")
    ap.add_argument("--out", default="piece-bisect.json")
    a = ap.parse_args()
    if a.triton_on_cpu:
        triton_on_cpu(a.sms)
    cfg = mini_cfg()
    path = tempfile.mkdtemp()
    Path(path, "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    weights = dummy_weights(cfg, progress=False)
    res = {"benchmark": "piece_bisect", "model": "mini (tests/harness.py mini_cfg)", "device":
           torch.cuda.get_device_name() if a.device == "cuda" else a.device, "torch": torch.__version__,
           "triton": __import__("triton").__version__ if a.device == "cuda" else None,
           "date": datetime.date.today().isoformat(), "backend": a.backend, "results": {}}

    def save():
        Path(a.out).write_text(json.dumps(res, indent=1))

    eng, fwd = build(path, weights, a.device, a.backend, True)
    selected = {op: registry.selected()[f"v41::{op}"].get(a.device, "reference") for op in FUSED_OPS}
    res["selected"] = selected
    # the per-op switches below act only on ops the passes put in the graph and kept
    res["matches"] = fwd.stats().get("matches")
    if fwd.pass_manager is not None:
        select = next(p for p in fwd.pass_manager.passes if p.name == "backend_select")
        res["backend_select"] = dict(select.decisions)
    out = res["results"]
    out["all_selected"] = check(eng, fwd, "all_selected", cfg.vocab_size, a.save_dir)
    save()
    with registry.using("reference", a.device, names=FUSED_OPS):
        out["all_reference"] = check(eng, fwd, "all_reference", cfg.vocab_size, a.save_dir)
    save()
    # the other compiles before the op-by-op switches: they tell more if the run is cut short
    variants = [(f"backend_{b}", b, True, {}) for b in filter(None, a.backends.split(","))]
    for v in filter(None, a.inductor.split(";")):
        patch = {k.strip(): ast.literal_eval(x.strip()) for k, x in (i.split("=", 1) for i in v.split(","))}
        variants.append(("inductor_" + "_".join(f"{k}={x}" for k, x in patch.items()), a.backend, True, patch))
    if a.passes_off:
        variants.insert(0, ("no_passes", a.backend, False, {}))
    for tag, backend, passes, patch in variants:
        with torch._inductor.config.patch(patch):
            eng_v, fwd_v = build(path, weights, a.device, backend, passes)
            out[tag] = check(eng_v, fwd_v, tag, cfg.vocab_size, a.save_dir)
        save()
    for op in FUSED_OPS:
        with registry.using("reference", a.device, names=(op,)):
            out[f"ref_{op}"] = check(eng, fwd, f"ref_{op}", cfg.vocab_size)
        save()
    # the first check also ran the autotuner's benchmarks: a repeat tells its share from the ops'
    out["all_selected_again"] = check(eng, fwd, "all_selected_again", cfg.vocab_size)
    save()

if __name__ == "__main__":
    main()
