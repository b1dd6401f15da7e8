"""Triton impl of `v41::index_topk` (spec §3.3 f-h; the reference in custom_ops/index.py is the
definition).

Scoring. One scorer for every shape: a program takes one query row and one tile of BLOCK_J
columns of that row's own column list, with that row's own bound: FULL, column c is owner row c
of its request (visible while c < (p+1)//ratio); REINDEX, column c is row cand[c // B]·B + c % B
of its candidate blocks (B = cand_block). A tile past the row's bound writes -inf and loads
nothing. The program gathers the tile's key rows from the index plane in place, through the
block table (fp8: E4M3 x one FP32 row scale; fp4: packed E2M1 nibbles x E8M0 per 32 dims),
decodes them exactly into the dot dtype (BF16 on GPU, which holds every FP8/FP4 grid value,
FP32 under the interpreter), and scores score = Σ_h relu(q_h·k)·w_h in FP32 with the index
heads as the N of `tl.dot`. The query arrives on the plane format's grid (the model rounds it,
`quant.index_query_qat`; its values are exact in BF16); for fp4 its even and odd dims meet the
low and high nibbles separately, so the packed bytes are never interleaved.

Selection, on the tile's score buffer (bounded: query rows are processed in tiles of at most
SCORE_BUDGET scores). Top-k with smaller-column-first ties and no sort of the row. Rows up to
ROW_SELECT_MAX columns, one program a row in one launch: a radix select over the score's four
bytes (order-preserving uint32 keys, a 256-bin histogram a byte) finds the k-th largest key,
then a pass in column order takes every key above it and the first ones equal to it until k,
each at its rank - so the output is ascending in column order (FULL: row order; REINDEX:
candidate order, which the op's ascending candidates make row order). FULL rows read only the
columns below the token's bound, so a CUDA graph captured at the block table's width costs what
the context costs. Wider rows: the k-th largest score (torch.topk) is the threshold, and two Triton passes
over chunks of SELECT_BLOCK columns, one counting (above, equal) per chunk and, after a prefix
over the chunk counts, one writing each taken column at its slot. Level-1 candidates: block max
over the score buffer, the newest visible block forced +inf, the same selection over blocks.

Width. REINDEX scores C·B columns. FULL scores up to the longest visible prefix of the batch
(read from the device, like the reference), or - while a CUDA graph is being captured, or with
`static_width=True` - up to the block table's capacity, so nothing on the host depends on the
step's data.

Its speed at Flash shapes: docs/kernels.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops import index as _ref
from custom_ops.registry import register_impl
from custom_ops.triton.common import pdl, pdl_wait

BLOCK_J = 64                 # columns per program
NUM_WARPS = 4
SCORE_BUDGET = 1 << 24       # FP32 scores per token tile (64 MiB)
SELECT_BLOCK = 1024          # columns per program of the selection passes
ROW_SELECT_MAX = 1 << 15     # rows up to this many columns are selected one program a row


@triton.jit
def _e2m1(code):
    """FP32 values of E2M1 codes (magnitude index | sign << 3)."""
    c = code.to(tl.int32)
    m = c & 7
    e = m >> 1
    mant = (m & 1).to(tl.float32)
    pw = (1 << tl.maximum(e - 1, 0)).to(tl.float32)
    v = tl.where(e == 0, 0.5 * mant, (1.0 + 0.5 * mant) * pw)
    return tl.where((c & 8) != 0, -v, v)


@triton.jit
def _e8m0(code):
    """2^(code-127) in FP32 (code 0: the subnormal 2^-127; 255: NaN)."""
    c = code.to(tl.int32)
    v = (c << 23).to(tl.float32, bitcast=True)
    v = tl.where(c == 0, (c + 0x400000).to(tl.float32, bitcast=True), v)
    return tl.where(c == 255, float("nan"), v)


@triton.jit
def _index_score_kernel(
        qa_ptr, qb_ptr, w_ptr, plane_ptr, pscale_ptr, bt_ptr, bid_ptr, pos_ptr, cand_ptr, score_ptr,
        t0, ratio, rows_per_page, max_pages, width, n_cand, cand_block, n_heads,
        stride_qt, stride_qh, stride_wt, stride_plane, stride_pscale, stride_bt, stride_cand,
        stride_st,
        BLOCK_NH: tl.constexpr, DQ: tl.constexpr, FP4: tl.constexpr, HAS_CAND: tl.constexpr,
        BLOCK_J: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    i = tl.program_id(0)
    jt = tl.program_id(1)
    t = (t0 + i).to(tl.int64)
    col = jt * BLOCK_J + tl.arange(0, BLOCK_J)
    sptr = score_ptr + i.to(tl.int64) * stride_st + col
    smask = col < width
    b = tl.load(bid_ptr + t)
    p = tl.load(pos_ptr + t)
    vis = tl.where(b >= 0, (p + 1) // ratio, 0)
    if HAS_CAND:
        bound = n_cand * cand_block
    else:
        bound = vis
    if jt * BLOCK_J < bound:
        if HAS_CAND:
            slot = col // cand_block
            cb = tl.load(cand_ptr + t * stride_cand + slot, mask=slot < n_cand, other=-1).to(tl.int64)
            c = tl.where(cb >= 0, cb * cand_block + col % cand_block, -1)
        else:
            c = col.to(tl.int64)
        cc = tl.maximum(c, 0)
        pg = cc // rows_per_page
        ok = (c >= 0) & (c < vis) & (pg < max_pages)
        page = tl.load(bt_ptr + tl.maximum(b, 0).to(tl.int64) * stride_bt + pg, mask=ok, other=0)
        row = page.to(tl.int64) * rows_per_page + cc % rows_per_page
        hs = tl.arange(0, BLOCK_NH)
        dd = tl.arange(0, DQ)
        qmask = (hs < n_heads)[None, :] & (dd < DQ)[:, None]
        kmask = ok[:, None] & (dd < DQ)[None, :]
        qoff = t * stride_qt + hs[None, :] * stride_qh + dd[:, None]              # [DQ, NH]
        qa = tl.load(qa_ptr + qoff, mask=qmask, other=0.0)
        kptr = plane_ptr + row[:, None] * stride_plane + dd[None, :]
        if FP4:
            byte = tl.load(kptr, mask=kmask, other=0).to(tl.int32)
            sc = tl.load(pscale_ptr + row[:, None] * stride_pscale + (dd // 16)[None, :],
                         mask=kmask, other=127)
            s = _e8m0(sc)
            k_lo = (_e2m1(byte & 15) * s).to(qa.dtype)          # dims 2i
            k_hi = (_e2m1(byte >> 4) * s).to(qa.dtype)          # dims 2i+1
            qb = tl.load(qb_ptr + qoff, mask=qmask, other=0.0)
            dots = tl.dot(k_lo, qa, input_precision=PREC) + tl.dot(k_hi, qb, input_precision=PREC)
        else:
            k = tl.load(kptr, mask=kmask, other=0.0).to(qa.dtype)
            ks = tl.load(pscale_ptr + row, mask=ok, other=0.0)
            dots = tl.dot(k, qa, input_precision=PREC) * ks[:, None]
        w = tl.load(w_ptr + t * stride_wt + hs, mask=hs < n_heads, other=0.0)
        score = tl.sum(tl.maximum(dots, 0.0) * w[None, :], 1)
        score = tl.where(ok, score, float("-inf"))
        tl.store(sptr, score, mask=smask)
    else:
        tl.store(sptr, tl.full([BLOCK_J], float("-inf"), tl.float32), mask=smask)


@triton.jit
def _against_threshold(score_ptr, thr_ptr, i, c, width, stride_s, BLOCK: tl.constexpr):
    """Row i's chunk c of columns: (columns, finite scores above the row's threshold, finite
    scores equal to it)."""
    cols = c * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(score_ptr + i * stride_s + cols, mask=cols < width, other=float("-inf"))
    thr = tl.load(thr_ptr + i)
    fin = s > float("-inf")
    return cols, (s > thr) & fin, (s == thr) & fin


@triton.jit
def _select_count_kernel(score_ptr, thr_ptr, cnt_ptr, width, n_chunks, stride_s, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
    """Per (row, chunk of columns): how many finite scores are above / equal to the row's
    threshold."""
    pdl_wait(PDL)
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    _, gt, eq = _against_threshold(score_ptr, thr_ptr, i, c, width, stride_s, BLOCK)
    base = (i * n_chunks + c) * 2
    tl.store(cnt_ptr + base, tl.sum(gt.to(tl.int32), 0))
    tl.store(cnt_ptr + base + 1, tl.sum(eq.to(tl.int32), 0))


@triton.jit
def _select_write_kernel(score_ptr, thr_ptr, need_ptr, eq_before_ptr, taken_before_ptr, out_ptr,
                         cand_ptr, width, n_chunks, cand_block, n_cand, stride_s, stride_o, stride_cand,
                         MAP_CAND: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Per (row, chunk): take every score above the threshold and the first `need` equal to it
    (in column order); each taken column goes to its slot, its rank among the row's taken
    columns. The value written is the column (or, MAP_CAND, the candidate row it stands for)."""
    pdl_wait(PDL)
    i = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    cols, gt, eq = _against_threshold(score_ptr, thr_ptr, i, c, width, stride_s, BLOCK)
    at = i * n_chunks + c
    eq_rank = tl.load(eq_before_ptr + at) + tl.cumsum(eq.to(tl.int32), 0)
    take = gt | (eq & (eq_rank <= tl.load(need_ptr + i)))
    slot = tl.load(taken_before_ptr + at) + tl.cumsum(take.to(tl.int32), 0) - 1
    _write_taken(out_ptr, cand_ptr, i, cols, take, slot, cand_block, n_cand, stride_o, stride_cand, MAP_CAND)


