"""The Triton impls against the reference impls on CUDA at Flash shapes (run on the H200 with
`pytest -m gpu tests/test_kernels_gpu.py`): BF16 attention with H=64, d=512, W=128, K=512;
index scoring with 32 heads x 128 dims in both plane formats, ratio 1 and 2, candidates of
2048 blocks x 8 rows; decode T = 1..64 and prefill T = 4096. Fresh random inputs every run.

Index selections are compared robustly: the Triton scorer sums in another order than torch, so
rows whose FP32 scores differ by a rounding step may trade places at the k-th boundary. Each
token must select the same number of rows, all visible (and inside its candidates), ascending
and distinct; the FP64 scores of the two selections must have the same sum (to rounding), and
almost every selected row must be the same.
"""
from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import require_compiled_kernels

pytestmark = pytest.mark.gpu

require_compiled_kernels()

import custom_ops  # noqa: E402,F401
import custom_ops.triton  # noqa: E402,F401  (registers the CUDA impls)
from custom_ops import attention as ref_attn  # noqa: E402
from custom_ops import cache as ref_cache  # noqa: E402
from custom_ops import compressor as ref_comp  # noqa: E402
from custom_ops import index as ref_index  # noqa: E402
from custom_ops import registry  # noqa: E402
from custom_ops.triton.attention import triton_sparse_attn  # noqa: E402
from v41 import quant  # noqa: E402
from tests.kernel_cases import (device_generator, index_plane, make_step,  # noqa: E402
                                random_candidates, random_topk, rel)

DEV = "cuda"
H, D, W, K, PAGE = 64, 512, 128, 512, 128
IH, ID, C, CB = 32, 128, 2048, 8
DECODE_T = [1, 2, 5, 16, 64]
PREFILL_T = 4096
PREFILL_NEW = [1500, 1000, 1024, 565]         # + padding rows up to PREFILL_T
DECODE_MAX_START, PREFILL_MAX_START = 24000, 20000


def _step(g, T, decode):
    # contexts past C*CB = 16384 rows somewhere, so the candidate level selects for real
    if decode:
        return make_step(g, n_req=T, max_new=1, max_start=DECODE_MAX_START, W=W, page=PAGE, n_slots=T + 3,
                         decode=True, pad_tokens=2, pad_reqs=1, device=DEV)
    # a ragged prefill of PREFILL_T rows: 4 requests with cached prefixes, then padding rows
    return make_step(g, n_req=len(PREFILL_NEW), max_new=0, max_start=PREFILL_MAX_START, W=W, page=PAGE,
                     n_slots=6, new_tokens=PREFILL_NEW, pad_tokens=PREFILL_T - sum(PREFILL_NEW),
                     pad_reqs=1, device=DEV)


def _rand(g, *shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=device_generator(g, DEV), device=DEV).to(dtype)


# ---- sparse_attn ---------------------------------------------------------------------------
def _attn_case(g, T, ratio, decode):
    step = _step(g, T, decode)
    T = step.T
    q, kv = _rand(g, T, H, D), _rand(g, T, D)
    ring, sink = _rand(g, step.n_ring, D), torch.randn(H, generator=g).to(DEV)
    if ratio:
        rpp = PAGE // ratio
        pool, topk = _rand(g, step.num_pages * rpp, D), random_topk(g, step, ratio, K, holes=0.02)
    else:
        rpp, pool, topk = 1, None, None
    args = (q, kv, ring, step.win_idx, pool, topk, step.block_table, step.batch_ids, max(ratio, 1),
            rpp, sink, D ** -0.5)
    ref = torch.empty(T, H, D, dtype=torch.bfloat16, device=DEV)
    for s in range(0, T, 256):     # the reference gathers [t, W+K, D] in FP32: bound its memory
        sl = slice(s, s + 256)
        a = list(args)
        a[0], a[3], a[7] = q[sl], step.win_idx[sl], step.batch_ids[sl]
        if ratio:
            a[5] = topk[sl]
        ref_attn.sparse_attn(*a, ref[sl])
    return step, args, ref


