"""The native-format GEMMs on a GPU (issue 16): `v41::fp8_block_gemm` (W8A8, FP8 32x32 block
weights) at Flash's dense projection shapes and `v41::moe_experts_w4a8` (FP4 experts, 384
experts top-6) at decode widths 1-64 and prefill widths >= 2048, beside cuBLAS bf16 on the same
shapes and `torch._scaled_mm` (FP8, per-tensor scales) as the FP8 dense peak.

    python benchmarks/native_gemm_bench.py            # H200: writes benchmarks/results/native-gemm-h200.json
    python benchmarks/native_gemm_bench.py --dry-run  # CPU, Triton interpreter, tiny shapes, prints only

Dense rows at decode widths also time the call from bf16 x: `fp8_linear` (the act quant inside
the one-row GEMV where `fp8_gemm.quantizes_inside` says so) against `fp8_act_quant` then
`fp8_block_gemm`.
Figures per case: device time (CUDA graph of `copies` calls, each on its own weight copy, so
the weights come from HBM and not from the 50 MB L2; CUDA events around 20 replays, median of
9), weight bytes read (codes + scales; for the experts, those of the experts the routing hits),
their rate and its share of the copy rate (a device-to-device copy measured in the same run,
bytes read + written per second) and of the read rate (a sum over 2 GiB: bytes read per
second), and at prefill widths TFLOP/s against the measured FP8 peak.
Targets (issue 16): >= 70% of the copy rate at decode widths, >= 60% of the FP8 peak at prefill.
"sweep" rows: the same cases with other knobs (the defaults' candidates): the dense kernel's at
widths 1, 8 and 64 and at the first prefill width; the experts' knobs and 'tiles' path at
widths 1, 8 and 64, and the 'tiles' path's tiles at the first prefill width.
Expert rows with a "path": flash-slice's 16 experts at 1, 5, 6, 16 and 96 tokens (plain decode,
DSpark's draft and verify widths), each path in turn (`slice_expert_rows`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time

DENSE = {   # name: (N, K) of the FP8 GEMMs Flash runs (spec §6; wq_a and wkv stacked), plus the cuBLAS reference
    "wq_a_kv": (1792, 5120), "wq_b": (32768, 1280), "wo_b": (5120, 8192), "shared_w1": (2304, 5120),
    "ref_4096x16384": (16384, 4096)}
DECODE = (1, 2, 4, 8, 16, 32, 64)
PREFILL = (2048, 4096)
EXPERTS = (384, 6, 5120, 2304)     # E, top-k, D, I (Flash)
SLICE_EXPERTS = (16, 6, 5120, 2304)   # flash-slice's
WO_A = (8, 1024, 4096)             # wo_a: groups, rows a group, K a group (Flash)
TINY_DENSE = {"tiny": (96, 64)}
TINY_EXPERTS = (6, 2, 64, 64)
# tile variants timed beside the defaults (the "sweep" rows) at SWEEP_M and the first prefill width.
# The path first: the MMA tiles where the CUDA-core GEMV is the default (one row) and the GEMV
# beside the tiles at 8 and 64 rows, then the GEMV's tiles and stages (128 x 128, 4 warps,
# unpipelined by default: native-gemm-paths-h200.json, native-gemm-one-row-h200.json), then the
# MMA tiles that beat its defaults on some shapes at 1 and 8 rows in native-gemm-h200.json
# (2026-12-03; its other tiles lost everywhere and left the list), then the GEMV's register
# prefetch at the tiles where it does not spill. The CPU dry run takes the first, which runs at any K.
DECODE_SWEEP = ({"path": "mma"}, {"path": "gemv"}, {"path": "gemv", "block_n": 128}, {"path": "gemv", "block_k": 256},
                {"path": "gemv", "block_n": 32}, {"path": "gemv", "block_n": 128, "num_warps": 8},
                {"path": "gemv", "num_warps": 8}, {"path": "gemv", "num_warps": 2},
                {"path": "gemv", "block_n": 128, "block_k": 256}, {"path": "gemv", "block_k": 64},
                {"path": "gemv", "split_k": 2}, {"path": "gemv", "split_k": 8}, {"path": "gemv", "num_stages": 2},
                {"path": "mma", "block_n": 128, "num_stages": 2}, {"path": "mma", "split_k": 8},
                {"path": "gemv", "prefetch": True, "num_warps": 8}, {"path": "gemv", "prefetch": True, "block_n": 64},
                {"path": "gemv", "split_k": 16}, {"path": "gemv", "split_k": 32}, {"path": "gemv", "split_k": 64})
# the prefill widths: the FP8 MMA kernel (fp8_gemm.gemm_path) at its default and with four stages
# (its 128 x 128 tile and eight warps lost at 2,048 and 4,096 rows, dense-prefill-h100.json), and
# cuBLAS on the bf16 values (path 'bf16'; the CPU dry run takes the last)
PREFILL_SWEEP = ({"path": "mma"}, {"path": "mma", "num_stages": 4}, {"path": "bf16"})
# the FP4 GEMVs' default tile (64 x 128, 4 warps, 3 stages) takes 130 registers in the up GEMV
# and 75 in the down one (sm_90 builds, Triton 3.9, sm90-build-cpu.json); num_stages 1: unpipelined;
# prefetch: each K block's words loaded during the one before's products (136 and 90 registers)
EXPERT_SWEEP = ({"block_n_up": 32}, {"block_k": 64}, {"block_n_up": 32, "block_k": 64}, {"num_warps": 8},
                {"block_n_down": 32}, {"splits": 1}, {"splits": 4}, {"splits": 20}, {"num_stages": 1},
                {"num_stages": 5}, {"prefetch": True}, {"prefetch": True, "splits": 1}, {"path": "tiles"})
# the 'tiles' path at the first prefill width (the expert kernels were 61% of a native 1x4096
# prefill's kernels on the FP8-MMA path, since deleted): at run_experts' tiles (the default) and at
# 64 x 128 and 128 x 128 (sm90-build-cpu.json: no spills)
EXPERT_PREFILL_SWEEP = ({"path": "tiles"}, {"path": "tiles", "block_m": 64, "block_n_up": 128, "block_n_down": 128},
                        {"path": "tiles", "block_m": 128, "block_n_up": 128, "block_n_down": 128, "num_warps": 8,
                         "block_k": 32})
SWEEP_M = (1, 8, 64)
# --slice-experts: the 'tiles' path's candidates at flash-slice's widths (its K loops pipelined
# by Triton's default; the GEMVs ran 2-3.5x faster unpipelined, native-gemm-paths-h200.json),
# split over K (the tiles of a verify step are about one per expert: 16 x 36 programs for 132 SMs)
SLICE_TILES_SWEEP = ({"num_stages": 1}, {"num_stages": 2}, {"splits": 2}, {"splits": 4}, {"splits": 8},
                     {"splits": 4, "num_stages": 1}, {"splits": 4, "num_stages": 2}, {"block_k": 128},
                     {"block_k": 128, "num_stages": 1}, {"block_n_up": 32, "block_n_down": 32},
                     {"block_n_up": 128, "block_n_down": 128}, {"num_warps": 8}, {"block_m": 16},
                     {"block_m": 16, "splits": 2}, {"block_n_up": 128, "block_n_down": 128, "block_k": 128})
# flash-slice's widths: plain decode at batch 1 to 64 (2 and 3 find where the GEMVs stop
# winning), the draft's five rows, a verify step's six (1 and 16 requests)
SLICE_WIDTHS = (1, 2, 3, 5, 6, 16, 64, 96)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="CPU under the Triton interpreter on tiny shapes; prints, writes nothing")
    p.add_argument("--out", default="benchmarks/results/native-gemm-h200.json")
    p.add_argument("--no-sweep", action="store_true", help="the defaults only, no sweep rows")
    p.add_argument("--one-row", action="store_true",
                   help="the dense GEMMs at one row and their sweep only (no wo_a, experts or prefill: a short call)")
    p.add_argument("--dense-widths", type=lambda v: tuple(int(w) for w in v.split(",")), default=None,
                   help="with --one-row: the dense GEMMs' widths (default 1), the sweep rows at each")
    p.add_argument("--knobs", type=json.loads, metavar="JSON",
                   help="a JSON list of knob dicts timed instead of the dense decode sweep, e.g. "
                        "'[{\"path\": \"gemv\", \"split_k\": 16}]'; with --slice-experts the experts' knobs "
                        "instead of the 'tiles' sweep (a knob dict may name its path)")
    p.add_argument("--widths", type=lambda v: tuple(int(w) for w in v.split(",")), default=SLICE_WIDTHS,
                   help="--slice-experts' token counts (default: SLICE_WIDTHS)")
    p.add_argument("--slice-experts", action="store_true",
                   help="flash-slice's expert paths ('gemv', 'mma', 'tiles') at SLICE_WIDTHS and the 'tiles' "
                        "path's sweep only (--no-sweep: the paths only)")
    return p.parse_args(argv)


def device_for(dry_run: bool) -> str:
    """'cpu' under the Triton interpreter for a dry run (set before triton is first imported),
    else 'cuda', or exit where there is none."""
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    if not dry_run and not torch.cuda.is_available():
        sys.exit("error: needs a CUDA device (or --dry-run)")
    return "cpu" if dry_run else "cuda"


def main(argv=None) -> dict:
    args = parse(argv)
    dev = device_for(args.dry_run)
    if args.slice_experts:
        res = slice_experts_run(dev, checkpoint=None if args.dry_run else lambda out: emit(out, args),
                                sweep=not args.no_sweep, knobs=args.knobs, widths=args.widths)
        emit(res, args)
        return res
    decode = (args.dense_widths or (1,)) if args.one_row else (1, 3) if args.dry_run else DECODE
    prefill = () if args.one_row else (40,) if args.dry_run else PREFILL
    experts = None if args.one_row else TINY_EXPERTS if args.dry_run else EXPERTS
    res = run(dev, TINY_DENSE if args.dry_run else DENSE, decode, prefill, experts, sweep=not args.no_sweep,
              checkpoint=None if args.dry_run else lambda out: emit(out, args), knobs=args.knobs,
              sweep_m=args.dense_widths if args.one_row else None)
    emit(res, args)
    return res


def emit(res: dict, args) -> None:
    """The result JSON: printed under --dry-run, else written to --out."""
    text = json.dumps(res, indent=1)
    if args.dry_run:
        print(text)
    else:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        print(f"wrote {args.out}")


def timer(dev: str):
    """fn -> microseconds per call of fn (fn makes `calls` calls)."""
    import torch
    if dev == "cpu":
        def cpu(fn, calls):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) / calls * 1e6
        return cpu
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from kernel_bench import time_graph

    def cuda(fn, calls):
        torch.cuda.synchronize()
        return time_graph(fn, reps=20, repeats=9) / calls
    return cuda


def run(dev, dense, decode, prefill, experts, sweep: bool = True, checkpoint=None, knobs=None, sweep_m=None) -> dict:
    """The rows (module docstring); `checkpoint(out)`, when given, after each group of rows, so
    a run cut by its time limit keeps what it measured; `experts` None: the dense rows only;
    `knobs`: the dense decode sweep's list instead of DECODE_SWEEP; `sweep_m`: its widths instead
    of SWEEP_M."""
    import torch

    import custom_ops  # noqa: F401
    import custom_ops.triton  # noqa: F401  (registers the CUDA impls)
    from custom_ops.triton import triton_fp8_act_quant, triton_fp8_block_gemm, triton_fp8_linear
    from tests.kernel_cases import fp8_gemm_case

    timed = timer(dev)
    g = torch.Generator().manual_seed(0)
    copy_rate, read_rate = measure_copy(dev, timed), measure_read(dev, timed)
    fp8_peak, bf16_peak = measure_peaks(dev, timed, 256 if dev == "cpu" else 8192)
    out = {**header(dev, copy_rate, read_rate), "fp8_peak_TFLOPs": fp8_peak / 1e12,
           "bf16_peak_TFLOPs": bf16_peak / 1e12, "dense": [], "experts": [], "sweep": []}
    sweep_m = () if not sweep else (1,) if dev == "cpu" else sweep_m or SWEEP_M
    dense_sweep, expert_sweep = (DECODE_SWEEP[:1], EXPERT_SWEEP[-1:]) if dev == "cpu" else (DECODE_SWEEP, EXPERT_SWEEP)
    dense_sweep = knobs if knobs is not None else dense_sweep
    prefill_sweep = () if not sweep else PREFILL_SWEEP[-1:] if dev == "cpu" else PREFILL_SWEEP
    expert_prefill_sweep = () if not sweep else EXPERT_PREFILL_SWEEP[:1] if dev == "cpu" else EXPERT_PREFILL_SWEEP
    budget = 256 * 2**20 if dev == "cuda" else 1
    for name, (N, K) in dense.items():
        for M in decode + prefill:
            xq, xs, w, ws = fp8_gemm_case(g, M, N, K, device=dev)
            wbytes = w.nbytes + ws.nbytes
            copies = max(1, min(8, math.ceil(budget / wbytes)))
            ws_ = [(w.clone(), ws.clone()) for _ in range(copies)]
            o = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
            us = timed(lambda: [triton_fp8_block_gemm(xq, xs, a, b, o) for a, b in ws_], copies)
            xb = (xq.float() * xs.repeat_interleave(32, -1)).bfloat16()
            wb = [a.float().bfloat16() for a, _ in ws_]
            us_bf16 = timed(lambda: [torch.mm(xb, b.T, out=o) for b in wb], copies)
            row = case_row(name, M, N, K, us, wbytes, copy_rate, fp8_peak)
            if M in decode:     # from bf16 x: the act quant inside the GEMM (fp8_linear) or before it
                row["linear_us"] = timed(lambda: [triton_fp8_linear(xb, a, b, o) for a, b in ws_], copies)
                row["quant_then_gemm_us"] = timed(lambda: [(triton_fp8_act_quant(xb, xq, xs),
                                                            triton_fp8_block_gemm(xq, xs, a, b, o))
                                                           for a, b in ws_], copies)
            for kw in dense_sweep if M in sweep_m else prefill_sweep if M in prefill[:1] else ():
                t = variant(timed, lambda: [triton_fp8_block_gemm(xq, xs, a, b, o, **kw) for a, b in ws_], copies)
                srow = {**case_row(name, M, N, K, t, wbytes, copy_rate, fp8_peak), "knobs": kw}
                if M in decode:
                    srow["linear_us"] = variant(timed, lambda: [triton_fp8_linear(xb, a, b, o, **kw) for a, b in ws_],
                                                copies)
                out["sweep"].append(srow)
            row.update(cublas_bf16_us=us_bf16, cublas_bf16_pct_copy=100 * 2 * N * K / (us_bf16 * 1e-6) / copy_rate)
            if M in prefill:
                one = torch.ones((), dtype=torch.float32, device=dev)
                row["scaled_mm_us"] = timed(lambda: torch._scaled_mm(xq, w.T, scale_a=one, scale_b=one,
                                                                     out_dtype=torch.bfloat16), 1)
            out["dense"].append(row)
        if checkpoint:
            checkpoint(out)
    if experts is not None:
        other_rows(out, dev, g, timed, decode, prefill, experts, sweep_m, expert_sweep, expert_prefill_sweep,
                   copy_rate, fp8_peak, budget, checkpoint)
    read_shares(out, read_rate)
    return out


def header(dev, copy_rate, read_rate) -> dict:
    """The result's device, versions, date and measured copy and read rates."""
    import torch
    return {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)",
            "torch": torch.__version__, "triton": __import__("triton").__version__,
            "date": datetime.date.today().isoformat(), "copy_rate_TBps": copy_rate / 1e12,
            "read_rate_TBps": read_rate / 1e12}


