"""A layer's dense FP8 GEMVs at one row as the native decode step launches them, back to back in
one CUDA graph with dependent launch: each GEMV after the kernel that writes its codes (the RMSNorm
with the act quant, the act-quant kernel standing in for Inductor's pointwise producers, wo_a's
epilogue for wo_b). Isolated, a GEMV's time includes its ramp and its first loads' latency; in the
step the kernel before overlaps them, or does not. This times the chain per layer against its
bytes at the read rate, with the GEMV's knobs varied (the register prefetch that loads a weight
block before the dependent-launch wait, its warps) and with dependent launch off.

    python benchmarks/gemv_chain_bench.py --out benchmarks/results/gemv-chain-h100.json
    python benchmarks/gemv_chain_bench.py --dry-run   # CPU, Triton interpreter, tiny shapes, prints only

Each layer has its own weights (LAYERS of them, about 1.3 GB at Flash's shapes, far above L2), so
every GEMV reads from HBM. CUDA events around 20 replays of the graph, median of 9.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

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
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    res = run(device_for(args.dry_run), TINY_CHAIN if args.dry_run else CHAIN, 1 if args.dry_run else args.layers)
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


def make_layer(dev, chain, weights, knobs: dict):
    """fn() launching one layer's chain: each GEMV's producer, then the GEMV on its codes."""
    import torch

    from custom_ops.triton import triton_fp8_act_quant, triton_fp8_block_gemm, triton_fp8_block_gemm_act_quant
    from custom_ops.triton.norm import triton_rms_norm_act_quant
    bf = dict(dtype=torch.bfloat16, device=dev)
    steps = []
    for i, ((_, n, k, g, src), (w, ws)) in enumerate(zip(chain, weights)):
        x, norm_w, y = torch.randn(1, k, **bf), torch.ones(k, **bf), torch.empty(1, k, **bf)
        q = torch.empty(1, k, dtype=torch.float8_e4m3fn, device=dev)
        s = torch.empty(1, k // 32, device=dev)
        nxt = chain[i + 1] if i + 1 < len(chain) else None
        # wo_a's epilogue writes the codes of the next GEMV's input (its output)
        to_codes = nxt is not None and nxt[4] == "epilogue"
        out = torch.empty(1, n, dtype=torch.float8_e4m3fn if to_codes else torch.bfloat16, device=dev)
        out_s = torch.empty(1, n // 32, device=dev) if to_codes else None
        steps.append((src, x, norm_w, y, q, s, w, ws, g, out, out_s))
    for i, st in enumerate(steps):
        if st[0] == "epilogue":             # reads the codes the GEMV before wrote
            prev = steps[i - 1]
            steps[i] = (*st[:4], prev[9], prev[10], *st[6:])

    def layer():
        for src, x, norm_w, y, q, s, w, ws, g, out, out_s in steps:
            if src == "norm":
                triton_rms_norm_act_quant(x, norm_w, 1e-6, y, q, s)
            elif src == "quant":
                triton_fp8_act_quant(x, q, s)
            if out_s is not None:
                triton_fp8_block_gemm_act_quant(q, s, w, ws, torch.bfloat16, out, out_s, g, **knobs)
            else:
                triton_fp8_block_gemm(q, s, w, ws, out, g, **knobs)
    return layer


def run(dev, chain, layers: int) -> dict:
    import torch

    import custom_ops  # noqa: F401
    import custom_ops.triton  # noqa: F401  (registers the CUDA impls)
    from custom_ops.triton import common

    timed = timer(dev)
    copy_rate, read_rate = measure_copy(dev, timed), measure_read(dev, timed)
    weights = [layer_weights(dev, chain) for _ in range(layers)]
    nbytes = sum(w.nbytes + ws.nbytes for w, ws in weights[0])
    out = {"benchmark": "benchmarks/gemv_chain_bench.py", **header(dev, copy_rate, read_rate), "layers": layers,
           "chain": [{"gemm": name, "N": n, "K": k, "groups": g, "codes_from": src} for name, n, k, g, src in chain],
           "weight_bytes_a_layer": nbytes, "floor_us_a_layer": nbytes / read_rate * 1e6, "rows": []}
    pdl_saved = dict(common._pdl)
    for pdl_on in (True, False):
        for knobs in VARIANTS if pdl_on else VARIANTS[:1]:
            if not pdl_on:                  # the launches without dependent launch (common.pdl's cache)
                common._pdl.update({i: False for i in range(torch.cuda.device_count())} if dev == "cuda" else {})
            fns = [make_layer(dev, chain, w, knobs) for w in weights]
            us = timed(lambda: [f() for f in fns], layers)
            common._pdl.clear()
            common._pdl.update(pdl_saved)
            out["rows"].append({"knobs": knobs, "pdl": pdl_on, "us_a_layer": us,
                                "of_floor": us / out["floor_us_a_layer"]})
    # each GEMV alone after an act-quant launch making its codes (wo_b's too), the step's knobs
    for i, (name, n, k, g, _) in enumerate(chain):
        fns = [make_layer(dev, [(name, n, k, g, "quant")], w[i:i + 1], {}) for w in weights]
        out["rows"].append({"alone": name, "us": timed(lambda: [f() for f in fns], layers)})
    out["date"] = datetime.date.today().isoformat()
    return out


if __name__ == "__main__":
    main()
