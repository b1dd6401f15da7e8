"""The sampling surface through the official `openai` client: presence/frequency penalties and
logit_bias as client arguments, repetition_penalty/min_p/min_tokens in extra_body. Each answer
equals an offline run of the same SamplingParams (float64 toy, one thread: see tests/server_helpers.py);
out-of-range values are 400s naming the parameter."""
from __future__ import annotations

import pytest

openai = pytest.importorskip("openai", reason="the test extra (openai) is not installed: pip install -e '.[test]'")
pytest.importorskip("httpx", reason="the test extra (httpx) is not installed: pip install -e '.[test]'")
pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed: pip install -e '.[serve]'")
pytest.importorskip("uvicorn", reason="the serve extra (uvicorn) is not installed: pip install -e '.[serve]'")

from runtime.sequence import SamplingParams  # noqa: E402
from tests.server_helpers import KEY, Reference, extra, start_server, stop_server  # noqa: E402

PROMPT = "The window ring"


@pytest.fixture(scope="module")
def client():
    s = start_server()
    yield openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, timeout=300, max_retries=0)
    log = stop_server(s)
    assert "Traceback" not in log, log[-4000:]


@pytest.fixture(scope="module")
def ref():
    return Reference()


def offline(ref, ids, **kw) -> list[int]:
    torch = ref.torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return ref.llm.generate([list(ids)], SamplingParams(**kw))[0].token_ids
    finally:
        torch.set_num_threads(n)


def completion_ids(client, **kw) -> list[int]:
    extra_body = {"return_token_ids": True, **kw.pop("extra_body", {})}
    r = client.completions.create(model="toy", prompt=PROMPT, extra_body=extra_body, **kw)
    return extra(r.choices[0], "token_ids")


@pytest.mark.parametrize("kw", [dict(presence_penalty=1.5), dict(frequency_penalty=2.0),
                                dict(presence_penalty=-1.0, frequency_penalty=2.0), dict(presence_penalty=-2.0, frequency_penalty=-2.0)])
def test_presence_and_frequency_penalties(client, ref, kw):
    ids = ref.tok.encode(PROMPT)
    got = completion_ids(client, max_tokens=16, temperature=0, **kw)
    assert got == offline(ref, ids, max_tokens=16, **kw)
    assert got != ref.greedy(ids, 16)                   # the penalty changed the greedy text


def test_logit_bias_forces_and_bans_tokens(client, ref):
    ids = ref.tok.encode(PROMPT)
    greedy = ref.greedy(ids, 8)
    assert completion_ids(client, max_tokens=8, temperature=0, logit_bias={"77": 100}) == [77] * 8
    banned = {str(t): -100 for t in set(greedy)}
    got = completion_ids(client, max_tokens=8, temperature=0, logit_bias=banned)
    assert got == offline(ref, ids, max_tokens=8, logit_bias={int(t): -100 for t in banned})
    assert not set(got) & set(greedy)
    r = client.chat.completions.create(model="toy", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logit_bias={"77": 100}, extra_body={"return_token_ids": True})
    assert extra(r.choices[0], "token_ids") == [77] * 4


def test_repetition_penalty_min_p_and_min_tokens_in_extra_body(client, ref):
    ids = ref.tok.encode(PROMPT)
    greedy = ref.greedy(ids, 12)
    got = completion_ids(client, max_tokens=12, temperature=0, extra_body={"repetition_penalty": 1.8})
    assert got == offline(ref, ids, max_tokens=12, repetition_penalty=1.8) and got != greedy
    body = {"min_p": 0.2, "top_k": 20, "seed": 7}
    got = completion_ids(client, max_tokens=12, temperature=1.0, extra_body=body)
    assert got == offline(ref, ids, max_tokens=12, temperature=1.0, min_p=0.2, top_k=20, seed=7)
    stop = greedy[0]                                    # the first greedy token stops the request at once
    assert completion_ids(client, max_tokens=12, temperature=0, extra_body={"stop_token_ids": [stop]}) == [stop]
    got = completion_ids(client, max_tokens=12, temperature=0, extra_body={"stop_token_ids": [stop], "min_tokens": 5})
    assert len(got) >= 5 and stop not in got[:5]
    assert got == offline(ref, ids, max_tokens=12, stop_token_ids=[stop], min_tokens=5)


@pytest.mark.parametrize("kw, param, msg", [
    (dict(presence_penalty=2.5), "presence_penalty", "must be in [-2.0, 2.0]"),
    (dict(frequency_penalty=-3), "frequency_penalty", "must be in [-2.0, 2.0]"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty", "must be > 0.0"),
    (dict(extra_body={"min_p": 1.5}), "min_p", "must be in [0.0, 1.0]"),
    (dict(extra_body={"min_tokens": 9}), "min_tokens", "'min_tokens' (9) must be <= max_tokens (4)"),
    (dict(logit_bias={"-1": 5}), "logit_bias", "keys must be token ids in [0, 1024)"),
    (dict(logit_bias={"5": None}), "logit_bias", "values must be finite numbers"),
])
def test_out_of_range_values_are_400s(client, kw, param, msg):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="toy", prompt=PROMPT, max_tokens=4, **kw)
    err = e.value.body
    assert err["param"] == param and msg in err["message"], err
