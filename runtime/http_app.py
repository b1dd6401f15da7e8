"""The OpenAI-compatible HTTP front end of `python -m v41.serve`.

`AsyncEngine` owns the (synchronous, not thread-safe) `LLMEngine` and runs its step loop in one
background thread. The asyncio side never touches the engine: it posts commands (add, abort) to
a queue the engine thread drains between steps, and the engine thread posts each request's new
tokens back into that request's asyncio queue (`loop.call_soon_threadsafe`). A request that is
aborted (client gone, stop string matched) is removed at the next step boundary, which frees its
pages and STATE slot; the other requests in the batch are untouched.

`create_app` builds the FastAPI app: `/v1/models`, `/v1/completions`, `/v1/chat/completions`
(both with SSE streaming), `/health` and `/metrics` (Prometheus text). Requests are validated
by hand so every refusal is an OpenAI-style JSON error with a precise message.
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.metrics import ServingMetrics
from runtime.sequence import SamplingParams, Status

log = logging.getLogger("v41.serve")


# ============================================================================================
# engine thread
# ============================================================================================

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
class _Track:
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


def _pool_stats(bm) -> tuple[int, int, int, int]:
    """(pages no request holds (free or cached), pages, free slots, slots) of a block manager."""
    return bm.num_available_pages, bm.num_pages, len(bm.free_slots), bm.num_slots


class AsyncEngine:
    """Runs `LLMEngine.step()` in one background thread and feeds asyncio queues."""

    def __init__(self, engine, metrics: ServingMetrics | None = None):
        self.engine = engine
        self.metrics = metrics
        self._cmds: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._live: dict[str, _Track] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._idle_checked = False
        self._preemptions = 0
        self.dead: str | None = None          # why the engine thread died, if it did
        self.num_step_errors = 0

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

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            sink: asyncio.Queue, logprobs: int | None = None, arrival: float | None = None) -> None:
        """Queue a request; its Deltas arrive in `sink` (called from the event loop)."""
        t = _Track(request_id, sink, asyncio.get_running_loop(), arrival or time.monotonic(),
                   len(prompt_token_ids))
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
                self._drain()
                if self.engine.has_unfinished():
                    self._idle_checked = False
                    t_step = time.monotonic()
                    try:
                        outs = self.engine.step()
                    except Exception as e:  # a bug in a step: fail what is in flight, keep serving
                        log.exception("engine step failed")
                        self.num_step_errors += 1
                        self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
                        continue
                    if self.metrics:
                        self.metrics.steps.inc(**self.metrics.lab())
                    self._dispatch(outs, t_step)
                    self._publish()
                else:
                    if not self._idle_checked:
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
                    if logprobs is None:
                        t.seq = self.engine.add_request(ids, params, t.request_id)
                    else:
                        t.seq = self.engine.add_request(ids, params, t.request_id, logprobs=logprobs)
                except ValueError as e:
                    t.post(Delta(t.request_id, [], error=str(e), status=400))
                    continue
                self._live[t.request_id] = t
            else:
                _, rid, reason = cmd
                t = self._live.pop(rid, None)
                self.engine.abort(rid)
                aborted = True
                if t is not None:
                    self._finished(t, reason, time.monotonic())
                    t.post(Delta(rid, [], finish_reason=reason))
        if aborted:
            self._check_invariants()
            self._publish()

    def _dispatch(self, outs, t_step: float) -> None:
        now = time.monotonic()
        m = self.metrics
        if m:  # requests the step just scheduled for the first time: their queue time ends there
            for t in self._live.values():
                if not t.scheduled and t.seq is not None and t.seq.status is not Status.WAITING:
                    t.scheduled = True
                    m.queue_time.observe(max(0.0, t_step - t.arrival), **m.lab())
        for seq in outs:
            t = self._live.get(seq.request_id)
            if t is None or t.seq is not seq:
                continue
            comp = seq.completion_token_ids
            new = comp[t.sent:]
            if not new and not seq.is_finished:
                continue
            lps = seq.logprobs[t.sent:len(comp)] if getattr(seq, "logprobs", None) is not None else None
            t.sent = len(comp)
            if m and new:
                m.generation_tokens.inc(len(new), **m.lab())
                if t.first_token is None:
                    m.ttft.observe(now - t.arrival, **m.lab())
                    m.prompt_tokens.inc(t.num_prompt_tokens, **m.lab())
                    m.prefix_queries.inc(t.num_prompt_tokens, **m.lab())
                    m.prefix_hits.inc(getattr(seq, "num_cached_tokens", 0) or 0, **m.lab())
                else:
                    m.itl.observe(now - t.last_token, **m.lab())
            if new:
                t.first_token = t.first_token or now
                t.last_token = now
            fin = seq.finish_reason if seq.is_finished else None
            t.post(Delta(t.request_id, new, lps, fin))
            if seq.is_finished:
                self._live.pop(t.request_id, None)
                self._finished(t, fin or "stop", now)

    def _finished(self, t: _Track, reason: str, now: float) -> None:
        m = self.metrics
        if m is None:
            return
        m.requests.inc(model_name=m.model_name, finished_reason=reason)
        if reason == "abort":
            return
        m.e2e.observe(now - t.arrival, **m.lab())
        m.prompt_len.observe(t.num_prompt_tokens, **m.lab())
        m.gen_len.observe(t.sent, **m.lab())
        if t.sent > 1 and t.first_token is not None:
            m.tpot.observe((t.last_token - t.first_token) / (t.sent - 1), **m.lab())

    def _fail_all(self, msg: str) -> None:
        for rid, t in list(self._live.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                log.exception("abort after a failed step")
            t.post(Delta(rid, [], finish_reason="abort", error=msg))
            self._finished(t, "abort", time.monotonic())
        self._live.clear()
        self._publish()

    def _check_invariants(self) -> None:
        sch = self.engine.scheduler
        live = list(sch.running) + list(sch.waiting)
        try:
            self.engine.bm.check(live)
        except AssertionError as e:
            log.error("block manager invariant failed: %s", e)
            if self.metrics:
                self.metrics.invariant_failures.inc(**self.metrics.lab())
        except Exception:  # noqa: BLE001 - a changed check signature must not stop serving
            log.debug("block manager check unavailable", exc_info=True)

    def _publish(self) -> None:
        m = self.metrics
        if m is None:
            return
        sch, lab = self.engine.scheduler, m.lab()
        m.running.set(len(sch.running), **lab)
        m.waiting.set(len(sch.waiting), **lab)
        fp, np_, fs, ns = _pool_stats(self.engine.bm)
        m.pages_free.set(fp, **lab)
        m.pages_total.set(np_, **lab)
        m.slots_free.set(fs, **lab)
        m.slots_total.set(ns, **lab)
        m.page_usage.set(1 - fp / np_ if np_ else 0.0, **lab)
        m.slot_usage.set(1 - fs / ns if ns else 0.0, **lab)
        q = m.prefix_queries.get(**lab)
        m.prefix_hit_rate.set(m.prefix_hits.get(**lab) / q if q else 0.0, **lab)
        st = self.engine.runner.state.stats
        m.images_stored.set(st["images_stored"], **lab)
        m.images_restored.set(st["images_restored"], **lab)
        m.images_refused.set(st["images_refused"], **lab)
        m.replayed_rows.set(sch.stats["replayed_rows"], **lab)
        m.cached_pages.set(len(self.engine.bm.evictable), **lab)
        npre = getattr(sch, "num_preemptions", 0)
        if npre > self._preemptions:
            m.preemptions.inc(npre - self._preemptions, **lab)
            self._preemptions = npre


# ============================================================================================
# errors and validation
# ============================================================================================

class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or {400: "invalid_request_error", 401: "invalid_request_error",
                             404: "invalid_request_error", 503: "server_error"}.get(status, "server_error")


def error_body(status: int, message: str, param=None, code=None, type=None) -> dict:
    e = APIError(status, message, param, code, type)
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message, e.param, e.code, e.type), status_code=e.status)


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def _type_name(v) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(v), type(v).__name__)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v))


class _Body:
    """Typed access to a JSON request body; every accessor raises APIError(400)."""

    def __init__(self, body: dict):
        self.b = body

    def has(self, k) -> bool:
        return self.b.get(k) is not None

    def get_int(self, k, default, lo=None, hi=None, what=None):
        v = self.b.get(k)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer() and not isinstance(v, bool):
            v = int(v)
        if not _is_int(v):
            raise bad(f"'{k}' must be an integer, got {_type_name(v)}", k)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise bad(f"'{k}' must be {what or _range(lo, hi)}, got {v}", k)
        return v

    def get_num(self, k, default, lo=None, hi=None, lo_open=False, what=None):
        v = self.b.get(k)
        if v is None:
            return default
        if not _is_num(v):
            got = "a non-finite number" if isinstance(v, float) else _type_name(v)
            raise bad(f"'{k}' must be a finite number, got {got}", k)
        if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
            raise bad(f"'{k}' must be {what or _range(lo, hi, lo_open)}, got {v}", k)
        return float(v)

    def get_bool(self, k, default):
        v = self.b.get(k)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise bad(f"'{k}' must be a boolean, got {_type_name(v)}", k)
        return v

    def get_str(self, k, default):
        v = self.b.get(k)
        if v is None:
            return default
        if not isinstance(v, str):
            raise bad(f"'{k}' must be a string, got {_type_name(v)}", k)
        return v


def _range(lo, hi, lo_open=False) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}]"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"<= {hi}"


# Fields accepted by both endpoints. Values in UNSUPPORTED_IF are refused unless harmless.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
           "n", "stream", "stream_options", "user", "ignore_eos", "return_token_ids", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "logit_bias", "best_of", "min_p", "min_tokens",
           "metadata", "store", "service_tier", "logprobs"}
_COMPLETION = _COMMON | {"prompt", "echo", "suffix"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                   "tool_choice", "parallel_tool_calls", "add_generation_prompt", "chat_template_kwargs"}


def _refuse_unsupported(b: _Body, allowed: set) -> None:
    unknown = sorted(k for k in b.b if k not in allowed)
    if unknown:
        raise bad(f"unrecognized request argument{'s' if len(unknown) > 1 else ''}: "
                  f"{', '.join(repr(k) for k in unknown)}", unknown[0], "unknown_parameter")
    d = b.b

    def no(k, why):
        raise bad(f"'{k}' {why} is not supported by this server", k, "unsupported_parameter")
    for k in ("presence_penalty", "frequency_penalty"):
        if d.get(k) is not None:
            v = b.get_num(k, 0.0, -2.0, 2.0)
            if v != 0:
                no(k, f"= {v}")
    if d.get("repetition_penalty") is not None and b.get_num("repetition_penalty", 1.0, 0, lo_open=True) != 1:
        no("repetition_penalty", f"= {d['repetition_penalty']}")
    if d.get("min_p") is not None and b.get_num("min_p", 0.0, 0.0, 1.0) != 0:
        no("min_p", f"= {d['min_p']}")
    if d.get("min_tokens") is not None and b.get_int("min_tokens", 0, 0) != 0:
        no("min_tokens", f"= {d['min_tokens']}")
    if d.get("logit_bias") not in (None, {}):
        if not isinstance(d["logit_bias"], dict):
            raise bad(f"'logit_bias' must be an object, got {_type_name(d['logit_bias'])}", "logit_bias")
        no("logit_bias", "(non-empty)")
    if d.get("suffix") not in (None, ""):
        no("suffix", "(non-empty)")
    if d.get("best_of") is not None and b.get_int("best_of", 1, 1) != b.get_int("n", 1, 1):
        no("best_of", "different from n")
    rf = d.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        no("response_format", f"= {json.dumps(rf)[:80]}")
    if d.get("tools") not in (None, []):
        no("tools", "(tool calling)")
    if d.get("tool_choice") not in (None, "none", "auto"):
        no("tool_choice", f"= {json.dumps(d['tool_choice'])[:80]}")
    if d.get("chat_template_kwargs") not in (None, {}):
        no("chat_template_kwargs", "(non-empty)")
    for k in ("user", "service_tier"):
        b.get_str(k, None)
    for k in ("store", "parallel_tool_calls"):
        b.get_bool(k, None)
    if d.get("metadata") is not None and not isinstance(d["metadata"], dict):
        raise bad(f"'metadata' must be an object, got {_type_name(d['metadata'])}", "metadata")


# ============================================================================================
# text: incremental detokenization, stop strings, token strings
# ============================================================================================

def _bytes_to_unicode() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: printable bytes stand for themselves, the others
    for the code points from 256 up, in byte order."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    inv, extra = {}, 0
    for b in range(256):
        if b in keep:
            inv[chr(b)] = b
        else:
            inv[chr(256 + extra)] = b
            extra += 1
    return inv


class TextCodec:
    """Decoding helpers over the model's tokenizer (or none: then all text is empty)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tok = tokenizer
        self.vocab_size = vocab_size
        self._bytes: dict[int, bytes] = {}
        self._byte_level = False
        self._inv = None
        self._special: set[int] = set()
        if tokenizer is not None:
            try:
                dec = json.loads(tokenizer.tok.to_str()).get("decoder") or {}
                self._byte_level = dec.get("type") == "ByteLevel"
                self._special = {i for i, t in tokenizer.tok.get_added_tokens_decoder().items()
                                 if t.special}
            except Exception:  # noqa: BLE001
                pass
            self._inv = _bytes_to_unicode()

    def decode(self, ids) -> str:
        return self.tok.decode(ids) if self.tok is not None and ids else ""

    def token_bytes(self, tid: int) -> bytes:
        b = self._bytes.get(tid)
        if b is None:
            if self.tok is None:
                b = b""
            else:
                piece = self.tok.tok.id_to_token(tid)
                if piece is None:
                    b = b""
                elif self._byte_level and tid not in self._special and all(c in self._inv for c in piece):
                    b = bytes(self._inv[c] for c in piece)
                else:
                    b = self.tok.tok.decode([tid], skip_special_tokens=False).encode()
            self._bytes[tid] = b
        return b

    def token_str(self, tid: int) -> str:
        """The text of one token; a token that is not whole UTF-8 reads 'bytes:\\xNN...' as in
        OpenAI's API."""
        if self.tok is None:
            return f"token_id:{tid}"
        b = self.token_bytes(tid)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


