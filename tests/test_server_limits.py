"""The server under hostile use, in process (issue 19): admission is bounded (a full queue is a
503 with Retry-After), an abort storm leaves the next request within about one engine step,
prompts and stop strings have byte caps checked before tokenization, tokenization runs off the
event loop, and `logprobs.text_offset` counts a character split across tokens once."""
from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("fastapi")

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
