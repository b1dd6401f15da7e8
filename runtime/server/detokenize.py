"""Token ids to text: incremental detokenization with stop strings, and the per-token strings
and bytes that logprobs report."""
from __future__ import annotations

import codecs
import functools
import itertools
import json

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# One byte of each class a UTF-8 decoder tells apart (Unicode table 3-7): ASCII; the continuation
# ranges 80-8F, 90-9F, A0-BF that E0, ED, F0 and F4 restrict their second byte to; the never
# valid C0-C1 and F5-FF; the lead bytes C2-DF, E0, E1-EC and EE-EF, ED, F0, F1-F3, F4.
UTF8_BYTE_CLASSES = bytes([0x41, 0x80, 0x90, 0xA0, 0xC0, 0xC2, 0xE0, 0xE1, 0xED, 0xF0, 0xF1, 0xF4, 0xF5])


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


def replaces_as_python(decode_batch) -> bool:
    """Whether `decode_batch` (byte strings to their texts) replaces invalid UTF-8 exactly as
    Python's incremental decoder (errors="replace") does when fed one byte at a time. Both
    should substitute each maximal invalid subpart by one U+FFFD, deciding within four bytes
    (a lead byte and at most three more), and bytes of one class act alike: so every sequence
    of four class representatives tries each decoder state with each next byte, and the end
    of the text after each state."""
    seqs = [bytes(s) for s in itertools.product(UTF8_BYTE_CLASSES, repeat=4)]
    for seq, whole in zip(seqs, decode_batch(seqs)):
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        if "".join([utf8.decode(seq[i:i + 1]) for i in range(len(seq))]) + utf8.decode(b"", final=True) != whole:
            return False
    return True


@functools.cache
def byte_level_decode_replaces_as_python() -> bool:
    """`replaces_as_python` for the `tokenizers` ByteLevel decoder (Rust's from_utf8_lossy over
    the tokens' bytes), on a vocabulary of the 256 single bytes; the same for every byte-level
    tokenizer, so checked once per process (0.2 s)."""
    from tokenizers import decoders, models
    raw = Tokenizer(models.BPE(vocab={c: b for c, b in _bytes_to_unicode().items()}, merges=[]))
    raw.decoder = decoders.ByteLevel()
    return replaces_as_python(lambda seqs: raw.decode_batch([list(s) for s in seqs]))


class Utf8Settled:
    """The settled text of byte-level tokens: their bytes through one incremental UTF-8 decoder,
    special tokens contributing nothing (as `decode` skips them). A proven invalid sequence
    (a lead byte and a byte that cannot continue it) is final, one U+FFFD; only a trailing
    sequence that is still a valid prefix is held. So a token repeated whose bytes end in a
    partial character streams at every step (DecodeStream waited for text that does not end
    in U+FFFD, which such a stream never has)."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, tid: int) -> str:
        return "" if self.codec.is_special(tid) else self._utf8.decode(self.codec.token_bytes(tid))


class StreamSettled:
    """The settled text from `tokenizers`' DecodeStream (special tokens skipped): for tokenizers
    that are not byte-level, whose decoders may depend on neighbouring tokens."""

    def __init__(self, raw: Tokenizer):
        self.raw, self._stream = raw, DecodeStream(skip_special_tokens=True)

    def step(self, tid: int) -> str:
        return self._stream.step(self.raw, tid) or ""


class TextCodec:
    """Decoding helpers over the model's tokenizer (or none: then all text is empty)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self._bytes: dict[int, bytes] = {}
        self._byte_level = False
        self._special: set[int] = set()
        self._inv = _bytes_to_unicode()
        if tokenizer is not None:
            try:
                dec = json.loads(tokenizer.tok.to_str()).get("decoder") or {}
                self._byte_level = dec.get("type") == "ByteLevel"
                self._special = {i for i, t in tokenizer.tok.get_added_tokens_decoder().items() if t.special}
            except Exception:  # noqa: BLE001 - an unusual tokenizer.json: fall back to decode()
                pass

    def decode(self, ids) -> str:
        return self.tok.decode(ids) if self.tok is not None and ids else ""

    def settled_text(self) -> Utf8Settled | StreamSettled | None:
        """Text of tokens fed one at a time, released once it can no longer change: so always a
        prefix of `decode` of all of them. Byte-level tokenizers decode through Python's UTF-8
        decoder where it replaces invalid bytes as `decode` does (checked); else DecodeStream;
        None for no tokenizer or one without `.tok` (the text then comes whole at the end)."""
        raw = getattr(self.tok, "tok", None)
        if not isinstance(raw, Tokenizer):
            return None
        if self._byte_level and byte_level_decode_replaces_as_python():
            return Utf8Settled(self)
        return StreamSettled(raw)

    def token_bytes(self, tid: int) -> bytes:
        """The bytes of one token; a byte-level piece maps back through the BPE alphabet, since
        decoding it alone may not be whole UTF-8."""
        b = self._bytes.get(tid)
        if b is None:
            piece = self.tok.tok.id_to_token(tid) if self.tok is not None else None
            if piece is None:
                b = b""
            elif self._byte_level and tid not in self._special and all(c in self._inv for c in piece):
                b = bytes(self._inv[c] for c in piece)
            else:
                b = self.tok.tok.decode([tid], skip_special_tokens=False).encode()
            self._bytes[tid] = b
        return b

    def max_token_bytes(self) -> int:
        """The longest token's bytes (0 without a `tokenizers.Tokenizer` to read it from): a text
        longer than max_model_len times this has more than max_model_len tokens."""
        raw = getattr(self.tok, "tok", None)
        if not isinstance(raw, Tokenizer):
            return 0
        vocab = raw.get_vocab(with_added_tokens=True)
        return max((len(p) if self._byte_level and i not in self._special else len(p.encode())
                    for p, i in vocab.items()), default=0)

    def is_special(self, tid: int) -> bool:
        return tid in self._special

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


