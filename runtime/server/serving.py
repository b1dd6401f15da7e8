"""One OpenAI request from its parsed form (a `Job`) to the response, the same path for
/v1/completions and /v1/chat/completions: submit each choice to the engine thread, read the
Deltas back, detokenize, then stream them as SSE chunks or assemble one JSON body. Only the
shape of a choice differs between the endpoints; `Job` subclasses (completions.py, chat.py)
write it."""
from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from runtime.sequence import SamplingParams
from runtime.server.async_engine import AsyncEngine, Delta
from runtime.server.detokenize import IncrementalText, TextCodec
from runtime.server.protocol import APIError, error_body


@dataclass
class Choice:
    """One completion of one prompt, as the client sees it: one engine request."""
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

    def feed(self, d: Delta, stop_ids: set) -> str:
        """Apply a Delta; returns the text delta."""
        final = d.finish_reason is not None
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs or []
        text, stopped = self.text.feed(d.token_ids, final)
        if stopped:
            self.finish_reason, self.stop_reason, self.done = "stop", self.text.stop_str, True
        elif final:
            self.done = True
            self.finish_reason = d.finish_reason
            if d.finish_reason == "stop" and self.token_ids:
                last = self.token_ids[-1]
                self.stop_reason = last if last in stop_ids else None
        return text


def choice(c: Choice, content: dict, logprobs, token_ids: list | None, done: bool) -> dict:
    """A choice object (whole or a chunk): index, the endpoint's content, logprobs, finish."""
    ch = {"index": c.index, **content, "logprobs": logprobs, "finish_reason": c.finish_reason if done else None}
    if done:
        ch["stop_reason"] = c.stop_reason
    if token_ids is not None:
        ch["token_ids"] = token_ids
    return ch


@dataclass
class Job:
    """A validated request: its prompts and sampling, and how its choices are written."""
    object = chunk_object = prefix = ""                  # set by each endpoint
    codec: TextCodec
    prompts: list[list[int]]
    params: list[list[SamplingParams]]                 # per prompt, one per choice
    stops: list[str]
    stop_ids: set
    logprobs: int | None                               # top-N per token; None: no logprobs
    want_ids: bool
    stream: bool
    include_usage: bool
    echoes: list[str] | None = None                    # per prompt
    head: dict = field(default_factory=dict)           # extra top-level fields

    def opening(self, c: Choice) -> dict | None:
        """The chunk that starts a choice's stream, if any."""

    def chunk(self, c: Choice, text: str, ids: list[int], lps: list) -> dict: ...

    def whole(self, c: Choice) -> dict: ...


class Gone(Exception):
    """The client disconnected."""


