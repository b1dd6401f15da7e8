"""DSpark in the engine's step (docs/dspark.md §1-§2), around the runner's forward:

- `stage` (in `prepare`, before the forward): each verify request's rows (anchor, drafts) are a
  chunk; the ring rows they will overwrite are saved (the undo log) and their ratio-2 tails go
  to staging rows past the slots, so the slot's own tail is not touched;
- `keep_context` (after the forward): the draft's context keys of every tapped row; rows of
  prefill chunks enter the draft rings now, verify rows wait for acceptance;
- `accept`: verification (runtime.spec_decode) of each verify request's rows: the drafts are
  matched against the token a plain step would emit at each row (the argmax, or for a sampled
  request the plain sampler's own draw at that output position: `_draws`), which for greedy
  drafts is rejection sampling; or, benchmark only, `forced` acceptance;
- `commit` (before the scheduler appends the tokens): accepted rows enter the draft rings;
- `propose`: the draft's next five tokens for every request that sampled and may draft; while
  its graph runs, `roll_back`: rejected rows get their saved ring bytes back, the staged tail of
  the last committed even position moves into the slot, the cursor is written from the accepted
  tokens.

In a step where every request that samples verified (DSpark's steady state), `accept` launches
the commit's scatter and the next drafts from the verdicts on the device, before the host reads
them (`_draft_ahead`): the device runs the draft while the host does its bookkeeping, instead of
waiting for it between the verdicts and the draft.
"""
from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from runtime.sampler import GREEDY_BELOW, SamplingTensors, draw, filter_logits, process_logits, uniforms
from runtime.sequence import Status
from runtime.spec_decode import forced_accept, match_accept
from v41.dspark import DSpark

ops = torch.ops.v41


def step_fields(T: int, B: int, cursor_width: int) -> dict:
    """Shapes of DSpark's step buffers (runtime.batch.StepBuffers): every row index and token
    a DSpark step sends to the device goes through a pinned mirror and a non-blocking copy (a
    pageable copy waits for the stream; `keep_context` runs while the target's forward may still
    run). Per row: the verify rows' ring rows (`stage`), the keyed rows' positions and ring and
    image destinations (`keep_context`), the verified rows and drafts (`accept`), the accepted
    rows' ring destinations (`commit`), the rejected rows (`roll_back`); per request: the last
    rows and the forced counts (`accept`), the staged tails' slots and rows, the cursors' slots
    and values (`roll_back`), the draft's inputs when no draft graph runs it (`propose`); the
    keyed rows' requests and offsets and the requests' first positions of a draft launched
    ahead (`_draft_ahead`)."""
    per_row = ("verify_ring", "ctx_pos", "ctx_dest", "ctx_image_dest", "verify_rows", "verify_drafts", "rejected",
               "accepted_dest", "ahead_place", "ahead_offset")
    per_request = ("last", "forced", "tail_slots", "tail_rows", "cursor_slots", "ahead_starts")
    return ({f"spec_{k}": (T,) for k in per_row} | {f"spec_{k}": (B,) for k in per_request}
            | {"spec_cursors": (B, cursor_width), "spec_draft_inputs": (4 * B,)})