class TextOffsets:
    """Where each completion token starts in the choice's text (legacy `logprobs.text_offset`):
    the characters completed before it. The tokens' bytes go through one incremental UTF-8
    decoder, so a character split across tokens counts once (decoding each token alone counted
    a U+FFFD per piece, and every later offset was one too far); special tokens, skipped in
    the text, count nothing."""

    def __init__(self, codec: TextCodec, start: int = 0):
        self.codec, self.offset = codec, start
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, tid: int) -> int:
        """The offset of token `tid`; moves past it."""
        at = self.offset
        if not self.codec.is_special(tid):
            self.offset += len(self._utf8.decode(self.codec.token_bytes(tid)))
        return at


class IncrementalText:
    """The completion text as it grows, token by token, with stop strings.

    Streaming and non-streaming responses both concatenate the deltas this returns, so they
    are equal by construction. `TextCodec.settled_text` gives the text that can no longer
    change (it holds back a trailing partial UTF-8 character); of that, the last
    len(longest stop) - 1 characters, which could begin a stop string, are held back here.
    The final feed decodes all the ids once, so the text ends as `decode` has it (an
    unfinished character there reads U+FFFD)."""

    def __init__(self, codec: TextCodec, stops: list[str]):
        self.codec, self.stops = codec, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.settling = codec.settled_text()
        self.ids: list[int] = []
        self.settled = ""         # what `settling` has released
        self.text = ""            # emitted so far
        self.checked = 0          # chars of the decoded text already searched for stops
        self.stop_str: str | None = None

    def feed(self, ids: list[int], final: bool) -> tuple[str, bool]:
        """Add tokens; returns (new text, stopped on a stop string)."""
        self.ids += ids
        if self.settling is not None:
            self.settled += "".join([self.settling.step(i) for i in ids])
        full = self.codec.decode(self.ids) if final else self.settled
        if self.stops and len(full) > self.checked:
            start = max(0, self.checked - self.hold)
            hits = [(i, s) for s in self.stops if (i := full.find(s, start)) >= 0]
            if hits:
                i, s = min(hits)
                self.stop_str = s
                return self._emit(full, i), True
            self.checked = len(full)
        return self._emit(full, len(full) if final else len(full) - self.hold), False

    def _emit(self, full: str, end: int) -> str:
        n = len(self.text)
        if end <= n:
            return ""
        d = full[n:end]
        self.text += d
        return d