def read_shares(out, read_rate) -> None:
    """Each row's share of the read-only ceiling too (and cuBLAS's where timed)."""
    for row in out.get("dense", []) + out["experts"] + out["sweep"]:
        row["pct_read"] = 100 * row["weight_TBps"] * 1e12 / read_rate
        if "cublas_bf16_us" in row:
            row["cublas_bf16_pct_read"] = 100 * 2 * row["N"] * row["K"] / (row["cublas_bf16_us"] * 1e-6) / read_rate


def other_rows(out, dev, g, timed, decode, prefill, experts, sweep_m, expert_sweep, expert_prefill_sweep, copy_rate,
               fp8_peak, budget, checkpoint) -> None:
    """wo_a's rows, the experts' (Flash's, with their sweeps) and flash-slice's expert paths."""
    from custom_ops.triton import triton_moe_experts_w4a8
    wo_a_rows(out, dev, g, timed, decode, copy_rate, fp8_peak, budget, small=dev == "cpu")
    if checkpoint:
        checkpoint(out)
    E, k, D, I = experts
    weights, per_expert = expert_weights(E, D, I, dev)
    for T in decode + prefill:
        x, ids, wts, o, hit = expert_inputs(g, T, E, k, D, dev)

        def row(us):
            return case_row("experts_w4a8", T, 3 * I, D, us, hit * per_expert, copy_rate, fp8_peak,
                            flops=2 * 3 * T * k * D * I)
        us = timed(lambda: triton_moe_experts_w4a8(x, ids, wts, *weights, 10.0, o), 1)
        out["experts"].append({**row(us), "experts_hit": hit})
        for kw in expert_sweep if T in sweep_m else expert_prefill_sweep if T == prefill[0] else ():
            t = variant(timed, lambda: experts_call(x, ids, wts, *weights, o, **kw), 1)
            out["sweep"].append({**row(t), "knobs": kw})
    if checkpoint:
        checkpoint(out)
    slice_expert_rows(out, dev, g, timed, (4, 2, 64, 64) if dev == "cpu" else SLICE_EXPERTS, copy_rate, fp8_peak)


