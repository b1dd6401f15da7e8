"""Decoder SWA bounded replay (DESIGN.md §5): which rows of a forward run the decoder.

With W the window and L a request's prompt length, the decoder (the boundary layer's attention
and FFN through the last layer) runs on the request's positions from its tail start
s = max(0, L - W) on, and every decoder window starts there: a row at position p reads
[max(s, p - W + 1), p]. Rows below s run the encoder and the boundary layer's compression
(the global KV every later row reads) and nothing else; the last layer's query, attention and
FFN run only on the row each finishing request samples from.

A finishing prompt's forward therefore runs the decoder on its last W rows (the scheduler never
ends a chunk past s, so the forward that finishes the prompt starts at or below s), decode rows
run it on their one row, and a recompute after preemption rebuilds exactly the decoder rows
the uninterrupted run computed (positions from s on). Rows below s never reach the decoder, so
no decoder ring row below s is ever written or read.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from runtime.batch import PAD, window_rows
from v41.attention import QueryRows


def decoder_start(num_prompt_tokens: int, window: int, replay: bool) -> int | None:
    """The first position of a request that runs the decoder (its tail start); None with
    replay off (every position)."""
    return max(0, num_prompt_tokens - window) if replay else None


def cut_chunk(start: int, n: int, num_tokens: int, tail_start: int | None) -> int:
    """A chunk that does not finish the request ends at its tail start rather than past it, so
    the forward that finishes the prompt holds the whole tail."""
    if tail_start is not None and start + n < num_tokens and start < tail_start < start + n:
        return tail_start - start
    return n


@dataclass
class DecoderRows:
    """The decoder's part of a forward: its rows (index into the batch), their Batch (windows
    from the tail start, no compression destinations) and the last layer's query rows."""
    rows: torch.Tensor
    batch: object
    queries: QueryRows


def plan(pos, bid, starts, tails, slots, sampled, W: int, S: int):
    """Host arrays of the decoder rows of a step (None: every row runs every layer).

    pos, bid: position and request of each row; starts, tails, slots: per request, the forward's
    first position, the tail start, the STATE slot; sampled: the rows the step samples, in batch
    order (a finishing request's last row; every row of a DSpark verify request; -1 entries are
    ignored). They are the last layer's query rows. Returns (rows, win_idx, query rows in the
    decoder's numbering), win_idx as Batch.win_idx over the decoder's rows."""
    dec = pos >= tails[bid]
    last = sampled[sampled >= 0]
    if dec.all() and len(last) == len(pos):     # decode rows only: the whole model on every row
        return None
    rows = np.flatnonzero(dec)
    p, b = pos[rows], bid[rows]
    first_pos = np.maximum(starts, tails)        # each request's first decoder row's position
    win = window_rows(np.empty((len(rows), W), np.int64), p, first_pos[b], slots[b], tails[b], W, S)
    queries = np.searchsorted(rows, last)
    return rows, win, queries


# the decoder Batch's per-row fields held in step buffers of their own (`dec_<field>`, beside
# dec_rows / dec_win / dec_queries), so a TR_HYBRID graph of the late layers reads them in place;
# owner_dest, tail_src and tail_dst are -1 on every decoder row (`dec_none`)
FIELDS = ("input_ids", "positions", "batch_ids", "ring_dest", "image_dest")


def step_fields(T: int) -> dict:
    """Shapes of the decoder's extra step buffers (runtime.batch.step_fields has the rest)."""
    return {f"dec_{k}": (T,) for k in (*FIELDS, "none")}


def stage(host: dict, fields: dict, rows: np.ndarray, win: np.ndarray, queries: np.ndarray,
          buckets=None) -> dict:
    """The decoder's rows into the host mirrors, padded to the smallest of `buckets` holding them
    (a token graph's width; None: exact) with inert rows: gathered from row 0, batch id -1, every
    destination and window -1; they are never query rows, so nothing reads what they compute.
    `fields`: the step's per-row host fields. Returns the rows to publish per field."""
    n = len(rows)
    width = buckets[bisect.bisect_left(buckets, n)] if buckets else n
    host["dec_rows"][:n], host["dec_rows"][n:width] = rows, 0
    host["dec_win"][:n], host["dec_win"][n:width] = win, -1
    host["dec_queries"][:len(queries)] = queries
    for k in FIELDS:
        host[f"dec_{k}"][:n], host[f"dec_{k}"][n:width] = fields[k][rows], PAD[k]
    host["dec_none"][:width] = -1
    return {"dec_rows": width, "dec_win": width, "dec_queries": len(queries), "dec_none": width} | \
        {f"dec_{k}": width for k in FIELDS}


def decoder_rows(batch, dev: dict, batch_cls) -> DecoderRows:
    """The DecoderRows of `batch` over the published decoder buffers (`dev`: their device views,
    `stage`'s row counts): per-row fields read in place, Engram rows gathered from the batch's."""
    r, w, none = dev["dec_rows"], dev["dec_win"], dev["dec_none"]
    sub = batch_cls(dev["dec_input_ids"], dev["dec_positions"], dev["dec_batch_ids"], batch.block_table, w,
                    dev["dec_ring_dest"], {k: none for k in batch.owner_dest}, none, none,
                    {l: e[r] for l, e in batch.engram_rows.items()},
                    None if batch.image_dest is None else dev["dec_image_dest"], max_position=batch.max_position)
    qr = dev["dec_queries"]
    return DecoderRows(r, sub, QueryRows(qr, sub.positions[qr], sub.batch_ids[qr], w[qr], batch.block_table))


def padding_decoder(bufs, batch, width: int, batch_cls) -> DecoderRows:
    """A decoder of `width` padding rows and no query row over the decoder buffers: a TR_HYBRID
    capture runs the late layers' pieces on it (runtime.token_graphs)."""
    empty = np.zeros(0, np.int64)
    rows = stage(bufs.begin(), {k: empty for k in FIELDS}, empty, np.zeros((0, bufs.host["dec_win"].shape[1]),
                                                                           np.int64), empty, (width,))
    return decoder_rows(batch, bufs.publish(rows), batch_cls)
