"""Mean teacher-forced NLL of the bf16 runtime against the float64 oracle on the toy (issue 3's
serving-dtype report): the same prompts, chunked as a server would, both index plane formats.

    python benchmarks/bf16_nll.py [--out benchmarks/results/bf16_nll.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform

import torch

from tests import harness as H
from tests.reference.oracle import Oracle
from tests.test_runtime_parity import teacher_forced


def nll(logits, ids):
    lp = torch.log_softmax(logits[:-1].double(), -1)
    return -lp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/bf16_nll.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from v41.config import preset
    from v41.loader import dummy_weights
    from v41.tokenizer import load_tokenizer
    cfg = preset("toy")
    w = dummy_weights(cfg, progress=False)
    tmap = load_tokenizer("toy", cfg)[1]
    lens = (2, 15, 16, 17, 33, 64, 127, 301, 600)
    reqs = H.prompts(lens, seed=1)
    rows = []
    for fmt in ("fp8", "fp4"):
        oracle = Oracle(cfg, w, dtype=torch.float64, index_plane=fmt, token_map=tmap)
        ref = torch.cat([nll(oracle.forward(torch.tensor(p)), p) for p in reqs])
        res = {"index_cache_dtype": fmt, "tokens": int(ref.numel()), "oracle_f64_mean_nll": ref.mean().item()}
        # the same arithmetic in bf16, by the oracle: how far bf16 itself moves this toy
        o16 = Oracle(cfg, w, dtype=torch.bfloat16, index_plane=fmt, token_map=tmap)
        res["oracle_bf16_minus_oracle_f64"] = (torch.cat([nll(o16.forward(torch.tensor(p)), p) for p in reqs]).mean()
                                               - ref.mean()).item()
        for dtype in ("bfloat16", "float32"):
            eng = H.make_engine(w, dtype, index_cache_dtype=fmt, max_num_batched_tokens=256)
            got = torch.cat([nll(l, p) for l, p in zip(teacher_forced(eng, reqs), reqs)])
            res[f"{dtype}_mean_nll"] = got.mean().item()
            res[f"{dtype}_minus_oracle"] = (got.mean() - ref.mean()).item()
        rows.append(res)
        print(json.dumps(res))
    out = {"benchmark": "bf16_nll", "what": "mean teacher-forced NLL (nats/token), runtime vs float64 oracle, toy random weights",
           "prompt_lengths": lens, "device": f"cpu ({platform.machine()})", "torch": torch.__version__,
           "date": datetime.date.today().isoformat(), "results": rows}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
