"""The engine thread. `LLMEngine` is synchronous and not thread-safe, so one background thread
owns it and runs its step loop. The asyncio side never touches the engine: it posts commands
(add, abort) to a deque the thread drains between steps, and the thread posts each request's new
tokens into that request's asyncio queue (`loop.call_soon_threadsafe`). An aborted request
(client gone, stop string matched) leaves at the next step boundary, which frees its pages and
STATE slot; the rest of the batch is untouched."""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass

from runtime.metrics import ServingMetrics
from runtime.sequence import SamplingParams, Status

log = logging.getLogger("v41.serve")


@dataclass
class Delta:
    """New output of one request: tokens since the last delta, their logprobs, and a finish
    reason on the last one ('stop', 'length', 'abort'), or an error."""
    request_id: str
    token_ids: list
    logprobs: list | None = None
    finish_reason: str | None = None
    error: str | None = None
    status: int = 500               # HTTP status of an error: 400 when the engine refused the input


@dataclass
class Track:
    """A live request as the engine thread sees it: where its Deltas go, what was sent, timings."""
    request_id: str
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float
    num_prompt_tokens: int
    seq: object = None
    sent: int = 0
    scheduled: bool = False
    first_token: float | None = None
    last_token: float | None = None

    def post(self, d: Delta) -> None:
        try:
            self.loop.call_soon_threadsafe(self.sink.put_nowait, d)
        except RuntimeError:          # the event loop is closed: shutting down
            pass


