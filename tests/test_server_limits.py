"""The server under hostile use, in process (issue 19): admission is bounded (a full queue is a
503 with Retry-After), an abort storm leaves the next request within about one engine step,
prompts and stop strings have byte caps checked before tokenization, tokenization runs off the
event loop, and `logprobs.text_offset` counts a character split across tokens once."""
from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra (fastapi) is not installed: pip install -e '.[serve]'")

from runtime.sequence import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def toy_tok():
    from v41.config import TOY_TOKENIZER_DIR
    from v41.tokenizer import Tokenizer
    return Tokenizer(TOY_TOKENIZER_DIR)


# ---- logprobs.text_offset ------------------------------------------------------------------

def _chars_before(text: str, nbytes: int) -> int:
    """Whole characters in the first `nbytes` bytes of `text` (a cut character not counted)."""
    return len(text.encode()[:nbytes].decode("utf-8", errors="ignore"))


def test_text_offset_counts_a_split_character_once(toy_tok):
    """Each token's offset is the index of the character its first byte belongs to, in whole
    responses and in streamed chunks alike. Decoding each token alone counted a split
    character twice, so every offset after it was one too far."""
    from runtime.server.completions import Completion
    from runtime.server.detokenize import TextCodec, TextOffsets
    codec = TextCodec(toy_tok)
    text = "héllo wörld ✓ 日本語テキスト 😀 emoji ß"
    ids = toy_tok.encode(text)
    assert toy_tok.decode(ids) == text
    pieces = [codec.token_bytes(t) for t in ids]
    assert any(p.decode("utf-8", errors="replace") != p.decode("utf-8", errors="ignore") for p in pieces)  # split
    starts = [sum(len(p) for p in pieces[:i]) for i in range(len(ids))]
    want = [_chars_before(text, b) for b in starts]
    job = Completion.__new__(Completion)
    job.codec = codec
    lps = [(0.0, [])] * len(ids)
    assert job._logprobs(ids, lps, TextOffsets(codec))["text_offset"] == want
    # streamed 1-3 tokens at a time, echo of 5 characters in front
    at, got, k = TextOffsets(codec, 5), [], 0
    for n in [1, 3, 2] * len(ids):
        if k >= len(ids):
            break
        got += job._logprobs(ids[k:k + n], lps[k:k + n], at)["text_offset"]
        k += n
    assert got == [5 + w for w in want]
    # a token that starts on a character boundary starts that character's text there
    for i, b in enumerate(starts):
        if pieces[i] and _chars_before(text, b + len(pieces[i])) > want[i] and \
                pieces[i].decode("utf-8", errors="replace") == pieces[i].decode("utf-8", errors="ignore"):
            assert text[want[i]:].startswith(pieces[i].decode())


# ---- bounded admission ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def toy_engine():
    """The toy engine in float32 on one torch thread, its AsyncEngine running."""
    import torch

    from runtime.engine import EngineArgs, LLMEngine
    from runtime.metrics import ServingMetrics
    from runtime.server import AsyncEngine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    aeng = AsyncEngine(LLMEngine(EngineArgs(model="toy", dtype="float32", max_model_len=64, max_num_seqs=4)),
                       ServingMetrics("toy"))
    aeng.start()
    yield aeng
    aeng.stop()
    torch.set_num_threads(n)


def _steps(aeng) -> float:
    from runtime.metrics import parse
    return parse(aeng.metrics.render())['v41:engine_steps_total{model_name="toy"}']


async def _one(aeng, rid: str) -> tuple[float, float]:
    """A 1-token request: (this process's CPU seconds to its finish, engine steps meanwhile).
    CPU time, not wall time: in the suite another worker shares the machine's two cores, and a
    wall clock counts the seconds this process waits for one (a 3.9 s wait failed a run once)."""
    sink: asyncio.Queue = asyncio.Queue()
    c0, s0 = time.process_time(), _steps(aeng)
    aeng.add(rid, [5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True), sink, None, time.monotonic())
    while (d := await sink.get()).finish_reason is None:
        pass
    assert d.error is None, d.error
    return time.process_time() - c0, _steps(aeng) - s0


def test_an_abort_storm_leaves_the_next_request_within_a_step(toy_engine):
    """10,000 queued requests behind a busy batch, all aborted (newest first, as a client giving
    up on a huge request does): the next request finishes after at most the step in flight and
    its own, in about that time; nothing stays queued. A linear scan per abort took ~1.6 s more."""
    aeng, n = toy_engine, 10_000

    async def run():
        alone = sorted([(await _one(aeng, f"alone-{i}"))[0] for i in range(3)])[1]   # one step's CPU time
        storm: asyncio.Queue = asyncio.Queue()
        now = time.monotonic()
        for i in range(n):
            aeng.add(f"storm-{i}", [5, 6, 7, 8], SamplingParams(max_tokens=40, ignore_eos=True), storm, None, now)
        while aeng.queued > n - 4:                 # four of them run, the rest wait
            await asyncio.sleep(0.01)
        for i in reversed(range(n)):
            aeng.abort(f"storm-{i}")
        took, steps = await _one(aeng, "probe")
        return alone, took, steps

    alone, took, steps = asyncio.run(run())
    assert steps <= 2, steps
    assert took < 2 * alone + 0.5, (took, alone)
    assert aeng.queued == 0 and not aeng.engine.has_unfinished()