class Fault(Exception):
    """The engine failed or refused a request after it was accepted."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def usage(job: Job, choices: list[Choice]) -> dict:
    p = sum(len(x) for x in job.prompts)
    c = sum(len(ch.token_ids) for ch in choices)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def fingerprint(engine) -> str:
    """`system_fingerprint`: the same for every response of one configuration (v41 and torch
    versions, the engine arguments), another when any of them changes."""
    import importlib.metadata

    import torch
    try:
        version = importlib.metadata.version("v41")
    except importlib.metadata.PackageNotFoundError:
        version = None
    args = getattr(engine, "args", None)
    args = sorted((k, repr(v)) for k, v in vars(args).items()) if args is not None else None
    return "fp_" + hashlib.sha256(repr((version, torch.__version__, args)).encode()).hexdigest()[:10]


class Frontend:
    """The served model as the endpoints see it: names, limits, text codec, and `respond`."""

    def __init__(self, aeng: AsyncEngine, served_model_names: list[str], max_logprobs: int = 20,
                 max_n: int = 128, max_choices: int = 256, max_body_bytes: int = 16 << 20,
                 max_queued: int = 1024, max_prompt_bytes: int | None = None, max_stop_bytes: int = 4096):
        """`max_prompt_bytes` None: max_model_len x the longest token's bytes, the most text that
        can fit max_model_len tokens."""
        eng = aeng.engine
        self.aeng = aeng
        self.names = list(served_model_names)
        self.model_name = self.names[0]
        self.tokenizer = eng.tokenizer
        self.vocab_size = eng.cfg.vocab_size
        self.max_model_len = eng.max_model_len
        self.codec = TextCodec(self.tokenizer)
        self.max_logprobs, self.max_n = max_logprobs, max_n
        self.max_choices, self.max_body_bytes = max_choices, max_body_bytes   # per request
        self.max_queued = max_queued                                          # over all requests
        self.max_prompt_bytes = max_prompt_bytes or self.max_model_len * self.codec.max_token_bytes()
        self.max_stop_bytes = max_stop_bytes
        self.created = int(time.time())
        self.fingerprint = fingerprint(eng)

    async def respond(self, request: Request, job: Job):
        rid = f"{job.prefix}-{uuid.uuid4().hex}"
        head = {"id": rid, "object": job.object, "created": int(time.time()), "model": self.model_name,
                "system_fingerprint": self.fingerprint, **job.head}
        choices, sink = self.submit(rid, job)
        if job.stream:
            return StreamingResponse(self.stream(request, job, choices, sink, dict(head, object=job.chunk_object)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        try:
            async for _ in self.events(request, choices, sink, job.stop_ids, True):
                pass
        except Gone:
            return Response(status_code=499)
        except Fault as e:
            raise APIError(e.status, str(e)) from None
        return dict(head, choices=[job.whole(c) for c in choices], usage=usage(job, choices))

    async def stream(self, request: Request, job: Job, choices: list[Choice], sink: asyncio.Queue, head: dict):
        more = {"usage": None} if job.include_usage else {}
        try:
            for c in choices:
                if (ch := job.opening(c)) is not None:
                    yield sse(dict(head, choices=[ch], **more))
            async for c, text, ids, lps in self.events(request, choices, sink, job.stop_ids, False):
                if text or c.done or job.logprobs is not None or job.want_ids:
                    yield sse(dict(head, choices=[job.chunk(c, text, ids, lps)], **more))
            if job.include_usage:
                yield sse(dict(head, choices=[], usage=usage(job, choices)))
        except Fault as e:
            yield sse(error_body(e.status, str(e)))
        yield b"data: [DONE]\n\n"

    def submit(self, rid: str, job: Job) -> tuple[list[Choice], asyncio.Queue]:
        if not self.aeng.alive:
            raise APIError(503, f"the engine is not running: {self.aeng.dead or 'stopped'}")
        n = sum(len(row) for row in job.params)
        queued = self.aeng.queued
        if queued + n > self.max_queued:
            raise APIError(503, f"server busy: {queued} requests wait to be scheduled and this one adds {n}; "
                                f"the limit is {self.max_queued} (--max-queued-requests)", None, "server_busy",
                           {"Retry-After": "1"})
        sink: asyncio.Queue = asyncio.Queue()
        now = time.monotonic()
        choices = []
        for ids, row, echo in zip(job.prompts, job.params, job.echoes or [""] * len(job.prompts)):
            for sp in row:
                c = Choice(len(choices), f"{rid}-{len(choices)}", ids, IncrementalText(self.codec, job.stops), echo)
                choices.append(c)
                self.aeng.add(c.request_id, ids, sp, sink, job.logprobs, now)
        return choices, sink

    async def events(self, request: Request, choices: list[Choice], sink: asyncio.Queue, stop_ids: set,
                     poll_disconnect: bool):
        """Yield (choice, text, ids, logprobs) as tokens arrive; abort whatever is unfinished when
        the consumer stops (client gone, error, cancellation). A streaming response learns of a
        disconnect by being cancelled; a non-streaming one has to poll for it."""
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
                        raise Gone()
                if d is None:
                    continue
                c = by_id.get(d.request_id)
                if c is None or c.done:
                    continue
                if d.error is not None:
                    pending.discard(c.request_id)
                    c.done = True
                    raise Fault(d.error, d.status)
                text = c.feed(d, stop_ids)
                if c.done:
                    pending.discard(c.request_id)
                    if d.finish_reason is None:      # stopped here (stop string): free it now
                        self.aeng.abort(c.request_id, "stop")
                yield c, text, d.token_ids, d.logprobs or []
        finally:
            for r in pending:
                self.aeng.abort(r)