@triton.jit
def _write_taken(out_ptr, cand_ptr, i, cols, take, slot, cand_block, n_cand, stride_o, stride_cand,
                 MAP_CAND: tl.constexpr):
    """Row i's taken columns to their slots: the column, or (MAP_CAND) the candidate row it
    stands for."""
    if MAP_CAND:
        cs = cols // cand_block
        cb = tl.load(cand_ptr + i * stride_cand + cs, mask=take & (cs < n_cand), other=-1).to(tl.int64)
        src = tl.where(cb >= 0, cb * cand_block + cols % cand_block, -1)
    else:
        src = cols.to(tl.int64)
    tl.store(out_ptr + i * stride_o + slot, src, mask=take)


@triton.jit
def _order_key(s):
    """FP32 scores as uint32 keys in the same order (the sign bit set for positives, every bit
    flipped for negatives); -0.0 is +0.0 first, equal to it as the float comparison has it."""
    bits = tl.where(s == 0.0, 0.0, s).to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) == 1, ~bits, bits | 0x80000000)


@triton.jit
def _radix_byte(row, lim, offs, need, prefix, BYTE: tl.constexpr, BLOCK: tl.constexpr):
    """Radix pass BYTE (0: the top byte) of the selection of the `need` largest finite keys of
    row[:lim]: a 256-bin histogram of the byte among the finite keys that share `prefix`'s
    higher bytes, the byte d where the count from the top reaches `need`. Returns the keys still
    needed after those above d, prefix with d, and the keys counted (at BYTE 0: the finite ones)."""
    shift: tl.constexpr = 24 - 8 * BYTE
    bins = tl.arange(0, 256)
    hist = tl.zeros([256], tl.int32)
    for c0 in range(0, lim, BLOCK):
        s = tl.load(row + c0 + offs, mask=c0 + offs < lim, other=float("-inf"))
        key = _order_key(s)
        m = s > float("-inf")
        if BYTE > 0:
            m = m & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
        # excluded keys counted in bin 0, then taken out
        hist += tl.histogram(tl.where(m, (key >> shift) & 255, 0).to(tl.int32), 256) - \
            tl.where(bins == 0, tl.sum((~m).to(tl.int32), 0), 0)
    total = tl.sum(hist, 0)
    from_top = total - tl.cumsum(hist, 0) + hist                    # keys at this byte or above
    d = tl.maximum(tl.max(tl.where(from_top >= need, bins, -1), 0), 0)
    return need - tl.sum(tl.where(bins > d, hist, 0), 0), prefix | (d.to(tl.uint32) << shift), total


