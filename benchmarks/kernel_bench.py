"""Per-kernel timings on a GPU against the floor of the bytes each call must move (Flash shapes,
bf16): v41::sparse_attn (decode 1/16/64 tokens, prefill 4096) and v41::index_topk (`--norm`: the
norms, one pass against chunks; `--mhc`:
v41::mhc_mix alone; `--wo-a`: v41::inv_rope_wo_a alone, split-K and tile variants; `--lm-head`: the
LM head at the row counts of decode and DSpark steps, bf16 and FP32, cuBLAS and common.skinny_gemm; `--grouping`:
the MoE pairs' grouping by expert, its kernel against the torch ops). Each call is
captured in a CUDA graph and replayed; CUDA events around 50 replays, median of 15 repeats.

    python benchmarks/kernel_bench.py --out benchmarks/results/kernels-h200.json

`--sweep` also times the decode cases of sparse_attn over a grid of tile sizes and launch
options (the wrapper's keyword knobs), to pick defaults from measurements. `--breakdown` splits
the decode sparse_attn time into its parts: the compiled kernel's registers and spills, the
same row gather alone (a sum of the rows, no dots: the access pattern's bandwidth), and the
same two dots on cuBLAS with each token's keys dense (the FLOPs without the gather).
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import statistics

import torch
import triton
import triton.language as tl

import custom_ops  # noqa: F401
import custom_ops.triton  # noqa: F401  (registers the CUDA impls)
from custom_ops.triton import triton_sparse_attn
from custom_ops.triton.attention import _sparse_attn_kernel, split_for
from tests.kernel_cases import index_plane, make_step, random_topk
from v41 import quant

H, D, W, K, PAGE, DI, HI = 64, 512, 128, 512, 128, 128, 32
COPY_BW = 4.24e12   # measured device-to-device copy on this H200 (DESIGN.md §9)


def floor_us(nbytes: int) -> float:
    """Microseconds to move `nbytes` at the measured copy bandwidth."""
    return nbytes / COPY_BW * 1e6


def attn_tflops(n_keys: int, us: float) -> float:
    """TFLOP/s of sparse_attn's two dots (S = Q·Kᵀ, then P·V) over `n_keys` (token, key) pairs."""
    return round(4 * n_keys * H * D / us / 1e6, 1)
SWEEP = {"block_h": (16, 32, 64), "block_n": (16, 32, 64), "num_warps": (4, 8), "num_stages": (1, 2, 3)}


def time_graph(fn, reps=50, repeats=15) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / reps * 1e3)
    return statistics.median(ts)


def attn_case(gen, T, decode):
    dev = "cuda"
    if decode:
        step = make_step(gen, n_req=T, max_new=1, max_start=20000, W=W, page=PAGE, n_slots=T + 1, decode=True,
                         device=dev)
    else:
        step = make_step(gen, n_req=2, max_new=0, max_start=4000, W=W, page=PAGE, n_slots=3,
                         new_tokens=[2048, 2048], device=dev)
    T = step.T
    rn = lambda *s: torch.randn(*s, device=dev).to(torch.bfloat16)  # noqa: E731
    q, kv, ring = rn(T, H, D), rn(T, D), rn(step.n_ring, D)
    pool, topk = rn(step.num_pages * PAGE, D), random_topk(gen, step, 1, K, holes=0.0).to(dev)
    sink = torch.randn(H, device=dev)
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device=dev)
    args = (q, kv, ring, step.win_idx, pool, topk, step.block_table, step.batch_ids, 1, PAGE, sink, D ** -0.5, out)
    valid = int((step.win_idx >= 0).sum() + (topk >= 0).sum())
    nbytes = valid * D * 2 + 2 * T * H * D * 2 + step.win_idx.numel() * 8 + topk.numel() * 8
    return T, args, nbytes


