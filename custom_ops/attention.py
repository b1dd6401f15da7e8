"""Sparse attention with sink over two sources (spec §3.3 i): the layer's window (ring rows
written by earlier forwards plus this forward's own rows) and the rows of the kv owner that the
index selected. K = V = the 512-d latent; one latent head shared by all query heads.
"""
from __future__ import annotations

import torch

from custom_ops.index import owner_rows
from custom_ops.registry import define


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
    no valid row (padding) gets 0."""
    rows, valid = gather_window(kv, ring, win_idx)
    if pool is not None and topk is not None and topk.shape[1]:
        prow = owner_rows(topk.clamp(min=0), block_table, batch_ids, ratio, rows_per_page)
        rows = torch.cat([rows, pool[prow].to(kv.dtype)], 1)
        valid = torch.cat([valid, topk >= 0], 1)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    rows = torch.where(valid[..., None], rows, torch.zeros_like(rows))  # never read stale memory
    s = torch.einsum("thd,tnd->thn", q.to(acc), rows.to(acc)) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True).clamp(min=-1e30)  # a row with nothing valid keeps m finite
    p = torch.exp(s - m)
    denom = p.sum(-1) + torch.exp(sink.to(acc)[None, :] - m[..., 0])
    # the kernel contract: unnormalized probabilities meet V in the activation dtype
    o = torch.einsum("thn,tnd->thd", p.to(q.dtype).to(acc), rows.to(acc)) / denom[..., None]
    out.copy_(torch.where(valid.any(1)[:, None, None], o, torch.zeros_like(o)).to(out.dtype))
