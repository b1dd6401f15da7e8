"""ModelRunner: publishes a ScheduledBatch into persistent buffers (fixed addresses, sized for
`max_num_batched_tokens` and `max_num_seqs`), runs the forward and returns the hidden rows that
sample. Metadata is computed on the host with numpy, without a Python loop over tokens.

A step runs `running_tokens` rows for `running_bs` requests: the scheduled ones first, then
padding rows (batch id -1, every destination -1) and zero-length padding requests, which read
and write nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runtime import replay
from runtime.cache import KVCache
from runtime.geometry import PoolGeometry
from runtime.scheduler import ScheduledBatch
from runtime.state import StateTransfer
from v41.engram.hashing import DEAD, EngramLayout, hash_lookback
from v41.model import Transformer

ops = torch.ops.v41


@dataclass
class Batch:
    """The forward's view of one step: tensors of `running_tokens` rows / `running_bs` requests."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    batch_ids: torch.Tensor        # request of each row, -1 for padding
    block_table: torch.Tensor      # [running_bs, max_pages]
    win_idx: torch.Tensor          # [T, W] window rows: ring row, ring rows + batch row, or -1
    ring_dest: torch.Tensor        # [T] ring row each row is kept in after the step, or -1
    owner_dest: dict               # ratio -> [T] owner plane row of the group a row completes
    tail_src: torch.Tensor         # [T] tail slot a row's group starts in, or -1
    tail_dst: torch.Tensor         # [T] tail slot that keeps the row for the next step, or -1
    engram_rows: dict              # layer -> [T, width] gathered table rows
    image_dest: torch.Tensor | None = None  # [T] checkpoint-image ring row, or -1 (copy mode)
    decoder: object = None         # runtime.replay.DecoderRows, or None: every row runs every layer


