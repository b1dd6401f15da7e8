"""One row per refusal the server code can raise.

The refusal sites are read from runtime/server/*.py with `ast` (tests/refusal_sites.py): every
`bad(...)`, `APIError(...)`, `error_response(...)`, `error_body(...)` call, every `no(key, ...)`
call (one site per key), and every `Response(status_code=4xx/5xx)`. A site is named `function:
message template` ("{}" for each interpolated value). Each row below names one site, sends a request that must
trigger exactly it, and checks the status, the OpenAI error's `param` and `code`, and that the
message fits the site's template (and no more specific one). `test_every_refusal_has_a_row`
fails when a site has no row, so a new refusal cannot go untested, and when a row or exemption
names a site that is gone.

The apps run in process (no sockets): `toy` is the real app over the real toy engine; the others
are the same app over a stand-in engine, for the paths the toy cannot reach (no tokenizer, a
failing chat template, an engine that refuses, crashes, is dead, or a client that disconnects).
"""
from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed: pip install -e '.[serve]'")

from runtime.server.async_engine import Delta  # noqa: E402
from tests.refusal_sites import SITES, literal_len, pattern, site_of  # noqa: E402

KEY = "refusal-key"
MAX_LEN = 128

# ---- the apps ------------------------------------------------------------------------------

class TemplateStub:
    """A tokenizer whose chat template fails on 'raise' and renders anything else to ''."""
    chat_template = "stub"

    def apply_chat_template(self, msgs, add_generation_prompt=True, **options):
        if any(m["content"] == "raise" for m in msgs):
            raise ValueError("stub template error")
        return ""

    def encode(self, text):
        return []

    def decode(self, ids):
        return ""


class StandIn:
    """The AsyncEngine surface the app uses, with one behaviour per mode."""

    def __init__(self, mode: str, tokenizer=None):
        self.mode = mode
        self.engine = SimpleNamespace(tokenizer=tokenizer, cfg=SimpleNamespace(vocab_size=1024), max_model_len=MAX_LEN)
        self.dead = "RuntimeError: stand-in engine died" if mode == "dead" else None
        self.alive = self.dead is None
        self.queued = 1024 if mode == "full" else 0

    def stalled_for(self):
        return 120.0 if self.mode == "stalled" else None

    def start(self):
        pass

    def stop(self):
        pass

    def add(self, rid, ids, params, sink, logprobs, arrival):
        if self.mode == "crash":
            raise RuntimeError("stand-in add crashed")
        if self.mode == "refuse":
            sink.put_nowait(Delta(rid, [], error="stand-in engine refused the prompt", status=400))
        # "silent": never answers

    def abort(self, rid, reason="abort"):
        pass


@pytest.fixture(scope="module")
def apps():
    from runtime.engine import EngineArgs, LLMEngine
    from runtime.metrics import ServingMetrics
    from runtime.server import AsyncEngine, create_app

    eng = LLMEngine(EngineArgs(model="toy", max_model_len=MAX_LEN, max_num_seqs=4))
    toy = AsyncEngine(eng, ServingMetrics("toy"))
    toy.start()
    made = {"toy": create_app(toy, ["toy"], api_key=KEY)}
    for mode, tok in [("bare", None), ("stub", TemplateStub()), ("refuse", eng.tokenizer), ("crash", eng.tokenizer),
                      ("dead", eng.tokenizer), ("silent", eng.tokenizer), ("stalled", eng.tokenizer),
                      ("full", eng.tokenizer)]:
        made[mode] = create_app(StandIn(mode, tok), ["toy"])
    loop = asyncio.new_event_loop()
    yield made, loop
    loop.close()
    toy.stop()


