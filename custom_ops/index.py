"""Index scoring with per-row visibility, level-1 candidate blocks and top-k (spec §3.3 f-h).

Every query row carries its own bound (rows j < (p+1)//ratio of its request are visible) and
reads the owner's index plane through its request's block table, so prefill, decode and draft
rows are one shape. Exact ties break smaller position first everywhere (a stable descending
sort over rows kept in ascending order).
"""
from __future__ import annotations

import torch

from custom_ops.registry import define
from v41 import quant

_CHUNK = 1 << 22  # bound on gathered key elements per step of the reference impl


def owner_rows(j, block_table, batch_ids, ratio: int, rows_per_page: int):
    """Flat plane row of compressed row j (in the request's owner space) of each token."""
    page = block_table[batch_ids.clamp(min=0)[:, None], (j * ratio) // (rows_per_page * ratio)]
    return page * rows_per_page + j % rows_per_page


def dequant_plane(vals, scales, rows, fmt: str, dtype):
    """Key rows of an index plane: fp8 = E4M3 x one pow2 FP32 scale per row; fp4 = packed E2M1 x
    one E8M0 per 32 dims."""
    if fmt == "fp8":
        return vals[rows].to(dtype) * scales[rows].to(dtype)[..., None]
    codes = quant.unpack_fp4(vals[rows])
    k = quant.e2m1_decode(codes, dtype)
    s = quant.e8m0_decode(scales[rows], dtype)
    return (k.unflatten(-1, (-1, 32)) * s[..., None]).flatten(-2)


def exact_dots(q, k, eq: str):
    """The query-key dots in q's dtype, summed in float64 and rounded once. Queries and keys
    are FP8 or FP4 values with power-of-two scales, so each product has at most 8 significant
    bits and a head's sum is exact in float64 (unless its groups' scales span more than ~2^40):
    the score then does not depend on the order a GEMM of this shape sums in (FP32 GEMMs of
    the same rows differ by shape on an AVX2 host), and equals the oracle's, summed the same way."""
    return torch.einsum(eq, q.double(), k.double()).to(q.dtype)


def visible_width(vis, max_position, ratio: int) -> int:
    """The most compressed rows a token of the step sees: from the host's `max_position` (an
    upper bound: the scorers mask each token's columns at its own count), else from `vis` on the
    device, which waits for it."""
    return (int(max_position[0]) + 1) // ratio if max_position is not None else int(vis.max())


def _stable_topk(score, k: int):
    """Indices of the k best scores, smaller index first among equals."""
    return torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :k]


@define("index_topk(Tensor q, Tensor w, Tensor plane, Tensor plane_scale, Tensor block_table, "
        "Tensor batch_ids, Tensor positions, int ratio, int rows_per_page, str fmt, Tensor? cand, "
        "int cand_block, Tensor(a!) topk, Tensor(b!)? cand_out, Tensor? max_position=None) -> ()")
def index_topk(q, w, plane, plane_scale, block_table, batch_ids, positions, ratio, rows_per_page,
               fmt, cand, cand_block, topk, cand_out, max_position=None) -> None:
    """q [T, h, d] rotated index queries on the plane format's grid (`quant.index_query_qat`:
    the model rounds them, so the compiled step fuses the rounding); w [T, h] head weights
    (already scaled).
    topk [T, K] <- the selected rows of each token, ascending, -1 padded.
    cand: [T, C] candidate blocks, ascending, -1 padded (REINDEX: score only inside them; a
    producer's cand_out), or None (score every visible row). cand_out: [T, C] <- this layer's
    own candidate blocks (the producer), ascending, -1 padded. max_position: [1] on the host, at
    least the largest position of a row with batch_ids >= 0 (`Batch.max_position`): the scored
    width comes from it without reading the device; None: from the positions on the device."""
    T, K = topk.shape
    acc = w.dtype
    qr = q.to(acc)
    vis = torch.where(batch_ids >= 0, (positions + 1) // ratio, torch.zeros_like(positions))
    topk.fill_(-1)
    if cand_out is not None:
        cand_out.fill_(-1)
    if T == 0:
        return
    if cand is None:
        width = visible_width(vis, max_position, ratio)
        cols = torch.arange(width, device=q.device).expand(T, width)
    else:
        off = torch.arange(cand_block, device=q.device)
        cols = (cand.clamp(min=0)[..., None] * cand_block + off).flatten(1)
        cols = torch.where((cand >= 0).repeat_interleave(cand_block, 1), cols, torch.full_like(cols, -1))
        width = cols.shape[1]
    if width == 0:
        return
    step = max(1, _CHUNK // (width * q.shape[-1]))
    for s in range(0, T, step):
        sl = slice(s, s + step)
        c = cols[sl]
        ok = (c >= 0) & (c < vis[sl, None])
        rows = owner_rows(c.clamp(min=0), block_table, batch_ids[sl], ratio, rows_per_page)
        keys = dequant_plane(plane, plane_scale, rows, fmt, acc)           # [t, width, d]
        dots = exact_dots(qr[sl], keys, "thd,tjd->thj").relu()
        score = (dots * w[sl, :, None]).sum(1)
        score = torch.where(ok, score, torch.full_like(score, float("-inf")))
        best = _stable_topk(score, min(K, width))
        picked = torch.where(score.gather(1, best) > float("-inf"), c.gather(1, best), -1)
        picked = torch.where(picked >= 0, picked, torch.iinfo(picked.dtype).max).sort(1).values
        topk[sl, : picked.shape[1]] = torch.where(picked == torch.iinfo(picked.dtype).max, -1, picked)
        if cand_out is not None:
            cand_out[sl] = candidate_blocks(score, vis[sl], cand_block, cand_out.shape[1])


def candidate_blocks(score, vis, block: int, n_blocks: int):
    """Level-1 selection: a block's score is the max of its rows; the block holding the newest
    visible row always stays; the best n_blocks with a finite score, ascending, -1 padded."""
    T, width = score.shape
    nb = -(-width // block)
    padded = torch.full((T, nb * block), float("-inf"), dtype=score.dtype, device=score.device)
    padded[:, :width] = score
    bscore = padded.view(T, nb, block).amax(-1)
    newest = ((vis - 1) // block).clamp(min=0)
    has = vis > 0
    bscore[has, newest[has]] = float("inf")
    best = _stable_topk(bscore, min(n_blocks, nb))
    ids = torch.where(bscore.gather(1, best) > float("-inf"), best, nb + 1).sort(1).values
    out = torch.full((T, n_blocks), -1, dtype=torch.long, device=score.device)
    out[:, : ids.shape[1]] = torch.where(ids > nb, -1, ids)
    return out
