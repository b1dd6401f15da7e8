"""Sparse attention with sink over two sources (spec §3.3 i): the layer's window (ring rows
written by earlier forwards plus this forward's own rows) and the rows of the kv owner that the
index selected. K = V = the 512-d latent; one latent head shared by all query heads.
"""
from __future__ import annotations

import torch

from custom_ops.index import owner_rows
from custom_ops.registry import define

BLOCK = 64  # rows per online-softmax block of the kernel contract (spec §3.3 i)


def gather_window(kv, ring, win_idx):
    """Window rows of each token, oldest first: win_idx [T, W] holds a ring row (< ring rows),
    a row of this batch (ring rows + t) or -1."""
    n_ring = ring.shape[0]
    in_ring = win_idx < n_ring
    from_ring = ring[win_idx.clamp(0, n_ring - 1)].to(kv.dtype)
    from_batch = kv[(win_idx - n_ring).clamp(0, max(kv.shape[0] - 1, 0))]
    return torch.where(in_ring[..., None], from_ring, from_batch), win_idx >= 0


@define("sparse_attn(Tensor q, Tensor kv, Tensor ring, Tensor win_idx, Tensor? pool, Tensor? topk, "
        "Tensor block_table, Tensor batch_ids, int ratio, int rows_per_page, Tensor sink, "
        "float scale, Tensor(a!) out) -> ()")
def sparse_attn(q, kv, ring, win_idx, pool, topk, block_table, batch_ids, ratio, rows_per_page,
                sink, scale, out) -> None:
    """q [T, H, d]; kv [T, d] this batch's window rows; ring [R, d] the layer's ring as rows;
    pool [N, d] the kv owner's main rows and topk [T, K] the selected compressed rows (or
    None for a window-only layer). out [T, H, d] <- softmax-with-sink attention; a token with
    no valid row (padding) gets 0. Rounds as the official kernel does: online softmax over
    blocks of BLOCK valid rows (window oldest first, then the selected rows), running max seeded
    at -1e30, probabilities cast to q's dtype before P·V, sink and division after the last
    block. With more than BLOCK rows the order of the list therefore matters in bf16."""
    rows, valid = gather_window(kv, ring, win_idx)
    if pool is not None and topk is not None and topk.shape[1]:
        prow = owner_rows(topk.clamp(min=0), block_table, batch_ids, ratio, rows_per_page)
        rows = torch.cat([rows, pool[prow].to(kv.dtype)], 1)
        valid = torch.cat([valid, topk >= 0], 1)
    # the contract's blocks count the valid entries in list order (-1 entries are skipped), so
    # move them to the front, keeping their order
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    valid = valid.gather(1, order)
    rows = rows.gather(1, order[..., None].expand_as(rows))
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    rows = torch.where(valid[..., None], rows, torch.zeros_like(rows)).to(acc)  # never read stale memory
    s = torch.einsum("thd,tnd->thn", q.to(acc), rows) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = torch.full(s.shape[:2], -1e30, dtype=acc, device=s.device)  # seeded finite: no-row tokens
    num = torch.zeros(q.shape, dtype=acc, device=q.device)
    den = torch.zeros(s.shape[:2], dtype=acc, device=s.device)
    for b in range(0, s.shape[-1], BLOCK):
        sb = s[..., b:b + BLOCK]
        m_new = torch.maximum(m, sb.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(sb - m_new[..., None])
        # unnormalized probabilities meet V in the activation dtype; the sum keeps them unrounded
        pv = torch.einsum("thn,tnd->thd", p.to(q.dtype).to(acc), rows[:, b:b + BLOCK])
        num = num * alpha[..., None] + pv
        den = den * alpha + p.sum(-1)
        m = m_new
    o = num / (den + torch.exp(sink.to(acc)[None, :] - m))[..., None]
    out.copy_(torch.where(valid.any(1)[:, None, None], o, torch.zeros_like(o)).to(out.dtype))