class IncrementalText:
    """The completion text as it grows, token by token, with stop strings.

    Streaming and non-streaming responses both concatenate the deltas this returns, so they
    are equal by construction. Text that may still change is held back until it settles: a
    trailing partial UTF-8 character (decoded as U+FFFD), and the last len(longest stop) - 1
    characters, which could begin a stop string."""

    def __init__(self, codec: TextCodec, stops: list[str]):
        self.codec, self.stops = codec, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""            # emitted so far
        self.checked = 0          # chars of the decoded text already searched for stops
        self.stop_str: str | None = None

    def feed(self, ids: list[int], final: bool) -> tuple[str, bool]:
        """Add tokens; returns (new text, stopped on a stop string)."""
        self.ids += ids
        full = self.codec.decode(self.ids)
        if self.stops and len(full) > self.checked:
            start = max(0, self.checked - self.hold)
            hits = [(i, s) for s in self.stops if (i := full.find(s, start)) >= 0]
            if hits:
                i, s = min(hits)
                self.stop_str = s
                return self._emit(full, i), True
            self.checked = len(full)
        if final:
            return self._emit(full, len(full)), False
        end = len(full)
        while end > 0 and full[end - 1] == "\ufffd":
            end -= 1
        return self._emit(full, min(end, len(full) - self.hold)), False

    def _emit(self, full: str, end: int) -> str:
        n = len(self.text)
        if end <= n:
            return ""
        d = full[n:end]
        self.text += d
        return d


