"""The sorted-by-expert tile scheme the expert GEMMs share (moe.py, moe_w4a8.py): the grouping
of (token, slot) pairs into BLOCK_M-row tiles of one expert, and the final per-token sum.

- `expert_tiles`: pairs sorted by expert (stable; padding slots, id -1, last), cut into tiles;
  a static bound of tiles, so nothing on the host depends on the routing (CUDA-graph safe).
  Up to FUSED_PAIRS pairs (decode widths) one launch builds it all (`_expert_tiles_kernel`: a
  program per 128 pairs ranks them by counting, no sort; one more builds the tile table), where
  the torch ops it replaces are ~20 kernels of a few µs each; above, those torch ops (stable
  sort, searchsorted), whose cost prefill amortizes.
- `tile_rows`: a GEMM program's view of its tile.
- `swiglu_store`: the up GEMMs' epilogue (the tile kernels' and the GEMVs'; `swiglu_values` its
  math, which fp4_mma.py's GEMVs store in their own form).
- `reduce_pairs`: out[t] = Σ of the token's valid slots in ascending expert id, in FP32 from 0
  (the reference's order, so the result depends on neither the batch nor atomics); each
  program ranks its tokens' slots itself.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.triton.common import fp8_qat_groups, pdl, pdl_wait

# P pairs ranked by P² comparisons, spread over a program per _BLOCK pairs; the tile table's
# program counts P x E. H100, graphed (grouping-h100.json): ahead of the torch ops through 768
# pairs at 384 experts (56.2 vs 89.9 µs), even at 1,536 (91.5 vs 93.0), behind at 3,072
FUSED_PAIRS = 1024
REDUCE_BLOCK_D = 512
_BLOCK = 128              # the grouping kernel's pairs a program and tiles a chunk,
_CHUNK = 16384            # its tile table's [tiles, experts] chunks at most 16K comparisons,
# its pairs compared at once (at 128: 72 bytes a thread spilled, grouping-build-triton36-cpu.json)
_BLOCK_J = 32


@triton.jit
def tile_rows(meta_ptr, order_ptr, n_tiles, BLOCK_M: tl.constexpr):
    """This program's tile of expert_tiles: (first row, end row, expert, sorted rows, their mask,
    their (token, slot) pair ids); end <= first for a tile past the real count."""
    tile = tl.program_id(0)
    r0 = tl.load(meta_ptr + n_tiles + tile)
    r1 = tl.load(meta_ptr + 2 * n_tiles + tile)
    e = tl.load(meta_ptr + tile).to(tl.int64)
    rows = r0 + tl.arange(0, BLOCK_M)
    rmask = rows < r1
    return r0, r1, e, rows, rmask, tl.load(order_ptr + rows, mask=rmask, other=0)


@triton.jit
def _keys(ids_ptr, i, P, E):
    """Sort keys of pairs i: the expert id, E for padding slots and past P."""
    e = tl.load(ids_ptr + i, mask=i < P, other=-1).to(tl.int32)
    return tl.where(e < 0, E, e)


@triton.jit
def _expert_tiles_kernel(ids_ptr, order_ptr, meta_ptr, bounds_ptr, tile_end_ptr, P, E, n_tiles,
                         BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_J: tl.constexpr, PDL: tl.constexpr = False):
    """A program per BLOCK_P pairs i ranks them: order[rank(i)] = i with rank(i) = #pairs j with
    (key_j, j) < (key_i, i) (a stable sort), j over all P in chunks of BLOCK_J. The last program
    builds the tile table: bounds[e] = #pairs with key < e (e = 0..E); tile_end[e] =
    Σ_{e' <= e} ⌈count(e') / BLOCK_M⌉; tile t belongs to expert #{e : tile_end[e] <= t}; chunks
    of BLOCK_E experts and BLOCK_T tiles (one each at one token). No program reads another's
    stores."""
    pdl_wait(PDL)
    lp = tl.arange(0, BLOCK_P)
    le = tl.arange(0, BLOCK_E)
    if tl.program_id(0) < tl.num_programs(0) - 1:            # order
        i = tl.program_id(0) * BLOCK_P + lp
        ki = _keys(ids_ptr, i, P, E)
        rank = tl.zeros([BLOCK_P], tl.int32)
        for j0 in range(0, P, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            kj = _keys(ids_ptr, j, P, E)
            before = (kj[None, :] < ki[:, None]) | ((kj[None, :] == ki[:, None]) & (j[None, :] < i[:, None]))
            rank += tl.sum((before & (j < P)[None, :]).to(tl.int32), axis=1)
        tl.store(order_ptr + rank, i, mask=i < P)
    else:
        for e0 in range(0, E + 1, BLOCK_E):                  # bounds
            e = e0 + le
            below = tl.zeros([BLOCK_E], tl.int32)
            for j0 in range(0, P, BLOCK_J):
                j = j0 + tl.arange(0, BLOCK_J)
                below += tl.sum((_keys(ids_ptr, j, P, E)[None, :] < e[:, None]).to(tl.int32), axis=1)
            tl.store(bounds_ptr + e, below, mask=e <= E)
        tl.debug_barrier()
        carry = 0                                             # tile_end: a running cumsum
        for e0 in range(0, E, BLOCK_E):
            e = e0 + le
            m = e < E
            cnt = tl.load(bounds_ptr + e + 1, mask=m, other=0) - tl.load(bounds_ptr + e, mask=m, other=0)
            end = carry + tl.cumsum((cnt + BLOCK_M - 1) // BLOCK_M, axis=0)
            tl.store(tile_end_ptr + e, end, mask=m)
            carry = tl.max(tl.where(m, end, 0), axis=0)
        tl.debug_barrier()
        lt = tl.arange(0, BLOCK_T)
        for t0 in range(0, n_tiles, BLOCK_T):                # meta
            t = t0 + lt
            te = tl.zeros([BLOCK_T], tl.int32)
            for e0 in range(0, E, BLOCK_E):
                e = e0 + le
                end = tl.load(tile_end_ptr + e, mask=e < E, other=2147483647)
                te += tl.sum((end[None, :] <= t[:, None]).to(tl.int32), axis=1)
            ec = tl.minimum(te, E - 1)
            b0 = tl.load(bounds_ptr + ec)
            b1 = tl.load(bounds_ptr + ec + 1)
            first = tl.load(tile_end_ptr + ec) - (b1 - b0 + BLOCK_M - 1) // BLOCK_M
            live = te < E
            tm = t < n_tiles
            tl.store(meta_ptr + t, ec, mask=tm)
            tl.store(meta_ptr + n_tiles + t, tl.where(live, b0 + (t - first) * BLOCK_M, 0), mask=tm)
            tl.store(meta_ptr + 2 * n_tiles + t, tl.where(live, b1, 0), mask=tm)


def expert_tiles(ids: torch.Tensor, E: int, block_m: int, fused: bool | None = None):
    """Device-side grouping of the (token, slot) pairs by expert, static shapes only.
    Returns (order [P] pair ids sorted by expert (padding last), meta [3, n_tiles] int32 rows
    (expert, first sorted row, end row) of each BLOCK_M tile, n_tiles = the static bound).
    `fused`: the grouping kernel (True) or the torch ops (False); default up to FUSED_PAIRS."""
    P = ids.numel()
    n_tiles = triton.cdiv(P, block_m) + min(E, P)
    if P <= FUSED_PAIRS if fused is None else fused:
        flat = ids.reshape(-1).contiguous()
        order = torch.empty(P, dtype=torch.int32, device=ids.device)
        meta = torch.empty(3, n_tiles, dtype=torch.int32, device=ids.device)
        scratch = torch.empty(2 * E + 1, dtype=torch.int32, device=ids.device)
        bp = min(_BLOCK, triton.next_power_of_2(P))
        bt = min(_BLOCK, triton.next_power_of_2(n_tiles))
        be = min(512, triton.next_power_of_2(E + 1), _CHUNK // max(bp, bt))
        # a program per BLOCK_P pairs ranks them, the last builds the tile table
        _expert_tiles_kernel[(triton.cdiv(P, bp) + 1,)](
            flat, order, meta, scratch, scratch[E + 1:], P, E, n_tiles, BLOCK_M=block_m, BLOCK_P=bp, BLOCK_E=be,
            BLOCK_T=bt, BLOCK_J=min(_BLOCK_J, bp), num_warps=8, **pdl(flat.device))
        return order, meta, n_tiles
    key = ids.reshape(-1).to(torch.int64)
    key = torch.where(key < 0, E, key)
    order = torch.sort(key, stable=True).indices
    skey = key[order]
    bounds = torch.searchsorted(skey, torch.arange(E + 1, device=ids.device, dtype=torch.int64))
    counts = bounds[1:] - bounds[:-1]
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    tix = torch.arange(n_tiles, device=ids.device, dtype=torch.int64)
    te = torch.searchsorted(tile_end, tix, right=True)
    ec = te.clamp(max=E - 1)
    row0 = bounds[ec] + (tix - (tile_end[ec] - tiles[ec])) * block_m
    row1 = bounds[ec + 1]
    live = te < E
    meta = torch.stack([ec, torch.where(live, row0, 0), torch.where(live, row1, 0)]).to(torch.int32)
    return order.to(torch.int32), meta.contiguous(), n_tiles


@triton.jit
def _moe_reduce_kernel(y_ptr, ids_ptr, out_ptr, T, D, E, stride_y, stride_it, stride_o,
                       K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                       PDL: tl.constexpr = False):
    """out[t] = Σ_r y[t·K + slot_r] over the token's valid slots, slot_r the one of rank r in
    (expert id, slot) order: ranks counted from the token's K ids (KP = K padded to a power of 2)."""
    pdl_wait(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tmask = t < T
    t64 = t.to(tl.int64)
    cmask = c < D
    s = tl.arange(0, KP)
    eid = tl.load(ids_ptr + t64[:, None] * stride_it + s[None, :], mask=tmask[:, None] & (s < K)[None, :],
                  other=-1).to(tl.int32)
    key = tl.where(eid < 0, E, eid)
    key = tl.where((s < K)[None, :], key, E + 1)                       # the padding lanes last
    before = (key[:, None, :] < key[:, :, None]) | \
        ((key[:, None, :] == key[:, :, None]) & (s[None, None, :] < s[None, :, None]))
    rank = tl.sum(before.to(tl.int32), axis=2)                          # [BLOCK_T, KP]
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for r in tl.static_range(K):                   # the token's slots in ascending expert id
        at_r = rank == r
        slot = tl.sum(tl.where(at_r, s[None, :], 0), axis=1).to(tl.int64)
        ok = tmask & (tl.sum(tl.where(at_r, eid, 0), axis=1) >= 0)
        y = tl.load(y_ptr + (t64 * K + slot)[:, None] * stride_y + c[None, :],
                    mask=ok[:, None] & cmask[None, :], other=0.0)
        acc += y.to(tl.float32)
    tl.store(out_ptr + t64[:, None] * stride_o + c[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=tmask[:, None] & cmask[None, :])


def reduce_pairs(y: torch.Tensor, ids: torch.Tensor, E: int, out: torch.Tensor) -> None:
    """out [T, D] <- Σ over each token's valid slots of y [T·k, D] (row t·k + slot), in
    ascending expert id, FP32 from 0."""
    T, D = out.shape
    K = ids.shape[1]
    ids_c = ids if ids.stride(1) == 1 else ids.contiguous()
    dst = out if out.stride(1) == 1 else torch.empty_like(out, memory_format=torch.contiguous_format)
    bd = min(REDUCE_BLOCK_D, triton.next_power_of_2(D))
    bt = max(1, min(triton.next_power_of_2(T), 2048 // bd))
    _moe_reduce_kernel[(triton.cdiv(T, bt), triton.cdiv(D, bd))](
        y, ids_c, dst, T, D, E, y.stride(0), ids_c.stride(0), dst.stride(0),
        K=K, KP=triton.next_power_of_2(K), BLOCK_T=bt, BLOCK_D=bd, num_warps=4, **pdl(y.device))
    if dst is not out:
        out.copy_(dst)


@triton.jit
def swiglu_values(acc_g, acc_u, wt, limit, ACT: tl.constexpr):
    """The up GEMMs' SwiGLU on FP32 sums: both rounded to the activation dtype ACT (the
    reference's GEMM outputs), clamp, silu, x routing weight wt, rounded to ACT; FP32."""
    g = acc_g.to(ACT).to(tl.float32)
    u = acc_u.to(ACT).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    g = tl.minimum(g, limit)
    h = (g / (1.0 + tl.exp(-g))) * u * wt
    return h.to(ACT).to(tl.float32)


@triton.jit
def swiglu_store(acc_g, acc_u, wt, rows, rn, rmask, nmask, h_ptr, stride_h, limit,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The up GEMMs' epilogue: `swiglu_values` in h's dtype, FP8 QAT per 32 along I -> h rows."""
    h = swiglu_values(acc_g, acc_u, wt[:, None], limit, h_ptr.dtype.element_ty)
    hq = tl.reshape(fp8_qat_groups(tl.reshape(h, [BLOCK_M, BLOCK_N // 32, 32]), 2), [BLOCK_M, BLOCK_N])
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * stride_h + rn[None, :], hq.to(h_ptr.dtype.element_ty),
             mask=rmask[:, None] & nmask[None, :])
