"""The server's surface beside generation, end to end on the toy server subprocess (tests/conftest.py's
`server` fixture): API keys and the errors bad requests get, Prometheus metrics, the CLI's
refusals before any weight loads, the README's curl and openai examples, model retrieval,
tokenize/detokenize, per-token streaming chunks and the prompt-size limit."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="the test extra (httpx) is not installed: pip install -e '.[test]'")
openai = pytest.importorskip("openai", reason="the test extra (openai) is not installed: pip install -e '.[test]'")
pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed: pip install -e '.[serve]'")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed: pip install -e '.[serve]'")

from runtime.metrics import parse as parse_metrics  # noqa: E402
from tests.server_helpers import KEY, MAX_MODEL_LEN, ONE_THREAD, ROOT, extra  # noqa: E402


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
        pytest.skip("curl is not on PATH: the README example is a curl command")
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
