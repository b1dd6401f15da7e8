"""/v1/chat/completions: messages in (rendered by the model's chat template), assistant
messages out."""
from __future__ import annotations

from dataclasses import dataclass

from runtime.server.protocol import (COMMON, Body, bad, check_model, refuse_unsupported, sampling, stream_options,
                                     type_name)
from runtime.server.serving import Choice, Job, choice

FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                   "tool_choice", "parallel_tool_calls", "add_generation_prompt", "chat_template_kwargs"}
ROLES = {"system", "developer", "user", "assistant"}


def parse_messages(fe, b: Body) -> list[int]:
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
        extra = set(m) - {"role", "content", "name"}
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
        if not isinstance(content, str):
            raise bad(f"'{where}.content' must be a string or a list of text parts, got {type_name(content)}",
                      f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    add_gen = b.get_bool("add_generation_prompt", True)
    try:
        text = fe.tokenizer.apply_chat_template(out, add_generation_prompt=add_gen)
    except Exception as e:  # noqa: BLE001 - a template error is the request's problem
        raise bad(f"the chat template failed on these messages: {e}", "messages") from None
    ids = fe.tokenizer.encode(text)
    if not ids:
        raise bad("the prompt is empty (it has no tokens)", "messages", "empty_prompt")
    return ids


@dataclass
class Chat(Job):
    object, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    @classmethod
    def parse(cls, fe, b: Body) -> Chat:
        refuse_unsupported(b, FIELDS)
        check_model(b, fe.names)
        ids = parse_messages(fe, b)
        stream = b.get_bool("stream", False)
        include_usage = stream_options(b, stream)
        want_lp = b.get_bool("logprobs", False)
        top = b.get_int("top_logprobs", None, 0, fe.max_logprobs)
        if top is not None and not want_lp:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        want_ids = b.get_bool("return_token_ids", False)
        params, stops, stop_ids = sampling(b, fe, [len(ids)], "messages", ("max_completion_tokens", "max_tokens"),
                                           None)
        return cls(fe.codec, [ids], params, stops, stop_ids, (top or 0) if want_lp else None, want_ids, stream,
                   include_usage, head={"prompt_token_ids": ids} if want_ids else {})

    def opening(self, c: Choice) -> dict:
        return choice(c, {"delta": {"role": "assistant", "content": ""}}, None, None, False)

    def chunk(self, c: Choice, text: str, ids: list[int], lps: list) -> dict:
        return choice(c, {"delta": {"content": text} if text else {}}, self._logprobs(ids, lps),
                      ids if self.want_ids else None, c.done)

    def whole(self, c: Choice) -> dict:
        return choice(c, {"message": {"role": "assistant", "content": c.text.text}},
                      self._logprobs(c.token_ids, c.logprobs), c.token_ids if self.want_ids else None, True)

    def _logprobs(self, ids: list[int], lps: list) -> dict | None:
        if self.logprobs is None:
            return None

        def entry(t, lp):
            return {"token": self.codec.token_str(t), "logprob": lp, "bytes": list(self.codec.token_bytes(t))}
        return {"content": [dict(entry(t, lp), top_logprobs=[entry(i, v) for i, v in tops])
                            for t, (lp, tops) in zip(ids, lps)], "refusal": None}