def sweep_attn(gen, rows: list) -> None:
    """Decode sparse_attn over the SWEEP grid (key splits from the SM count each time)."""
    for T in (1, 16, 64):
        T, args, nbytes = attn_case(gen, T, True)
        floor = floor_us(nbytes)
        for combo in itertools.product(*SWEEP.values()):
            knobs = dict(zip(SWEEP, combo))
            row = {"kernel": "sparse_attn", "tokens": T, "decode": True, **knobs}
            try:
                us = time_graph(lambda: triton_sparse_attn(*args, **knobs))
                row.update(us=round(us, 2), frac_of_copy_bw=round(floor / us, 3))
            except Exception as e:   # a tile that does not fit (shared memory, registers)
                row["error"] = repr(e)[:200]
            rows.append(row)
            print(json.dumps(row), flush=True)


@triton.jit
def _gather_sum_kernel(ring_ptr, kv_ptr, pool_ptr, win_ptr, topk_ptr, bt_ptr, bid_ptr, out_ptr, n_ring, W, K,
                       rows_per_page,
                       blocks_per_split, stride_win, stride_topk, stride_bt,
                       D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Sum of the rows sparse_attn reads for one token (ring window, then top-k owner rows) over
    one split of its key blocks: the same gather with no dots."""
    t = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    dofs = tl.arange(0, D)
    noff = tl.arange(0, BLOCK_N)
    n_win = tl.cdiv(W, BLOCK_N)
    b0 = sp * blocks_per_split
    b1 = tl.minimum(b0 + blocks_per_split, n_win + tl.cdiv(K, BLOCK_N))
    acc = tl.zeros([D], tl.float32)
    for blk in range(b0, tl.minimum(b1, n_win)):
        n = blk * BLOCK_N + noff
        idx = tl.load(win_ptr + t * stride_win + n, mask=n < W, other=-1).to(tl.int64)
        rows = tl.where(idx < n_ring, ring_ptr + idx * D, kv_ptr + (idx - n_ring) * D)
        k = tl.load(rows[:, None] + dofs[None, :], mask=(idx >= 0)[:, None], other=0.0)
        acc += tl.sum(k.to(tl.float32), 0)
    req = tl.maximum(tl.load(bid_ptr + t), 0).to(tl.int64)
    for blk in range(tl.maximum(b0, n_win), b1):
        n = (blk - n_win) * BLOCK_N + noff
        j = tl.load(topk_ptr + t * stride_topk + n, mask=n < K, other=-1).to(tl.int64)
        jj = tl.maximum(j, 0)
        page = tl.load(bt_ptr + req * stride_bt + jj // rows_per_page, mask=j >= 0, other=0).to(tl.int64)
        k = tl.load(pool_ptr + (page * rows_per_page + jj % rows_per_page)[:, None] * D + dofs[None, :],
                    mask=(j >= 0)[:, None], other=0.0)
        acc += tl.sum(k.to(tl.float32), 0)
    tl.store(out_ptr + (t * tl.num_programs(1) + sp) * D + dofs, acc)


def compiled_meta(fn) -> list[dict]:
    """Registers, spills, warps and shared memory of each compiled specialization of `fn`."""
    out = []
    for caches in fn.device_caches.values():
        for ker in caches[0].values():
            ker._init_handles()
            out.append({"n_regs": ker.n_regs, "n_spills": ker.n_spills, "num_warps": ker.metadata.num_warps,
                        "shared_bytes": ker.metadata.shared})
    return out


def breakdown_attn(gen, rows: list, T: int = 64) -> None:
    """Where the decode sparse_attn time goes at T tokens (see the module docstring)."""
    T, args, nbytes = attn_case(gen, T, True)
    q, kv, ring, win, pool, topk, bt, bid, _, page = args[:10]

    def add(row):
        rows.append({"kernel": "sparse_attn", "tokens": T, **row})
        print(json.dumps(rows[-1]), flush=True)

    us = time_graph(lambda: triton_sparse_attn(*args))
    n_keys = int((win >= 0).sum() + (topk >= 0).sum())
    key_bytes = n_keys * D * 2
    add({"part": "whole kernel", "us": round(us, 2), "bytes": nbytes,
         "frac_of_copy_bw": round(floor_us(nbytes) / us, 3), "TFLOPs": attn_tflops(n_keys, us),
         "compiled": compiled_meta(_sparse_attn_kernel)})
    bn = 32
    n_blocks = triton.cdiv(W, bn) + triton.cdiv(K, bn)
    for n_split in dict.fromkeys((1, split_for(T, 1, n_blocks, q.device), 4, 8)):
        bps = triton.cdiv(n_blocks, n_split)
        acc = torch.empty(T, n_split, D, device="cuda")
        g = lambda: _gather_sum_kernel[(T, n_split)](ring, kv, pool, win, topk, bt, bid, acc, ring.shape[0],  # noqa: E731
                                                      W, K, page, bps,
                                                      win.stride(0), topk.stride(0), bt.stride(0), D=D, BLOCK_N=bn)
        gus = time_graph(g)
        add({"part": "row gather alone (sum of the rows)", "splits": n_split, "us": round(gus, 2),
             "key_bytes": key_bytes, "frac_of_copy_bw": round(floor_us(key_bytes) / gus, 3)})
    per_token = W + K
    kd = torch.randn(T, per_token, D, device="cuda").to(torch.bfloat16)
    s = torch.empty(T, H, per_token, device="cuda", dtype=torch.bfloat16)
    o = torch.empty(T, H, D, device="cuda", dtype=torch.bfloat16)
    dots = lambda: (torch.bmm(q, kd.transpose(1, 2), out=s), torch.bmm(s, kd, out=o))  # noqa: E731
    dus = time_graph(dots)
    add({"part": "the two dots on cuBLAS, keys dense per token (bmm)", "keys_per_token": per_token,
         "us": round(dus, 2), "TFLOPs": attn_tflops(T * per_token, dus)})


def bench_mhc(rows: list, hc: int = 4, dim: int = 5120) -> None:
    """v41::mhc_mix at Flash's widths: the default (the projection on tensor cores, fn split into
    three bf16 parts) beside the FP32-FMA projection (split_w False, the default before), the
    projection split more ways (at decode widths its default 80 splits give each program four
    64-wide K blocks in sequence, in one wave of programs: more splits, fewer blocks a program)
    and, from 2 tokens, the coefficient programs in the form the default does not take (token
    tiles, which sum the splits one load at a time, up to mhc.COEF_TOKEN_PROGRAMS tokens; one token
    a program, its splits summed as a tree, past it); twice in alternation. The floor is fn's FP32
    bytes plus X once."""
    from custom_ops.triton.mhc import COEF_BLOCK_T, coef_block_t, triton_mhc_mix
    fn = torch.randn(hc * (hc + 2), hc * dim, device="cuda") * 0.01
    base, scale = torch.randn(hc * (hc + 2), device="cuda"), torch.rand(3, device="cuda")
    for T in (1, 2, 5, 6, 16, 32, 64, 96, 512, 4096):
        X = torch.randn(T, hc, dim, device="cuda").to(torch.bfloat16)
        outs = [torch.empty(T, hc, device="cuda"), torch.empty(T, hc, device="cuda"),
                torch.empty(T, hc, hc, device="cuda")]
        nbytes = fn.nbytes + X.nbytes
        knobs = ({}, {"split_w": False}) + (({"split": 160}, {"split": 320}) if T <= 64 else ())
        if T > 1:
            knobs += ({"block_t": min(COEF_BLOCK_T, triton.next_power_of_2(T)) if coef_block_t(T) == 1 else 1},)
        cases = [({"kernel": "mhc_mix", "tokens": T, "knobs": kw or "default"},
                  lambda kw=kw: triton_mhc_mix(X, fn, base, scale, 20, 1e-6, 1e-20, *outs, **kw)) for kw in knobs]
        alternate(rows, cases, nbytes, lambda us: {})


def bench_norm(rows: list, hc: int = 4, dim: int = 5120) -> None:
    """The norms at Flash's widths, the one-pass tile (norm.py's default up to ONE_PASS_MAX,
    its warps by FEW_ROWS) beside 4 and 16 warps and beside the two passes over 1024-wide chunks: mHC's
    collapse + RMSNorm + act quant (the attention and FFN inputs, [T, 4, 5120]), the act-quant
    norm of q's 1280-wide latent and the plain bf16 norm at 5120 (the dequant engine's), twice in
    alternation; the floor is the bytes read and written."""
    from custom_ops.triton import norm
    from custom_ops.triton.norm import (triton_hc_collapse_rms_norm_act_quant, triton_rms_norm,
                                        triton_rms_norm_act_quant)

    def knobbed(fn, **knobs):
        def call():
            old = {k: getattr(norm, k) for k in knobs}
            for k, v in knobs.items():
                setattr(norm, k, v)
            try:
                fn()
            finally:
                for k, v in old.items():
                    setattr(norm, k, v)
        return call
    knobs = {"default": {}, "one_pass_4_warps": {"FEW_ROWS": 0}, "one_pass_16_warps": {"FEW_ROWS": 1 << 30},
             "chunks": {"ONE_PASS_MAX": 0}}
    for T in (1, 16, 64, 4096):
        for name, width, streams in (("hc_collapse_rms_norm_act_quant", dim, hc), ("rms_norm_act_quant", 1280, 0),
                                     ("rms_norm", dim, 0)):
            X = torch.randn(T, streams, width, device="cuda").bfloat16() if streams else \
                torch.randn(T, width, device="cuda").bfloat16()
            mix, w = torch.rand(T, hc, device="cuda"), torch.randn(width, device="cuda").bfloat16()
            out = torch.empty(T, width, dtype=torch.bfloat16, device="cuda")
            q = torch.empty(T, width, dtype=torch.float8_e4m3fn, device="cuda")
            s = torch.empty(T, width // 32, device="cuda")
            op = {"hc_collapse_rms_norm_act_quant": lambda: triton_hc_collapse_rms_norm_act_quant(X, mix, w, 1e-20,
                                                                                                out, q, s),
                  "rms_norm_act_quant": lambda: triton_rms_norm_act_quant(X, w, 1e-20, out, q, s),
                  "rms_norm": lambda: triton_rms_norm(X, w, 1e-20, out)}[name]
            nbytes = X.nbytes + w.nbytes + out.nbytes + (0 if name == "rms_norm" else q.nbytes + s.nbytes)
            cases = [({"kernel": name, "tokens": T, "knobs": k}, knobbed(op, **kw)) for k, kw in knobs.items()]
            alternate(rows, cases, nbytes, lambda us: {})


def alternate(rows: list, cases: list, nbytes: int, rate, rounds: int = 2) -> None:
    """`cases` ((a row's leading fields, the call) each) timed in turn, `rounds` times: a row
    each with its round, µs, the floor of its bytes (a case's own "bytes" field, else `nbytes`)
    and `rate(us)`'s fields, printed as it comes."""
    for r in range(rounds):
        for fields, fn in cases:
            us = time_graph(fn)
            nb = fields.get("bytes", nbytes)
            rows.append({**fields, "round": r, "us": round(us, 2), "bytes": nb,
                         "floor_us": round(floor_us(nb), 2), **rate(us)})
            print(json.dumps(rows[-1]), flush=True)


def bench_grouping(rows: list, k: int = 6, block_m: int = 8) -> None:
    """moe_tiles.expert_tiles (the pairs grouped by expert into 8-row tiles, fp4_mma's) at decode
    and DSpark verify widths, top-6 of flash-slice's 16 experts and of Flash's 384: the grouping
    kernel beside the torch ops (expert_tiles' `fused`), twice in alternation."""
    from custom_ops.triton.moe_tiles import expert_tiles
    for E in (16, 384):
        for T in (1, 16, 64, 96, 128, 256, 512):
            ids = torch.rand(T, E, device="cuda").argsort(dim=1)[:, :k].int().contiguous()
            cases = [({"kernel": "expert_tiles", "experts": E, "tokens": T, "pairs": T * k, "variant": v},
                      lambda ids=ids, E=E, v=v: expert_tiles(ids, E, block_m, fused=v == "kernel"))
                     for v in ("kernel", "torch_ops")]
            alternate(rows, cases, ids.nbytes, lambda us: {})


def bench_wo_a(rows: list, G: int = 8, R: int = 1024, I: int = 4096, d: int = 512, rot: int = 64) -> None:
    """v41::inv_rope_wo_a (bf16, Flash's wo_a: 8 groups of 1024 x 4096) at decode widths: the
    default (attn_out.split_for's split count) beside fixed counts and 128-wide K tiles, twice
    in alternation; the floor is wo_a's bytes plus o's."""
    from custom_ops.triton.attn_out import triton_inv_rope_wo_a
    wo_a = (torch.randn(G, R, I, device="cuda") * 0.02).to(torch.bfloat16)
    ang = torch.rand(8192, rot // 2, device="cuda") * 6.28
    cos, sin = ang.cos(), ang.sin()
    variants = ({}, {"split_k": 1}, {"split_k": 2}, {"split_k": 4}, {"split_k": 8}, {"split_k": 16},
                {"block_k": 128})
    for T in (1, 6, 16, 32, 64):
        o = torch.randn(T, G * I // d, d, device="cuda").to(torch.bfloat16)
        pos = torch.randint(0, 8192, (T,), device="cuda")
        out = torch.empty(T, G * R, dtype=torch.bfloat16, device="cuda")
        nbytes = wo_a.nbytes + o.nbytes
        cases = [({"kernel": "inv_rope_wo_a", "tokens": T, "knobs": kw or "default"},
                  lambda kw=kw: triton_inv_rope_wo_a(o, cos, sin, pos, wo_a, out, **kw)) for kw in variants]
        alternate(rows, cases, nbytes, lambda us: {"TBps": round(nbytes / us / 1e6, 3)})


def bench_lm_head(rows: list, V: int = 129280, D: int = 5120) -> None:
    """The LM head (Flash: [129280, 5120]) at the rows a step multiplies: plain decode (1, 16,
    64), DSpark's draft (5 a request) and verify rows (6 a request) at 1 and 16 requests, h the
    final norm's bf16 output. Held in bf16 (1.32 GB, the engine's): common.skinny_gemm (one bf16
    dot a tile, exact products, FP32 sums) at its defaults, with 4 stages and with 128-wide K
    blocks, beside cuBLAS with an FP32 output (`torch.mm(..., out_dtype=float32)`). Held in FP32
    (2.65 GB, before): cuBLAS on h widened to FP32 and skinny_gemm's three-part split. In
    alternation; each floor is its own head's bytes."""
    from custom_ops.triton.common import skinny_gemm
    head = torch.randn(V, D, device="cuda") * 0.02
    head16 = head.bfloat16()
    for M in (1, 5, 6, 16, 64, 96):
        hb = torch.randn(M, D, device="cuda").bfloat16()
        h = hb.float()
        f32, b16 = {"kernel": "lm_head", "rows": M, "bytes": head.nbytes}, {"kernel": "lm_head", "rows": M,
                                                                           "bytes": head16.nbytes}
        cases = [({**b16, "variant": "bf16_skinny"}, lambda: skinny_gemm(hb, head16, False, split=1)),
                 ({**b16, "variant": "bf16_skinny_stages4"},
                  lambda: skinny_gemm(hb, head16, False, split=1, num_stages=4)),
                 ({**b16, "variant": "bf16_skinny_k128"}, lambda: skinny_gemm(hb, head16, False, split=1, block_k=128)),
                 ({**b16, "variant": "bf16_cublas"}, lambda: torch.mm(hb, head16.T, out_dtype=torch.float32)),
                 ({**f32, "variant": "f32_cublas"}, lambda: h @ head.T),
                 ({**f32, "variant": "f32_skinny_split"}, lambda: skinny_gemm(hb, head, False, split=1))]
        alternate(rows, cases, head.nbytes, lambda us: {"TFLOPs": round(2 * M * V * D / us / 1e6, 2)})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/kernels-h200.json")
    ap.add_argument("--sweep", action="store_true", help="also sweep sparse_attn decode launch options")
    ap.add_argument("--breakdown", action="store_true", help="only the decode sparse_attn breakdown")
    ap.add_argument("--mhc", action="store_true", help="only mhc_mix: the default beside more projection splits")
    ap.add_argument("--wo-a", action="store_true", help="only inv_rope_wo_a at decode widths, split-K and tiles")
    ap.add_argument("--lm-head", action="store_true", help="only the LM head: bf16 and FP32, cuBLAS and skinny_gemm")
    ap.add_argument("--norm", action="store_true", help="only the norms: one pass (warps) against chunks")
    ap.add_argument("--grouping", action="store_true", help="only the MoE pairs' grouping: kernel against torch ops")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows = []
    if a.lm_head:
        bench_lm_head(rows)
        return save(a.out, rows)
    if a.norm:
        bench_norm(rows)
        return save(a.out, rows)
    if a.grouping:
        bench_grouping(rows)
        return save(a.out, rows)
    if a.wo_a:
        bench_wo_a(rows)
        return save(a.out, rows)
    if a.mhc:
        bench_mhc(rows)
        return save(a.out, rows)
    if a.breakdown:
        for T in (16, 64):
            breakdown_attn(gen, rows, T)
        return save(a.out, rows)
    if a.sweep:
        sweep_attn(gen, rows)
    for T, decode in ((1, True), (16, True), (64, True), (4096, False)):
        T, args, nbytes = attn_case(gen, T, decode)
        us = time_graph(lambda: torch.ops.v41.sparse_attn(*args))
        floor = floor_us(nbytes)
        rows.append({"kernel": "sparse_attn", "tokens": T, "decode": decode, "us": round(us, 2),
                     "bytes": nbytes, "floor_us": round(floor, 2), "GBps": round(nbytes / us / 1e3, 1),
                     "frac_of_copy_bw": round(floor / us, 3)})
        print(json.dumps(rows[-1]))
    for fmt in ("fp8", "fp4"):
        for T, decode in ((64, True), (4096, False)):
            step = make_step(gen, n_req=T if decode else 2, max_new=1, max_start=20000 if decode else 4000, W=W,
                             page=PAGE, n_slots=(T if decode else 2) + 1, decode=decode,
                             new_tokens=None if decode else [2048, 2048], device="cuda")
            plane, scale = index_plane(gen, step.num_pages * PAGE, DI, fmt, device="cuda", ties=False)
            q = quant.index_query_qat(torch.randn(step.T, HI, DI, device="cuda").to(torch.bfloat16), fmt)
            w = torch.randn(step.T, HI, device="cuda")
            topk = torch.empty(step.T, 512, dtype=torch.long, device="cuda")
            cand = torch.empty(step.T, 2048, dtype=torch.long, device="cuda")
            us = time_graph(lambda: torch.ops.v41.index_topk(q, w, plane, scale, step.block_table, step.batch_ids,
                                                               step.positions, 1, PAGE, fmt, None, 8, topk, cand))
            vis = int(step.vis(1).sum())
            per_row = DI + 4 if fmt == "fp8" else DI // 2 + DI // 32
            nbytes = vis * per_row
            rows.append({"kernel": "index_topk", "index_cache_dtype": fmt, "tokens": step.T, "decode": decode,
                         "us": round(us, 2), "visible_rows_scored": vis, "plane_bytes_read": nbytes,
                         "floor_us": round(floor_us(nbytes), 2), "frac_of_copy_bw": round(floor_us(nbytes) / us, 3)})
            print(json.dumps(rows[-1]))
    save(a.out, rows)


def save(path: str, rows: list) -> None:
    res = {"benchmark": "kernels", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "date": datetime.date.today().isoformat(),
           "method": "CUDA graph of one call, 50 replays between CUDA events, median of 15",
           "copy_bandwidth_Bps": COPY_BW, "results": rows}
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
