"""Continuous batching with chunked prefill: every step mixes the running requests' next tokens
(decode rows, or the next chunk of an unfinished prompt) with new requests' first chunks, under
`max_num_batched_tokens` and `max_num_seqs`. When pages run out the newest running request is
preempted: it gives back its pages and slot and is recomputed later from position 0.

A new request first looks its prompt up in the prefix cache. A hit of h tokens (whole PAGEs)
shares those pages and resumes below h, as the StateTransfer dictates: `replay` one hash
block below (`replay_start`), `copy` at the newest valid checkpoint image at or below h.
Either way nothing below h is written again (`write_from`).

Cancelling is O(1) in the number of queued requests: the waiting queue is an ordered dict by
request id and the running set is found through `status` (an abort storm of thousands of
queued requests once took a linear scan each, quadratic in all)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from runtime import replay
from runtime.block_manager import BlockManager
from runtime.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new: list[int]            # query length of each request this step
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # STATE slot per request
    block_tables: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int64))
    resumes: list = field(default_factory=list)     # (batch index, ("image", img) | ("replay",))
    captures: list = field(default_factory=list)    # (batch index, boundary position, image)
    decode: bool = False          # every request is running and computes its one last token
    spec: list = field(default_factory=list)        # per request: the drafts its rows verify (DSpark)
    # a steady step (Scheduler._next_decode): the decode step of the same requests as the step
    # before, each one row on; its lists and arrays are that step's, `table_rows` the rows of
    # block_tables that changed since (a request took a page), `positions` each row's position
    positions: np.ndarray | None = None
    table_rows: np.ndarray | None = None

    @property
    def starts(self) -> list[int]:
        return [s.num_computed for s in self.seqs]

    @property
    def is_final_chunk(self) -> list[bool]:
        """The step computes the request's last known token (and its drafts), so it samples."""
        return [s.num_computed + n == s.num_tokens + len(d) for s, n, d in zip(self.seqs, self.num_new, self.drafts)]

    @property
    def drafts(self) -> list:
        return self.spec or [()] * len(self.seqs)

    @property
    def steady(self) -> bool:
        return self.positions is not None

    @property
    def scheduled_bs(self) -> int:
        return len(self.seqs)

    @property
    def scheduled_tokens(self) -> int:
        return sum(self.num_new)


