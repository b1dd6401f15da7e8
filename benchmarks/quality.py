"""Quality gates of the trained toy (issue 20, item 3): the runtime in bf16 against the oracle in
float64, teacher-forced on the held-out slice of the training corpus, both index planes.

    .venv/bin/python benchmarks/quality.py [--tokens 4096] [--compiled] [--out benchmarks/results/quality-toy.json]
    python3 benchmarks/quality.py --device cuda --compiled --no-diagnosis --out quality-toy-h200.json

On CUDA the runtime runs through its Triton kernels; the float64 oracle stays on the CPU.

Per variant: nll_delta = mean NLL of the runtime minus mean NLL of the oracle (nats/token, the
same target tokens) and top1 = the fraction of rows whose argmax agrees. The oracle runs the same
index plane as the runtime (`index_plane=fp8` is the runtime's FP8 key plane, `fp4` the published
model's); `nll_delta_vs_fp4_oracle` also states the fp8 plane against the published model.
Gates (the seeds' ATOM gate): nll_delta <= +0.01 and top1 >= 0.965.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.engine import EngineArgs, LLMEngine  # noqa: E402
from tests.reference.oracle import Oracle  # noqa: E402
from tests.test_runtime_parity import teacher_forced  # noqa: E402
from tools.train_toy import CORPUS, heldout_tokens  # noqa: E402
from v41.loader import load_checkpoint  # noqa: E402
from v41.tokenizer import load_tokenizer  # noqa: E402

MODEL = ROOT / "v41" / "assets" / "toy-trained"
NLL_DELTA_MAX = 0.01
TOP1_MIN = 0.965


def windows(ids: torch.Tensor, tokens: int, seq: int) -> list[list[int]]:
    """The first `tokens` held-out tokens as requests of at most `seq` tokens (each from position
    0, as the model was trained)."""
    ids = ids[:tokens].tolist()
    return [ids[s: s + seq] for s in range(0, len(ids), seq) if len(ids[s: s + seq]) > 1]


def row_nll(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """NLL of each next token (rows 0..n-2), in float64."""
    lp = torch.log_softmax(logits[:-1].double(), -1)
    return -lp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def compare(test: list[torch.Tensor], ref: list[torch.Tensor], reqs: list[list[int]]) -> dict:
    """nll_delta (test minus ref, nats/token) and top1 agreement over every row with a target."""
    nt = torch.cat([row_nll(t, p) for t, p in zip(test, reqs)])
    nr = torch.cat([row_nll(r, p) for r, p in zip(ref, reqs)])
    agree = torch.cat([(t[:-1].argmax(-1) == r[:-1].argmax(-1)) for t, r in zip(test, ref)])
    return {"nll_delta": (nt.mean() - nr.mean()).item(), "top1": agree.double().mean().item(),
            "nll": nt.mean().item(), "oracle_nll": nr.mean().item(), "tokens": int(nt.numel())}


def oracle_logits(cfg, weights, token_map, reqs, plane: str, dtype=torch.float64) -> list[torch.Tensor]:
    o = Oracle(cfg, weights, dtype=dtype, index_plane=plane, token_map=token_map)
    return [o.forward(torch.tensor(p)) for p in reqs]


def runtime_logits(model: Path, weights, reqs, plane: str, eager: bool = True,
                   dtype: str = "bfloat16", device: str = "cpu") -> list[torch.Tensor]:
    if device != "cpu":
        weights = None      # the engine loads the checkpoint onto its device
    args = EngineArgs(model=str(model), dtype=dtype, device=device, index_cache_dtype=plane,
                      enable_prefix_caching=False, max_num_seqs=len(reqs),
                      max_num_batched_tokens=max(len(p) for p in reqs), enforce_eager=eager,
                      decoder_swa_bounded_replay=False)
    return [lg.cpu() for lg in teacher_forced(LLMEngine(args, weights=weights), reqs)]


def forced_choices(cfg, weights, token_map, reqs, forced: str) -> list[torch.Tensor]:
    """The oracle in bf16 (fp4 plane) with the float64 run's discrete choices imposed: the
    router's expert choice ("routing"), the index top-k and candidate blocks ("index"), or both.
    Both runs make those choices through `stable_desc_order` in the same order, so it is
    recorded in the float64 run and replayed in the bf16 run."""
    import tests.reference.oracle as O
    own_order, own_moe, tape, in_moe = O.stable_desc_order, O.Oracle.moe, [], [False]

    def moe(self, *a):
        in_moe[0] = True
        try:
            return own_moe(self, *a)
        finally:
            in_moe[0] = False

    def record(score):
        tape.append(own_order(score))
        return tape[-1]

    def replay(score):
        rec = tape.pop(0)
        return rec if ("routing" if in_moe[0] else "index") in forced else own_order(score)
    try:
        O.Oracle.moe, O.stable_desc_order = moe, record
        oracle_logits(cfg, weights, token_map, reqs, "fp4")
        O.stable_desc_order = replay
        return oracle_logits(cfg, weights, token_map, reqs, "fp4", torch.bfloat16)
    finally:
        O.Oracle.moe, O.stable_desc_order = own_moe, own_order


def gates_pass(row: dict) -> bool:
    return row["nll_delta"] <= NLL_DELTA_MAX and row["top1"] >= TOP1_MIN


def measure(model: Path = MODEL, tokens: int = 4096, seq: int = 512, compiled: bool = False,
            device: str = "cpu", diagnosis: bool = True, log=print, partial: Path | None = None) -> dict:
    """`partial`: a file that gets the result rows so far after each one (a run cut short keeps
    what it measured)."""
    weights = load_checkpoint(model, progress=False)
    cfg = weights.cfg
    token_map = load_tokenizer(str(model), cfg)[1]
    reqs = windows(heldout_tokens(), tokens, seq)
    ref = {p: oracle_logits(cfg, weights, token_map, reqs, p) for p in ("fp4", "fp8")}
    rows, eager_bf16 = [], {}
    for plane in ("fp8", "fp4"):
        for eager in ((True, False) if compiled else (True,)):
            t0 = time.time()
            got = runtime_logits(model, weights, reqs, plane, eager, device=device)
            if eager:
                eager_bf16[plane] = got
            row = {"variant": "bf16-eager" if eager else "bf16-compiled", "index_cache_dtype": plane,
                   **compare(got, ref[plane], reqs), "oracle": f"float64, {plane} index plane",
                   "seconds": round(time.time() - t0, 1)}
            if plane == "fp8":
                row["nll_delta_vs_fp4_oracle"] = compare(got, ref["fp4"], reqs)["nll_delta"]
            row["pass"] = gates_pass(row)
            rows.append(row)
            log(json.dumps(row))
            if partial:
                partial.write_text(json.dumps({"partial": True, "device": device, "results": rows}, indent=1) + "\n")
    # where the differences come from: the oracle's own bf16 run (and the runtime against it),
    # the runtime in float32, and the oracle's bf16 run with the float64 run's discrete choices
    # imposed
    diag = []
    for plane in (("fp8", "fp4") if diagnosis else ()):
        o16 = oracle_logits(cfg, weights, token_map, reqs, plane, torch.bfloat16)
        diag.append({"variant": "oracle-bf16", "index_cache_dtype": plane, **compare(o16, ref[plane], reqs)})
        log(json.dumps(diag[-1]))
        # the runtime against the reference in the production dtype ("oracle_nll": the bf16 oracle's)
        diag.append({"variant": "bf16-eager vs oracle-bf16", "index_cache_dtype": plane,
                     **compare(eager_bf16[plane], o16, reqs)})
        log(json.dumps(diag[-1]))
    if diagnosis:
        f32 = runtime_logits(model, weights, reqs, "fp8", True, "float32", device)
        diag.append({"variant": "runtime-float32-eager", "index_cache_dtype": "fp8", **compare(f32, ref["fp8"], reqs)})
        log(json.dumps(diag[-1]))
    for forced in (("routing", "index", "routing+index") if diagnosis else ()):
        got = forced_choices(cfg, weights, token_map, reqs, forced)
        diag.append({"variant": f"oracle-bf16, float64 {forced} choices imposed", "index_cache_dtype": "fp4",
                     **compare(got, ref["fp4"], reqs)})
        log(json.dumps(diag[-1]))
    return {"benchmark": "quality", "model": str(model.relative_to(ROOT)) if model.is_relative_to(ROOT) else str(model),
            "what": "teacher-forced runtime bf16 vs oracle float64 on held-out text",
            "heldout": {"corpus": CORPUS, "tokens": tokens, "requests": len(reqs), "request_tokens": seq},
            "thresholds": {"nll_delta_max": NLL_DELTA_MAX, "top1_min": TOP1_MIN},
            "results": rows, "diagnosis": diag,
            "device": (torch.cuda.get_device_name() + " (runtime), " if device != "cpu" else "")
            + f"cpu ({platform.machine()}), {torch.get_num_threads()} thread(s)",
            "versions": {"torch": torch.__version__, "python": platform.python_version(),
                         **({"triton": version("triton")} if device != "cpu" else {})},
            "date": datetime.date.today().isoformat()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/quality.py", description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--tokens", type=int, default=4096, help="held-out tokens compared")
    ap.add_argument("--seq", type=int, default=512, help="tokens per request")
    ap.add_argument("--compiled", action="store_true", help="also the compiled forward (slow on a CPU)")
    ap.add_argument("--device", default="cpu", help="where the runtime runs (the oracle: the CPU)")
    ap.add_argument("--diagnosis", action=argparse.BooleanOptionalAction, default=True,
                    help="also the oracle-in-bf16, runtime-float32 and imposed-choice runs")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quality-toy.json")
    a = ap.parse_args(argv)
    if a.tokens < 2 or a.seq < 2:
        ap.error("--tokens and --seq: at least 2")
    torch.set_num_threads(1)
    out = measure(a.model, a.tokens, a.seq, a.compiled, a.device, a.diagnosis, partial=a.out)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}: " + ", ".join(f"{r['variant']}/{r['index_cache_dtype']} "
                                          f"{'pass' if r['pass'] else 'FAIL'}" for r in out["results"]))
    return 0 if all(r["pass"] for r in out["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