class SpecStep:
    def __init__(self, runner, weights, k: int):
        cfg = runner.cfg
        self.runner, self.k, self.cache = runner, k, None
        self.n, self.W = cfg.num_hidden_layers, cfg.sliding_window
        self.staging_per_request = k // 2 + 1        # the even positions among 1 + k rows
        self.draft = DSpark(cfg, weights, runner.model.embed_weight, runner.model.head, runner.dtype,
                            runner.device, max_pos=runner.max_model_len, native=runner.model.native)
        # the target's taps, written by its forward (compiled and graphed too) at the tapped layers
        self.taps = torch.zeros(len(cfg.topology.dspark_taps), runner.max_tokens, cfg.hidden_size,
                                dtype=runner.dtype, device=runner.device)
        runner.model.record_taps(self.taps)
        # counted for /metrics (runtime.metrics.ServingMetrics.spec_decode)
        self.stats = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [0] * k,
                      "acceptance_length": [0] * (k + 2)}
        self._verify = None
        self._ctx = None
        self._rollback = None   # (sb, verify rows, accepted counts, starts): `commit` to `roll_back`
        self._ahead = None      # (requests, proposed tokens) drafted by `accept`, for `propose`
        cuda = runner.device.type == "cuda"     # the verdicts come back through a pinned buffer
        self._verdicts = torch.zeros(runner.max_seqs, 2, dtype=torch.long, pin_memory=cuda)
        self._verdicts_copied = torch.cuda.Event() if cuda else None
        self.graphs = None      # runtime.draft_graphs.DraftGraphRunner, when the target is graphed
        # benchmark only (EngineArgs.spec_decode_acceptance_length L): the mean accepted drafts
        # per verify step, L - 1, whatever the target says; None: real verification
        self.forced: float | None = None
        self._forced_owed = 0.0

    # ---- before the forward ---------------------------------------------------------------
    def stage(self, sb, fields: dict, starts: np.ndarray, n: np.ndarray) -> None:
        """Verify rows: tails to staging rows, and the undo log of the ring rows they write."""
        if self._rollback is not None:
            raise RuntimeError("the last verify step was not rolled back (SpecStep.propose runs roll_back)")
        self._verify = self._ctx = None
        d = np.array([len(x) for x in sb.drafts], np.int64)
        v = np.flatnonzero(d)
        if not v.size:
            return
        if int(n[v].max()) > self.W:
            raise ValueError(f"a verify chunk of {int(n[v].max())} rows is longer than the window {self.W}")
        off = np.cumsum(n) - n
        req = np.repeat(v, n[v])
        rows = np.repeat(off[v], n[v]) + np.arange(len(req)) - np.repeat(np.cumsum(n[v]) - n[v], n[v])
        pos, c = fields["positions"][rows], starts[req]
        S = self.runner.cache.num_slots
        fields["tail_dst"][rows] = np.where(pos % 2 == 0, S + req * self.staging_per_request + (pos - c) // 2, -1)
        ring_t = self.runner.bufs.put("spec_verify_ring", sb.slots[req] * self.W + pos % self.W)
        undo = self.runner.cache.ring[:self.n].index_select(1, ring_t)
        self._verify = dict(v=v, rows=rows, req=req, pos=pos, ring=ring_t, undo=undo)

    @staticmethod
    def sampled_rows(ends: np.ndarray, final: np.ndarray, drafts: list) -> np.ndarray:
        """The rows the step samples, flat: a verify request's 1 + k rows, a finishing chunk's last."""
        cnt = 1 + np.array([len(drafts[i]) for i in np.flatnonzero(final)], np.int64)
        first = ends[final] - cnt + 1
        return np.repeat(first, cnt) + np.arange(int(cnt.sum())) - np.repeat(np.cumsum(cnt) - cnt, cnt)

    # ---- after the forward ----------------------------------------------------------------
    def keep_context(self, batch, fields: dict, T: int) -> None:
        """Context keys of the tapped rows; those not verifying enter the draft rings (and the
        images the step captures) now."""
        dec, host = batch.decoder, self.runner.bufs.host
        if dec is None:
            rows = np.arange(T)
        else:       # the decoder's rows, less the padding rows a TR_HYBRID step ends them with
            real = int((host["dec_batch_ids"][:len(dec.rows)] >= 0).sum())
            rows = host["dec_rows"][:real].copy()
        if not len(rows):
            return          # no row reached the tapped layers (a chunk below its tail start)
        # a layer past the decoder boundary saw the decoder's rows only, one below it every row
        boundary = self.runner.cfg.topology.boundary
        taps = [t.index_select(0, dec.rows) if dec is not None and layer < boundary else t[:len(rows)]
                for t, layer in zip(self.taps, self.runner.cfg.topology.dspark_taps)]
        pos = fields["positions"][rows]
        self.draft.check_positions("positions", pos)       # on the host copy: no device read
        bufs = self.runner.bufs
        keys = self.draft.context_keys(taps, bufs.put("spec_ctx_pos", pos), check=False)
        verify_req = np.full(T, -1, np.int64)
        if self._verify is not None:
            verify_req[self._verify["rows"]] = self._verify["req"]
        vr = verify_req[rows]
        dest = np.where(vr < 0, fields["ring_dest"][rows], -1)
        if (dest >= 0).any():
            self._scatter(keys, bufs.put("spec_ctx_dest", dest), self.runner.cache.ring[self.n:])
        if batch.image_dest is not None and (fields["image_dest"][rows] >= 0).any():
            image_dest = bufs.put("spec_ctx_image_dest", fields["image_dest"][rows])
            self._scatter(keys, image_dest, self.runner.cache.image_ring[self.n:])
        self._ctx = (keys, pos, vr, fields["ring_dest"][rows].copy())

    @staticmethod
    def _scatter(keys, dest: torch.Tensor, rings: torch.Tensor) -> None:
        for ring, key in zip(rings, keys):
            ops.scatter_rows(ring, key, dest)

    # ---- acceptance and commit -------------------------------------------------------------
    def accept(self, rows: torch.Tensor, drafts: list, seqs: list, sb=None, at=None) -> tuple[torch.Tensor, dict]:
        """`rows`: the sampled rows of the final requests (runner.run, final_only), their drafts
        and their requests. Returns each request's last row (what a plain step samples) and, for
        the verify requests, {index: (accepted count, [accepted drafts..., next token])}. With
        the step's batch `sb` and each final request's index in it (`at`): when every final
        request verified, the next drafts are launched before the verdicts are read (`_draft_ahead`)."""
        bufs = self.runner.bufs
        cnt = np.array([1 + len(d) for d in drafts], np.int64)
        ends = np.cumsum(cnt) - 1
        last = rows if len(cnt) == len(rows) else rows.index_select(0, bufs.put("spec_last", ends))
        groups: dict = {}
        for j, d in enumerate(drafts):          # one batched verification per (k, greedy or sampled)
            if d:
                groups.setdefault((len(d), seqs[j].params.temperature >= GREEDY_BELOW), []).append(j)
        out, order = {}, sorted(groups.items())
        if not order:
            return last, out
        # every group's rows and drafts (and forced counts) reach the device in one copy each
        verify = [(k, j) for (k, _), js in order for j in js]
        idx = bufs.put("spec_verify_rows", np.concatenate([np.arange(ends[j] - k, ends[j] + 1) for k, j in verify]))
        flat = bufs.put("spec_verify_drafts", np.fromiter(chain.from_iterable(drafts[j] for _, j in verify), np.int64))
        forced = bufs.put("spec_forced", self._forced_counts(verify)) if self.forced is not None else None
        r = d0 = f = 0
        verdicts = []
        for (k, sampled), js in order:
            n = len(js)
            target = rows.index_select(0, idx[r:r + n * (k + 1)]).view(n, k + 1, -1)
            d = flat[d0:d0 + n * k].view(n, k)
            tokens = self._draws(target, [seqs[j] for j in js]) if sampled else target.argmax(-1)
            if forced is None:
                a, nxt = match_accept(tokens, d)
            else:       # counts built in 0..k on the host (_forced_counts): no range check on the device
                a, nxt = forced_accept(tokens, d, forced[f:f + n], check=False)
            verdicts.append(torch.stack([a, nxt], 1))
            r, d0, f = r + n * (k + 1), d0 + n * k, f + n
        verdicts = torch.cat(verdicts)
        if sb is not None and len(verify) == len(seqs) and self._fits_ahead(verify, seqs):
            got = self._copy_back(verdicts)             # queued before the draft: read while it runs
            self._draft_ahead(sb, at[[j for _, j in verify]], verify, verdicts)
            got = got()
        else:
            got = verdicts.tolist()
        for (k, j), (aj, t) in zip(verify, got):        # one copy back for every group
            out[j] = (aj, list(drafts[j][:aj]) + [t])
            self._count(k, aj)
        return last, out

    def _fits_ahead(self, verify: list, seqs: list) -> bool:
        """Every draft of these verify requests starts inside the draft's RoPE table whatever
        they accept (the anchor at most k past the step's first row)."""
        return max(seqs[j].num_computed + k for k, j in verify) + self.draft.T < self.draft.max_pos

    def _copy_back(self, verdicts: torch.Tensor):
        """The verdicts [n, 2] to the host: on CUDA a non-blocking copy into a pinned buffer now
        and a wait for it later. Returns the call that gives them as lists."""
        if self._verdicts_copied is None:
            return verdicts.tolist
        host = self._verdicts[:len(verdicts)]
        host.copy_(verdicts, non_blocking=True)
        self._verdicts_copied.record()

        def read() -> list:
            self._verdicts_copied.synchronize()
            return host.tolist()
        return read

    @torch.inference_mode()
    def _draft_ahead(self, sb, at: np.ndarray, verify: list, verdicts: torch.Tensor) -> None:
        """`commit`'s scatter and `propose`'s draft for the verify requests (batch indices `at`,
        in `verify`'s order), from the verdicts [n, 2] on the device: a verify row's context key
        enters the draft rings where the accepted count reaches its position, and each draft's
        anchor is the next token, at the step's first position plus the accepted count."""
        bufs, seqs = self.runner.bufs, [sb.seqs[i] for i in at.tolist()]
        starts = np.array([s.num_computed for s in sb.seqs], np.int64)
        ks = np.array([k for k, _ in verify], np.int64)
        accepted = verdicts[:, 0]
        if self._ctx is not None:
            keys, pos, vr, ring_dest = self._ctx
            place = np.zeros(len(sb.seqs), np.int64)     # each verify request's row of the verdicts
            place[at] = np.arange(len(at))
            # a verify row is kept when accepted >= its offset from the step's first row
            offset = np.where(vr >= 0, pos - starts[np.maximum(vr, 0)], self.k + 1)
            kept = accepted.index_select(0, bufs.put("spec_ahead_place", place[np.maximum(vr, 0)])) >= \
                bufs.put("spec_ahead_offset", offset)
            dest = torch.where(kept, bufs.put("spec_accepted_dest", np.where(vr >= 0, ring_dest, -1)), -1)
            self._scatter(keys, dest, self.runner.cache.ring[self.n:])
            self._ctx = None        # committed: `commit` has no scatter left
        # anchors stand in as 0 and positions as their bound in the host's columns (its checks)
        cols = self._columns(seqs, np.zeros_like(ks), starts[at] + ks)
        anchor_pos = bufs.put("spec_ahead_starts", starts[at]) + accepted
        self._ahead = (seqs, self._run_draft(cols, (verdicts[:, 1], anchor_pos)))

    @staticmethod
    def _draws(target: torch.Tensor, seqs: list) -> torch.Tensor:
        """The token the plain sampler would draw at each row [B, k+1] of sampled requests:
        the same arithmetic (runtime.sampler: process_logits, filter_logits with the request's
        temperature and filters, `draw`) and the same uniform, uniforms(seed, g+i) for row i
        with g tokens generated (the anchor the last): the counter of output position g+i.
        Matching greedy drafts against these draws is rejection sampling (runtime.spec_decode),
        and every emitted token is the one plain decoding draws there from the same logits, so
        a seeded request's tokens do not depend on DSpark, its drafts or its batch."""
        B, k1, V = target.shape
        st = SamplingTensors.build(seqs, V, target.device, torch.promote_types(target.dtype, torch.float32))
        if st.bias_at.numel() or st.banned_at.numel() or st.use_repetition or st.use_output_penalty:
            raise RuntimeError("a drafting request has logit_bias, min_tokens or penalties (Sequence.may_draft)")
        rep = lambda t: t.repeat_interleave(k1)  # noqa: E731  (each request's parameters on its 1 + k rows)
        x = filter_logits(process_logits(target.reshape(B * k1, V), st), rep(st.temperature), rep(st.top_k),
                          rep(st.top_p), rep(st.min_p), st.top_k_max, st.use_top_p, st.use_min_p,
                          st.top_p_sorts_all)
        at = (st.step[:, None] + torch.arange(k1, device=target.device)).reshape(-1)     # output positions
        return draw(x, uniforms(rep(st.seed_lo), rep(st.seed_hi), at)).view(B, k1)

    def _forced_counts(self, verify: list) -> np.ndarray:
        """Benchmark only: the accepted count of each verify request ((k, index) in order), each
        floor or ceil of what keeps the running mean at `forced` (the shortfall of a request
        with fewer than that many drafts is carried to the next ones)."""
        out = np.empty(len(verify), np.int64)
        for i, (k, _) in enumerate(verify):
            out[i] = min(k, int(self._forced_owed + self.forced + 1e-9))
            self._forced_owed += self.forced - out[i]
        return out

    def _count(self, k: int, a: int) -> None:
        s = self.stats
        s["drafts"] += 1
        s["draft_tokens"] += k
        s["accepted"] += a
        for i in range(a):
            s["accepted_per_pos"][i] += 1
        s["acceptance_length"][1 + a] += 1

    def commit(self, sb, accepted: dict) -> None:
        """accepted: batch index -> accepted count, for the verify requests that got tokens.
        Requests no longer running (aborted, failed) are skipped: their slot is not theirs. The
        accepted verify rows' context keys enter the draft rings now (the next drafts read
        them); the target's part waits for `propose`, which runs it while the draft's graph runs."""
        V = self._verify
        if V is None:
            return
        a_req = np.full(len(sb.seqs), -1, np.int64)
        for i, a in accepted.items():
            if sb.seqs[i].status is Status.RUNNING:
                a_req[i] = a
        starts = np.array([s.num_computed for s in sb.seqs], np.int64)
        if self._ctx is not None:
            keys, pos, vr, ring_dest = self._ctx
            ok = (vr >= 0) & (a_req[vr] >= 0) & (pos <= starts[vr] + a_req[vr])
            if ok.any():
                self._scatter(keys, self.runner.bufs.put("spec_accepted_dest", np.where(ok, ring_dest, -1)),
                              self.runner.cache.ring[self.n:])
        self._verify = self._ctx = None
        self._rollback = (sb, V, a_req, starts)

    def roll_back(self) -> None:
        """The target's state after a verify step, as if only the accepted tokens had been
        decoded (after the scheduler appended them): rejected rows get their saved ring bytes
        back, the staged tail of the last committed even position moves into the slot, the
        cursor is written from the accepted tokens."""
        if self._rollback is None:
            return
        sb, V, a_req, starts = self._rollback
        self._rollback = None
        cache, runner, S = self.runner.cache, self.runner, self.runner.cache.num_slots
        # a request that finished in this step (its slot is free) or was aborted is skipped
        a_req = np.where([s.status is Status.RUNNING for s in sb.seqs], a_req, -1)
        a_row, c_row = a_req[V["req"]], starts[V["req"]]
        rejected = (a_row >= 0) & (V["pos"] > c_row + a_row)
        bufs = runner.bufs
        if rejected.any():
            sel = bufs.put("spec_rejected", np.flatnonzero(rejected))
            cache.ring[:self.n].index_copy_(1, V["ring"].index_select(0, sel), V["undo"].index_select(1, sel))
        got = np.flatnonzero(a_req >= 0)
        if not got.size:
            return
        c, slots = starts[got], sb.slots[got]
        last = c + a_req[got]                         # the last committed position
        e = last - last % 2                           # plain decode's tail holds position e
        tail = e >= c                                 # ... staged by this step: copy it in
        if tail.any():
            dst = bufs.put("spec_tail_slots", slots[tail])
            src = bufs.put("spec_tail_rows", S + got[tail] * self.staging_per_request + (e - c)[tail] // 2)
            for o in cache.owners.values():
                if o.tail_v is not None:
                    o.tail_v.index_copy_(0, dst, o.tail_v.index_select(0, src))
                    o.tail_g.index_copy_(0, dst, o.tail_g.index_select(0, src))
        # the scheduler appended the accepted drafts and the next token: positions below last + 1
        # hold the tokens the cursor reads
        runner.set_cursors(slots, np.array([runner.step_rows.cursor_at(sb.seqs[i].token_ids, p)
                                            for i, p in zip(got.tolist(), (last + 1).tolist())], np.int64))

    # ---- the next drafts --------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list) -> None:
        """Drafts for every request that sampled this step and is still running (anchor: its
        last token, at position num_computed), or those `accept` launched ahead for the verify
        requests (kept for the ones still running). While the draft's graph runs, the host rolls
        the target back (`roll_back`: nothing there reads what the draft writes, or the reverse)."""
        if self._ahead is not None:     # `accept` launched the drafts of every verify request
            seqs, tokens = self._ahead
            self._ahead = None
        else:
            seqs = [s for s in seqs if s.status is Status.RUNNING and s.may_draft]
            tokens = self._launch(seqs) if seqs else None
        self.roll_back()
        if tokens is not None:
            for s, toks in zip(seqs, tokens[:, :self.k].tolist()):
                if s.status is Status.RUNNING:          # (drafted ahead: it may have finished)
                    s.spec_token_ids = toks

    def _launch(self, seqs: list) -> torch.Tensor:
        """The draft over `seqs` (its graph when one holds that many requests, else eagerly): the
        proposed tokens [B, T] on the device, not yet waited for."""
        return self._run_draft(self._columns(seqs, [s.token_ids[-1] for s in seqs], [s.num_computed - 1 for s in seqs]))

    @staticmethod
    def _columns(seqs: list, anchors, anchor_pos) -> np.ndarray:
        """The draft's inputs of `seqs` [4, B]: anchor tokens, their positions, STATE slots,
        context floors."""
        floors = [max(s.decoder_start or 0, s.swa_floor) for s in seqs]
        return np.array([anchors, anchor_pos, [s.slot for s in seqs], floors], np.int64).reshape(4, len(seqs))

    def _run_draft(self, cols: np.ndarray, on_device: tuple | None = None) -> torch.Tensor:
        """The draft of `cols` [4, B] (its graph when one holds B requests, else eagerly);
        `on_device`: (anchors, anchor positions) [B] on the device in place of cols' first two
        rows, which then only bound the checks."""
        tokens = self.graphs.propose(cols, on_device) if self.graphs is not None else None
        if tokens is None:      # checked on the host, copied through the step buffers: no device read
            self.draft.check_inputs(*cols, self.draft_rings.shape[1])
            inputs = self.runner.bufs.put("spec_draft_inputs", cols.reshape(-1)).view(4, -1)
            anchors, anchor_pos = on_device if on_device is not None else inputs[:2]
            tokens = self.draft(anchors, anchor_pos, inputs[2], inputs[3], self.draft_rings, check=False).tokens
        return tokens

    @property
    def draft_rings(self) -> torch.Tensor:
        """The draft stages' context rings: layers n.. of the ring plane."""
        return self.runner.cache.ring[self.n:]
