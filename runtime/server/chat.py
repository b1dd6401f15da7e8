"""/v1/chat/completions: messages in, rendered by the V4.1 chat protocol (v41/chat_format.py:
thinking, reasoning_effort, tools and tool_choice in DSML); assistant messages out, the generated
text parsed (v41/chat_parse.py) into content, reasoning_content and tool_calls, whole or as
stream deltas."""
from __future__ import annotations

from dataclasses import dataclass, field

from runtime.server.protocol import (COMMON, Body, bad, check_model, refuse_unsupported, sampling, stream_options,
                                     type_name)
from runtime.server.serving import Choice, Job, choice
from v41.chat_format import (ChatFormatError, check_message, generation_prefill, parse_effort, parse_template_kwargs,
                             parse_tool_choice, parse_tools)
from v41.chat_parse import OutputParser, Parsed, parse

FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                   "tool_choice", "parallel_tool_calls", "add_generation_prompt", "chat_template_kwargs",
                   "reasoning_effort"}
ROLES = {"system", "developer", "user", "assistant", "tool"}
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}


def protocol_options(fe, b: Body) -> dict:
    """render()'s options from the request: thinking (chat_template_kwargs, else on with an
    explicit effort, else the tokenizer's default), effort, tools and tool_choice."""
    kw = parse_template_kwargs(b.get("chat_template_kwargs"))
    effort = parse_effort(b.get("reasoning_effort"))
    effort = kw.get("effort") if effort is None else effort
    tools = parse_tools(b.get("tools"))
    tool_choice = parse_tool_choice(b.get("tool_choice"), tools)
    default = effort is not None or getattr(fe.tokenizer, "thinking_default", False)
    return {"thinking": kw.get("thinking", default), "effort": effort, "tools": tools, "tool_choice": tool_choice}


def parse_messages(fe, b: Body, options: dict) -> list[int]:
    """The prompt ids of 'messages': text content only, 'developer' read as 'system'."""
    msgs = b.get("messages")
    if msgs is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(msgs, list):
        raise bad(f"'messages' must be an array, got {type_name(msgs)}", "messages")
    if not msgs:
        raise bad("'messages' is empty", "messages", "empty_prompt")
    if fe.tokenizer is None or not fe.tokenizer.chat_template:
        raise bad("this model has no chat template: use /v1/completions", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"'{where}' must be an object, got {type_name(m)}", where)
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"'{where}.role' must be one of {sorted(ROLES)}, got {role!r}", f"{where}.role")
        extra = set(m) - MESSAGE_FIELDS
        if extra:
            raise bad(f"'{where}' has unsupported fields: {', '.join(sorted(extra))}", where,
                      "unsupported_parameter")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"'{where}.content[{j}]': only text parts ({{'type': 'text', 'text': ...}}) "
                              f"are supported", f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        if content is None and role == "assistant" and m.get("tool_calls"):
            content = ""                    # a turn of tool calls only
        if not isinstance(content, str):
            raise bad(f"'{where}.content' must be a string or a list of text parts, got {type_name(content)}",
                      f"{where}.content")
        out.append(check_message(dict(m, role="system" if role == "developer" else role, content=content), where))
    add_gen = b.get_bool("add_generation_prompt", True)
    try:
        text = fe.tokenizer.apply_chat_template(out, add_generation_prompt=add_gen, **options)
    except Exception as e:  # noqa: BLE001 - a template error is the request's problem
        raise bad(f"the chat template failed on these messages: {e}", "messages") from None
    ids = fe.tokenizer.encode(text)
    if not ids:
        raise bad("the prompt is empty (it has no tokens)", "messages", "empty_prompt")
    return ids


@dataclass
class Chat(Job):
    object, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"
    thinking: bool = False
    tool_parsing: bool = False          # tools offered: the output's DSML blocks become tool_calls
    prefill: str = ""                   # how the prompt already opened the reply (a forced tool call)
    parsers: dict = field(default_factory=dict)       # per choice index, when streaming

    @classmethod
    def parse(cls, fe, b: Body) -> Chat:
        refuse_unsupported(b, FIELDS)
        check_model(b, fe.names)
        try:
            options = protocol_options(fe, b)
            ids = parse_messages(fe, b, options)
        except ChatFormatError as e:
            raise bad(f"chat protocol: {e}", e.param) from None
        stream = b.get_bool("stream", False)
        include_usage = stream_options(b, stream)
        want_lp = b.get_bool("logprobs", False)
        top = b.get_int("top_logprobs", None, 0, fe.max_logprobs)
        if top is not None and not want_lp:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        want_ids = b.get_bool("return_token_ids", False)
        params, stops, stop_ids = sampling(b, fe, [len(ids)], "messages", ("max_completion_tokens", "max_tokens"),
                                           None)
        tools = options["tools"] if options["tool_choice"] != "none" else []
        return cls(fe.codec, [ids], params, stops, stop_ids, (top or 0) if want_lp else None, want_ids, stream,
                   include_usage, head={"prompt_token_ids": ids} if want_ids else {},
                   thinking=options["thinking"], tool_parsing=bool(tools),
                   prefill=generation_prefill(options["thinking"], tools, options["tool_choice"]))

    def opening(self, c: Choice) -> dict:
        return choice(c, {"delta": {"role": "assistant", "content": ""}}, None, None, False)

    def chunk(self, c: Choice, text: str, ids: list[int], lps: list) -> dict:
        p = self.parsers.get(c.index)
        if p is None:
            p = self.parsers[c.index] = OutputParser(self.thinking, self.tool_parsing, self.prefill)
        d = p.feed(text)
        if c.done:
            d += p.finish()
            self._finish_reason(c, p.count)
        delta = {}
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
        if d.content:
            delta["content"] = d.content
        if d.tool_calls:
            delta["tool_calls"] = tool_calls(d)
        return choice(c, {"delta": delta}, self._logprobs(ids, lps), ids if self.want_ids else None, c.done)

    def whole(self, c: Choice) -> dict:
        d = parse(c.text.text, self.thinking, self.tool_parsing, self.prefill)
        self._finish_reason(c, len(d.tool_calls))
        msg = {"role": "assistant", "content": d.content or (None if d.tool_calls else ""),
               "reasoning_content": d.reasoning or None}
        if d.tool_calls:
            msg["tool_calls"] = tool_calls(d)
        return choice(c, {"message": msg}, self._logprobs(c.token_ids, c.logprobs),
                      c.token_ids if self.want_ids else None, True)

    @staticmethod
    def _finish_reason(c: Choice, calls: int) -> None:
        # the model ended its turn after calling tools: OpenAI's reason for that is "tool_calls"
        if calls and c.finish_reason == "stop" and c.stop_reason is None:
            c.finish_reason = "tool_calls"

    def _logprobs(self, ids: list[int], lps: list) -> dict | None:
        if self.logprobs is None:
            return None

        def entry(t, lp):
            return {"token": self.codec.token_str(t), "logprob": lp, "bytes": list(self.codec.token_bytes(t))}
        return {"content": [dict(entry(t, lp), top_logprobs=[entry(i, v) for i, v in tops])
                            for t, (lp, tops) in zip(ids, lps)], "refusal": None}


def tool_calls(d: Parsed) -> list[dict]:
    return [{"index": t.index, "id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
            for t in d.tool_calls]