def slice_expert_rows(out, dev, g, timed, experts, copy_rate, fp8_peak, tiles_sweep=(), checkpoint=None,
                      widths=SLICE_WIDTHS) -> None:
    """flash-slice's experts (16, top-6) at `widths` (the CPU's dry run: 1 and 6 tokens),
    each path in turn at each width ('gemv', 'mma', 'tiles' with `tile_knobs`, and past one token
    'mma' a pair a program): with 16 experts a verify step's rows reach most of them. Rows in
    out["experts"] with "path" and "experts" set; each of `tiles_sweep`'s knobs (on the 'tiles'
    path unless they name one) in out["sweep"]."""
    E, k, D, I = experts
    weights, per_expert = expert_weights(E, D, I, dev)
    for T in ((1, 6) if dev == "cpu" else widths):
        x, ids, wts, o, hit = expert_inputs(g, T, E, k, D, dev)

        def row(**kw):
            us = variant(timed, lambda: experts_call(x, ids, wts, *weights, o, **kw), 1)
            return {**case_row("experts_w4a8", T, 3 * I, D, us, hit * per_expert, copy_rate, fp8_peak,
                               flops=2 * 3 * T * k * D * I), "experts": E, "experts_hit": hit, "path": kw["path"]}
        out["experts"] += [row(path=p) for p in ("gemv", "mma", "tiles")]
        if T > 1:       # the tensor-core GEMVs a program a pair, as the CUDA-core ones
            out["experts"].append({**row(path="mma", mma_cols=1), "mma_cols": 1})
        out["sweep"] += [{**row(**{"path": "tiles", **kw}), "knobs": {"path": "tiles", **kw}} for kw in tiles_sweep]
        if checkpoint:
            checkpoint(out)