def test_a_full_queue_is_503_with_retry_after(toy_engine):
    """Choices waiting to be scheduled are bounded by max_queued: a request that would pass the
    bound is refused whole (no choice of it is queued) with Retry-After; aborts give the room
    back."""
    from runtime.server.completions import Completion
    from runtime.server.protocol import APIError, Body
    from runtime.server.serving import Frontend
    aeng = toy_engine
    fe = Frontend(aeng, ["toy"], max_queued=6)
    body = {"prompt": [5, 6, 7], "max_tokens": 30, "ignore_eos": True, "n": 6}

    async def run():
        choices, _ = fe.submit("big", Completion.parse(fe, Body(body)))
        assert 3 <= aeng.queued <= 6                   # at most 4 (max_num_seqs) got scheduled
        with pytest.raises(APIError) as e:
            fe.submit("next", Completion.parse(fe, Body(dict(body, n=4))))
        for c in choices:
            aeng.abort(c.request_id)
        deadline = time.monotonic() + 30
        while aeng.queued or aeng.engine.has_unfinished():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        again, _ = fe.submit("again", Completion.parse(fe, Body(dict(body, n=6))))
        for c in again:
            aeng.abort(c.request_id)
        return e.value

    err = asyncio.run(run())
    assert (err.status, err.code, err.headers) == (503, "server_busy", {"Retry-After": "1"})
    assert "this one adds 4; the limit is 6 (--max-queued-requests)" in err.message


def test_the_queue_bound_must_hold_one_request():
    from runtime.geometry import AdmissionError
    from v41 import serve
    ap, _ = serve.build_parser()
    with pytest.raises(AdmissionError, match="max_queued_requests: 100 is below max_choices_per_request 256"):
        serve.check_server_args(ap.parse_args(["--max-queued-requests", "100"]))
    serve.check_server_args(ap.parse_args([]))


# ---- tokenization off the event loop --------------------------------------------------------

async def _asgi(app, path: str, body: dict, arrivals: list | None = None) -> tuple[int, bytes]:
    import json

    from tests.test_server_refusals import call
    return await call(app, "POST", path, json.dumps(body).encode(), {}, False, arrivals)


def test_a_big_prompt_is_tokenized_off_the_event_loop(toy_engine):
    """While a 1.5 MB prompt is tokenized (a second or more here; then refused: too many tokens),
    a stream that started before keeps sending chunks and the event loop never stops for long:
    tokenization runs in a worker thread, and the tokenizer releases the GIL meanwhile (the
    list of ids is built holding it: ~0.1 s per million ids)."""
    import threading

    from runtime.server import create_app
    aeng = toy_engine
    app = create_app(aeng, ["toy"], max_prompt_bytes=64 << 20)
    tok = aeng.engine.tokenizer
    text = "héllo wörld the window ring 日本語 " * 37_500
    seen = {}

    async def run():
        loop_thread = threading.get_ident()
        arrivals: list = []
        stream = asyncio.create_task(_asgi(app, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 40,
                                                                     "ignore_eos": True, "stream": True}, arrivals))
        while len(arrivals) < 2:
            await asyncio.sleep(0.01)
        ticks, stop = [], asyncio.Event()

        async def tick():
            while not stop.is_set():
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)
        ticker = asyncio.create_task(tick())
        t0 = time.monotonic()
        status, body = await _asgi(app, "/v1/completions", {"prompt": text, "max_tokens": 1})
        seen["tokenize_s"] = time.monotonic() - t0
        stop.set()
        await ticker
        seen["ticks"] = [b - a for a, b in zip(ticks, ticks[1:])]
        seen["chunks_during"] = sum(t0 <= a <= t0 + seen["tokenize_s"] for a in arrivals)
        seen["status"], seen["count"] = status, body
        seen["thread_is_loop"] = loop_thread
        await stream

    real = tok.encode
    threads = []
    tok.encode = lambda s: (threads.append(threading.get_ident()), real(s))[1]
    try:
        asyncio.run(run())
    finally:
        del tok.encode
    assert seen["status"] == 400 and b"maximum context length" in seen["count"], seen["count"][:300]
    assert threads and seen["thread_is_loop"] not in threads
    assert seen["tokenize_s"] > 0.5, seen["tokenize_s"]            # long enough to have stalled the loop
    assert max(seen["ticks"]) < 0.3, max(seen["ticks"])
    assert seen["chunks_during"] >= 1