# ============================================================================================
# requests
# ============================================================================================

@dataclass
class _Choice:
    index: int
    request_id: str
    prompt_ids: list[int]
    text: IncrementalText
    echo: str = ""
    token_ids: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)      # (logprob, [(id, lp)]) per token
    finish_reason: str | None = None
    stop_reason: object = None
    done: bool = False

    def feed(self, d: Delta, stop_ids: set) -> tuple[str, list, list]:
        """Apply a Delta; returns (text delta, new token ids, their logprobs)."""
        ids = list(d.token_ids)
        lps = list(d.logprobs or [])
        final = d.finish_reason is not None
        self.token_ids += ids
        self.logprobs += lps
        text, stopped = self.text.feed(ids, final)
        if stopped:
            self.finish_reason, self.stop_reason, self.done = "stop", self.text.stop_str, True
        elif final:
            self.done = True
            self.finish_reason = d.finish_reason
            if d.finish_reason == "stop" and self.token_ids:
                last = self.token_ids[-1]
                self.stop_reason = last if last in stop_ids else None
        return text, ids, lps


class _Gone(Exception):
    """The client disconnected."""


class _ServerFault(Exception):
    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class Frontend:
    def __init__(self, aeng: AsyncEngine, served_model_names: list[str], max_logprobs: int = 20,
                 max_n: int = 128, model_path: str | None = None):
        self.aeng = aeng
        eng = aeng.engine
        self.names = list(served_model_names)
        self.model_name = self.names[0]
        self.model_path = model_path
        self.tokenizer = eng.tokenizer
        self.vocab_size = eng.cfg.vocab_size
        self.eos = eng.cfg.eos_token_id
        self.max_model_len = eng.max_model_len
        self.codec = TextCodec(self.tokenizer, self.vocab_size)
        self.max_logprobs, self.max_n = max_logprobs, max_n
        self.created = int(time.time())

    # ---- shared parsing --------------------------------------------------------------------
    def check_model(self, b: _Body) -> None:
        m = b.b.get("model")
        if m is None:
            return
        if not isinstance(m, str):
            raise bad(f"'model' must be a string, got {_type_name(m)}", "model")
        if m not in self.names:
            raise APIError(404, f"The model `{m}` does not exist. This server serves: "
                           f"{', '.join(self.names)}", "model", "model_not_found")

    def encode(self, text: str, param: str) -> list[int]:
        if self.tokenizer is None:
            raise bad("this model has no tokenizer: send the prompt as token ids", param)
        return self.tokenizer.encode(text)

    def sampling(self, b: _Body, prompt_lens: list[int], max_tokens_key=("max_tokens",),
                 default_max: int | None = 16) -> tuple[list[SamplingParams], int, list[str], set]:
        """SamplingParams per choice index within a prompt (seeded choices get seed + j),
        n, stop strings, stop ids."""
        n = b.get_int("n", 1, 1, self.max_n)
        max_tokens = None
        for k in max_tokens_key:
            if b.has(k):
                max_tokens = b.get_int(k, None, 1)
                break
        temperature = b.get_num("temperature", 1.0, 0.0, 2.0)
        top_p = b.get_num("top_p", 1.0, 0.0, 1.0, lo_open=True)
        top_k = b.get_int("top_k", 0, -1, what="-1, 0 (off) or a positive integer")
        top_k = 0 if top_k == -1 else top_k
        seed = b.get_int("seed", None, -(2 ** 63), 2 ** 64 - 1)
        ignore_eos = b.get_bool("ignore_eos", False)
        stop = b.b.get("stop")
        if stop is None:
            stops = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            stops = list(stop)
        else:
            raise bad("'stop' must be a string or a list of strings", "stop")
        if any(s == "" for s in stops):
            raise bad("'stop' strings must not be empty", "stop")
        if stops and self.tokenizer is None:
            raise bad("'stop' strings need a tokenizer; this model has none (use stop_token_ids)", "stop")
        sti = b.b.get("stop_token_ids")
        if sti is None:
            sti = []
        if not isinstance(sti, list) or not all(_is_int(t) for t in sti):
            raise bad("'stop_token_ids' must be a list of integers", "stop_token_ids")
        if any(not 0 <= t < self.vocab_size for t in sti):
            raise bad(f"'stop_token_ids' must be token ids in [0, {self.vocab_size})", "stop_token_ids")
        longest = max(prompt_lens)
        if longest >= self.max_model_len:
            raise bad(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                      f"your prompt has {longest} tokens. Please reduce the length of the prompt.",
                      "prompt" if max_tokens_key == ("max_tokens",) else "messages",
                      "context_length_exceeded")
        if max_tokens is not None and longest + max_tokens > self.max_model_len:
            raise bad(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                      f"requested {longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for "
                      f"the completion). Please reduce the length of the prompt or max_tokens.",
                      max_tokens_key[0], "context_length_exceeded")
        per_prompt = []
        for plen in prompt_lens:
            mt = max_tokens
            if mt is None:
                room = self.max_model_len - plen
                mt = room if default_max is None else min(default_max, room)
            row = []
            for j in range(n):
                try:
                    row.append(SamplingParams(max_tokens=mt, temperature=temperature, top_k=top_k, top_p=top_p,
                                              seed=None if seed is None else (seed + j) % 2 ** 64,
                                              stop_token_ids=list(sti),
                                              ignore_eos=ignore_eos))
                except ValueError as e:
                    raise bad(str(e)) from None
            per_prompt.append(row)
        return per_prompt, n, stops, set(sti)

    def stream_opts(self, b: _Body, stream: bool) -> bool:
        so = b.b.get("stream_options")
        if so is None:
            return False
        if not isinstance(so, dict):
            raise bad(f"'stream_options' must be an object, got {_type_name(so)}", "stream_options")
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        extra = set(so) - {"include_usage", "continuous_usage_stats"}
        if extra:
            raise bad(f"unrecognized stream_options: {', '.join(sorted(extra))}", "stream_options")
        _Body(so).get_bool("continuous_usage_stats", False)
        return _Body(so).get_bool("include_usage", False)

    # ---- running choices -------------------------------------------------------------------
    def submit(self, rid: str, prompts: list[list[int]], params: list[list[SamplingParams]],
               stops: list[str], echoes: list[str], logprobs: int | None) -> tuple[list[_Choice], asyncio.Queue]:
        if not self.aeng.alive:
            raise APIError(503, f"the engine is not running: {self.aeng.dead or 'stopped'}")
        sink: asyncio.Queue = asyncio.Queue()
        now = time.monotonic()
        choices = []
        for i, (ids, row) in enumerate(zip(prompts, params)):
            for j, sp in enumerate(row):
                c = _Choice(len(choices), f"{rid}-{len(choices)}", ids, IncrementalText(self.codec, stops),
                            echoes[i])
                choices.append(c)
                self.aeng.add(c.request_id, ids, sp, sink, logprobs, now)
        return choices, sink

    async def events(self, request: Request, choices: list[_Choice], sink: asyncio.Queue,
                     stop_ids: set, poll_disconnect: bool):
        """Yield (choice, text, ids, logprobs) as tokens arrive; abort whatever is unfinished when
        the consumer stops (client gone, error, cancellation)."""
        by_id = {c.request_id: c for c in choices}
        pending = set(by_id)
        last_poll = time.monotonic()
        try:
            while pending:
                try:
                    d = await asyncio.wait_for(sink.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    d = None
                if poll_disconnect and time.monotonic() - last_poll >= 0.25:
                    last_poll = time.monotonic()
                    if await request.is_disconnected():
                        raise _Gone()
                if d is None:
                    continue
                c = by_id.get(d.request_id)
                if c is None or c.done:
                    continue
                if d.error is not None:
                    pending.discard(c.request_id)
                    c.done = True
                    raise _ServerFault(d.error, d.status)
                text, ids, lps = c.feed(d, stop_ids)
                if c.done:
                    pending.discard(c.request_id)
                    if d.finish_reason is None:      # stopped here (stop string): free it now
                        self.aeng.abort(c.request_id, "stop")
                yield c, text, ids, lps
        finally:
            for r in pending:
                self.aeng.abort(r)

    # ---- formatting ------------------------------------------------------------------------
    def completion_logprobs(self, ids: list[int], lps: list, offset: int) -> dict:
        toks, tlp, top, offs = [], [], [], []
        for t, (lp, tops) in zip(ids, lps):
            s = self.codec.token_str(t)
            toks.append(s)
            tlp.append(lp)
            top.append({self.codec.token_str(i): v for i, v in tops})
            offs.append(offset)
            offset += len(self.codec.decode([t]))
        return {"tokens": toks, "token_logprobs": tlp, "top_logprobs": top, "text_offset": offs}

    def chat_logprobs(self, ids: list[int], lps: list) -> dict:
        def entry(t, lp):
            return {"token": self.codec.token_str(t), "logprob": lp, "bytes": list(self.codec.token_bytes(t))}
        return {"content": [dict(entry(t, lp), top_logprobs=[entry(i, v) for i, v in tops])
                            for t, (lp, tops) in zip(ids, lps)], "refusal": None}

    @staticmethod
    def usage(prompts: list[list[int]], choices: list[_Choice]) -> dict:
        p = sum(len(x) for x in prompts)
        c = sum(len(ch.token_ids) for ch in choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


# ============================================================================================
# the app
# ============================================================================================

class _Auth:
    """Bearer-key check on every route but /health (pure ASGI: it leaves streaming and
    disconnect detection alone)."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                msg = ("Missing API key: send 'Authorization: Bearer <key>'" if not auth
                       else "Incorrect API key provided")
                resp = JSONResponse(error_body(401, msg, None, "invalid_api_key"), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _json_body(request: Request) -> _Body:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {_type_name(body)}")
    return _Body(body)


def create_app(aeng: AsyncEngine, served_model_names: list[str], api_key: str | None = None,
               max_logprobs: int = 20, model_path: str | None = None) -> FastAPI:
    from contextlib import asynccontextmanager

    fe = Frontend(aeng, served_model_names, max_logprobs, model_path=model_path)
    metrics = aeng.metrics

    @asynccontextmanager
    async def lifespan(app):
        aeng.start()
        yield
        aeng.stop()

    app = FastAPI(title="v41", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.frontend = fe

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        msg = {404: f"no route {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return JSONResponse(error_body(e.status_code, msg, None, None,
                                       "invalid_request_error" if e.status_code < 500 else "server_error"),
                            status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"), status_code=500)

    @app.get("/health")
    async def health():
        if not aeng.alive:
            return JSONResponse(error_body(503, f"engine not running: {aeng.dead or 'stopped'}"), 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics():
        body = metrics.render() if metrics else ""
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version():
        import importlib.metadata

        import torch
        eng = aeng.engine
        args = getattr(eng, "args", None)
        try:
            v41_version = importlib.metadata.version("v41")
        except importlib.metadata.PackageNotFoundError:
            v41_version = None
        return {"version": v41_version, "torch": torch.__version__, "model": model_path,
                "device": str(getattr(getattr(eng, "runner", None), "device", "unknown")),
                "torch_threads": torch.get_num_threads(),
                "engine_args": {k: v for k, v in vars(args).items() if k != "extra"} if args else {},
                "max_model_len": fe.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": n, "object": "model", "created": fe.created, "owned_by": "v41",
             "root": model_path or n, "parent": None, "max_model_len": fe.max_model_len,
             "vocab_size": fe.vocab_size} for n in fe.names]}

    # ---- completions ---------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        b = await _json_body(request)
        _refuse_unsupported(b, _COMPLETION)
        fe.check_model(b)
        if "prompt" not in b.b:
            raise bad("'prompt' is required", "prompt")
        texts, prompts = _parse_prompts(fe, b.b["prompt"])
        echo = b.get_bool("echo", False)
        stream = b.get_bool("stream", False)
        include_usage = fe.stream_opts(b, stream)
        lp = b.b.get("logprobs")
        if isinstance(lp, bool):
            raise bad("'logprobs' must be an integer (the number of top logprobs) for completions", "logprobs")
        logprobs = b.get_int("logprobs", None, 0, fe.max_logprobs)
        if echo and logprobs is not None:
            raise bad("'echo' with 'logprobs' needs prompt logprobs, which this server does not compute",
                      "echo", "unsupported_parameter")
        want_ids = b.get_bool("return_token_ids", False)
        params, n, stops, stop_ids = fe.sampling(b, [len(p) for p in prompts])
        echoes = [(t if t is not None else fe.codec.decode(p)) if echo else "" for t, p in zip(texts, prompts)]
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        choices, sink = fe.submit(rid, prompts, params, stops, echoes, logprobs)
        head = {"id": rid, "object": "text_completion", "created": created, "model": fe.model_name}

        def fmt_lp(c, ids, lps, offset):
            return fe.completion_logprobs(ids, lps, offset) if logprobs is not None else None

        if stream:
            async def gen():
                started = set()
                offsets = {}
                try:
                    async for c, text, ids, lps in fe.events(request, choices, sink, stop_ids, False):
                        if c.index not in started:
                            started.add(c.index)
                            offsets[c.index] = len(c.echo)
                            if c.echo or want_ids:
                                ch = {"index": c.index, "text": c.echo, "logprobs": None, "finish_reason": None}
                                if want_ids:
                                    ch["prompt_token_ids"] = c.prompt_ids
                                yield sse(dict(head, choices=[ch], **({"usage": None} if include_usage else {})))
                        if not text and not c.done and logprobs is None and not want_ids:
                            continue
                        ch = {"index": c.index, "text": text,
                              "logprobs": fmt_lp(c, ids, lps, offsets[c.index]),
                              "finish_reason": c.finish_reason if c.done else None}
                        offsets[c.index] += sum(len(fe.codec.decode([t])) for t in ids) if logprobs is not None else 0
                        if c.done:
                            ch["stop_reason"] = c.stop_reason
                        if want_ids:
                            ch["token_ids"] = ids
                        yield sse(dict(head, choices=[ch], **({"usage": None} if include_usage else {})))
                    if include_usage:
                        yield sse(dict(head, choices=[], usage=fe.usage(prompts, choices)))
                except _ServerFault as e:
                    yield sse(error_body(e.status, str(e)))
                yield b"data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})

        try:
            async for _ in fe.events(request, choices, sink, stop_ids, True):
                pass
        except _Gone:
            return Response(status_code=499)
        except _ServerFault as e:
            raise APIError(e.status, str(e)) from None
        out = []
        for c in choices:
            ch = {"index": c.index, "text": c.echo + c.text.text,
                  "logprobs": fmt_lp(c, c.token_ids, c.logprobs, len(c.echo)),
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if want_ids:
                ch["prompt_token_ids"], ch["token_ids"] = c.prompt_ids, c.token_ids
            out.append(ch)
        return dict(head, choices=out, usage=fe.usage(prompts, choices))

    # ---- chat ----------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        b = await _json_body(request)
        _refuse_unsupported(b, _CHAT)
        fe.check_model(b)
        ids = _parse_messages(fe, b)
        stream = b.get_bool("stream", False)
        include_usage = fe.stream_opts(b, stream)
        want_lp = b.get_bool("logprobs", False)
        top = b.get_int("top_logprobs", None, 0, fe.max_logprobs)
        if top is not None and not want_lp:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = (top or 0) if want_lp else None
        want_ids = b.get_bool("return_token_ids", False)
        params, n, stops, stop_ids = fe.sampling(b, [len(ids)], ("max_completion_tokens", "max_tokens"), None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        choices, sink = fe.submit(rid, [ids], params, stops, [""], logprobs)
        head = {"id": rid, "object": "chat.completion", "created": created, "model": fe.model_name}
        if want_ids:
            head["prompt_token_ids"] = ids

        if stream:
            chead = dict(head, object="chat.completion.chunk")

            async def gen():
                started = set()
                try:
                    for c in choices:
                        started.add(c.index)
                        yield sse(dict(chead, choices=[{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}],
                                       **({"usage": None} if include_usage else {})))
                    async for c, text, tids, lps in fe.events(request, choices, sink, stop_ids, False):
                        if not text and not c.done and logprobs is None and not want_ids:
                            continue
                        ch = {"index": c.index, "delta": {"content": text} if text else {},
                              "logprobs": fe.chat_logprobs(tids, lps) if logprobs is not None else None,
                              "finish_reason": c.finish_reason if c.done else None}
                        if c.done:
                            ch["stop_reason"] = c.stop_reason
                        if want_ids:
                            ch["token_ids"] = tids
                        yield sse(dict(chead, choices=[ch], **({"usage": None} if include_usage else {})))
                    if include_usage:
                        yield sse(dict(chead, choices=[], usage=fe.usage([ids], choices)))
                except _ServerFault as e:
                    yield sse(error_body(e.status, str(e)))
                yield b"data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})

        try:
            async for _ in fe.events(request, choices, sink, stop_ids, True):
                pass
        except _Gone:
            return Response(status_code=499)
        except _ServerFault as e:
            raise APIError(e.status, str(e)) from None
        out = []
        for c in choices:
            ch = {"index": c.index, "message": {"role": "assistant", "content": c.text.text},
                  "logprobs": fe.chat_logprobs(c.token_ids, c.logprobs) if logprobs is not None else None,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if want_ids:
                ch["token_ids"] = c.token_ids
            out.append(ch)
        return dict(head, choices=out, usage=fe.usage([ids], choices))

    if api_key:
        return _Auth(app, api_key)  # type: ignore[return-value]
    return app


def _parse_prompts(fe: Frontend, p) -> tuple[list[str | None], list[list[int]]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of lists of ids."""
    shape = ("'prompt' must be a string, a list of strings, a list of token ids or a list of lists "
             "of token ids")
    if isinstance(p, str):
        items = [p]
    elif isinstance(p, list):
        if not p:
            raise bad("'prompt' is empty", "prompt", "empty_prompt")
        if all(_is_int(x) for x in p):
            items = [p]
        elif all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            items = p
        else:
            raise bad(shape, "prompt")
    else:
        raise bad(f"{shape}, got {_type_name(p)}", "prompt")
    texts, prompts = [], []
    for x in items:
        if isinstance(x, str):
            ids = fe.encode(x, "prompt")
            texts.append(x)
        else:
            if not all(_is_int(t) for t in x):
                raise bad(shape, "prompt")
            bad_ids = [t for t in x if not 0 <= t < fe.vocab_size]
            if bad_ids:
                raise bad(f"token ids out of range [0, {fe.vocab_size}): {bad_ids[:5]}", "prompt")
            ids = list(x)
            texts.append(None)
        if not ids:
            raise bad("the prompt is empty (it has no tokens)", "prompt", "empty_prompt")
        prompts.append(ids)
    return texts, prompts


_ROLES = {"system", "developer", "user", "assistant"}


def _parse_messages(fe: Frontend, b: _Body) -> list[int]:
    msgs = b.b.get("messages")
    if msgs is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(msgs, list):
        raise bad(f"'messages' must be an array, got {_type_name(msgs)}", "messages")
    if not msgs:
        raise bad("'messages' is empty", "messages", "empty_prompt")
    if fe.tokenizer is None or not fe.tokenizer.chat_template:
        raise bad("this model has no chat template: use /v1/completions", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"'{where}' must be an object, got {_type_name(m)}", where)
        role = m.get("role")
        if role not in _ROLES:
            raise bad(f"'{where}.role' must be one of {sorted(_ROLES)}, got {role!r}", f"{where}.role")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise bad(f"'{where}' has unsupported fields: {', '.join(sorted(extra))}", where,
                      "unsupported_parameter")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"'{where}.content[{j}]': only text parts ({{'type': 'text', 'text': ...}}) "
                              f"are supported", f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise bad(f"'{where}.content' must be a string or a list of text parts, got {_type_name(content)}",
                      f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    add_gen = b.get_bool("add_generation_prompt", True)
    try:
        text = fe.tokenizer.apply_chat_template(out, add_generation_prompt=add_gen)
    except Exception as e:  # noqa: BLE001 - a template error is the request's problem
        raise bad(f"the chat template failed on these messages: {e}", "messages") from None
    ids = fe.tokenizer.encode(text)
    if not ids:
        raise bad("the prompt is empty (it has no tokens)", "messages", "empty_prompt")
    return ids
