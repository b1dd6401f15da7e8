"""StepRows: what each row of a step reads and writes, computed on the host from the scheduled
requests, with numpy and no Python loop over tokens, and each STATE slot's host mirror.

Per row: token id, position, request, window rows (the ring rows p-W+1 .. p, oldest first; this
step's own rows where computed now), ring, tail and owner-plane destinations, and the Engram
hash ids of every Engram layer. Per request: the cursor the step commits (position, last m
compressed ids). The Engram history comes from the tokens the host holds, never the device.

A decode step whose requests are the ones each slot's mirror describes (`decode`) reads only
(seq_id, position, last token) per request; any other step (`general`) reads each request's
tokens and fields. Both give the same fields (tests/test_decode_fast_path.py).
"""
from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from runtime.batch import window_rows
from runtime.cache import KVCache
from runtime.scheduler import ScheduledBatch
from v41.engram.hashing import DEAD, EngramLayout, LayerHashes


class StepRows:
    verify_history = False      # tests: check the host's Engram history against the STATE cursor

    def __init__(self, cfg, cache: KVCache, page: int, token_map: np.ndarray, max_seqs: int):
        self.cache, self.page, self.W = cache, page, cfg.sliding_window
        self.token_map = token_map
        self.layout = layout = EngramLayout(cfg, pad_id=int(token_map[cfg.engram_pad_token_id]))
        self.hash_layers = LayerHashes(layout, range(len(cfg.engram_layer_ids)),
                                       [f"engram_ids.{l}" for l in cfg.engram_layer_ids])
        self.m = m = layout.max_ngram - 1          # Engram history length (the cursor's ids)
        self.ids_width = m * layout.n_heads        # hash ids per row and Engram layer
        # each slot's request after its last commit: (seq_id, committed position, encoder
        # floor, first written row, tail start) and its Engram history
        self.slot_meta = np.full((cache.num_slots, 5), -1, np.int64)
        self.slot_hist = np.zeros((cache.num_slots, m), np.int64)
        self._rotation = (np.arange(self.W)[:, None] + np.arange(self.W)) % self.W    # [r, j]: (r + j) % W
        self._no_image = np.full(max_seqs, -1, np.int64)

    def general(self, sb: ScheduledBatch, host: dict, n: np.ndarray, T: int):
        """Any step's per-row fields but image_dest (the runner's capture plan). Returns
        (fields, per-request meta [B, 5], known tokens, each request's Engram history after the step)."""
        seqs, B = sb.seqs, len(sb.seqs)
        m, W, S = self.m, self.W, self.cache.num_slots
        # per request, in one pass: first position, encoder floor, first written row, tail
        # start, known tokens
        cols = np.array([(s.seq_id, s.num_computed, s.swa_floor, s.write_from, s.decoder_start or 0,
                          len(s.token_ids)) for s in seqs], dtype=np.int64).reshape(B, 6)
        meta, known = cols[:, :5], cols[:, 5] + [len(d) for d in sb.drafts]
        starts, floor_r, write_r = meta[:, 1], meta[:, 2], meta[:, 3]
        slots = sb.slots
        # the tokens of the step and the m before each request's first (its Engram history)
        hl = np.minimum(starts, m)
        # a verify request's rows: its anchor, then its drafts (never in token_ids)
        toks = [chain(s.token_ids[a - h:a + k], d) for s, a, h, k, d in zip(seqs, starts.tolist(), hl.tolist(),
                                                                           sb.num_new, sb.drafts)]
        flat = np.fromiter(chain.from_iterable(toks), dtype=np.int64, count=int(hl.sum()) + T)
        src0 = np.cumsum(hl + n) - (hl + n)                          # each request's chunk in `flat`
        first = np.repeat(np.cumsum(n) - n, n)                      # row of each request's first token
        within = np.arange(T) - first
        ids = flat[np.repeat(src0 + hl, n) + within]
        bid = np.repeat(np.arange(B), n)
        pos = np.repeat(starts, n) + within
        start_t, slot_t = np.repeat(starts, n), np.repeat(slots, n)
        end_t = start_t + np.repeat(n, n)
        # written straight into the host mirror (the runner skips its copy)
        win = window_rows(host["win_idx"][:T], pos, start_t, slot_t, np.repeat(floor_r, n), W, S)
        dest = self.owner_dest(sb.block_tables[bid, pos // self.page], pos, np.repeat(write_r, n))
        fields = dict(input_ids=ids, positions=pos, batch_ids=bid, win_idx=win,
                      ring_dest=np.where(pos >= end_t - W, slot_t * W + pos % W, -1),
                      tail_src=np.where((pos % 2 == 1) & (pos == start_t), slot_t, -1),
                      tail_dst=np.where((pos == end_t - 1) & (pos % 2 == 0), slot_t, -1),
                      dest1=dest[1], dest2=dest[2])
        return fields, meta, known, self.engram_ids(flat, src0, hl, n, starts, slots, T, host)

    def decode(self, sb: ScheduledBatch, host: dict):
        """`general` for a decode step (ScheduledBatch.decode: one final row per request; no
        resume or capture), image_dest included: each request's fields and Engram history come
        from its slot's mirror, so the only pass over the requests reads (seq_id, position, last
        token). None when a mirror is not the request's at that position, or a row is below its
        tail start (decoder replay)."""
        seqs, B = sb.seqs, len(sb.seqs)
        m, W, S, P = self.m, self.W, self.cache.num_slots, self.page
        slots = sb.slots
        meta = self.slot_meta[slots]
        pos, floor_r, write_r = meta[:, 1], meta[:, 2], meta[:, 3]
        if sb.steady and not self.verify_history:
            # the step before's requests (Scheduler._next_decode), whose slots' mirrors are
            # theirs if the step before committed: the positions tell
            if not (pos == sb.positions).all():
                return None
            ids = np.fromiter([s.token_ids[-1] for s in seqs], np.int64, B)
        else:
            got = np.fromiter(chain.from_iterable([(s.seq_id, s.num_computed, s.token_ids[-1]) for s in seqs]),
                              np.int64, 3 * B).reshape(B, 3)
            if not (meta[:, :2] == got[:, :2]).all():
                return None
            ids = got[:, 2]
        if not (pos >= meta[:, 4]).all():
            return None
        bid = np.arange(B)
        # window rows p-W+1 .. p: ring rows (slot*W + q % W, q % W read from a rotation table),
        # the last one this step's row; rows below the floor (or position 0) read nothing
        win = host["win_idx"][:B]
        np.add(self._rotation[(pos + 1) % W], (slots * W)[:, None], out=win)
        win[:, -1] = S * W + bid
        low = np.flatnonzero(pos - (W - 1) < floor_r)
        if low.size:
            q = pos[low, None] - (W - 1) + np.arange(W)
            win[low] = np.where(q >= floor_r[low, None], win[low], -1)
        off = pos % P
        d1 = sb.block_tables[bid, pos // P] * P + off      # owner row of ratio 1; ratio 2: d1 // 2
        odd = (off & 1) == 1
        cached = pos < write_r
        fields = dict(input_ids=ids, positions=pos, batch_ids=bid, win_idx=win,
                      ring_dest=slots * W + pos % W, tail_src=np.where(odd, slots, -1),
                      tail_dst=np.where(odd, -1, slots), dest1=np.where(cached, -1, d1),
                      dest2=np.where(odd & ~cached, d1 >> 1, -1), image_dest=self._no_image[:B])
        hist = self.slot_hist[slots]
        if self.verify_history:
            self.check_history(hist, pos, slots)
        look = np.empty((B, m + 1), np.int64)          # look[t, k]: compressed id at position p - k
        look[:, 0] = self.token_map[ids]
        look[:, 1:] = hist[:, ::-1]
        self.hash_layers(look, host)
        return fields, meta, pos + 1, np.concatenate([hist[:, 1:], look[:, :1]], 1)

    def owner_dest(self, page: np.ndarray, pos: np.ndarray, write_from: np.ndarray) -> dict:
        """Owner plane row of the group each row completes, per ratio (-1: none, or cached)."""
        dest = {}
        for r in (1, 2):
            rpp = self.page // r
            # a group is written by the row completing it, unless the prefix cache holds it
            dest[r] = np.where((pos % r == r - 1) & (pos >= write_from), page * rpp + (pos // r) % rpp, -1)
        return dest

    def engram_ids(self, flat, src0, hl, n, starts, slots, T, host) -> np.ndarray:
        """Hash ids of every Engram layer into the host mirrors, from the step's tokens and the
        m tokens before each request's first (`flat`, `hl` of them; DEAD before position 0).
        Returns each request's last m compressed ids, its history after the step."""
        m, B = self.m, len(n)
        comp = self.token_map[flat]
        # per request: [history (m ids, oldest first), this step's compressed ids]
        ext_len = n + m
        base = np.cumsum(ext_len) - ext_len
        ext = np.full(int(ext_len.sum()), DEAD, dtype=np.int64)
        ext[np.repeat(base + m - hl - src0, hl + n) + np.arange(len(flat))] = comp
        if self.verify_history:
            self.check_history(ext[base[:, None] + np.arange(m)], starts, slots)
        first = np.repeat(np.cumsum(n) - n, n)
        tok_ext = np.repeat(base + m, n) + (np.arange(T) - first)
        look = ext[tok_ext[:, None] - np.arange(m + 1)]
        self.hash_layers(look, host)
        return ext[(base + ext_len)[:, None] - m + np.arange(m)].reshape(B, m)

    def check_history(self, hist, starts, slots) -> None:
        """Tests (`verify_history`): the history taken from the host's tokens equals the STATE
        cursor's, and its position the request's first (positions before 0 are DEAD; a slot
        starting at 0 holds whatever its last request left). Reads the device."""
        cursor = self.cache.cursor
        dev = cursor[torch.as_tensor(slots, device=cursor.device)].cpu().numpy()
        want = np.where(starts[:, None] - self.m + np.arange(self.m) >= 0, dev[:, 1:], DEAD)
        if not (np.array_equal(want, hist) and np.array_equal(np.where(starts > 0, dev[:, 0], 0), starts)):
            raise AssertionError(f"Engram history on the host {hist.tolist()} / starts {starts.tolist()} "
                                 f"differs from the STATE cursor {dev.tolist()}")

    def cursor_at(self, token_ids, position: int, base: int = 0) -> list[int]:
        """[position, compressed ids of the m tokens before it (DEAD before 0)]; token_ids[i] is
        the token at position base + i."""
        m = self.m
        hist = [int(self.token_map[token_ids[p - base]]) if p >= 0 else DEAD for p in range(position - m, position)]
        return [position] + hist

    def commit(self, slots: np.ndarray, meta: np.ndarray, ends: np.ndarray, hist: np.ndarray) -> None:
        """The slots' mirrors after a step: its requests' meta, committed up to `ends`, with `hist`."""
        self.slot_meta[slots] = meta
        self.slot_meta[slots, 1] = ends
        self.slot_hist[slots] = hist

    def set_cursors(self, slots: np.ndarray, cursors: np.ndarray) -> None:
        """The slots' mirrors at `cursors`, rows of `cursor_at` (DSpark's accepted tokens)."""
        self.slot_meta[slots, 1], self.slot_hist[slots] = cursors[:, 0], cursors[:, 1:]