class AsyncEngine:
    """Runs `LLMEngine.step()` in one background thread and feeds asyncio queues."""

    def __init__(self, engine, metrics: ServingMetrics):
        self.engine, self.metrics = engine, metrics
        self._cmds: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._live: dict[str, Track] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._idle_checked = False
        self._preemptions = 0
        self._admitted = 0                    # requests added (event loop side)
        self._dequeued = 0                    # of those, scheduled once, refused or gone (engine thread)
        self.dead: str | None = None          # why the engine thread died, if it did
        self.heartbeat = time.monotonic()     # the engine loop's last turn (steps and idle waits)

    # ---- asyncio side ----------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="v41-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    def stalled_for(self) -> float | None:
        """Seconds since the engine loop last turned, while requests wait on it; None when
        nothing is queued (an idle engine turns every 0.5 s anyway)."""
        if not (self._cmds or self._live):
            return None
        return time.monotonic() - self.heartbeat

    @property
    def queued(self) -> int:
        """Requests added and not yet scheduled (nor refused, aborted or failed): the admission
        queue `--max-queued-requests` bounds. Each counter has one writer, so no lock."""
        return self._admitted - self._dequeued

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            sink: asyncio.Queue, logprobs: int | None, arrival: float) -> None:
        """Queue a request; its Deltas arrive in `sink` (called from the event loop)."""
        t = Track(request_id, sink, asyncio.get_running_loop(), arrival, len(prompt_token_ids))
        self._admitted += 1
        self._cmds.append(("add", t, list(prompt_token_ids), params, logprobs))
        self._wake.set()

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Cancel a request at the next step boundary (any thread)."""
        self._cmds.append(("abort", request_id, reason))
        self._wake.set()

    # ---- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self.heartbeat = time.monotonic()
                self._drain()
                if self.engine.has_unfinished():
                    self._idle_checked = False
                    t_step = time.monotonic()
                    try:
                        outs = self.engine.step()
                    except Exception as e:  # a bug in a step: fail what is in flight, keep serving
                        log.exception("engine step failed")
                        self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
                        continue
                    self.metrics.steps.inc()
                    self._dispatch(outs, t_step)
                    self._publish()
                else:
                    if not self._idle_checked:   # once per idle period: everything should be back
                        self._check_invariants()
                        self._publish()
                        self._idle_checked = True
                    self._wake.wait(0.5)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - report, then let the thread end
            self.dead = f"{type(e).__name__}: {e}"
            log.exception("engine thread died")
            for t in list(self._live.values()):
                t.post(Delta(t.request_id, [], error=self.dead))
            raise
        finally:
            for t in list(self._live.values()):
                t.post(Delta(t.request_id, [], finish_reason="abort", error="server shutting down"))

    def _drain(self) -> None:
        aborted = False
        while self._cmds:
            cmd = self._cmds.popleft()
            if cmd[0] == "add":
                _, t, ids, params, logprobs = cmd
                try:
                    t.seq = self.engine.add_request(ids, params, t.request_id, logprobs)
                except ValueError as e:
                    self._dequeued += 1
                    t.post(Delta(t.request_id, [], error=str(e), status=400))
                    continue
                self._live[t.request_id] = t
            else:
                _, rid, reason = cmd
                t = self._live.pop(rid, None)
                self.engine.abort(rid)
                aborted = True
                if t is not None:
                    self._leave_queue(t)
                    self._finished(t, reason, time.monotonic())
                    t.post(Delta(rid, [], finish_reason=reason))
        if aborted:
            self._check_invariants()
            self._publish()

    def _dispatch(self, outs, t_step: float) -> None:
        now, m = time.monotonic(), self.metrics
        for t in self._live.values():  # requests this step scheduled first: their queue time ends
            if not t.scheduled and t.seq.status is not Status.WAITING:
                self._leave_queue(t)
                m.queue_time.observe(max(0.0, t_step - t.arrival))
        for seq in outs:
            t = self._live.get(seq.request_id)
            if t is None:
                continue
            comp = seq.completion_token_ids
            new = comp[t.sent:]
            if not new and not seq.is_finished:
                continue
            lps = seq.logprobs[t.sent:len(comp)] if seq.logprobs is not None else None
            t.sent = len(comp)
            if new:
                m.generation_tokens.inc(len(new))
                if t.first_token is None:
                    m.ttft.observe(now - t.arrival)
                    m.prompt_tokens.inc(t.num_prompt_tokens)
                    m.prefix_lookup(t.num_prompt_tokens, seq.num_cached_tokens)
                    t.first_token = now
                else:
                    m.itl.observe(now - t.last_token)
                t.last_token = now
            fin = seq.finish_reason if seq.is_finished else None
            err = seq.error if fin == "error" else None      # its own data failed it: 400, the batch went on
            t.post(Delta(t.request_id, new, lps, fin, error=err, status=400))
            if seq.is_finished:
                self._live.pop(t.request_id, None)
                self._finished(t, fin or "stop", now)

    def _leave_queue(self, t: Track) -> None:
        if not t.scheduled:
            t.scheduled = True
            self._dequeued += 1

    def _finished(self, t: Track, reason: str, now: float) -> None:
        m = self.metrics
        m.finished(reason)
        if reason == "abort":
            return
        m.e2e.observe(now - t.arrival)
        m.prompt_len.observe(t.num_prompt_tokens)
        m.gen_len.observe(t.sent)
        if t.sent > 1 and t.first_token is not None:
            m.tpot.observe((t.last_token - t.first_token) / (t.sent - 1))

    def _fail_all(self, msg: str) -> None:
        for rid, t in list(self._live.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - the failed step may have left the engine half-updated
                log.exception("abort after a failed step")
            t.post(Delta(rid, [], finish_reason="abort", error=msg))
            self._leave_queue(t)
            self._finished(t, "abort", time.monotonic())
        self._live.clear()
        self._publish()

    def _check_invariants(self) -> None:
        sch = self.engine.scheduler
        try:
            self.engine.bm.check(list(sch.running) + list(sch.waiting))
        except AssertionError as e:
            log.error("block manager invariant failed: %s", e)
            self.metrics.invariant_failures.inc()

    def _publish(self) -> None:
        m, sch, bm = self.metrics, self.engine.scheduler, self.engine.bm
        fp, np_, fs, ns = bm.num_available_pages, bm.num_pages, len(bm.free_slots), bm.num_slots
        m.running.set(len(sch.running))
        m.waiting.set(len(sch.waiting))
        m.pages_free.set(fp)
        m.pages_total.set(np_)
        m.slots_free.set(fs)
        m.slots_total.set(ns)
        m.page_usage.set(1 - fp / np_ if np_ else 0.0)
        m.slot_usage.set(1 - fs / ns if ns else 0.0)
        st = self.engine.runner.state.stats
        m.images_stored.set(st["images_stored"])
        m.images_restored.set(st["images_restored"])
        m.images_refused.set(st["images_refused"])
        m.replayed_rows.set(sch.stats["replayed_rows"])
        m.encoder_rows.set(self.engine.runner.rows_run["encoder"])
        m.decoder_rows.set(self.engine.runner.rows_run["decoder"])
        m.cached_pages.set(len(bm.evictable))
        if sch.num_preemptions > self._preemptions:
            m.preemptions.inc(sch.num_preemptions - self._preemptions)
            self._preemptions = sch.num_preemptions
        spec = getattr(self.engine.runner, "spec", None)
        if spec is not None:                 # DSpark's drafted / accepted counts
            m.spec_decode(spec.stats)