@triton.jit
def _last_valid(cand_row, n_cand, offs, BLOCK: tl.constexpr):
    """1 + the index of the last candidate >= 0 in cand_row[:n_cand] (0 where there is none)."""
    last = 0
    for c0 in range(0, n_cand, BLOCK):
        cs = c0 + offs
        cb = tl.load(cand_row + cs, mask=cs < n_cand, other=-1)
        last = tl.maximum(last, tl.max(tl.where(cb >= 0, cs + 1, 0), 0))
    return last


@triton.jit
def _select_row_kernel(score_ptr, out_ptr, cand_ptr, pos_ptr, bid_ptr, t0, ratio, per, width, k, cand_block,
                       n_cand, stride_s, stride_o, stride_cand, BOUNDED: tl.constexpr, MAP_CAND: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """One row per program, the whole selection in one launch: the kk-th largest finite score's
    key (kk = min(k, width)) by a radix select over its four bytes (`_radix_byte`), then one
    pass in column order that takes every key above it and the first `need` equal to it, each at
    its rank. Fewer finite scores than kk: all of them, with key 0 as the threshold (every
    finite key is above it); a row of at most kk columns skips the radix passes, and one whose
    first byte's pass counts at most kk finite scores the other three. BOUNDED: only columns
    below the token's bound are read, ceil(((p + 1) // ratio) / per) (0 for a padding row), the
    same columns the scorer left finite. MAP_CAND: only the columns up to the row's last valid
    candidate are read (the scorer left those past it -inf: its -1 candidates)."""
    pdl_wait(PDL)
    i = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    lim = width
    if BOUNDED:
        p = tl.load(pos_ptr + t0 + i)
        v = tl.where(tl.load(bid_ptr + t0 + i) >= 0, (p + 1) // ratio, 0)
        lim = tl.minimum((v + per - 1) // per, width)
    if MAP_CAND:
        lim = tl.minimum(lim, _last_valid(cand_ptr + i * stride_cand, n_cand, offs, BLOCK) * cand_block)
    row = score_ptr + i * stride_s
    kk = tl.minimum(k, width)
    need = kk                                   # still to find, from the top
    prefix = tl.zeros([], tl.uint32)            # the threshold key's bytes found so far
    # a skipped pass reads no column (its bound 0) and changes neither need nor prefix; a
    # branch here instead made Triton 3.6 give the kernel a stack frame (sm90_build)
    read = tl.where(lim > kk, lim, 0)           # at most kk columns: every finite one is taken
    need, prefix, finite = _radix_byte(row, read, offs, need, prefix, 0, BLOCK)
    # at most kk finite keys: each at or above the first byte's threshold, no more than `need`
    # at it, so the column pass takes them all
    read = tl.where(finite > kk, read, 0)
    for byte in tl.static_range(1, 4):
        need, prefix, finite = _radix_byte(row, read, offs, need, prefix, byte, BLOCK)
    eq_seen = 0
    taken = 0
    for c0 in range(0, lim, BLOCK):
        cols = c0 + offs
        s = tl.load(row + cols, mask=cols < lim, other=float("-inf"))
        key = _order_key(s)
        fin = s > float("-inf")
        eq = fin & (key == prefix)
        rank = eq_seen + tl.cumsum(eq.to(tl.int32), 0)
        take = fin & ((key > prefix) | (eq & (rank <= need)))
        slot = taken + tl.cumsum(take.to(tl.int32), 0) - 1
        _write_taken(out_ptr, cand_ptr, i, cols, take, slot, cand_block, n_cand, stride_o, stride_cand, MAP_CAND)
        eq_seen += tl.sum(eq.to(tl.int32), 0)
        taken += tl.sum(take.to(tl.int32), 0)


def select_into(score: torch.Tensor, out: torch.Tensor, cand: torch.Tensor | None = None,
                cand_block: int = 1, block: int | None = None, bound: tuple | None = None,
                row_max: int | None = None) -> None:
    """Per row of `score` [n, w], the best min(k, w) finite scores (k = out.shape[1]; equal
    scores: smaller column first) written to `out` [n, k] (already -1) in ascending column order:
    the column, or with `cand` the owner row cand[c // cand_block]·cand_block + c % cand_block.
    Rows up to `row_max` (ROW_SELECT_MAX) columns: one program a row (`_select_row_kernel`),
    reading only the columns below `bound` = (positions, batch_ids, t0, ratio, per), the row's
    ceil(((p + 1) // ratio) / per), where given. Wider: the k-th largest score (torch.topk) is
    the threshold, and a count pass and a prefix over chunks give every taken column its slot,
    so nothing [n, w]-sized is materialized besides the scores."""
    n, w = score.shape
    k = out.shape[1]
    kk = min(k, w)
    if n == 0 or kk == 0:
        return
    block = block or SELECT_BLOCK
    if w <= (row_max or ROW_SELECT_MAX):
        pos, bid, t0, ratio, per = bound if bound is not None else (out, out, 0, 1, 1)     # unread
        _select_row_kernel[(n,)](
            score, out, cand if cand is not None else out, pos, bid, t0, ratio, per, w, k, cand_block,
            cand.shape[1] if cand is not None else 0, score.stride(0), out.stride(0),
            cand.stride(0) if cand is not None else 0, BOUNDED=bound is not None, MAP_CAND=cand is not None,
            BLOCK=block, num_warps=4, **pdl(score.device))
        return
    thr = torch.topk(score, kk, dim=1, sorted=False).values.amin(1).contiguous()
    n_chunks = triton.cdiv(w, block)
    cnt = torch.empty(n, n_chunks, 2, dtype=torch.int32, device=score.device)
    _select_count_kernel[(n, n_chunks)](score, thr, cnt, w, n_chunks, score.stride(0),
                                        BLOCK=block, num_warps=4, **pdl(score.device))
    gt_c, eq_c = cnt[..., 0], cnt[..., 1]
    need = kk - gt_c.sum(1, dtype=torch.int32)
    eq_before = torch.cumsum(eq_c, 1, dtype=torch.int32) - eq_c
    take_c = gt_c + torch.minimum((need[:, None] - eq_before).clamp(min=0), eq_c)
    taken_before = torch.cumsum(take_c, 1, dtype=torch.int32) - take_c
    _select_write_kernel[(n, n_chunks)](
        score, thr, need.contiguous(), eq_before.contiguous(), taken_before.contiguous(), out,
        cand if cand is not None else out, w, n_chunks, cand_block,
        cand.shape[1] if cand is not None else 0, score.stride(0), out.stride(0),
        cand.stride(0) if cand is not None else 0,
        MAP_CAND=cand is not None, BLOCK=block, num_warps=4, **pdl(score.device))


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def triton_index_topk(q, w, plane, plane_scale, block_table, batch_ids, positions, ratio, rows_per_page,
                      fmt, cand, cand_block, topk, cand_out, max_position=None, *, static_width: bool | None = None,
                      score_budget: int | None = None, block_j: int | None = None,
                      select_block: int | None = None, row_max: int | None = None,
                      num_warps: int | None = None) -> None:
    """`v41::index_topk` (same signature); keyword knobs: `static_width` (FULL width from the
    block table instead of the batch's longest prefix; default: only while capturing), the
    score-tile budget, the widest row one program selects (`row_max`) and launch options."""
    T, K = topk.shape
    if w.dtype != torch.float32 or fmt not in ("fp8", "fp4"):
        return _ref.index_topk(q, w, plane, plane_scale, block_table, batch_ids, positions, ratio,
                               rows_per_page, fmt, cand, cand_block, topk, cand_out, max_position)
    topk.fill_(-1)
    if cand_out is not None:
        cand_out.fill_(-1)
    if T == 0:
        return
    dev = q.device
    c_ = lambda x: x if x is None or x.stride(-1) == 1 else x.contiguous()  # noqa: E731
    block_table, batch_ids, positions, cand = c_(block_table), c_(batch_ids), c_(positions), c_(cand)
    plane, plane_scale = c_(plane), c_(plane_scale)
    static = static_width or (static_width is None and _capturing(dev))
    # compressed rows each token sees: for the dynamic width and the candidate blocks only (a
    # scorer in a captured graph that publishes no candidates launches none of these kernels)
    vis = None
    if cand_out is not None or (cand is None and not static and max_position is None):
        vis = torch.where(batch_ids >= 0, (positions + 1) // ratio, torch.zeros_like(positions))
    if cand is not None:
        width = cand.shape[1] * cand_block
    elif static:
        width = block_table.shape[1] * rows_per_page
    else:
        width = _ref.visible_width(vis, max_position, ratio)
    if width <= 0:
        return
    if cand_out is not None:
        width = -(-width // cand_block) * cand_block
    # the query's grid values are exact in BF16 (the GPU dot dtype)
    cdt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    qr = q.to(cdt)
    if fmt == "fp4":
        qa, qb = qr[..., 0::2].contiguous(), qr[..., 1::2].contiguous()
    else:
        qa = qb = qr.contiguous()
    n_heads, dq = qa.shape[1], qa.shape[2]
    wf = w.contiguous()
    pscale = plane_scale if fmt == "fp4" else plane_scale.reshape(-1)
    bj = block_j or BLOCK_J
    tt = max(1, min(T, (score_budget or SCORE_BUDGET) // width))
    score = torch.empty(tt, width, dtype=torch.float32, device=dev)
    tk = topk if topk.stride(-1) == 1 else torch.full(topk.shape, -1, dtype=topk.dtype, device=dev)
    co = cand_out
    if cand_out is not None and cand_out.stride(-1) != 1:
        co = torch.full(cand_out.shape, -1, dtype=cand_out.dtype, device=dev)
    n_cand = cand.shape[1] if cand is not None else 0
    for t0 in range(0, T, tt):
        n = min(tt, T - t0)
        s = score[:n]
        _index_score_kernel[(n, triton.cdiv(width, bj))](
            qa, qb, wf, plane, pscale, block_table, batch_ids, positions,
            cand if cand is not None else batch_ids, s,
            t0, ratio, rows_per_page, block_table.shape[1], width, n_cand, cand_block, n_heads,
            qa.stride(0), qa.stride(1), wf.stride(0), plane.stride(0),
            pscale.stride(0), block_table.stride(0), cand.stride(0) if cand is not None else 0,
            s.stride(0),
            BLOCK_NH=max(16, triton.next_power_of_2(n_heads)), DQ=dq, FP4=fmt == "fp4",
            HAS_CAND=cand is not None, BLOCK_J=bj, PREC="ieee" if cdt == torch.float32 else "tf32",
            num_warps=num_warps or NUM_WARPS, **pdl(s.device))
        sel = tk[t0:t0 + n]
        if cand is None:                                 # columns are rows: already ascending
            select_into(s, sel, block=select_block, bound=(positions, batch_ids, t0, ratio, 1), row_max=row_max)
        else:                                            # ascending candidates: rows ascending too
            select_into(s, sel, cand[t0:t0 + n], cand_block, block=select_block, row_max=row_max)
        if cand_out is not None:
            nb = width // cand_block
            bs = s.view(n, nb, cand_block).amax(-1)
            v = vis[t0:t0 + n]
            newest = ((v - 1) // cand_block).clamp(0, nb - 1)[:, None]
            bs.scatter_(1, newest, torch.where((v > 0)[:, None], float("inf"), bs.gather(1, newest)))
            select_into(bs, co[t0:t0 + n], block=select_block, bound=(positions, batch_ids, t0, ratio, cand_block),
                        row_max=row_max)
    if tk is not topk:
        topk.copy_(tk)
    if co is not cand_out:
        cand_out.copy_(co)


register_impl("index_topk", "triton", triton_index_topk, device_type="cuda")
