"""Generated text of a V4.1 chat turn parsed back into content, reasoning (`reasoning_content`)
and tool calls (the DSML block of v41/chat_format.py), whole or incrementally for streaming: one
state machine fed text deltas in any split gives the same result as the whole text."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from v41.chat_format import CALLS_CLOSE, CALLS_OPEN, DSML, INVOKE_CLOSE, PARAM_CLOSE, THINK_END

@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: str              # a JSON object, as OpenAI sends it


@dataclass
class Parsed:
    """Output of the parser (a delta, or everything once accumulated)."""
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, o: Parsed) -> Parsed:
        self.content += o.content
        self.reasoning += o.reasoning
        self.tool_calls += o.tool_calls
        return self


NAME = object()                 # a pattern slot: an attribute value up to the closing quote
INVOKE_OPEN = (f"<{DSML}invoke name=\"", NAME, "\">")
PARAM_OPEN = (f"<{DSML}parameter name=\"", NAME, "\" string=\"", ("true", "false"), "\">")
PARTIAL = "partial"


def _match(pattern: tuple, s: str):
    """(end, captures) when `s` starts with a match of `pattern`; PARTIAL when `s` could still
    grow into one; None when it cannot."""
    i, caps = 0, []
    for item in pattern:
        if isinstance(item, str):
            n = min(len(item), len(s) - i)
            if s[i:i + n] != item[:n]:
                return None
            if n < len(item):
                return PARTIAL
            i += n
        elif item is NAME:
            j = i
            while j < len(s) and s[j] not in "\"<>\n" and j - i <= 256:
                j += 1
            if j - i > 256 or (j < len(s) and j == i):
                return None
            if j == len(s):
                return PARTIAL
            caps.append(s[i:j])
            i = j
        else:
            hit = next((c for c in item if s.startswith(c, i)), None)
            if hit is None:
                return PARTIAL if any(c.startswith(s[i:]) for c in item) else None
            caps.append(hit)
            i += len(hit)
    return i, caps


def _held(buf: str, marker: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `marker`."""
    for k in range(min(len(buf), len(marker) - 1), 0, -1):
        if marker.startswith(buf[-k:]):
            return k
    return 0


class OutputParser:
    """Generated text in (any split), content / reasoning / tool-call deltas out. Text that may
    be the start of a marker is held back until it is decided. A tool block that does not
    parse becomes content, from the first text not yet returned as a tool call."""

    def __init__(self, thinking: bool, tools: bool, prefill: str = "", new_id=None):
        self.state = "reasoning" if thinking else "content"
        self.tools = tools
        self.buf = ""
        self.raw = ""               # consumed text of the block not yet returned as a call
        self.call: tuple | None = None      # (name, {args}) of the invoke being read
        self.count = 0
        self.new_id = new_id or (lambda: f"call_{uuid.uuid4().hex[:24]}")
        if prefill:
            self.feed(prefill)      # the prompt's own opening of a block: nothing to return yet

    def feed(self, text: str) -> Parsed:
        self.buf += text
        out = Parsed()
        while self.buf and self._step(out):
            pass
        return out

    def finish(self) -> Parsed:
        """The rest, once generation ended: held text is flushed, an open block is content."""
        out = self.feed("")
        if self.state == "reasoning":
            out.reasoning += self.buf
        elif self.state == "block":
            rest = self.raw + self.buf
            if self.call is not None or rest.strip():
                out.content += rest
        else:
            out.content += self.buf
        self.buf, self.raw, self.call = "", "", None
        self.state = "done"
        return out

    def _step(self, out: Parsed) -> bool:
        """Consume what can be decided from buf; False when it needs more text."""
        buf = self.buf
        if self.state == "reasoning":
            i = buf.find(THINK_END)
            if i >= 0:
                out.reasoning += buf[:i]
                self.buf, self.state = buf[i + len(THINK_END):], "content"
                return True
            k = _held(buf, THINK_END)
            out.reasoning += buf[:len(buf) - k]
            self.buf = buf[len(buf) - k:]
            return False
        if self.state in ("content", "done") or not self.tools:
            if self.state == "content" and self.tools:
                i = buf.find(CALLS_OPEN)
                if i >= 0:
                    pre = buf[:i].rstrip()
                    out.content += pre
                    self.raw = buf[len(pre):i + len(CALLS_OPEN)]
                    self.buf, self.state = buf[i + len(CALLS_OPEN):], "block"
                    return True
                k = _held(buf, CALLS_OPEN)
                k += len(buf[:len(buf) - k]) - len(buf[:len(buf) - k].rstrip())   # whitespace before it
                out.content += buf[:len(buf) - k]
                self.buf = buf[len(buf) - k:]
                return False
            out.content += buf
            self.buf = ""
            return False
        return self._block(out)

    def _block(self, out: Parsed) -> bool:
        buf = self.buf
        s = buf.lstrip()
        if not s:
            return False
        ws = buf[:len(buf) - len(s)]
        if self.call is None:
            if s.startswith(CALLS_CLOSE):
                self.buf, self.raw, self.state = s[len(CALLS_CLOSE):], "", "content"
                return True
            m = self._tag(INVOKE_OPEN, CALLS_CLOSE, s, out)
            if m is None:
                return False
            self.call = (m[1][0], {})
            self.raw += ws + s[:m[0]]
            self.buf = s[m[0]:]
            return True
        if s.startswith(INVOKE_CLOSE):
            name, args = self.call
            out.tool_calls.append(ToolCall(self.count, self.new_id(), name, json.dumps(args, ensure_ascii=False)))
            self.count += 1
            self.call, self.raw, self.buf = None, "", s[len(INVOKE_CLOSE):]
            return True
        m = self._tag(PARAM_OPEN, INVOKE_CLOSE, s, out)
        if m is None:
            return False
        end = s.find(PARAM_CLOSE, m[0])
        if end < 0:
            return False
        key, is_str = m[1][0], m[1][1] == "true"
        value = s[m[0]:end]
        if not is_str:
            try:
                value = json.loads(value)
            except ValueError:
                return self._malformed(out)
        self.call[1][key] = value
        self.raw += ws + s[:end + len(PARAM_CLOSE)]
        self.buf = s[end + len(PARAM_CLOSE):]
        return True

    def _tag(self, pattern: tuple, close: str, s: str, out: Parsed):
        """The match of `pattern` at the start of `s`, or None: more text is needed, or neither
        it nor `close` can start there and the block was returned as content."""
        m = _match(pattern, s)
        if m is None and not close.startswith(s):
            self._malformed(out)
        return None if m is None or m == PARTIAL else m

    def _malformed(self, out: Parsed) -> bool:
        """The block does not parse: its unreturned text, and all text after it, is content."""
        out.content += self.raw + self.buf
        self.buf, self.raw, self.call = "", "", None
        self.tools, self.state = False, "content"
        return False


def parse(text: str, thinking: bool, tools: bool, prefill: str = "", new_id=None) -> Parsed:
    """The whole of a generated text, parsed (the same machine as streaming)."""
    p = OutputParser(thinking, tools, prefill, new_id)
    out = p.feed(text)
    out += p.finish()
    return out