class WaitQueue:
    """The waiting requests in FCFS order, with O(1) removal by request id: the deque surface
    the scheduler uses (append, appendleft, popleft, [0]) over an OrderedDict."""

    def __init__(self):
        self._q: OrderedDict[str, Sequence] = OrderedDict()

    def append(self, seq: Sequence) -> None:
        if seq.request_id in self._q:
            raise ValueError(f"request id {seq.request_id!r} is already waiting")
        self._q[seq.request_id] = seq

    def appendleft(self, seq: Sequence) -> None:
        self._q[seq.request_id] = seq
        self._q.move_to_end(seq.request_id, last=False)

    def popleft(self) -> Sequence:
        return self._q.popitem(last=False)[1]

    def pop(self, request_id: str) -> Sequence | None:
        return self._q.pop(request_id, None)

    def __getitem__(self, i: int) -> Sequence:
        if i != 0:
            raise IndexError("WaitQueue reads only its head, [0]")
        return next(iter(self._q.values()))

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(self._q.values())


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_id: int | None, max_prefill_chunk: int | None = None, state=None,
                 speculative: bool = False):
        self.bm = block_manager
        self.state = state            # StateTransfer (prefix hits), or None without prefix caching
        self.stats = {"replayed_rows": 0}
        self.max_num_seqs, self.max_tokens = max_num_seqs, max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk or max_num_batched_tokens
        self.eos = eos_token_id
        self.waiting = WaitQueue()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # steady decode (`_next_decode`): drafts are proposed after postprocess, so a speculative
        # engine never repeats a batch
        self.speculative = speculative
        self._scheduled = None        # (batch, its positions, its requests' page capacity): a decode batch
        self._steady = None           # the same, confirmed by postprocess and advanced one row

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = len(seq.token_ids) - seq.num_computed
        if n > 1:  # a prompt (or a recompute): chunked
            n = min(n, self.max_prefill_chunk)
        return replay.cut_chunk(seq.num_computed, min(n, budget), len(seq.token_ids), seq.decoder_start)

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """The drafts a verify step of `seq` checks: at most what its max_tokens can still take
        after the anchor (so no position passes max_model_len) and the step budget allows."""
        left = seq.params.max_tokens - (len(seq.token_ids) - seq.num_prompt_tokens) - 1
        return seq.spec_token_ids[:max(0, min(left, budget - 1))]

    def schedule(self) -> ScheduledBatch:
        sb = self._next_decode()
        if sb is not None:
            return sb
        seqs, num_new, budget, spec = [], [], self.max_tokens, {}      # spec: row -> drafts (DSpark)
        P, resumes, decode = self.bm.page_tokens, [], True
        i, running = 0, self.running
        while i < len(running) and budget > 0:  # preemption shortens the list as we go
            seq = running[i]
            c = seq.num_computed
            i += 1
            if len(seq.token_ids) == c + 1:
                d = self._drafts(seq, budget) if seq.spec_token_ids else None
                if d:
                    # a verify step: the anchor and the drafts, laid out as a chunk (docs/dspark.md §1)
                    if not self._make_room(seq, 1 + len(d)):
                        break
                    spec[len(seqs)] = tuple(d)
                    seqs.append(seq), num_new.append(1 + len(d))
                    decode, budget = False, budget - 1 - len(d)
                    continue
                if c < len(seq.pages) * P and seq.slot is not None:
                    # a decode row whose page is already held: no chunking, nothing to allocate
                    seqs.append(seq)
                    num_new.append(1)
                    budget -= 1
                    continue
            n = self._chunk(seq, budget)
            decode = decode and n == 1 and len(seq.token_ids) == c + 1   # a decode row taking a page
            if not self._make_room(seq, n):
                break
            seqs.append(seq), num_new.append(n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.pages:
                self.resume_from_cache(seq)
            n = self._chunk(seq, budget)
            if not self.bm.allocate(seq, n):
                self.bm.free(seq)
                self._reset(seq)
                break
            self.waiting.popleft()
            decode = False
            seq.status = Status.RUNNING
            self.running.append(seq)
            if seq.resume is not None:  # only a request admitted now can carry a resume
                resumes.append((len(seqs), seq.resume))
                seq.resume = None
                self.bm.stats["hit_tokens"] += seq.num_cached_tokens
                self.stats["replayed_rows"] += seq.num_cached_tokens - seq.num_computed
            seqs.append(seq), num_new.append(n)
            budget -= n
        slots = np.fromiter([s.slot for s in seqs], dtype=np.int64, count=len(seqs))
        sb = ScheduledBatch(seqs, num_new, slots, self.bm.table[slots], resumes, decode=decode and bool(seqs),
                            spec=[spec.get(j, ()) for j in range(len(seqs))] if spec else [])
        if self.state is not None and self.state.mode == "copy":
            self._plan_captures(sb)
        self._scheduled = None
        if sb.decode and not (resumes or sb.captures or self.speculative) and len(seqs) == len(self.running):
            pos = np.fromiter([s.num_computed for s in seqs], np.int64, len(seqs))
            cap = np.fromiter([len(s.pages) for s in seqs], np.int64, len(seqs)) * P
            self._scheduled = (sb, pos, cap)
        return sb

    def _next_decode(self) -> ScheduledBatch | None:
        """After a decode step in which every request took one token and none ended (a steady
        step, `postprocess`), the next step is the same requests one row on, unless a waiting
        request could be admitted: that batch again, from arrays, visiting only the requests
        whose row opens a page. None: schedule afresh (no page left: preemption decides)."""
        st, self._steady = self._steady, None
        if st is None or (self.waiting and len(self.running) < self.max_num_seqs):
            return None
        prev, pos, cap = st
        full = np.flatnonzero(pos >= cap)
        for i in full.tolist():
            if not self.bm.allocate(prev.seqs[i], 1):
                return None
        if full.size:
            cap[full] += self.bm.page_tokens
            prev.block_tables[full] = self.bm.table[prev.slots[full]]
        sb = ScheduledBatch(prev.seqs, prev.num_new, prev.slots, prev.block_tables, decode=True, positions=pos,
                            table_rows=full)
        self._scheduled = (sb, pos, cap)
        return sb

    def resume_from_cache(self, seq: Sequence) -> None:
        """Share the longest cached prefix and decide where the forward resumes."""
        pages = self.bm.match(seq)
        if not pages:
            return
        P = self.bm.page_tokens
        hit = len(pages) * P
        if self.state.mode == "replay":
            start, seq.resume = self.bm.replay_start(hit), ("replay",)
            seq.swa_floor = start
        else:
            # an image above the decoder's tail start holds decoder rings of another request's
            # tail: resume at or below it (runtime.replay)
            start = 0
            for i in reversed(range(len(pages))):
                img = self.bm.image_of.get(pages[i])
                if seq.decoder_start is not None and (i + 1) * P > seq.decoder_start:
                    continue
                if img is not None and self.state.valid(img, (i + 1) * P):
                    start, seq.resume = (i + 1) * P, ("image", img)
                    break
                if img is not None:  # refused: never restored, recomputed instead
                    self.bm.drop_image(pages[i])
                    self.state.forget(img)
        self.bm.share(seq, pages)
        seq.num_computed, seq.write_from, seq.num_cached_tokens = start, hit, hit

    def _plan_captures(self, sb: ScheduledBatch) -> None:
        """Copy mode: every full prompt PAGE boundary a forward crosses gets an image."""
        P = self.bm.page_tokens
        for i, (seq, n) in enumerate(zip(sb.seqs, sb.num_new)):
            a, b = seq.num_computed, min(seq.num_computed + n, seq.num_prompt_tokens)
            for end in range((a // P + 1) * P, b + 1, P):
                img = self.bm.take_image(seq.pages[end // P - 1])
                if img is not None:
                    sb.captures.append((i, end, img))

    def _reset(self, seq: Sequence) -> None:
        seq.num_computed = seq.write_from = seq.swa_floor = seq.num_cached_tokens = 0
        seq.resume = None
        seq.spec_token_ids = []     # drafts were never tokens: the recompute drafts again

    def _make_room(self, seq: Sequence, n: int) -> bool:
        """Pages for `n` more rows of a running request, preempting from the back of the running
        list until they fit; False when the request itself had to go."""
        while not self.bm.allocate(seq, n):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free everything the request holds; it recomputes all its tokens when rescheduled."""
        self.running.remove(seq)
        self.bm.free(seq)
        self._reset(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self._steady = None

    def abort(self, request_id: str) -> Sequence | None:
        """Cancel a request wherever it is; its pages and slot return at once. O(1) for a
        waiting request; a running one costs a scan of at most max_num_seqs."""
        seq = self.waiting.pop(request_id)
        if seq is None:
            seq = next((s for s in self.running if s.request_id == request_id), None)
            if seq is None:
                return None
            self.running.remove(seq)
        self.bm.free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, "abort"
        self._steady = None
        return seq

    def postprocess(self, batch: ScheduledBatch, sampled: dict) -> list[Sequence]:
        """Commit the step: positions advance, sampled tokens append, finished requests free.
        `sampled` maps seq_id -> token for the requests whose final chunk ran; a verify request
        (DSpark) maps to its accepted drafts then the next token: its position advances past the
        anchor and the accepted drafts only, and the tokens append one by one, a stop or the
        length ending the request there."""
        finished, steady = [], True      # steady: every request took one token
        caching, RUNNING, eos = self.bm.prefix_caching, Status.RUNNING, self.eos
        for seq, n, d in zip(batch.seqs, batch.num_new, batch.drafts):
            if seq.status is not RUNNING:
                steady = False
                continue  # aborted or preempted after scheduling
            toks = sampled.get(seq.seq_id)
            c = seq.num_computed
            if d and toks:          # a verify request: past the anchor and the accepted drafts
                seq.num_computed = c + n - len(d) + len(toks) - 1
            else:
                seq.num_computed = c + n
            if seq.spec_token_ids:
                seq.spec_token_ids = []
            # a prompt PAGE can only become full (and cacheable) while the prompt is computed
            if caching and c < seq.num_prompt_tokens:
                self.bm.register(seq)
            if toks is None:
                steady = False
                continue
            ids, p = seq.token_ids, seq.params
            if type(toks) is int:           # a token (the common case, without a loop)
                ids.append(toks)
                if (toks == eos and not p.ignore_eos) or toks in p.stop_token_ids:
                    seq.finish_reason = "stop"
                elif len(ids) - seq.num_prompt_tokens >= p.max_tokens:
                    seq.finish_reason = "length"
                else:
                    continue
            elif not self._append(seq, toks):
                continue
            seq.status = Status.FINISHED
            self.running.remove(seq)
            self.bm.free(seq)
            finished.append(seq)
        sch = self._scheduled
        if sch is not None and sch[0] is batch and steady and not finished:
            self._steady = (batch, sch[1] + 1, sch[2])
        self._scheduled = None
        return finished

    def _append(self, seq: Sequence, toks) -> bool:
        """A verify request's accepted tokens, one by one, up to a stop or the length; whether
        the request finished."""
        ids, p, eos = seq.token_ids, seq.params, self.eos
        for tok in toks:
            ids.append(tok)
            if (tok == eos and not p.ignore_eos) or tok in p.stop_token_ids:
                seq.finish_reason = "stop"
                return True
            if len(ids) - seq.num_prompt_tokens >= p.max_tokens:
                seq.finish_reason = "length"
                return True
        return False
