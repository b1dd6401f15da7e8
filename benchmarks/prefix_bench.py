"""A 2,000-token shared prefix served to 16 requests (toy, CPU): prefill rows computed and wall
time with prefix caching off, with checkpoint images (`copy`) and with encoder SWA bounded
replay (`replay`). The first request runs alone (it fills the cache), then the other 15 arrive
together; each has its own 16-token suffix and generates 4 tokens.

    python benchmarks/prefix_bench.py [--out benchmarks/results/prefix_cache.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import time

import torch

from runtime.engine import EngineArgs, LLMEngine
from runtime.sequence import SamplingParams

MODES = {"off": {"enable_prefix_caching": False},
         "copy": {"enable_prefix_caching": True, "encoder_swa_bounded_replay": False},
         "replay": {"enable_prefix_caching": True, "encoder_swa_bounded_replay": True}}


def serve(weights, mode: str, prefix: list[int], suffixes: list[list[int]]) -> dict:
    eng = LLMEngine(EngineArgs(model="toy", dtype="float32", device="cpu", max_num_seqs=16,
                               max_num_batched_tokens=2048, max_model_len=4096, **MODES[mode]), weights=weights)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    rows = 0

    def drain():
        nonlocal rows
        while eng.has_unfinished():
            sb = eng.scheduler.schedule()
            rows += sum(n for s, n in zip(sb.seqs, sb.num_new) if s.num_computed < s.num_prompt_tokens)
            logits = eng.runner.run(sb)
            final = [i for i, f in enumerate(sb.is_final_chunk) if f]
            eng.scheduler.postprocess(sb, {sb.seqs[i].seq_id: int(logits[i].argmax()) for i in final})

    t0 = time.perf_counter()
    first = eng.add_request(prefix + suffixes[0], params)
    drain()
    t1 = time.perf_counter()
    rest = [eng.add_request(prefix + s, params) for s in suffixes[1:]]
    drain()
    t2 = time.perf_counter()
    eng.bm.check([])
    return {"mode": mode, "prefill_rows_computed": rows, "wall_s": round(t2 - t0, 3),
            "first_request_s": round(t1 - t0, 3), "other_15_s": round(t2 - t1, 3),
            "hit_tokens": sum(s.num_cached_tokens for s in [first] + rest),
            "images_restored": eng.runner.state.stats["images_restored"],
            "replayed_rows": eng.scheduler.stats["replayed_rows"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/prefix_cache.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from v41.config import preset
    from v41.loader import dummy_weights
    weights = dummy_weights(preset("toy"), progress=False)
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 1000, (2000,), generator=g).tolist()
    suffixes = [torch.randint(3, 1000, (16,), generator=g).tolist() for _ in range(16)]
    rows = []
    for mode in MODES:
        r = serve(weights, mode, prefix, suffixes)
        print(json.dumps(r))
        rows.append(r)
    out = {"benchmark": "prefix_cache", "what": "2,000-token shared prefix served to 16 requests (toy, float32)",
           "device": f"cpu ({platform.machine()}, 1 torch thread)", "torch": torch.__version__,
           "date": datetime.date.today().isoformat(), "results": rows}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
