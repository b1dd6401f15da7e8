"""`python -m v41.serve` end to end: the server runs in a subprocess on a free loopback port
(toy model, float64 so greedy outputs do not depend on batch composition) and is driven with
the official `openai` client, httpx and raw sockets.

Greedy references are isolated `LLM.generate` runs (one request at a time) of the same config.
Both processes run torch on one thread: on a shared 2-core machine that is the fast setting, and
it keeps GEMM reduction order identical between the server and the reference.
"""
from __future__ import annotations

import asyncio
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from runtime.metrics import parse as parse_metrics  # noqa: E402
from tests.server_helpers import (KEY, MAX_MODEL_LEN, ONE_THREAD, ROOT, Reference, extra,  # noqa: E402
                                  start_server, stop_server)


# ---- fixtures ------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def server():
    s = start_server()
    yield s
    log = stop_server(s)
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=300, max_retries=0)


@pytest.fixture(scope="session")
def ref():
    return Reference()


# ---- the openai client ---------------------------------------------------------------------

def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["toy", "v41-toy"]
    assert httpx.get(server.url + "/health").status_code == 200      # no key needed


def test_completion_greedy_equals_llm_generate(server, client, ref):
    prompt = "The window ring"
    r = client.completions.create(model="toy", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"return_token_ids": True})
    want = ref.greedy(ref.tok.encode(prompt), 12)
    c = r.choices[0]
    assert extra(c, "token_ids") == want
    assert c.text == ref.tok.decode(want)
    assert c.finish_reason == ("length" if len(want) == 12 else "stop")
    assert r.usage.prompt_tokens == len(ref.tok.encode(prompt))
    assert r.usage.completion_tokens == len(want)
    assert r.model == "toy"
    # the second served name works too; token-id prompts give the same tokens
    r2 = client.completions.create(model="v41-toy", prompt=ref.tok.encode(prompt), max_tokens=12,
                                   temperature=0, extra_body={"return_token_ids": True})
    assert extra(r2.choices[0], "token_ids") == want


def test_chat_greedy_equals_llm_generate(client, ref):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    r = client.chat.completions.create(model="toy", messages=messages, max_tokens=10, temperature=0,
                                       extra_body={"return_token_ids": True})
    want = ref.greedy(ref.chat_ids(messages), 10)
    assert extra(r.choices[0], "token_ids") == want
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.tok.decode(want)
    assert r.usage.prompt_tokens == len(ref.chat_ids(messages))
    assert r.usage.completion_tokens == len(want)


def test_streaming_equals_non_streaming(client, ref):
    prompt = "Paged attention over"
    kw = dict(model="toy", prompt=prompt, max_tokens=12, temperature=0)
    full = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.text == ref.tok.decode(ref.greedy(ref.tok.encode(prompt), 12))
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == full.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.greedy(ref.tok.encode(prompt), 12))
    # chat
    messages = [{"role": "user", "content": "Tell me about pages"}]
    ckw = dict(model="toy", messages=messages, max_tokens=10, temperature=0)
    cfull = client.chat.completions.create(**ckw).choices[0].message.content
    cchunks = list(client.chat.completions.create(stream=True, **ckw))
    assert cchunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in cchunks) == cfull
    assert cchunks[-1].choices[0].finish_reason in ("length", "stop")


def test_logprobs(client, ref):
    prompt = "Sparse attention"
    r = client.completions.create(model="toy", prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"return_token_ids": True})
    c = r.choices[0]
    ids = extra(c, "token_ids")
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) == 6
    for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(v, abs=1e-6)      # greedy: the argmax
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # streamed logprobs are the same numbers
    s = [ch.choices[0].logprobs for ch in client.completions.create(
        model="toy", prompt=prompt, max_tokens=6, temperature=0, logprobs=3, stream=True) if ch.choices[0].logprobs]
    assert [v for x in s for v in x.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-9)
    # chat
    cr = client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = cr.choices[0].logprobs.content
    assert len(content) == cr.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6)
        assert isinstance(e.bytes, list)