class ModelRunner:
    def __init__(self, cfg, weights, geo: PoolGeometry, num_pages: int, num_slots: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, token_map,
                 device, dtype, transfer: str, num_images: int, decoder_replay: bool = False):
        """`decoder_replay`: decoder SWA bounded replay (runtime.replay); each request's
        Sequence.decoder_start says where its decoder rows begin."""
        self.cfg, self.geo, self.device, self.dtype = cfg, geo, torch.device(device), dtype
        self.decoder_replay = decoder_replay
        self.model = Transformer(cfg, weights, dtype, device, max_pos=max_model_len)
        self.cache = KVCache(geo, num_pages, num_slots, num_images, device)
        self.state = StateTransfer(self.cache, transfer)
        self.W, self.page = cfg.sliding_window, geo.page_tokens
        self.token_map = np.asarray(token_map, dtype=np.int64)
        self.layout = EngramLayout(cfg, pad_id=int(self.token_map[cfg.engram_pad_token_id]))
        self.engram_tables = {l: (weights[f"layers.{l}.engram.embed.weight"],
                                  weights[f"layers.{l}.engram.embed.scale"]) for l in cfg.engram_layer_ids}
        self.max_pages = -(-max_model_len // geo.page_tokens)
        T, B = max_num_batched_tokens, max_num_seqs
        self.max_tokens, self.max_seqs = T, B
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=self.device)  # noqa: E731
        self.buf = {"input_ids": z(T), "positions": z(T), "batch_ids": z(T), "block_table": z(B, self.max_pages),
                    "win_idx": z(T, self.W), "ring_dest": z(T), "tail_src": z(T), "tail_dst": z(T),
                    "dest1": z(T), "dest2": z(T), "image_dest": z(T)}
        width = cfg.engram_width
        self.engram_buf = {l: torch.zeros(T, width, dtype=dtype, device=self.device)
                           for l in cfg.engram_layer_ids}
        self.rows_run = {"encoder": 0, "decoder": 0}    # rows each part of the model has run
        self.use_forward(self.model, static_shapes=False)

    # a padding row's value in each per-token buffer: it reads and writes nothing (DESIGN §5
    # "Padding is inert"); block-table rows past the step's requests are 0
    PAD = {"input_ids": 0, "positions": 0, "batch_ids": -1, "win_idx": -1, "ring_dest": -1, "tail_src": -1,
           "tail_dst": -1, "dest1": -1, "dest2": -1, "image_dest": -1}

    def use_forward(self, forward, *, static_shapes: bool) -> None:
        """The step's forward: the eager model, or a compiled one (runtime.compile.compile_runner
        installs its CompiledForward), which wants `static_shapes`: every step then passes the
        same Batch structure (block table at full capacity, image rows whenever images exist), so
        one graph serves every step."""
        self.forward, self.static_shapes = forward, static_shapes

    def block_table_rows(self, n: int) -> torch.Tensor:
        """The block-table rows a forward of `n` requests reads (all of them under static_shapes:
        rows past the step's requests are zero, and only padding rows, batch id -1, point there)."""
        return self.buf["block_table"] if self.static_shapes else self.buf["block_table"][:n]

    def image_rows(self, captures, rows: torch.Tensor) -> torch.Tensor | None:
        """The Batch's image_dest: the rows when the step captures images (or, under
        static_shapes, whenever the cache has images: all -1 without a capture), else None."""
        keep = captures or (self.static_shapes and self.cache.image_ring.shape[1] > 0)
        return rows if keep else None

    # ---- metadata ------------------------------------------------------------------------
    def prepare(self, sb: ScheduledBatch, running_tokens: int | None = None,
                running_bs: int | None = None) -> Batch:
        """Host metadata for the step, copied into the persistent buffers. Prefix hits get
        their state first (a restored image, or a replay cursor), before Engram inputs."""
        self.resume(sb)
        n = np.asarray(sb.num_new, dtype=np.int64)
        starts = np.fromiter((s.num_computed for s in sb.seqs), dtype=np.int64, count=len(n))
        slots = sb.slots
        T = int(n.sum())
        Tr, Br = running_tokens or T, running_bs or len(sb.seqs)
        if Tr > self.max_tokens or Br > self.max_seqs or Tr < T or Br < len(sb.seqs):
            raise ValueError(f"step of {T} tokens / {len(sb.seqs)} requests does not fit running width "
                             f"{Tr}/{Br} (capacity {self.max_tokens}/{self.max_seqs})")
        W, S = self.W, self.cache.num_slots
        bid = np.repeat(np.arange(len(n)), n)
        first = np.repeat(np.cumsum(n) - n, n)                      # row of each request's first token
        pos = np.repeat(starts, n) + (np.arange(T) - first)
        start_t, slot_t = np.repeat(starts, n), np.repeat(slots, n)
        end_t = np.repeat(starts + n, n)
        ids = np.fromiter((t for s, a, k in zip(sb.seqs, sb.starts, sb.num_new) for t in s.token_ids[a:a + k]),
                          dtype=np.int64, count=T)
        # window: positions p-W+1 .. p, oldest first; this step's rows where computed now
        q = pos[:, None] - (W - 1) + np.arange(W)
        row = np.where(q >= start_t[:, None], S * W + np.arange(T)[:, None] - (pos[:, None] - q),
                       slot_t[:, None] * W + q % W)
        floor = np.repeat(np.fromiter((s.swa_floor for s in sb.seqs), dtype=np.int64, count=len(n)), n)
        win = np.where(q >= floor[:, None], row, -1)      # encoder replay: no window below the floor
        ring_dest = np.where(pos >= end_t - W, slot_t * W + pos % W, -1)
        tail_src = np.where((pos % 2 == 1) & (pos == start_t), slot_t, -1)
        tail_dst = np.where((pos == end_t - 1) & (pos % 2 == 0), slot_t, -1)
        bt = sb.block_tables
        write_from = np.repeat(np.fromiter((s.write_from for s in sb.seqs), dtype=np.int64, count=len(n)), n)
        dest = {}
        for r in (1, 2):
            rpp = self.page // r
            j = pos // r
            page = bt[bid, (j * r) // self.page]
            # a group is written by the row completing it, unless the prefix cache holds it
            dest[r] = np.where((pos % r == r - 1) & (pos >= write_from), page * rpp + j % rpp, -1)
        host = dict(input_ids=ids, positions=pos, batch_ids=bid, win_idx=win, ring_dest=ring_dest,
                    tail_src=tail_src, tail_dst=tail_dst, dest1=dest[1], dest2=dest[2],
                    image_dest=self.plan_captures(sb, starts, np.cumsum(n) - n, T))
        for k, a in host.items():
            b = self.buf[k]
            b[:T].copy_(torch.from_numpy(a))
            if Tr > T:
                b[T:Tr].fill_(self.PAD[k])
        self.buf["block_table"][: len(n)].copy_(torch.from_numpy(bt))
        hi = self.max_seqs if self.static_shapes else Br
        if hi > len(n):
            self.buf["block_table"][len(n):hi].fill_(0)
        self._committed = (slots, starts + n)
        batch = self.batch_view(Tr, Br, self.prepare_engram(ids, n, starts, slots, T, Tr), sb.captures)
        tails = np.fromiter((s.decoder_start or 0 for s in sb.seqs), dtype=np.int64, count=len(n))
        last = np.where(sb.is_final_chunk, np.cumsum(n) - 1, -1)
        dec = replay.plan(pos, bid, starts, tails, slots, last, W, S) if self.decoder_replay else None
        if dec is not None:
            batch.decoder = replay.decoder_rows(batch, *dec, Batch)
            self.rows_run["decoder"] += len(dec[0])
        else:
            self.rows_run["decoder"] += T
        self.rows_run["encoder"] += T
        return batch

    def padding_batch(self, tokens: int) -> Batch:
        """A step of `tokens` padding rows and no request: reads and writes nothing; it traces and
        warms the compiled segments (runtime.compile.compile_runner)."""
        if not 1 <= tokens <= self.max_tokens:
            raise ValueError(f"padding batch of {tokens} rows: capacity is {self.max_tokens}")
        for k, b in self.buf.items():
            if k != "block_table":
                b[:tokens].fill_(self.PAD[k])
        self.block_table_rows(1).fill_(0)
        return self.batch_view(tokens, 1, {l: b[:tokens].zero_() for l, b in self.engram_buf.items()}, [])

    def batch_view(self, rows: int, bs: int, engram_rows: dict, captures) -> Batch:
        """The Batch over the persistent buffers' first `rows` rows and `bs` requests."""
        v = {k: b[:rows] for k, b in self.buf.items() if k != "block_table"}
        return Batch(v["input_ids"], v["positions"], v["batch_ids"], self.block_table_rows(bs), v["win_idx"],
                     v["ring_dest"], {1: v["dest1"], 2: v["dest2"]}, v["tail_src"], v["tail_dst"],
                     engram_rows, self.image_rows(captures, v["image_dest"]))

    def resume(self, sb: ScheduledBatch) -> None:
        """A prefix hit's fresh slot gets its state: the checkpoint image (copy), or, for
        encoder replay, only the cursor: the replay start and the compressed tokens before it."""
        for i, (kind, *arg) in sb.resumes:
            seq, slot = sb.seqs[i], int(sb.slots[i])
            if kind == "image":
                self.state.restore(arg[0], slot)
            else:
                self.cache.cursor[slot] = torch.as_tensor(self.cursor_at(seq.token_ids, seq.num_computed))

    def cursor_at(self, token_ids, position: int) -> list[int]:
        m = self.layout.max_ngram - 1
        hist = [int(self.token_map[token_ids[p]]) if p >= 0 else DEAD for p in range(position - m, position)]
        return [position] + hist

    def plan_captures(self, sb: ScheduledBatch, starts, offsets, T) -> np.ndarray:
        """Copy mode: image rows of each boundary a request's forward crosses, [T] destinations
        for this forward's rows; rows computed earlier are copied from the ring now, before the
        forward moves the ring on."""
        dest = np.full(T, -1, dtype=np.int64)
        W, c = self.W, self.cache
        for i, end, img in sb.captures:
            seq, slot, a = sb.seqs[i], int(sb.slots[i]), int(starts[i])
            for p in range(max(0, end - W), end):
                if p >= a:
                    dest[offsets[i] + p - a] = img * W + p % W
                else:
                    c.image_ring[:, img * W + p % W] = c.ring[:, slot * W + p % W]
            c.image_cursor[img] = torch.as_tensor(self.cursor_at(seq.token_ids, end))
        return dest

    def prepare_engram(self, ids, n, starts, slots, T, Tr) -> dict:
        """Hash ids from the tokens and each request's committed Engram history (the STATE
        cursor, read after any restore), then the table rows of every Engram layer."""
        m = self.layout.max_ngram - 1
        hist = self.cache.cursor[torch.as_tensor(slots, device=self.device), 1:].cpu().numpy()
        # a slot holds whatever its last request left (or zeros): positions before 0 are DEAD
        hist = np.where(starts[:, None] - m + np.arange(m) >= 0, hist, DEAD)
        comp = self.token_map[ids]
        # per request: [history (m ids, oldest first), this step's compressed ids]
        ext_len = n + m
        ext = np.empty(int(ext_len.sum()), dtype=np.int64)
        base = np.cumsum(ext_len) - ext_len
        hrow = np.repeat(base, m) + np.tile(np.arange(m), len(n))
        ext[hrow] = hist.reshape(-1)[: hrow.size]
        first = np.repeat(np.cumsum(n) - n, n)
        tok_ext = np.repeat(base + m, n) + (np.arange(T) - first)
        ext[tok_ext] = comp
        look = ext[tok_ext[:, None] - np.arange(m + 1)]
        # the last m compressed ids of each request become its history after the step
        self._tail_ids = ext[(base + ext_len)[:, None] - m + np.arange(m)]
        out = {}
        for i, l in enumerate(self.cfg.engram_layer_ids):
            hid = torch.from_numpy(hash_lookback(look, self.layout, i))
            buf = self.engram_buf[l]
            table, scale = self.engram_tables[l]
            ops.engram_gather(table, scale, hid, buf[:T])
            out[l] = buf[:Tr]
        return out

    # ---- step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, sb: ScheduledBatch, all_rows: bool = False, **width) -> torch.Tensor:
        """Forward one step. Returns logits of each request's last row (the sampling rows), or of
        every row when `all_rows` (teacher forcing)."""
        batch = self.prepare(sb, **width)
        if all_rows and batch.decoder is not None:
            raise ValueError("every row's logits (teacher forcing) need the decoder on every row: "
                             "--no-decoder-swa-bounded-replay")
        h = self.forward(batch, self.cache)
        self.commit(sb)
        for _, end, img in sb.captures:
            self.state.seal(img, end)
        T = sb.scheduled_tokens
        if batch.decoder is not None:
            # only the rows the step samples left the decoder; the other requests' rows are NaN
            out = torch.full((len(sb.seqs), self.cfg.vocab_size), float("nan"), device=h.device)
            final = torch.as_tensor(np.flatnonzero(sb.is_final_chunk), device=h.device)
            lg = self.model.logits(h)
            return out.to(lg.dtype).index_copy_(0, final, lg)
        if all_rows:
            return self.model.logits(h[:T])
        last = torch.as_tensor(np.cumsum(sb.num_new) - 1, device=h.device)
        return self.model.logits(h[last])

    def commit(self, sb: ScheduledBatch) -> None:
        """Positions and Engram history advance after the forward: cursor = (committed position,
        last three compressed ids)."""
        if not sb.seqs:
            return
        slots, pos = self._committed
        cur = torch.from_numpy(np.concatenate([pos[:, None], self._tail_ids], 1))
        self.cache.cursor[torch.from_numpy(slots).to(self.device)] = cur.to(self.device)
