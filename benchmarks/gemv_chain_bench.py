"""A layer's dense FP8 GEMVs at one row as the native decode step launches them, back to back in
one CUDA graph with dependent launch: each GEMV after the kernel that writes its codes (the RMSNorm
with the act quant, the act-quant kernel standing in for Inductor's pointwise producers, wo_a's
epilogue for wo_b). Isolated, a GEMV's time includes its ramp and its first loads' latency; in the
step the kernel before overlaps them, or does not. This times the chain per layer against its
bytes at the read rate, with the GEMV's knobs varied (the register prefetch that loads a weight
block before the dependent-launch wait, its warps) and with dependent launch off; past one row
(--rows: the FP8 MMA kernel's widths) at the defaults only.

    python benchmarks/gemv_chain_bench.py --out benchmarks/results/gemv-chain-h100.json
    python benchmarks/gemv_chain_bench.py --dry-run   # CPU, Triton interpreter, tiny shapes, prints only

Each layer has its own weights (LAYERS of them, about 1.3 GB at Flash's shapes, far above L2), so
every GEMV reads from HBM. CUDA events around 20 replays of the graph, median of 9.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from native_gemm_bench import device_for, emit, header, measure_copy, measure_read, timer  # noqa: E402

# name: (N, x's width, groups, what writes its codes) of Flash's dense FP8 projections at one row
# (v41/attention.py, v41/moe.py: wq_a and wkv stacked, shared w1 and w3 stacked; wo_a's 8 groups
# of 1,024 rows each read their own 4,096 of the attention output's 32,768)
CHAIN = (("wq_a_kv", 1792, 5120, 1, "norm"), ("wq_b", 32768, 1280, 1, "norm"), ("wo_a", 8192, 32768, 8, "quant"),
         ("wo_b", 5120, 8192, 1, "epilogue"), ("s_w13", 4608, 5120, 1, "norm"), ("s_w2", 5120, 2304, 1, "quant"))
TINY_CHAIN = (("a", 96, 128, 1, "norm"), ("o", 64, 64, 2, "quant"), ("b", 128, 64, 1, "epilogue"))
LAYERS = 8
# the GEMV's knobs timed (fp8_gemm._gemm's); {} is the step's default
VARIANTS = ({}, {"prefetch": True}, {"prefetch": True, "num_warps": 8}, {"num_warps": 8})


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU under the Triton interpreter, tiny shapes; prints only")
    p.add_argument("--out", default="benchmarks/results/gemv-chain-h100.json")
    p.add_argument("--layers", type=int, default=LAYERS)
    p.add_argument("--rows", default="1", help="comma-separated row counts; past one (the MMA kernel) the chain "
                   "at the defaults only")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    res = run(device_for(args.dry_run), TINY_CHAIN if args.dry_run else CHAIN, 1 if args.dry_run else args.layers,
              [int(r) for r in args.rows.split(",")])
    if not args.dry_run:
        for row in res["rows"]:
            print(json.dumps(row))
    emit(res, args)
    return res


def layer_weights(dev, chain):
    """One layer's (FP8 codes, E8M0 scales) of each projection: values do not matter to the timing."""
    import torch
    return [(torch.randn(n, k // g, device=dev).to(torch.float8_e4m3fn),
             torch.full((-(-n // 32), -(-k // g // 32)), 127, dtype=torch.uint8, device=dev).view(torch.float8_e8m0fnu))
            for _, n, k, g, _ in chain]


def make_layer(dev, chain, weights, knobs: dict, rows: int = 1):
    """fn() launching one layer's chain at `rows` rows: each GEMV's producer, then the GEMV on its
    codes."""
    import torch

    from custom_ops.triton import triton_fp8_act_quant, triton_fp8_block_gemm, triton_fp8_block_gemm_act_quant
    from custom_ops.triton.norm import triton_rms_norm_act_quant
    bf, fp8 = dict(dtype=torch.bfloat16, device=dev), dict(dtype=torch.float8_e4m3fn, device=dev)
    launches, codes = [], None
    for i, ((_, n, k, g, src), (w, ws)) in enumerate(zip(chain, weights)):
        if src == "epilogue":              # the codes the GEMV before wrote
            q, s = codes
        else:
            x, q, s = torch.randn(rows, k, **bf), torch.empty(rows, k, **fp8), torch.empty(rows, k // 32, device=dev)
            if src == "norm":
                launches.append(partial(triton_rms_norm_act_quant, x, torch.ones(k, **bf), 1e-6, torch.empty_like(x),
                                        q, s))
            else:
                launches.append(partial(triton_fp8_act_quant, x, q, s))
        if i + 1 < len(chain) and chain[i + 1][4] == "epilogue":     # wo_a's output leaves as wo_b's codes
            codes = torch.empty(rows, n, **fp8), torch.empty(rows, n // 32, device=dev)
            launches.append(partial(triton_fp8_block_gemm_act_quant, q, s, w, ws, torch.bfloat16, *codes, g, **knobs))
        else:
            launches.append(partial(triton_fp8_block_gemm, q, s, w, ws, torch.empty(rows, n, **bf), g, **knobs))
    return lambda: [f() for f in launches]


def run(dev, chain, layers: int, rows: list[int] = (1,)) -> dict:
    import custom_ops  # noqa: F401
    import custom_ops.triton  # noqa: F401  (registers the CUDA impls)

    timed = timer(dev)
    copy_rate, read_rate = measure_copy(dev, timed), measure_read(dev, timed)
    weights = [layer_weights(dev, chain) for _ in range(layers)]
    nbytes = sum(w.nbytes + ws.nbytes for w, ws in weights[0])
    out = {"benchmark": "benchmarks/gemv_chain_bench.py", **header(dev, copy_rate, read_rate), "layers": layers,
           "chain": [{"gemm": name, "N": n, "K": k, "groups": g, "codes_from": src} for name, n, k, g, src in chain],
           "weight_bytes_a_layer": nbytes, "floor_us_a_layer": nbytes / read_rate * 1e6, "rows": []}
    saved = os.environ.get("V41_PDL")
    cases = [(m, kw, True) for m in rows for kw in (VARIANTS if m == 1 else ({},))]
    for m, knobs, pdl_on in cases + [(1, {}, False)]:
        os.environ["V41_PDL"] = "1" if pdl_on else "0"      # common.pdl reads it at every launch
        fns = [make_layer(dev, chain, w, knobs, m) for w in weights]
        us = timed(lambda: [f() for f in fns], layers)
        out["rows"].append({"M": m, "knobs": knobs, "pdl": pdl_on, "us_a_layer": us,
                            "of_floor": us / out["floor_us_a_layer"]})
    os.environ.pop("V41_PDL")
    if saved is not None:
        os.environ["V41_PDL"] = saved
    # each GEMV alone after an act-quant launch making its codes (wo_b's too), the step's knobs
    for i, (name, n, k, g, _) in enumerate(chain):
        fns = [make_layer(dev, [(name, n, k, g, "quant")], w[i:i + 1], {}) for w in weights]
        out["rows"].append({"alone": name, "us": timed(lambda: [f() for f in fns], layers)})
    return out


if __name__ == "__main__":
    main()
