"""Triton impl of `v41::sparse_attn` (spec §3.3 i; the reference in custom_ops/attention.py is
the definition).

One program serves one token and a group of BLOCK_H query heads. All heads share one latent KV
row (K = V), so each block of BLOCK_N key rows is gathered once for the whole head group and
meets the queries as the M dimension of `tl.dot`: S = Q·Kᵀ [BLOCK_H, BLOCK_N], then P·V.
The token's key list is its window (win_idx: a ring row, or a row of this batch's kv) followed by
its selected owner rows (topk -> block table -> pool row); -1 entries are skipped. The softmax is
online over blocks, running max seeded at -1e30, unnormalized probabilities cast to the
activation dtype before P·V, the running sum kept in FP32 from the unrounded values, the sink
added after the last block and the division at the end (the kernel contract of §3.3 i), with
one deviation: a block is BLOCK_N entries of the padded list (window W, then K selected, -1s
included) and key splits are merged at the end, where the contract and the reference count 64
valid entries in one pass. The bf16 probabilities therefore round against other running maxima;
README (Correctness) gives the size and tests/test_kernels_cpu.py bounds it.

Decode (few tokens): the key list of each token is split across `split_k` programs, each writing
a partial (max, sum, acc) in FP32; a second small kernel merges the partials, adds the sink and
normalizes. `split_k=None` picks it from the SM count: no split once the tokens x head groups
fill the GPU, else as many splits as fit it in one wave (at least `MIN_BLOCKS_PER_SPLIT` key
blocks each).

Grid: (tokens, head groups, splits); a split takes a contiguous run of the token's key blocks
(window blocks first, then top-k blocks). Owner rows: the page of compressed row j is
block_table[request, j // rows_per_page] (what the reference's (j·ratio) // (rows_per_page·ratio)
reduces to), so `ratio` needs no further use here.

Its speed at Flash shapes, the tile sweep behind the defaults, what was tried and where the
decode time goes: docs/kernels.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops import attention as _ref
from custom_ops.registry import register_impl
from custom_ops.triton import common
from custom_ops.triton.common import TL_DTYPES, pdl, pdl_wait

# defaults: the best of the H200 sweep at Flash shapes (H=64, d=512; docs/kernels.md)
BLOCK_H = 64                # query heads per program (the M of both dots)
BLOCK_N = 32                # key rows per online-softmax block
QK_SPLIT = 1                # D-chunks of S = Q·Kᵀ (1: Q held whole in registers)
NUM_WARPS = 8
NUM_STAGES = 2
MIN_BLOCKS_PER_SPLIT = 1


@triton.jit
def _attn_block(q, qrow, rows, valid, m_i, l_i, acc, scale, hmask, dofs, dmask,
                D: tl.constexpr, BLOCK_D: tl.constexpr, QK_SPLIT: tl.constexpr,
                P_DTYPE: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """One online-softmax step over a block of key rows (`rows`: a pointer to each row; an
    invalid row is read as 0 and scored -inf). QK_SPLIT > 1 forms S = Q·Kᵀ from D-chunks, with
    Q re-read per chunk (`qrow`: the program's query rows) instead of held whole."""
    kmask = valid[:, None] & dmask[None, :]
    if QK_SPLIT == 1:
        k = tl.load(rows[:, None] + dofs[None, :], mask=kmask, other=0.0)
        if DOT_F32:                          # the interpreter's tl.dot takes no bf16: widen (exact)
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
    else:
        DC: tl.constexpr = BLOCK_D // QK_SPLIT
        s = tl.zeros([q.shape[0], valid.shape[0]], tl.float32)
        for c in tl.static_range(QK_SPLIT):
            dc = c * DC + tl.arange(0, DC)
            qc = tl.load(qrow[:, None] + dc[None, :], mask=hmask[:, None] & (dc < D)[None, :],
                         other=0.0)
            kc = tl.load(rows[:, None] + dc[None, :], mask=valid[:, None] & (dc < D)[None, :],
                         other=0.0)
            if DOT_F32:
                qc = qc.to(tl.float32)
                kc = kc.to(tl.float32)
            s += tl.dot(qc, tl.trans(kc), input_precision=PREC)
        k = tl.load(rows[:, None] + dofs[None, :], mask=kmask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
    s = s * scale                                                              # [BH, BN] fp32
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # the kernel contract: unnormalized probabilities meet V in the activation dtype
    acc = acc * alpha[:, None] + tl.dot(p.to(P_DTYPE).to(k.dtype), k, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _sparse_attn_kernel(
        q_ptr, kv_ptr, ring_ptr, pool_ptr, win_ptr, topk_ptr, bt_ptr, bid_ptr, sink_ptr,
        out_ptr, pm_ptr, pl_ptr, pacc_ptr,
        H, W, K, n_ring, rows_per_page, max_pages, blocks_per_split, n_split, scale,
        stride_qt, stride_qh, stride_kv, stride_ring, stride_pool, stride_win, stride_topk,
        stride_bt, stride_ot, stride_oh,
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
        QK_SPLIT: tl.constexpr, HAS_POOL: tl.constexpr, SPLIT: tl.constexpr,
        P_DTYPE: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    hg = tl.program_id(1)
    sp = tl.program_id(2)
    heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    dofs = tl.arange(0, BLOCK_D)
    dmask = dofs < D
    qrow = q_ptr + t * stride_qt + heads * stride_qh
    if QK_SPLIT == 1:
        q = tl.load(qrow[:, None] + dofs[None, :], mask=hmask[:, None] & dmask[None, :],
                    other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
    else:
        q = tl.zeros([BLOCK_H, 1], tl.float32)     # not held: QK_SPLIT re-reads Q by chunks

    n_win_blocks = tl.cdiv(W, BLOCK_N)
    n_blocks = n_win_blocks
    if HAS_POOL:
        n_blocks += tl.cdiv(K, BLOCK_N)
    b0 = sp * blocks_per_split
    b1 = tl.minimum(b0 + blocks_per_split, n_blocks)

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    noff = tl.arange(0, BLOCK_N)

    # window rows, oldest first: a ring row (< n_ring) or a row of this batch (n_ring + t)
    for blk in range(b0, tl.minimum(b1, n_win_blocks)):
        n = blk * BLOCK_N + noff
        idx = tl.load(win_ptr + t * stride_win + n, mask=n < W, other=-1).to(tl.int64)
        rows = tl.where(idx < n_ring, ring_ptr + idx * stride_ring,
                        kv_ptr + (idx - n_ring) * stride_kv)
        m_i, l_i, acc = _attn_block(q, qrow, rows, idx >= 0, m_i, l_i, acc, scale, hmask, dofs,
                                    dmask, D, BLOCK_D, QK_SPLIT, P_DTYPE, DOT_F32, PREC)

    # selected owner rows: compressed row j of the token's request -> block table -> pool row
    if HAS_POOL:
        req = tl.maximum(tl.load(bid_ptr + t), 0).to(tl.int64)
        for blk in range(tl.maximum(b0, n_win_blocks), b1):
            n = (blk - n_win_blocks) * BLOCK_N + noff
            j = tl.load(topk_ptr + t * stride_topk + n, mask=n < K, other=-1).to(tl.int64)
            jj = tl.maximum(j, 0)
            pg = jj // rows_per_page
            valid = (j >= 0) & (pg < max_pages)
            page = tl.load(bt_ptr + req * stride_bt + pg, mask=valid, other=0).to(tl.int64)
            rows = pool_ptr + (page * rows_per_page + jj % rows_per_page) * stride_pool
            m_i, l_i, acc = _attn_block(q, qrow, rows, valid, m_i, l_i, acc, scale, hmask, dofs,
                                        dmask, D, BLOCK_D, QK_SPLIT, P_DTYPE, DOT_F32, PREC)

    if SPLIT:
        part = (t * H + heads) * n_split + sp                                   # [BH]
        tl.store(pm_ptr + part, m_i, mask=hmask)
        tl.store(pl_ptr + part, l_i, mask=hmask)
        tl.store(pacc_ptr + part[:, None] * BLOCK_D + dofs[None, :], acc,
                 mask=hmask[:, None] & dmask[None, :])
    else:
        sink = tl.load(sink_ptr + heads, mask=hmask, other=0.0).to(tl.float32)
        denom = l_i + tl.exp(tl.where(l_i > 0, sink - m_i, 0.0))
        o = acc / denom[:, None]
        o = tl.where((l_i > 0)[:, None], o, 0.0)          # no valid row (padding): 0
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + dofs[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])


@triton.jit
def _combine_kernel(pm_ptr, pl_ptr, pacc_ptr, sink_ptr, out_ptr, H, n_split, stride_ot, stride_oh,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False):
    """Merge the split-K partials of one (token, head): rescale to the common max, add the
    sink, divide."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = (t * H + h) * n_split
    so = tl.arange(0, BLOCK_S)
    smask = so < n_split
    m_s = tl.load(pm_ptr + base + so, mask=smask, other=-1.0e30)
    l_s = tl.load(pl_ptr + base + so, mask=smask, other=0.0)
    m = tl.max(m_s, 0)
    w_s = tl.exp(m_s - m)
    l_tot = tl.sum(l_s * w_s, 0)
    dofs = tl.arange(0, BLOCK_D)
    dmask = dofs < D
    acc = tl.load(pacc_ptr + (base + so)[:, None] * BLOCK_D + dofs[None, :],
                  mask=smask[:, None] & dmask[None, :], other=0.0)
    acc = tl.sum(acc * w_s[:, None], 0)
    sink = tl.load(sink_ptr + h).to(tl.float32)
    o = acc / (l_tot + tl.exp(tl.where(l_tot > 0, sink - m, 0.0)))
    o = tl.where(tl.zeros([BLOCK_D], tl.float32) + l_tot > 0, o, 0.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dofs, o.to(out_ptr.dtype.element_ty),
             mask=dmask)


def split_for(n_tokens: int, n_head_groups: int, n_blocks: int, device: torch.device,
              split_k: int | None = None) -> int:
    """Key-list splits per token: `split_k` if given; else as many as fit the SMs without a
    second wave (floor: at 64 tokens on 132 SMs 2 splits took 82 us, 3 took 102), each with
    >= MIN_BLOCKS_PER_SPLIT blocks; 1 once tokens x head groups fill the SMs."""
    if n_blocks <= 1:
        return 1
    if split_k is None:
        base = n_tokens * n_head_groups
        sms = common.num_sms(device)
        if base >= sms:
            return 1
        split_k = min(sms // base, n_blocks // max(1, MIN_BLOCKS_PER_SPLIT))
    return max(1, min(int(split_k), n_blocks))


def _rows(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def triton_sparse_attn(q, kv, ring, win_idx, pool, topk, block_table, batch_ids, ratio, rows_per_page,
                       sink, scale, out, *, split_k: int | None = None, block_h: int | None = None,
                       block_n: int | None = None, qk_split: int | None = None,
                       num_warps: int | None = None, num_stages: int | None = None) -> None:
    """`v41::sparse_attn` (same signature); keyword knobs: `split_k` (None: from the SM count),
    tile sizes and launch options."""
    T, H, d = q.shape
    if T == 0:
        return
    dtypes = {q.dtype, kv.dtype, ring.dtype}
    if pool is not None and topk is not None:
        dtypes.add(pool.dtype)
    if q.dtype not in TL_DTYPES or len(dtypes) > 1:
        # the oracle's float64, or mixed row dtypes: no tensor-core path, use the definition
        return _ref.sparse_attn(q, kv, ring, win_idx, pool, topk, block_table, batch_ids, ratio,
                                rows_per_page, sink, scale, out)
    has_pool = pool is not None and topk is not None and topk.shape[1] > 0
    q, kv, ring, win_idx = _rows(q), _rows(kv), _rows(ring), _rows(win_idx)
    block_table, batch_ids = _rows(block_table), _rows(batch_ids)
    if has_pool:
        pool, topk = _rows(pool), _rows(topk)
    else:
        pool, topk = kv, win_idx                       # placeholders, never read
    if kv.shape[0] == 0:
        kv = ring                                      # no batch rows: never read either
    sink = sink.to(torch.float32).contiguous()
    dst = out if out.stride(-1) == 1 else torch.empty_like(out, memory_format=torch.contiguous_format)
    W, K = win_idx.shape[1], (topk.shape[1] if has_pool else 0)
    bh = block_h or BLOCK_H
    bh = max(16, min(bh, triton.next_power_of_2(H)))
    bn = block_n or BLOCK_N
    n_hg = triton.cdiv(H, bh)
    n_blocks = triton.cdiv(W, bn) + (triton.cdiv(K, bn) if has_pool else 0)
    n_split = split_for(T, n_hg, n_blocks, q.device, split_k)
    bps = triton.cdiv(n_blocks, n_split) if n_blocks else 1
    n_split = max(1, triton.cdiv(n_blocks, bps)) if n_blocks else 1
    BLOCK_D = triton.next_power_of_2(d)
    prec = "ieee" if q.dtype == torch.float32 or q.device.type == "cpu" else "tf32"
    split = n_split > 1
    if split:
        pm = torch.empty(T * H * n_split, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pacc = torch.empty(T * H * n_split * BLOCK_D, dtype=torch.float32, device=q.device)
    else:
        pm = pl = pacc = sink                           # placeholders
    _sparse_attn_kernel[(T, n_hg, n_split)](
        q, kv, ring, pool, win_idx, topk, block_table, batch_ids, sink,
        dst, pm, pl, pacc,
        H, W, K, ring.shape[0], rows_per_page, block_table.shape[1], bps, n_split, float(scale),
        q.stride(0), q.stride(1), kv.stride(0), ring.stride(0), pool.stride(0), win_idx.stride(0),
        topk.stride(0), block_table.stride(0), dst.stride(0), dst.stride(1),
        D=d, BLOCK_D=BLOCK_D, BLOCK_H=bh, BLOCK_N=bn, QK_SPLIT=qk_split or QK_SPLIT,
        HAS_POOL=has_pool, SPLIT=split,
        P_DTYPE=TL_DTYPES[q.dtype], DOT_F32=q.device.type == "cpu" and q.dtype != torch.float32, PREC=prec,
        num_warps=num_warps or NUM_WARPS, num_stages=num_stages or NUM_STAGES, **pdl(q.device))
    if split:
        _combine_kernel[(T, H)](pm, pl, pacc, sink, dst, H, n_split, dst.stride(0), dst.stride(1),
                                D=d, BLOCK_D=BLOCK_D, BLOCK_S=triton.next_power_of_2(n_split),
                                num_warps=4, **pdl(q.device))
    if dst is not out:
        out.copy_(dst)


register_impl("sparse_attn", "triton", triton_sparse_attn, device_type="cuda")
