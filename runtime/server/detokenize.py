"""Token ids to text: incremental detokenization (`tokenizers.decoders.DecodeStream`) with stop
strings, and the per-token strings and bytes that logprobs report."""
from __future__ import annotations

import codecs
import json

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


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

    def stream(self) -> DecodeStream | None:
        """A DecodeStream over the model's `tokenizers.Tokenizer` (special tokens skipped, as in
        `decode`); None for no tokenizer or one without `.tok` (the text then comes whole at the
        end)."""
        raw = getattr(self.tok, "tok", None)
        return DecodeStream(skip_special_tokens=True) if isinstance(raw, Tokenizer) else None

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
    are equal by construction. `DecodeStream` gives the settled text (it holds back a trailing
    partial UTF-8 character); of that, the last len(longest stop) - 1 characters, which could
    begin a stop string, are held back here. The final feed decodes all the ids once, so the
    text ends as `decode` has it (an unfinished character there reads U+FFFD)."""

    def __init__(self, codec: TextCodec, stops: list[str]):
        self.codec, self.stops = codec, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.stream = codec.stream()
        self.ids: list[int] = []
        self.settled = ""         # what DecodeStream has released
        self.text = ""            # emitted so far
        self.checked = 0          # chars of the decoded text already searched for stops
        self.stop_str: str | None = None

    def feed(self, ids: list[int], final: bool) -> tuple[str, bool]:
        """Add tokens; returns (new text, stopped on a stop string)."""
        self.ids += ids
        if self.stream is not None:
            for i in ids:
                if (piece := self.stream.step(self.codec.tok.tok, i)) is not None:
                    self.settled += piece
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