async def call(app, method, path, body: bytes, headers: dict, gone: bool, arrivals: list | None = None):
    """One HTTP request straight through the ASGI app; `gone`: the client disconnects after
    sending it; `arrivals` gets the time of each body chunk sent. Returns (status, response body)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive():
        if pending:
            return pending.pop()
        if gone:
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()

    got = {"status": None, "body": b""}

    async def send(m):
        if m["type"] == "http.response.start":
            got["status"] = m["status"]
        elif m["type"] == "http.response.body":
            got["body"] += m.get("body", b"")
            if arrivals is not None and m.get("body"):
                arrivals.append(time.monotonic())

    hdrs = [(b"content-type", b"application/json")] + [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": hdrs,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    try:
        await asyncio.wait_for(app(scope, receive, send), 60)
    except Exception:          # an unhandled error is re-raised after its 500 response was sent
        if got["status"] is None:
            raise
    return got["status"], got["body"]


# ---- the rows ------------------------------------------------------------------------------

def C(**kw):
    return {"model": "toy", "prompt": "hi", "max_tokens": 2, **kw}


def M(content="hi", **kw):
    return {"model": "toy", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **kw}


CHAT = "/v1/chat/completions"
UNS, UNK, CTX = "unsupported_parameter", "unknown_parameter", "context_length_exceeded"
LONG = list(range(5, 5 + MAX_LEN + 3))
SHAPE = ("completions.parse_prompts: 'prompt' must be a string, a list of strings, a list of token ids or a list of "
         "lists of token ids")


def R(site, status, param=None, code=None, body=None, path="/v1/completions", app="toy", method="POST",
      headers=None, gone=False):
    body = C() if body is None else body
    return pytest.param(dict(site=site, status=status, param=param, code=code, path=path, body=body, app=app,
                             method=method, headers=headers, gone=gone), id=site)


ROWS = [
    # protocol.Body: the typed getters
    R("get_int: '{}' must be an integer, got {}", 400, "max_tokens", body=C(max_tokens="5")),
    R("get_int: '{}' must be {}, got {}", 400, "max_tokens", body=C(max_tokens=0)),
    R("get_num: '{}' must be a finite number, got {}", 400, "temperature", body=C(temperature="hot")),
    R("get_num: '{}' must be {}, got {}", 400, "top_p", body=C(top_p=0)),
    R("get_as: '{}' must be a {}, got {}", 400, "stream", body=C(stream="yes")),
    # protocol.read_body
    R("request body over the limit of {} bytes", 413, code="request_too_large", body=b" " * (16 << 20) + b"{}"),
    R("malformed JSON body", 400, body=b"{not json"),
    R("malformed JSON body", 400, body=b"[" * 100_000 + b"]" * 100_000),            # RecursionError
    R("malformed JSON body", 400, body=b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"),
    R("malformed JSON body", 400, body=b'{"model": "toy", "prompt": "a\\ud800b"}'),  # lone surrogate
    R("must be a JSON object", 400, body=b"[1, 2]"),
    R("{} prompts x n={} = {} choices; this server takes at most {} per request", 400, "n", "too_many_choices",
      body=C(prompt=["a", "b", "c"], n=100)),
    R("'prompt' holds {} prompts; this server takes at most {} choices per request", 400, "prompt",
      "too_many_choices", body=C(prompt=["a"] * 300)),
    # protocol.refuse_unsupported
    R("unrecognized request argument", 400, "bogus", UNK, body=C(bogus=1)),
    R("'min_tokens' ({}) must be <= max_tokens ({})", 400, "min_tokens", body=C(min_tokens=3)),
    # protocol._logit_bias
    R("'logit_bias' must be an object", 400, "logit_bias", body=C(logit_bias=[1])),
    R("'logit_bias' has {} entries", 400, "logit_bias", body=C(logit_bias={str(i): 1 for i in range(301)})),
    R("'logit_bias' keys must be token ids", 400, "logit_bias", body=C(logit_bias={"1024": 1})),
    R("'logit_bias' values must be finite numbers", 400, "logit_bias", body=C(logit_bias={"5": "up"})),
    R("'suffix' (non-empty)", 400, "suffix", UNS, body=C(suffix="end")),
    R("'best_of' different from n", 400, "best_of", UNS, body=C(best_of=2)),
    R("'response_format' = {}", 400, "response_format", UNS, path=CHAT,
      body=M(response_format={"type": "json_object"})),
    R("'metadata' must be an object", 400, "metadata", body=C(metadata="x")),
    # protocol.check_model
    R("'model' must be a string", 400, "model", body=C(model=5)),
    R("does not exist", 404, "model", "model_not_found", body=C(model="nope")),
    # protocol.stream_options
    R("'stream_options' must be an object", 400, "stream_options", body=C(stream=True, stream_options=True)),
    R("only allowed when 'stream' is true", 400, "stream_options", body=C(stream_options={"include_usage": True})),
    R("unrecognized stream_options", 400, "stream_options", body=C(stream=True, stream_options={"x": 1})),
    # protocol.sampling
    R("'stop' must be a string or a list of strings", 400, "stop", body=C(stop=5)),
    R("'stop' strings must not be empty", 400, "stop", body=C(stop=[""])),
    R("'stop' strings need a tokenizer", 400, "stop", app="bare", body=C(prompt=[5, 6], stop="x")),
    R("'stop_token_ids' must be a list of integers", 400, "stop_token_ids", body=C(stop_token_ids="1")),
    R("'stop_token_ids' must be token ids in", 400, "stop_token_ids", body=C(stop_token_ids=[-1])),
    R("your prompt has", 400, "prompt", CTX, body=C(prompt=LONG)),
    R("you requested", 400, "max_tokens", CTX, body=C(prompt=LONG[:100], max_tokens=50)),
    # completions.parse_prompts / Completion.parse
    R("parse_prompts: 'prompt' is empty", 400, "prompt", "empty_prompt", body=C(prompt=[])),
    R(SHAPE, 400, "prompt", body=C(prompt=["a", 1])),
    R(SHAPE + " #2", 400, "prompt", body=C(prompt=[[5, "a"]])),
    R("token ids, got {}", 400, "prompt", body=C(prompt=42)),
    R("this model has no tokenizer: send the prompt", 400, "prompt", app="bare", body=C(prompt="hi")),
    R("token ids out of range", 400, "prompt", body=C(prompt=[5, 99999])),
    R("parse_prompts: the prompt is empty", 400, "prompt", "empty_prompt", body=C(prompt="")),
    R("'prompt' is required", 400, "prompt", body={"model": "toy"}),
    R("'logprobs' must be an integer (the number", 400, "logprobs", body=C(logprobs=True)),
    R("'echo' with 'logprobs'", 400, "echo", UNS, body=C(echo=True, logprobs=1)),
    # chat.parse_messages / Chat.parse
    R("'messages' is required", 400, "messages", path=CHAT, body={"model": "toy"}),
    R("'messages' must be an array", 400, "messages", path=CHAT, body=M(messages="hi")),
    R("'messages' is empty", 400, "messages", "empty_prompt", path=CHAT, body=M(messages=[])),
    R("no chat template", 400, "messages", app="bare", path=CHAT, body=M()),
    R("'messages[{}]' must be an object", 400, "messages[0]", path=CHAT, body=M(messages=["hi"])),
    R(".role' must be one of", 400, "messages[0].role", path=CHAT,
      body=M(messages=[{"role": "wizard", "content": "x"}])),
    R("has unsupported fields", 400, "messages[0]", UNS, path=CHAT,
      body=M(messages=[{"role": "user", "content": "x", "audio": {"id": "a1"}}])),
    R("only text parts", 400, "messages[0].content", path=CHAT,
      body=M(messages=[{"role": "user", "content": [{"type": "image_url"}]}])),
    R(".content' must be a string or a list of text parts", 400, "messages[0].content", path=CHAT, body=M(3)),
    R("the chat template failed", 400, "messages", app="stub", path=CHAT, body=M("raise")),
    R("parse_messages: the prompt is empty", 400, "messages", "empty_prompt", app="stub", path=CHAT, body=M()),
    R("'top_logprobs' needs 'logprobs'", 400, "top_logprobs", path=CHAT, body=M(top_logprobs=2)),
    R("Chat.parse: chat protocol: {}", 400, "reasoning_effort", path=CHAT, body=M(reasoning_effort="extreme")),
    # protocol.check_text_sizes (before anything is tokenized)
    R("per prompt (--max-prompt-bytes)", 400, "prompt", "prompt_too_large", body=C(prompt=["a", "x" * 9000])),
    R("per prompt (--max-prompt-bytes)", 400, "messages", "prompt_too_large", path=CHAT, body=M("y" * 9000)),
    R("(--max-stop-bytes)", 400, "stop", "stop_too_large", body=C(stop=["s" * 3000, "t" * 1100])),
    # tokens.py: /tokenize, /detokenize
    R("nothing to tokenize or detokenize with", 400, app="bare", path="/tokenize", body={"prompt": "hi"}),
    R("'add_special_tokens': true", 400, "add_special_tokens", UNS, path="/tokenize",
      body={"prompt": "hi", "add_special_tokens": True}),
    R("exactly one of 'prompt' and 'messages'", 400, "prompt", path="/tokenize", body={"model": "toy"}),
    R("tokenize: chat protocol: {}", 400, "reasoning_effort", path="/tokenize",
      body={"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "extreme"}),
    R("'tokens' must be a list of token ids", 400, "tokens", path="/detokenize", body={"tokens": [1, 99999]}),
    # app.py
    R("Missing API key", 401, code="invalid_api_key", headers={}),
    R("Incorrect API key provided", 401, code="invalid_api_key", headers={"Authorization": "Bearer wrong"}),
    R("no route {} {}", 404, path="/v1/nothing"),
    R("method {} is not allowed on {}", 405, method="GET"),
    R("internal error", 500, app="crash"),
    R("health: engine not running", 503, app="dead", method="GET", path="/health"),
    R("health: engine has not stepped for {} s with requests queued (limit {} s)", 503, app="stalled",
      method="GET", path="/health"),
    # serving.py
    R("the engine is not running", 503, app="dead"),
    R("server busy: {} requests wait to be scheduled", 503, code="server_busy", app="full"),
    R("respond: {}", 400, app="refuse"),
    R("stream: {}", 400, app="refuse", body=C(stream=True)),
    R("<status 499", 499, app="silent", gone=True),
]

# sites no request can reach, each with the reason
EXEMPT = {
    "protocol.sampling: {}": "SamplingParams' own checks; sampling() validates every field before it",
    "app.create_app._api_error: {}": "forwards each APIError: every row above goes through it",
    "app.create_app._http_error: {}": "another HTTPException: routing raises only 404 and 405",
}


@pytest.mark.parametrize("row", ROWS)
def test_refusal(apps, row):
    """Each refusal answers its own OpenAI error: the right status, param, code and message (the
    echo + logprobs refusal once went missing and the request answered 200)."""
    made, loop = apps
    body = row["body"] if isinstance(row["body"], bytes) else json.dumps(row["body"]).encode()
    headers = {"Authorization": f"Bearer {KEY}"} if row["headers"] is None else row["headers"]
    app = made[row["app"]]
    status, raw = loop.run_until_complete(call(app, row["method"], row["path"], body, headers, row["gone"]))
    key = site_of(row["site"])
    if status == 200 and raw.startswith(b"data: "):          # an error after the stream began
        status, raw = row["status"], next(ln[6:] for ln in raw.split(b"\n") if b'"error"' in ln)
    assert status == row["status"], (status, raw[:300])
    if raw == b"":
        assert SITES[key][0].startswith("<status"), key
        return
    err = json.loads(raw)["error"]
    assert (err["param"], err["code"]) == (row["param"], row["code"]), err
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    fits = [k for k, parts in SITES.items() if pattern(parts).fullmatch(err["message"])]
    assert key in fits, f"{err['message']!r} does not fit {key!r}"
    best = max(literal_len(SITES[k]) for k in fits)
    assert literal_len(SITES[key]) == best, f"{err['message']!r} fits a more specific site than {key!r}: {fits}"


def test_every_refusal_has_a_row():
    """A refusal added to runtime/server without a row here fails; so does a row or an
    exemption whose site is gone."""
    rows = {site_of(p.values[0]["site"]) for p in ROWS}
    assert set(EXEMPT) <= set(SITES), set(EXEMPT) - set(SITES)
    missing = set(SITES) - rows - set(EXEMPT)
    assert not missing, "refusals without a row in ROWS:\n" + "\n".join(sorted(missing))
    assert len(SITES) >= 60


def test_health_answers_head_and_reports_a_stalled_engine(apps):
    """A wedged engine thread with requests queued is a 503 on /health (GET and HEAD); an idle
    engine is healthy."""
    made, loop = apps
    for method in ("GET", "HEAD"):
        assert loop.run_until_complete(call(made["toy"], method, "/health", b"", {}, False))[0] == 200
        assert loop.run_until_complete(call(made["stalled"], method, "/health", b"", {}, False))[0] == 503


def test_stalled_for_counts_only_while_work_waits():
    from runtime.metrics import ServingMetrics
    from runtime.server import AsyncEngine
    aeng = AsyncEngine(SimpleNamespace(), ServingMetrics("toy"))   # its thread is never started
    aeng.heartbeat -= 100
    assert aeng.stalled_for() is None                  # nothing queued: idle, not stalled
    aeng.abort("r1")
    assert aeng.stalled_for() >= 100