def slice_experts_run(dev, checkpoint=None, sweep: bool = True, knobs=None, widths=SLICE_WIDTHS) -> dict:
    """--slice-experts: the copy and read rates, then `slice_expert_rows` with SLICE_TILES_SWEEP
    or `knobs` (--dry-run: tiny experts, the first two; --no-sweep: none) at `widths`."""
    import torch
    timed = timer(dev)
    g = torch.Generator().manual_seed(0)
    copy_rate, read_rate = measure_copy(dev, timed), measure_read(dev, timed)
    out = {**header(dev, copy_rate, read_rate), "experts": [], "sweep": []}
    cpu = dev == "cpu"
    knobs = knobs if knobs is not None else SLICE_TILES_SWEEP
    knobs = (knobs[:2] if cpu else knobs) if sweep else ()
    slice_expert_rows(out, dev, g, timed, (4, 2, 64, 64) if cpu else SLICE_EXPERTS, copy_rate, None, knobs, checkpoint,
                      widths)
    read_shares(out, read_rate)
    return out


def wo_a_rows(out, dev, g, timed, widths, copy_rate, fp8_peak, budget, small: bool) -> None:
    """wo_a's 8 output groups (R = 1024 rows of K = 4096 each; --dry-run: 2 of 32 x 64) at
    decode widths: one grouped `fp8_block_gemm` call against a call per group on its slices,
    in the same run."""
    import torch
    from custom_ops.triton import triton_fp8_block_gemm
    from tests.kernel_cases import fp8_grouped_case
    G, R, K = (2, 32, 64) if small else WO_A
    for M in widths:
        xq, xs, w, ws = fp8_grouped_case(g, M, G, R, K, device=dev)
        wbytes = w.nbytes + ws.nbytes
        copies = max(1, min(8, math.ceil(budget / wbytes)))
        ws_ = [(w.clone(), ws.clone()) for _ in range(copies)]
        o = torch.empty(M, G * R, dtype=torch.bfloat16, device=dev)
        xg = [(xq[:, i * K:(i + 1) * K].contiguous(), xs[:, i * K // 32:(i + 1) * K // 32].contiguous())
              for i in range(G)]

        def per_group(a, b):
            for i, (q, s) in enumerate(xg):
                triton_fp8_block_gemm(q, s, a[i * R:(i + 1) * R], b[i * R // 32:(i + 1) * R // 32],
                                      o[:, i * R:(i + 1) * R])
        for name, fn in (("wo_a_grouped", lambda a, b: triton_fp8_block_gemm(xq, xs, a, b, o, G)),
                         ("wo_a_per_group", per_group)):
            us = timed(lambda: [fn(a, b) for a, b in ws_], copies)
            out["dense"].append({**case_row(name, M, G * R, K, us, wbytes, copy_rate, fp8_peak), "groups": G})


def variant(timed, fn, calls) -> float:
    """timed(fn, calls), or NaN where the tile variant does not fit the SM (Triton's
    OutOfResources: shared memory or registers)."""
    from triton.runtime.errors import OutOfResources
    try:
        return timed(fn, calls)
    except OutOfResources:
        return float("nan")


def experts_call(x, ids, wts, w1, s1, w3, s3, w2, s2, out, *, path: str | None = None, **knobs) -> None:
    """The op with knobs (its GEMVs), or with a path ("gemv", "mma", "tiles") that path whatever
    the width."""
    from custom_ops.triton import triton_moe_experts_w4a8
    triton_moe_experts_w4a8(x, ids, wts, w1, s1, w3, s3, w2, s2, 10.0, out, path=path, **knobs)


def expert_weights(E: int, D: int, I: int, dev) -> tuple:
    """((w1, s1, w3, s3, w2, s2) random native experts of hidden size D and width I, the bytes
    of one expert's codes and scales)."""
    (w1, s1), (w3, s3), (w2, s2) = experts_native(E, I, D, dev), experts_native(E, I, D, dev), \
        experts_native(E, D, I, dev)
    ws = (w1, s1, w3, s3, w2, s2)
    return ws, sum(t.nbytes for t in ws) // E


def expert_inputs(g, T: int, E: int, k: int, D: int, dev) -> tuple:
    """(x [T, D] bf16, top-k ids and weights (ragged groups), an FP32 output, the experts hit)."""
    import torch
    from tests.kernel_cases import w4a8_case
    _, ids, wts = (t.to(dev) for t in w4a8_case(g, T, E, 32, 32, k, pad_token=False)[:3])
    x = torch.randn(T, D, device=dev, dtype=torch.bfloat16)
    return x, ids, wts, torch.empty(T, D, dtype=torch.float32, device=dev), int(torch.unique(ids[ids >= 0]).numel())


def experts_native(E: int, n: int, k: int, dev):
    """Random packed FP4 experts [E, n, k/2] and E8M0 scales [E, n, k/32] (2^-4..2^-1), made on
    the device: Flash's experts are 9 GB in FP4, too many to quantize on the host."""
    import torch
    packed = torch.randint(-128, 128, (E, n, k // 2), dtype=torch.int8, device=dev)
    scale = torch.randint(123, 127, (E, n, k // 32), dtype=torch.uint8, device=dev)
    return packed, scale.view(torch.float8_e8m0fnu)


def case_row(name, M, N, K, us, wbytes, copy_rate, fp8_peak, flops=None) -> dict:
    """A case's figures; `fp8_peak` None (not measured): no share of it."""
    flops = flops if flops is not None else 2 * M * N * K
    rate = wbytes / (us * 1e-6)
    row = {"gemm": name, "M": M, "N": N, "K": K, "us": us, "weight_bytes": wbytes,
           "weight_TBps": rate / 1e12, "pct_copy": 100 * rate / copy_rate, "TFLOPs": flops / (us * 1e-6) / 1e12}
    if fp8_peak is not None:
        row["pct_fp8_peak"] = 100 * flops / (us * 1e-6) / fp8_peak
    return row


def measure_copy(dev, timed) -> float:
    """Bytes read + written per second by a device-to-device copy of 2 GiB (1 MiB dry run), in
    8-byte elements: a uint8 copy ran at 2.78 TB/s on the H200, under what cuBLAS read its weights at."""
    import torch
    n = (2**31 if dev == "cuda" else 2**20) // 8
    a, b = torch.empty(n, dtype=torch.int64, device=dev), torch.empty(n, dtype=torch.int64, device=dev)
    return 2 * 8 * n / (timed(lambda: b.copy_(a), 1) * 1e-6)


def measure_read(dev, timed) -> float:
    """Bytes read per second by a sum over 2 GiB of FP32 (1 MiB dry run): the read-only ceiling
    a weight-streaming GEMM can approach."""
    import torch
    a = torch.ones((2**31 if dev == "cuda" else 2**20) // 4, device=dev)
    r = torch.empty((), device=dev)
    return a.nbytes / (timed(lambda: torch.sum(a, 0, out=r), 1) * 1e-6)


def measure_peaks(dev, timed, n: int):
    """(FP8 FLOP/s of torch._scaled_mm, bf16 FLOP/s of torch.mm) on n x n x n."""
    import torch
    a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
    one = torch.ones((), dtype=torch.float32, device=dev)
    fp8 = timed(lambda: torch._scaled_mm(a, b.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 1)
    ab, bb = a.bfloat16(), b.bfloat16()
    bf16 = timed(lambda: torch.mm(ab, bb.T), 1)
    return 2 * n**3 / (fp8 * 1e-6), 2 * n**3 / (bf16 * 1e-6)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