@pytest.mark.parametrize("ratio", [0, 1, 2])
@pytest.mark.parametrize("T", DECODE_T)
def test_sparse_attn_decode(g, T, ratio):
    step, args, ref = _attn_case(g, T, ratio, decode=True)
    for kw in ({}, {"split_k": 1}, {"split_k": 7}):
        out = torch.full_like(ref, float("nan"))
        triton_sparse_attn(*args, out, **kw)
        assert not out.isnan().any(), kw
        assert rel(out, ref) < 1e-2, (kw, rel(out, ref))
        assert (out[step.batch_ids < 0] == 0).all()
    out = torch.full_like(ref, float("nan"))
    torch.ops.v41.sparse_attn(*args, out)                   # through the registered CUDA impl
    assert rel(out, ref) < 1e-2


@pytest.mark.parametrize("ratio", [1, 2])
def test_sparse_attn_prefill(g, ratio):
    step, args, ref = _attn_case(g, PREFILL_T, ratio, decode=False)
    out = torch.full_like(ref, float("nan"))
    torch.ops.v41.sparse_attn(*args, out)
    assert not out.isnan().any()
    assert rel(out, ref) < 1e-2, rel(out, ref)
    assert (out[step.batch_ids < 0] == 0).all()


# ---- index_topk ----------------------------------------------------------------------------
def _scores64(q, w, plane, pscale, step, ratio, rpp, fmt, rows):
    """FP64 score of owner rows `rows` [T, n] (-1 -> nan) of each token."""
    qr = q.double()
    out = torch.full(rows.shape, float("nan"), dtype=torch.float64, device=DEV)
    chunk = max(1, (1 << 25) // (rows.shape[1] * ID))
    for s in range(0, rows.shape[0], chunk):
        sl = slice(s, s + chunk)
        r = rows[sl]
        prow = ref_index.owner_rows(r.clamp(min=0), step.block_table, step.batch_ids[sl], ratio, rpp)
        keys = ref_index.dequant_plane(plane, pscale, prow, fmt, torch.float64)
        sc = (torch.einsum("thd,tjd->thj", qr[sl], keys).relu() * w[sl, :, None].double()).sum(1)
        out[sl] = torch.where(r >= 0, sc, float("nan"))
    return out


def _check_selection(sel, ref, score_of, vis, row_ok=None):
    """`sel` and `ref` [T, k] ascending -1-padded selections, compared up to near-ties."""
    n_sel, n_ref = (sel >= 0).sum(1), (ref >= 0).sum(1)
    assert torch.equal(n_sel, n_ref), "different number of selected rows"
    valid = sel >= 0
    # -1 padding is a suffix, entries ascending and distinct, all visible
    assert torch.equal(valid, torch.arange(sel.shape[1], device=DEV)[None, :] < n_sel[:, None])
    s = torch.where(valid, sel, torch.iinfo(torch.long).max)
    assert (s[:, 1:] > s[:, :-1]).logical_or(~valid[:, 1:]).all(), "not ascending/distinct"
    assert (sel < vis[:, None]).logical_or(~valid).all(), "row not visible"
    if row_ok is not None:
        assert row_ok(sel).logical_or(~valid).all(), "row outside the candidates"
    a, b = score_of(sel), score_of(ref)
    sa, sb = a.nan_to_num(0).sum(1), b.nan_to_num(0).sum(1)
    mag = b.nan_to_num(0).abs().sum(1) + 1e-30
    assert ((sa - sb).abs() <= 1e-5 * mag).all(), float(((sa - sb).abs() / mag).max())
    big = torch.iinfo(torch.long).max
    rs = torch.where(ref >= 0, ref, big)                       # ascending, padding last
    at = torch.searchsorted(rs, torch.where(valid, sel, big - 1)).clamp(max=rs.shape[1] - 1)
    same = (rs.gather(1, at) == sel) & valid                   # selected by both
    assert int(same.sum()) >= 0.99 * int(valid.sum()), (int(same.sum()), int(valid.sum()))


def _index_case(g, T, ratio, fmt, decode):
    step = _step(g, T, decode)
    T, rpp = step.T, PAGE // ratio
    plane, pscale = index_plane(g, step.num_pages * rpp, ID, fmt, device=DEV, ties=False)
    q = quant.index_query_qat(_rand(g, T, IH, ID), fmt)         # as the model hands it to the op
    w = (torch.randn(T, IH, generator=g) / 64).to(DEV)
    return step, q, w, plane, pscale, rpp


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("ratio", [1, 2])
@pytest.mark.parametrize("T", DECODE_T + [PREFILL_T])
def test_index_topk(g, T, ratio, fmt):
    decode = T != PREFILL_T
    step, q, w, plane, pscale, rpp = _index_case(g, T, ratio, fmt, decode)
    T, vis = step.T, step.vis(ratio)
    base = (q, w, plane, pscale, step.block_table, step.batch_ids, step.positions, ratio, rpp, fmt)
    score_of = lambda rows: _scores64(q, w, plane, pscale, step, ratio, rpp, fmt, rows)  # noqa: E731

    # FULL scoring + the candidate producer
    ref, ref_c = (torch.empty(T, n, dtype=torch.long, device=DEV) for n in (K, C))
    ref_index.index_topk(*base, None, CB, ref, ref_c)
    out, out_c = (torch.full((T, n), -7, dtype=torch.long, device=DEV) for n in (K, C))
    torch.ops.v41.index_topk(*base, None, CB, out, out_c)
    _check_selection(out, ref, score_of, vis)
    # candidate blocks: same count, the newest block kept, block-max scores of the same sum
    nb_vis = (vis + CB - 1) // CB

    def block_score(blocks):
        rows = blocks[..., None] * CB + torch.arange(CB, device=DEV)
        rows = torch.where((blocks[..., None] >= 0) & (rows < vis[:, None, None]), rows, -1)
        sc = score_of(rows.flatten(1)).view(rows.shape).nan_to_num(float("-inf")).amax(-1)
        newest = blocks == (vis[:, None] - 1) // CB
        return torch.where(newest | (blocks < 0), float("nan"), sc)

    _check_selection(out_c, ref_c, block_score, nb_vis)
    has = vis > 0
    assert (out_c == ((vis - 1) // CB)[:, None]).any(1)[has].all(), "newest block dropped"

    # REINDEX scoring inside random candidate blocks
    cand = random_candidates(g, step, ratio, C, CB)
    ref = torch.empty(T, K, dtype=torch.long, device=DEV)
    ref_index.index_topk(*base, cand, CB, ref, None)
    out = torch.full((T, K), -7, dtype=torch.long, device=DEV)
    torch.ops.v41.index_topk(*base, cand, CB, out, None)

    def in_cand(rows):
        return ((rows // CB)[:, :, None] == cand[:, None, :]).any(-1)

    _check_selection(out, ref, score_of, vis, in_cand)


def test_index_topk_capturable_width(g):
    """static_width (the CUDA-graph path) selects what the data-dependent width selects."""
    from custom_ops.triton.index import triton_index_topk
    step, q, w, plane, pscale, rpp = _index_case(g, 16, 1, "fp8", True)
    base = (q, w, plane, pscale, step.block_table, step.batch_ids, step.positions, 1, rpp, "fp8",
            None, CB)
    a, ac = (torch.empty(step.T, n, dtype=torch.long, device=DEV) for n in (K, C))
    b, bc = (torch.empty(step.T, n, dtype=torch.long, device=DEV) for n in (K, C))
    triton_index_topk(*base, a, ac)
    triton_index_topk(*base, b, bc, static_width=True)
    assert torch.equal(a, b) and torch.equal(ac, bc)


@pytest.mark.parametrize("w,row_max", [(30000, None), (40000, None), (3000, 1)])
def test_select_into_equals_the_stable_sort(g, w, row_max):
    """The selection alone, on the reference's own scores: exactly the stable sort's rows (ties
    smaller column first, -inf never, +inf first, -0.0 equal to +0.0, fewer finite than k), one
    program a row up to ROW_SELECT_MAX columns, the chunked passes past it or when forced."""
    from custom_ops.triton.index import select_into
    n, k = 6, K
    gd = device_generator(g, DEV)
    score = torch.randint(-40, 40, (n, w), generator=gd, device=DEV).float() * 0.25     # ties
    score[0] = torch.randn(w, generator=gd, device=DEV)
    score[1, 300:] = float("-inf")                                                     # 300 finite < k
    score[2, ::7] = float("inf")
    score[3] = torch.where(score[3] > 0, 0.0, -0.0)
    score[4, w // 2:] = float("-inf")
    order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :k]
    ref = torch.where(score.gather(1, order) > float("-inf"), order, -1)
    ref = torch.where(ref >= 0, ref, w + 1).sort(1).values
    ref = torch.where(ref == w + 1, -1, ref)
    out = torch.full((n, k), -1, dtype=torch.long, device=DEV)
    select_into(score, out, row_max=row_max)
    assert torch.equal(out, ref)


# ---- the MoE pairs' grouping kernel ----------------------------------------------------------
@pytest.mark.parametrize("T,E", [(1, 384), (16, 16), (64, 384), (96, 16), (256, 384), (512, 16)])
def test_expert_tiles_kernel_equals_the_torch_ops(g, T, E):
    """moe_tiles' grouping kernel (its programs running concurrently, as only a GPU does) gives
    the stable sort's order and the searchsorted tile table bit for bit, top-6 routing with a
    fifth of the slots padding, at decode and DSpark verify widths (6-3,072 pairs)."""
    from custom_ops.triton import moe_tiles
    ids = torch.rand(T, E, generator=g).argsort(dim=1)[:, :6].int()
    ids[torch.rand(T, 6, generator=g) < 0.2] = -1
    ids = ids.to(DEV)
    fused = moe_tiles.expert_tiles(ids, E, 8, fused=True)
    ops = moe_tiles.expert_tiles(ids, E, 8, fused=False)
    assert fused[2] == ops[2]
    assert torch.equal(fused[0], ops[0]) and torch.equal(fused[1], ops[1])


# ---- scatter_rows, compress_pool -------------------------------------------------------------
@pytest.mark.parametrize("kind", ["bf16", "fp8", "scale", "e8m0"])
def test_scatter_rows(g, kind):
    N, T = 20000, 4096
    shapes = {"bf16": (D,), "fp8": (ID,), "scale": (), "e8m0": (ID // 32,)}[kind]
    if kind == "bf16":
        dst, rows = _rand(g, N, *shapes), _rand(g, T, *shapes)
    elif kind == "fp8":
        dst = _rand(g, N, *shapes, dtype=torch.float32).to(torch.float8_e4m3fn)
        rows = _rand(g, T, *shapes, dtype=torch.float32).to(torch.float8_e4m3fn)
    elif kind == "scale":
        dst, rows = _rand(g, N, dtype=torch.float32), _rand(g, T, dtype=torch.float32)
    else:
        e8m0 = torch.float8_e8m0fnu
        dst = torch.randint(0, 255, (N, *shapes), generator=g, dtype=torch.uint8).to(DEV).view(e8m0)
        rows = torch.randint(0, 255, (T, *shapes), generator=g, dtype=torch.uint8).to(DEV).view(e8m0)
    dest = torch.randperm(N, generator=g)[:T]
    dest[torch.rand(T, generator=g) < 0.2] = -1
    dest = dest.to(DEV)
    ref = dst.clone()
    ref_cache.scatter_rows(ref, rows, dest)
    torch.ops.v41.scatter_rows(dst, rows, dest)
    assert torch.equal(dst.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("T", [1, 64, PREFILL_T])
def test_compress_pool(g, T):
    step = _step(g, T, T < PREFILL_T)
    T, slots = step.T, len(step.starts) + 3
    slot_of = torch.randperm(slots, generator=g)[: len(step.starts)]
    src, dst = torch.full((T,), -1), torch.full((T,), -1)
    t = 0
    for i, (s, n) in enumerate(zip(step.starts, step.n_new)):
        if s % 2 == 1:
            src[t] = slot_of[i]
        if (s + n - 1) % 2 == 0:
            dst[t + n - 1] = slot_of[i]
        t += n
    src, dst = src.to(DEV), dst.to(DEV)
    v, gg = _rand(g, T, D, dtype=torch.float32), _rand(g, T, D, dtype=torch.float32) * 3
    tv, tg = _rand(g, slots, D, dtype=torch.float32), _rand(g, slots, D, dtype=torch.float32)
    rtv, rtg, ref = tv.clone(), tg.clone(), torch.empty(T, D, device=DEV)
    ref_comp.compress_pool(v, gg, step.positions, step.batch_ids, src, dst, rtv, rtg, ref)
    out = torch.full((T, D), float("nan"), device=DEV)
    torch.ops.v41.compress_pool(v, gg, step.positions, step.batch_ids, src, dst, tv, tg, out)
    assert rel(out, ref) < 1e-5
    assert torch.equal(tv, rtv) and torch.equal(tg, rtg)


def test_selected():
    sel = registry.log_selected("cuda")
    for name in ("sparse_attn", "index_topk", "scatter_rows", "compress_pool"):
        assert sel[f"v41::{name}"]["cuda"] == "triton"