def test_n_greater_than_one(client, ref):
    prompt = "Compressed keys"
    r = client.completions.create(model="toy", prompt=prompt, max_tokens=6, temperature=0, n=3,
                                  extra_body={"return_token_ids": True})
    want = ref.greedy(ref.tok.encode(prompt), 6)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(extra(c, "token_ids") == want for c in r.choices)
    assert r.usage.completion_tokens == 3 * len(want)
    # seeded sampling: reproducible, choices differ from each other
    kw = dict(model="toy", prompt=prompt, max_tokens=8, temperature=1.0, n=2, seed=1234,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    ta = [extra(c, "token_ids") for c in a.choices]
    assert ta == [extra(c, "token_ids") for c in b.choices]
    assert ta[0] != ta[1]
    # streaming with n=2 and a list of two prompts: 4 choices, each as the non-streamed one
    kw = dict(model="toy", prompt=[prompt, "Engram tables"], max_tokens=5, temperature=0, n=2)
    full = {c.index: c.text for c in client.completions.create(**kw).choices}
    streamed = {}
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == full and sorted(full) == [0, 1, 2, 3]
    assert full[2] == ref.tok.decode(ref.greedy(ref.tok.encode("Engram tables"), 5))


def test_stop_strings_and_stop_ids(client, ref):
    prompt = "The window ring"
    want = ref.greedy(ref.tok.encode(prompt), 12)
    text = ref.tok.decode(want)
    starts = [i for i in range(len(text) // 3, len(text) - 2) if "\ufffd" not in text[i:i + 2]]
    stop = text[starts[0]: starts[0] + 2]
    cut = text[: text.index(stop)]
    for stream in (False, True):
        r = client.completions.create(model="toy", prompt=prompt, max_tokens=12, temperature=0,
                                      stop=[stop, "zzzz-never"], stream=stream)
        if stream:
            chunks = list(r)
            got = "".join(ch.choices[0].text for ch in chunks)
            fin = chunks[-1].choices[0].finish_reason
        else:
            got, fin = r.choices[0].text, r.choices[0].finish_reason
        assert (got, fin) == (cut, "stop")
    k = 4
    r = client.completions.create(model="toy", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"stop_token_ids": [want[k]], "return_token_ids": True})
    first = want.index(want[k])
    assert extra(r.choices[0], "token_ids") == want[: first + 1]
    assert r.choices[0].finish_reason == "stop"


def test_echo(client, ref):
    prompt = "Echo this"
    r = client.completions.create(model="toy", prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text == prompt + ref.tok.decode(ref.greedy(ref.tok.encode(prompt), 4))
    s = "".join(ch.choices[0].text for ch in client.completions.create(
        model="toy", prompt=prompt, max_tokens=4, temperature=0, echo=True, stream=True))
    assert s == r.choices[0].text


# ---- prefix cache --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def copy_server():
    """A second server in StateTransfer copy mode (checkpoint images, no bounded replay)."""
    s = start_server(["--no-encoder-swa-bounded-replay"])
    yield s
    stop_server(s)


@pytest.mark.parametrize("mode", ["server", "copy_server"], ids=["replay", "copy"])
@pytest.mark.parametrize("pages", [1, 2])
def test_page_aligned_prompt_twice(request, ref, mode, pages):
    """A prompt of exactly k PAGEs (toy PAGE = 32 tokens) sent twice: the second is a prefix hit
    that must stop one PAGE short (a hit covering the last prompt token left nothing to compute:
    copy mode crashed on a 0-token chunk, replay mode answered other tokens). Both answers equal
    the isolated greedy output; the hit is (k - 1) PAGEs."""
    srv = request.getfixturevalue(mode)
    rng = random.Random(1000 * pages + len(mode))
    ids = [rng.randrange(5, 1000) for _ in range(32 * pages)]
    want = ref.greedy(ids, 6)
    body = {"model": "toy", "prompt": ids, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    for k in range(2):
        srv.wait_idle()
        hits0 = srv.m("v41:prefix_cache_hits_total")
        r = srv.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["token_ids"] == want and c["text"] == ref.tok.decode(want), k
        assert r.json()["usage"]["prompt_tokens"] == 32 * pages
        srv.wait_idle()
        assert srv.m("v41:prefix_cache_hits_total") - hits0 == (0 if k == 0 else 32 * (pages - 1)), k


# ---- auth and errors -----------------------------------------------------------------------

def test_api_key(server):
    body = {"model": "toy", "prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(server.url + path).status_code == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


LONG = list(range(5, 5 + MAX_MODEL_LEN + 10))
BAD = [  # (path, body (dict or raw bytes), status, substring of the message)
    ("/v1/completions", b"{not json", 400, "malformed JSON"),
    ("/v1/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "does not exist"),
    ("/v1/completions", {"model": "toy"}, 400, "'prompt' is required"),
    ("/v1/completions", {"model": "toy", "prompt": ""}, 400, "empty"),
    ("/v1/completions", {"model": "toy", "prompt": []}, 400, "empty"),
    ("/v1/completions", {"model": "toy", "prompt": [[]]}, 400, "empty"),
    ("/v1/completions", {"model": "toy", "prompt": 42}, 400, "'prompt' must be"),
    ("/v1/completions", {"model": "toy", "prompt": ["a", 1]}, 400, "'prompt' must be"),
    ("/v1/completions", {"model": "toy", "prompt": [5, 99999]}, 400, "out of range"),
    ("/v1/completions", {"model": "toy", "prompt": LONG}, 400, "maximum context length is 128"),
    ("/v1/completions", {"model": "toy", "prompt": LONG[:100], "max_tokens": 50}, 400,
     "maximum context length is 128"),
    ("/v1/completions", {"model": "toy", "prompt": "hi", "max_tokens": 0}, 400, "'max_tokens' must be >= 1"),
    ("/v1/completions", {"model": "toy", "prompt": "hi", "max_tokens": "5"}, 400, "'max_tokens' must be an integer"),
    ("/v1/completions", {"model": "toy", "prompt": "hi", "temperature": -0.5}, 400, "'temperature' must be in"),
    ("/v1/completions", {"model": "toy", "prompt": "hi", "temperature": "hot"}, 400, "must be a finite number"),
    ("/v1/completions", b'{"model": "toy", "prompt": "hi", "top_p": NaN}', 400, "must be a finite number"),
    ("/v1/completions", {"model": "toy", "prompt": "hi", "seed": 2 ** 70}, 400, "'seed' must be in"),
    ("/v1/completions", {"model": "toy", "prompt": "hi", "top_p": 0}, 400, "'top_p' must be in (0"),
    ("/v1/completions", {"model": "toy", "prompt": "hi", "top_p": 1.5}, 400, "'top_p' must be in (0"),
    ("/v1/completions", {"model": "toy", "prompt": "hi", "top_k": -2}, 400, "'top_k'"),
    ("/v1/completions", {"model": "toy", "prompt": "hi", "n": 0}, 400, "'n' must be"),
    ("/v1/completions", {"model": "toy", "prompt": "hi", "logprobs": 99}, 400, "'logprobs' must be"),
    ("/v1/completions", {"model": "toy", "prompt": "hi", "stream": "yes"}, 400, "'stream' must be a boolean"),
    ("/v1/completions", {"model": "toy", "prompt": "hi", "stop": 5}, 400, "'stop' must be"),
    ("/v1/completions", {"model": "toy", "prompt": "hi", "stop_token_ids": [-1]}, 400, "'stop_token_ids'"),
    ("/v1/completions", {"model": "toy", "prompt": "hi", "seed": 1.5}, 400, "'seed' must be an integer"),
    ("/v1/completions", {"model": "toy", "prompt": "hi", "bogus_field": 1}, 400, "unrecognized request argument"),
    ("/v1/completions", {"model": "toy", "prompt": "hi", "presence_penalty": 2.5}, 400, "'presence_penalty' must be in"),
    ("/v1/completions", {"model": "toy", "prompt": "hi", "logit_bias": {"99999": 10}}, 400, "'logit_bias' keys"),
    ("/v1/completions", {"model": "toy", "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "only allowed when 'stream' is true"),
    ("/v1/chat/completions", {"model": "toy", "messages": []}, 400, "'messages' is empty"),
    ("/v1/chat/completions", {"model": "toy", "messages": "hi"}, 400, "'messages' must be an array"),
    ("/v1/chat/completions", {"model": "toy", "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"model": "toy", "messages": [{"role": "user", "content": 3}]}, 400, "content"),
    ("/v1/chat/completions", {"model": "toy", "messages": [{"role": "user", "content": "x" * 400}]}, 400,
     "maximum context length"),
    ("/v1/chat/completions", {"model": "toy", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "needs 'logprobs'"),
    ("/v1/chat/completions", {"model": "toy", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function"}]}, 400, "'tools[0]' must be"),
    ("/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404,
     "does not exist"),
    ("/v1/nothing", {}, 404, "no route"),
]


@pytest.mark.parametrize("path,body,status,msg", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_requests(server, path, body, status, msg):
    h = server.http
    r = h.post(path, content=body) if isinstance(body, bytes) else h.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert msg in err["message"], err
    assert set(err) >= {"message", "type", "param", "code"}
    ok = h.post("/v1/completions", json={"model": "toy", "prompt": "ok", "max_tokens": 1, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="toy", prompt="hi", temperature=3.0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


# ---- cancellation --------------------------------------------------------------------------

def test_disconnect_mid_stream_frees_everything(server, client, ref):
    server.wait_idle()
    aborts0 = server.m("v41:request_success_total", finished_reason="abort")
    gen0 = server.m("v41:generation_tokens_total")
    prompt = "Concurrent request"
    result = {}

    def other():
        r = client.completions.create(model="toy", prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True})
        result["ids"] = extra(r.choices[0], "token_ids")

    th = threading.Thread(target=other)
    th.start()
    body = {"model": "toy", "prompt": "A long story", "max_tokens": 100, "temperature": 0, "stream": True,
            "ignore_eos": True}
    got = 0
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as h:
        with h.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got += 1
                if got >= 3:
                    break           # leaving the block closes the connection mid-stream
    th.join(120)
    assert result["ids"] == ref.greedy(ref.tok.encode(prompt), 12)
    ms = server.wait_idle(timeout=30)
    assert ms['v41:request_success_total{finished_reason="abort",model_name="toy"}'] == aborts0 + 1
    # the abandoned request stopped early: far fewer than its 100 tokens were generated
    assert ms['v41:generation_tokens_total{model_name="toy"}'] - gen0 < 12 + 50
    assert server.m("v41:request_success_total", finished_reason="length") >= 1


def test_disconnect_non_streaming_frees_everything(server):
    server.wait_idle()
    aborts0 = server.m("v41:request_success_total", finished_reason="abort")
    body = {"model": "toy", "prompt": "Wait for me", "max_tokens": 100, "temperature": 0, "ignore_eos": True,
            "n": 2}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", json=body, timeout=2.0,
                   headers={"Authorization": f"Bearer {KEY}"})
    server.wait_idle(timeout=30)
    assert server.m("v41:request_success_total", finished_reason="abort") == aborts0 + 2


# ---- metrics -------------------------------------------------------------------------------

def test_metrics_exposition(server):
    text = server.http.get("/metrics").text
    for name, kind in [("v41:num_requests_running", "gauge"), ("v41:num_requests_waiting", "gauge"),
                       ("v41:kv_cache_usage_perc", "gauge"), ("v41:state_slot_usage_perc", "gauge"),
                       ("v41:prefix_cache_hit_rate", "gauge"), ("v41:prompt_tokens_total", "counter"),
                       ("v41:generation_tokens_total", "counter"), ("v41:time_to_first_token_seconds", "histogram"),
                       ("v41:time_per_output_token_seconds", "histogram"),
                       ("v41:e2e_request_latency_seconds", "histogram"), ("v41:encoder_rows", "gauge"),
                       ("v41:decoder_rows", "gauge")]:
        assert f"# TYPE {name} {kind}" in text
    ms = parse_metrics(text)
    assert ms['v41:generation_tokens_total{model_name="toy"}'] > 0
    # decoder bounded replay: the decoder runs fewer rows than the encoder once a prompt is longer than W
    assert 0 < ms['v41:decoder_rows{model_name="toy"}'] <= ms['v41:encoder_rows{model_name="toy"}']
    assert ms['v41:time_to_first_token_seconds_count{model_name="toy"}'] > 0
    assert ms['v41:e2e_request_latency_seconds_bucket{le="+Inf",model_name="toy"}'] == \
        ms['v41:e2e_request_latency_seconds_count{model_name="toy"}']
    assert "_created" not in text


def test_metrics_registry_per_server():
    """Each ServingMetrics has its own registry: two in one process do not collide or share
    values; the hit rate is computed at scrape time from the prefix lookups."""
    from runtime.metrics import ServingMetrics
    a, b = ServingMetrics("a"), ServingMetrics("b")
    a.generation_tokens.inc(3)
    a.finished("length")
    a.prefix_lookup(10, 4)
    ma, mb = parse_metrics(a.render()), parse_metrics(b.render())
    assert ma['v41:generation_tokens_total{model_name="a"}'] == 3
    assert mb['v41:generation_tokens_total{model_name="b"}'] == 0
    assert ma['v41:request_success_total{finished_reason="length",model_name="a"}'] == 1
    assert mb['v41:request_success_total{finished_reason="abort",model_name="b"}'] == 0
    assert ma['v41:prefix_cache_hit_rate{model_name="a"}'] == 0.4
    assert mb['v41:prefix_cache_hit_rate{model_name="b"}'] == 0
    assert not any('model_name="b"' in k for k in ma)


# ---- load ----------------------------------------------------------------------------------

def test_load_64_streaming_clients(server, ref):
    """64 concurrent streaming clients x 3 requests each, random prompt and output lengths: none
    fails or hangs, each output equals its isolated greedy output, nothing leaks."""
    rng = random.Random(41)
    prompts = [[rng.randrange(5, 1000) for _ in range(rng.randrange(2, 41))] for _ in range(16)]
    max_out = 10
    want = [ref.greedy(p, max_out) for p in prompts]
    server.wait_idle()
    before = server.metrics()
    jobs = [[(rng.randrange(len(prompts)), rng.randrange(1, max_out + 1)) for _ in range(3)] for _ in range(64)]

    async def run():
        ac = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=300, max_retries=0)

        async def one_client(plan):
            out = []
            for k, m in plan:
                ids, text, fin = [], "", None
                stream = await ac.completions.create(model="toy", prompt=prompts[k], max_tokens=m, temperature=0,
                                                     stream=True, extra_body={"return_token_ids": True})
                async for ch in stream:
                    c = ch.choices[0]
                    ids += extra(c, "token_ids") or []
                    text += c.text
                    fin = c.finish_reason or fin
                out.append((k, m, ids, text, fin))
            return out
        try:
            return await asyncio.wait_for(asyncio.gather(*(one_client(p) for p in jobs)), timeout=600)
        finally:
            await ac.close()

    t0 = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - t0
    n = 0
    for per_client in results:
        for k, m, ids, text, fin in per_client:
            exp = want[k][:m]
            assert ids == exp, (k, m)
            assert text == ref.tok.decode(exp)
            assert fin == ("length" if len(exp) == m and exp[-1] != 1 else "stop")
            n += 1
    assert n == 192
    after = server.wait_idle(timeout=60)
    key = 'v41:request_success_total{finished_reason="%s",model_name="toy"}'
    done = sum(after[key % r] - before[key % r] for r in ("length", "stop"))
    assert done == 192 and after[key % "abort"] == before[key % "abort"]
    print(f"\n192 streaming requests from 64 clients in {elapsed:.1f}s")


# ---- the CLI refuses bad settings before loading weights -----------------------------------

@pytest.mark.parametrize("args,msg", [
    (["--index-cache-dtype", "fp16"], "index_cache_dtype"),
    (["--pipeline-parallel-size", "2"], "pipeline"),
    (["--kv-cache-dtype", "fp8"], "kv_cache_dtype"),
    (["--enable-dp-attention"], "DP attention"),
    (["--model", "/nonexistent/model"], "config"),
])
def test_cli_refuses_before_loading(args, msg):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "v41.serve", "--port", "0", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, **ONE_THREAD))
    assert r.returncode == 2, r.stderr
    assert "error:" in r.stderr and msg in r.stderr, r.stderr
    assert "weights" not in r.stderr          # no progress bar: nothing was loaded
    assert time.monotonic() - t0 < 60


def test_cli_refuses_a_busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "v41.serve", "--port", str(port)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120, env=dict(os.environ, **ONE_THREAD))
    assert r.returncode == 2 and "cannot listen" in r.stderr, r.stderr


# ---- the documented examples work ----------------------------------------------------------

def _doc_blocks(lang: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_documented_curl_examples(server):
    import shutil
    if shutil.which("curl") is None:
        pytest.skip("no curl")
    block = next(b for b in _doc_blocks("bash") if "curl" in b and "/v1/chat/completions" in b)
    block = block.replace("http://127.0.0.1:8000", server.url)
    block = re.sub(r"curl (-s\w*)", rf"curl \1 -H 'Authorization: Bearer {KEY}'", block)
    r = subprocess.run(["bash", "-c", "set -e\n" + block], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert '"object":"text_completion"' in r.stdout and '"usage"' in r.stdout
    assert "chat.completion.chunk" in r.stdout and r.stdout.rstrip().endswith("data: [DONE]")


def test_documented_openai_example(server):
    code = next(b for b in _doc_blocks("python") if "OpenAI(" in b)
    code = code.replace("http://127.0.0.1:8000", server.url).replace('api_key="EMPTY"', f'api_key="{KEY}"')
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "completion_tokens=" in r.stdout


# ---- surface (issue 19, seventh item) and limits ----------------------------------------------

def test_model_retrieve_and_system_fingerprint(server, client):
    m = client.models.retrieve("v41-toy")
    assert (m.id, m.object, m.owned_by) == ("v41-toy", "model", "v41")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")
    r = client.completions.create(model="toy", prompt="fingerprint", max_tokens=2, temperature=0)
    fp = r.system_fingerprint
    assert fp and fp.startswith("fp_")
    chunks = list(client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=3, temperature=0, stream=True))
    assert chunks and all(ch.system_fingerprint == fp for ch in chunks)
    assert client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=1).system_fingerprint == fp


def test_tokenize_and_detokenize(server, client, ref):
    text = "héllo wörld ✓ 日本語"
    r = server.http.post("/tokenize", json={"model": "toy", "prompt": text, "return_token_strs": True}).json()
    ids = ref.tok.encode(text)
    assert (r["tokens"], r["count"], r["max_model_len"]) == (ids, len(ids), MAX_MODEL_LEN)
    assert len(r["token_strs"]) == len(ids)
    assert server.http.post("/detokenize", json={"model": "toy", "tokens": ids}).json() == {"prompt": text}
    messages = [{"role": "user", "content": "Count my tokens"}]
    t = server.http.post("/tokenize", json={"messages": messages}).json()
    used = client.chat.completions.create(model="toy", messages=messages, max_tokens=1).usage.prompt_tokens
    assert t["count"] == used == len(t["tokens"]) and t["token_strs"] is None


def test_streaming_with_token_ids_sends_a_chunk_per_token(client, ref):
    """return_token_ids: one chunk per generated token, its id in it, even where the text does
    not change (a token that ends inside a character)."""
    prompt = "Stream every token"
    for kw in ({"stream_options": {"include_usage": True}}, {}):
        chunks = list(client.completions.create(model="toy", prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                                extra_body={"return_token_ids": True, "ignore_eos": True}, **kw))
        ids = [extra(c.choices[0], "token_ids") for c in chunks if c.choices and extra(c.choices[0], "token_ids")]
        assert all(len(x) == 1 for x in ids) and [x[0] for x in ids] == ref.greedy(ref.tok.encode(prompt), 10)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_oversize_prompts_are_refused_before_tokenizing_and_memory_returns(server):
    """Prompts past --max-prompt-bytes (derived: max_model_len x the longest token) are 400s
    read but never tokenized: eight 12 MB prompts leave the server's RSS within 200 MB of where
    it was (a 50 MB prompt once took it from 0.5 to 5.1 GB, and it stayed there); a 50 MB stop
    string is refused too."""
    big = "the window ring " * (12 << 16)
    rss0 = _rss_bytes(server.proc.pid)
    for _ in range(8):
        r = server.http.post("/v1/completions", json={"model": "toy", "prompt": big, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_large", r.text[:300]
    grown = _rss_bytes(server.proc.pid) - rss0
    assert grown < 200 << 20, grown
    r = server.http.post("/v1/completions", json={"model": "toy", "prompt": "hi", "stop": "x" * (8 << 20)})
    assert r.status_code == 400 and r.json()["error"]["code"] == "stop_too_large"
    ok = server.http.post("/v1/completions", json={"model": "toy", "prompt": "ok", "max_tokens": 1})
    assert ok.status_code == 200
