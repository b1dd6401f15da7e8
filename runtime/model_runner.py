"""ModelRunner: publishes a ScheduledBatch into the step's buffers (runtime.batch.StepBuffers:
fixed device addresses sized for `max_num_batched_tokens` and `max_num_seqs`, host mirrors
filled with numpy, one non-blocking copy per field), runs the forward and returns the logits of
the rows that sample. The rows' fields come from runtime.step_rows (host arithmetic, no Python
loop over tokens), and nothing in a step reads the device.

A step runs `running_tokens` rows for `running_bs` requests: the scheduled ones first, then
padding rows (batch id -1, every destination -1) and zero-length padding requests, which read
and write nothing.
"""
from __future__ import annotations

import numpy as np
import torch

from runtime import replay, spec_step
from runtime.batch import PAD, Batch, StepBuffers, step_fields
from runtime.cache import KVCache
from runtime.geometry import PoolGeometry
from runtime.scheduler import ScheduledBatch
from runtime.state import StateTransfer
from runtime.step_rows import StepRows
from v41.loader.engram_map import engram_stager, engram_tables
from v41.model import Transformer

ops = torch.ops.v41


class ModelRunner:
    PAD = PAD
    decode_fast_path = True     # tests: False runs every step through StepRows.general

    def __init__(self, cfg, weights, geo: PoolGeometry, num_pages: int, num_slots: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, token_map,
                 device, dtype, transfer: str, num_images: int, decoder_replay: bool = False,
                 native_weights: bool = False, spec_tokens: int = 0):
        """`decoder_replay`: decoder SWA bounded replay (runtime.replay); each request's
        Sequence.decoder_start says where its decoder rows begin. `spec_tokens`: DSpark's drafts
        per verify step (runtime.spec_step; 0: off)."""
        self.cfg, self.geo, self.device, self.dtype = cfg, geo, torch.device(device), dtype
        self.decoder_replay = decoder_replay
        self.model = Transformer(cfg, weights, dtype, device, max_pos=max_model_len, native=native_weights)
        self.W, self.page = cfg.sliding_window, geo.page_tokens
        self.token_map = np.asarray(token_map, dtype=np.int64)
        self.max_model_len = max_model_len
        T, B = max_num_batched_tokens, max_num_seqs
        self.max_tokens, self.max_seqs = T, B
        self.tail_staging = max_num_seqs * (spec_tokens // 2 + 1) if spec_tokens else 0
        self.use_cache(num_pages, num_slots, num_images, transfer)
        self.engram_tables = engram_tables(cfg, weights, self.device)     # resident ones on the device
        self.max_pages = -(-max_model_len // geo.page_tokens)
        self.engram_stager = engram_stager(weights, T, self.device)    # tables mapped on the host
        m, ids_width = self.step_rows.m, self.step_rows.ids_width
        self.bufs = StepBuffers(step_fields(T, B, self.W, self.max_pages, {l: ids_width for l in cfg.engram_layer_ids},
                                            geo.page_tokens) | replay.step_fields(T)
                                | (spec_step.step_fields(T, B, 1 + m) if spec_tokens else {}), self.device)
        self.buf = {k: self.bufs.dev[k] for k in (*PAD, "block_table")}    # the Batch's fields
        width = cfg.engram_width
        self.engram_buf = {l: torch.zeros(T, width, dtype=dtype, device=self.device)
                           for l in cfg.engram_layer_ids}
        self.engram_ids = {l: f"engram_ids.{l}" for l in cfg.engram_layer_ids}    # layer -> its ids' field
        self.rows_run = {"encoder": 0, "decoder": 0}    # rows each part of the model has run
        self.fast_steps = 0             # steps StepRows.decode prepared
        self._table = None              # (block tables, rows) on the device's block_table buffer
        self._row_views = {}            # rows -> the Batch fields' and Engram rows' first rows (batch_view)
        # the step's largest position, on the host: the indexer sizes its scores without a device read
        self.max_position = torch.zeros(1, dtype=torch.long)
        self._max_position = self.max_position.numpy()      # written through numpy: no torch dispatch a step
        self._ones, self._rows = np.ones(max_num_batched_tokens, np.int64), np.arange(max_num_batched_tokens)
        self.graphs = None              # runtime.cuda_graph.graph_runner (FULL, TR_HYBRID), when captured
        self.use_forward(self.model, static_shapes=False)
        self.spec = None                # runtime.spec_step.SpecStep with DSpark
        if spec_tokens:
            self.spec = spec_step.SpecStep(self, weights, spec_tokens)

    def use_cache(self, num_pages: int, num_slots: int, num_images: int, transfer: str) -> None:
        """(Re)allocate the KV cache and its state transfer (the engine sizes the pool from
        memory after a profiling forward on a small one)."""
        self.cache = None
        self.cache = KVCache(self.geo, num_pages, num_slots, num_images, self.device, self.tail_staging)
        self.state = StateTransfer(self.cache, transfer)
        # each step's rows, and each slot's host mirror (a decode step reads it instead of
        # each request's tokens and fields)
        self.step_rows = StepRows(self.cfg, self.cache, self.page, self.token_map, self.max_seqs)

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
    def prepare(self, sb: ScheduledBatch, running_tokens: int | None = None, running_bs: int | None = None,
                decoder_buckets: tuple | None = None, gather: bool = True) -> Batch:
        """Host metadata for the step, written into the host mirrors and copied to the device
        buffers. Prefix hits get their state first (a restored image, or a replay cursor).
        `decoder_buckets`: the decoder's rows run padded to one of them (TR_HYBRID); `gather`
        False: the FULL graph the step replays gathers its Engram rows (`graph_forward`)."""
        host = self.bufs.begin()
        B = len(sb.seqs)
        # a decode step: one row per request (its last), the rows' numbers known already
        n, T = (self._ones[:B], B) if sb.decode else (np.asarray(sb.num_new, dtype=np.int64), sum(sb.num_new))
        Tr, Br = running_tokens or T, running_bs or B
        if Tr > self.max_tokens or Br > self.max_seqs or Tr < T or Br < B:
            raise ValueError(f"step of {T} tokens / {B} requests does not fit running width "
                             f"{Tr}/{Br} (capacity {self.max_tokens}/{self.max_seqs})")
        self.resume(sb, host)
        got = (self.step_rows.decode(sb, host) if self.decode_fast_path and sb.decode and not sb.resumes
               and not sb.captures else None)
        fast = got is not None
        self.fast_steps += fast
        fields, meta, known, tail_ids = got if fast else self.step_rows.general(sb, host, n, T)
        starts, tails, slots = meta[:, 1], meta[:, 4], sb.slots
        if not fast:
            fields["image_dest"] = self.plan_captures(sb, starts, np.cumsum(n) - n, T, host)
        if sb.spec:
            self.spec.stage(sb, fields, starts, n)
        self._max_position[0] = fields["positions"].max(initial=0)
        for k, a in fields.items():
            h = host[k]
            if not np.may_share_memory(h, a):      # (the window rows are written in place)
                h[:T] = a
            if Tr > T:
                h[T:Tr] = PAD[k]
        hi = self.max_seqs if self.static_shapes else Br
        # a steady decode step's table is the step before's (Scheduler._next_decode) with
        # `table_rows` changed: only those rows are written, and nothing when none changed
        written = self._table is None or self._table[0] is not sb.block_tables or self._table[1] != hi
        if written:
            host["block_table"][:B] = sb.block_tables
            host["block_table"][B:hi] = 0
            self._table = (sb.block_tables, hi)
        elif sb.table_rows is not None and sb.table_rows.size:
            host["block_table"][sb.table_rows] = sb.block_tables[sb.table_rows]
            written = True
        final = starts + n == known
        self.final_mask = final
        host["commit_slots"][:B] = slots
        host["commit_cursor"][:B, 0] = starts + n
        host["commit_cursor"][:B, 1:] = tail_ids
        self._mirror = (slots, meta, starts + n, tail_ids)
        ends = self._rows[:B] if sb.decode else np.cumsum(n) - 1
        # the rows that sample: each final chunk's last row, every row of a verify request
        sampled = self.spec.sampled_rows(ends, final, sb.drafts) if sb.spec else ends[final]
        # a fast decode step has every row in the decoder and every request final: no plan
        dec = (replay.plan(fields["positions"], fields["batch_ids"], starts, tails, slots,
                           sampled, self.W, self.cache.num_slots)
               if self.decoder_replay and not fast else None)
        rows = ({k: Tr for k in fields} | {"commit_slots": B, "commit_cursor": B}
                | dict.fromkeys(self.engram_ids.values(), T) | ({"block_table": hi} if written else {}))
        # the rows that sample: each request's last row; of those, the final chunks' (and
        # which requests they are). A fast decode step samples row i for request i: none needed
        F = int(final.sum())
        if not fast:
            host["sample_rows"][:B] = ends
            host["final_rows"][:F] = np.flatnonzero(final)
            host["final_last"][:len(sampled)] = sampled
            rows.update(sample_rows=B, final_rows=F, final_last=len(sampled))
        if dec is not None:
            rows.update(replay.stage(host, fields, *dec, decoder_buckets))
        dev = self.bufs.publish(rows)
        self._commit = (dev["commit_slots"], dev["commit_cursor"])
        self._sample = (B, T, F, *(dev.get(k) for k in ("sample_rows", "final_rows", "final_last")))
        if gather:
            self.gather_engram(dev, T)
        batch = self.batch_view(Tr, Br, sb.captures)
        self._fields = fields if self.spec is not None else None
        if dec is not None:
            batch.decoder = replay.decoder_rows(batch, dev, Batch)
        self.rows_run["decoder"] += T if dec is None else len(dec[0])
        self.rows_run["encoder"] += T
        return batch

    def padding_batch(self, tokens: int) -> Batch:
        """A step of `tokens` padding rows and no request: reads and writes nothing; it traces,
        warms and captures the compiled forward (runtime.compile, runtime.cuda_graph)."""
        if not 1 <= tokens <= self.max_tokens:
            raise ValueError(f"padding batch of {tokens} rows: capacity is {self.max_tokens}")
        for k, pad in PAD.items():                # every field but the block table
            self.buf[k][:tokens].fill_(pad)
        self.block_table_rows(1).fill_(0)
        self._table = None
        self._max_position[0] = 0
        batch = self.batch_view(tokens, 1, [])
        for b in batch.engram_rows.values():
            b.zero_()
        return batch

    def batch_view(self, rows: int, bs: int, captures) -> Batch:
        """The Batch over the persistent buffers' first `rows` rows (fields, Engram rows) and `bs` requests."""
        v = self._row_views.get(rows)
        if v is None:
            v = self._row_views[rows] = ({k: b[:rows] for k, b in self.buf.items() if k != "block_table"}
                                         | {"engram": {l: b[:rows] for l, b in self.engram_buf.items()}})
        return Batch(v["input_ids"], v["positions"], v["batch_ids"], self.block_table_rows(bs), v["win_idx"],
                     v["ring_dest"], {1: v["dest1"], 2: v["dest2"]}, v["tail_src"], v["tail_dst"],
                     v["engram"], self.image_rows(captures, v["image_dest"]), max_position=self.max_position)

    def resume(self, sb: ScheduledBatch, host: dict) -> None:
        """A prefix hit's fresh slot gets its state: the checkpoint image (copy), or, for
        encoder replay, only the cursor: the replay start and the compressed tokens before it."""
        cur = []
        for i, (kind, *arg) in sb.resumes:
            seq, slot = sb.seqs[i], int(sb.slots[i])
            if kind == "image":
                self.state.restore(arg[0], slot)
            else:
                cur.append((slot, self.step_rows.cursor_at(seq.token_ids, seq.num_computed)))
        if cur:
            host["resume_slots"][:len(cur)] = [c[0] for c in cur]
            host["resume_cursor"][:len(cur)] = [c[1] for c in cur]
            d = self.bufs.publish({"resume_slots": len(cur), "resume_cursor": len(cur)})
            self.cache.cursor.index_copy_(0, d["resume_slots"], d["resume_cursor"])

    def plan_captures(self, sb: ScheduledBatch, starts, offsets, T, host) -> np.ndarray:
        """Copy mode: image rows of each boundary a request's forward crosses, [T] destinations
        for this forward's rows; rows computed earlier are copied from the ring now, before the
        forward moves the ring on (device to device)."""
        dest = np.full(T, -1, dtype=np.int64)
        W, c = self.W, self.cache
        for j, (i, end, img) in enumerate(sb.captures):
            seq, slot, a = sb.seqs[i], int(sb.slots[i]), int(starts[i])
            for p in range(max(0, end - W), end):
                if p >= a:
                    dest[offsets[i] + p - a] = img * W + p % W
                else:
                    c.image_ring[:, img * W + p % W] = c.ring[:, slot * W + p % W]
            host["image_ids"][j] = img
            host["image_cursor"][j] = self.step_rows.cursor_at(seq.token_ids, end)
        if sb.captures:
            k = len(sb.captures)
            d = self.bufs.publish({"image_ids": k, "image_cursor": k})
            c.image_cursor.index_copy_(0, d["image_ids"], d["image_cursor"])
        return dest

    def gather_engram(self, dev: dict, T: int) -> None:
        """Every Engram layer's table rows of the first T rows (`engram_buf`): from the published ids
        (`dev`) on the device, or from mapped tables on the host (EngramStager, pinned staging)."""
        if self.engram_stager is not None:
            return self.engram_stager.gather({l: self.bufs.host[k][:T] for l, k in self.engram_ids.items()},
                                             self.engram_buf)
        for l, k in self.engram_ids.items():
            ops.engram_gather(*self.engram_tables[l], dev[k][:T], self.engram_buf[l][:T])

    def graph_forward(self, batch: Batch, cache) -> torch.Tensor:
        """What a FULL graph captures: the Engram rows of every row of `batch` gathered on the device
        (off the host's path to the replay; mapped tables gather in `prepare`), then the forward."""
        if self.engram_stager is None:
            self.gather_engram(self.bufs.dev, batch.input_ids.shape[0])
        return self.forward(batch, cache)

    # ---- step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, sb: ScheduledBatch, all_rows: bool = False, final_only: bool = False, **width) -> torch.Tensor:
        """Forward one step. Returns logits of each request's last row (the sampling rows; with
        decoder replay NaN for requests whose chunk is not final), of the final chunks' last rows
        only (`final_only`, what the engine samples), or of every row when `all_rows` (teacher
        forcing). A step that fits a captured CUDA graph replays it (FULL: decode; TR_HYBRID: any)."""
        graph = self.graphs.width_for(sb) if self.graphs is not None and not width and not all_rows else None
        if graph is not None:
            width = self.graphs.running(graph)
        batch = self.prepare(sb, gather=graph is None or not self.graphs.gathers_engram, **width)
        if all_rows and batch.decoder is not None:
            raise ValueError("every row's logits (teacher forcing) need the decoder on every row: "
                             "--no-decoder-swa-bounded-replay")
        h = self.graphs.replay(graph, batch, self.cache) if graph is not None else self.forward(batch, self.cache)
        self.commit(sb)
        if self.spec is not None:
            self.spec.keep_context(batch, self._fields, sb.scheduled_tokens)
        for _, end, img in sb.captures:
            self.state.seal(img, end)
        B, T, F, last, final_rows, final_last = self._sample
        if batch.decoder is not None:
            # only the rows the step samples left the decoder; the other requests' rows are NaN
            lg = self.model.logits(h)
            if final_only:
                return lg
            out = torch.full((B, self.cfg.vocab_size), float("nan"), device=h.device)
            return out.to(lg.dtype).index_copy_(0, final_rows, lg)
        if all_rows:
            return self.model.logits(h[:T])
        if B == T and (F == B or not final_only):      # decode rows only: row i is request i's
            return self.model.logits(h[:B])
        return self.model.logits(h.index_select(0, final_last if final_only else last))

    def commit(self, sb: ScheduledBatch) -> None:
        """Positions and Engram history advance after the forward: cursor = (committed position,
        last three compressed ids), copied by `prepare`; the slots' host mirror follows."""
        if sb.seqs:
            self.cache.cursor.index_copy_(0, *self._commit)
            self.step_rows.commit(*self._mirror)

    def set_cursors(self, slots: np.ndarray, cursors: np.ndarray) -> None:
        """Slots' cursors, rows of StepRows.cursor_at (DSpark's commit of accepted tokens), through
        the step buffers (runtime.spec_step.step_fields)."""
        self.cache.cursor[self.bufs.put("spec_cursor_slots", slots)] = self.bufs.put("spec_cursors", cursors)
        self.step_rows.set_cursors(slots, cursors)
