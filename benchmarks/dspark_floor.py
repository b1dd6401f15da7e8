"""What DSpark can gain at the floors, per preset, counted from the checkpoint schema on the meta
device (no weights are built, so the `flash` preset counts too): the bytes a plain decode step of
one request reads against a DSpark step's (the verify forward of 1 + K rows and the draft's K
rows), by benchmarks/floor.py's rule: every resident tensor once, of a MoE layer's routed experts
the ones its rows can reach (min(E, k·rows) of E), of the embedding (and the draft's Markov
embedding) the rows looked up, the bf16 LM
head once a forward; the Engram tables stay on the host and the KV state is left out (8 MB a
request at flash-slice's 1,024 tokens). `bound` = L × plain / DSpark bytes: DSpark's speedup at
acceptance length L (tokens a step) for a runtime whose steps run at their byte floors.

    python benchmarks/dspark_floor.py --out benchmarks/results/dspark-floor-presets-cpu.json
"""
from __future__ import annotations

import argparse
import datetime
import json

import torch

from v41.config import load_config
from v41.loader.load import fp32_copy_names
from v41.loader.placement import ROUTED_EXPERT
from v41.loader.schema import checkpoint_schema, is_host_table

K = 5                                      # DSpark drafts five tokens


def resident_bytes(cfg, weight_format: str) -> dict[str, int]:
    """Bytes of each device tensor as the engine holds it: native, as stored (the draft's
    confidence head copied to FP32); dequant, every FP8/FP4 weight as bf16 without its scales."""
    schema = checkpoint_schema(cfg)
    f32 = set(fp32_copy_names(schema))
    out = {}
    for name, s in schema.items():
        if is_host_table(name):
            continue
        if name in f32:
            out[name] = s.numel * 4
        elif weight_format == "dequant" and s.kind == "e8m0":
            continue
        elif weight_format == "dequant" and s.kind in ("fp8", "fp4"):
            out[name] = torch.Size(s.logical).numel() * 2
        else:
            out[name] = s.nbytes
    return out


def forward_bytes(cfg, sizes: dict, rows: int, draft: bool) -> int:
    """Bytes one forward over `rows` rows reads: the target's tensors (draft False) or the
    draft's `mtp.*` ones plus the embedding and head it shares (draft True)."""
    experts = {"layers": (cfg.n_routed_experts, cfg.num_experts_per_tok),
               "mtp": (cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok)}
    total = 0
    for name, b in sizes.items():
        if name == "embed.weight" or (draft and name.endswith("markov_head.embed.weight")):
            total += b * rows // cfg.vocab_size          # lookup tables: the rows looked up
        elif name == "head.weight":
            total += b
        elif name.startswith("mtp.") != draft:
            continue
        elif m := ROUTED_EXPERT.match(name):
            e, k = experts[m.group(1)]
            total += b * min(e, k * rows) // e
        else:
            total += b
    return total


def bounds(preset: str, weight_format: str, acceptance: float) -> dict:
    cfg = load_config(preset)
    sizes = resident_bytes(cfg, weight_format)
    plain = forward_bytes(cfg, sizes, 1, False)
    verify, draft = forward_bytes(cfg, sizes, 1 + K, False), forward_bytes(cfg, sizes, K, True)
    return {"preset": preset, "weight_format": weight_format, "plain_bytes": plain, "verify_bytes": verify,
            "draft_bytes": draft, "dspark_over_plain": round((verify + draft) / plain, 3),
            "bound": round(acceptance * plain / (verify + draft), 3)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", type=lambda s: s.split(","), default=["flash-slice", "flash"])
    ap.add_argument("--acceptance-length", type=float, default=3.51)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    res = {"benchmark": "dspark_floor", "device": "cpu (meta tensors: schema sizes only)", "torch": torch.__version__,
           "date": datetime.date.today().isoformat(), "acceptance_length": a.acceptance_length, "K": K,
           "method": __doc__.split("\n\n")[0].replace("\n", " "),
           "results": [bounds(p, f, a.acceptance_length) for p in a.presets for f in ("native", "dequant")]}
    for r in res["results"]:
        print(json.dumps(r))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
    return res


if __name__ == "__main__":
    main()
