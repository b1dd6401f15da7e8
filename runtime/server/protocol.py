"""The OpenAI wire format shared by both endpoints: error bodies, typed access to a JSON body,
the fields this server accepts or refuses, sampling parameters and stream options.

Requests are validated by hand, not by pydantic models, so that every refusal is an
OpenAI-style error naming the offending parameter with a precise message."""
from __future__ import annotations

import json
import math

from fastapi import Request
from fastapi.responses import JSONResponse

from runtime.sequence import SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def type_name(v) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}.get(type(v), type(v).__name__)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _range(lo, hi, lo_open=False) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{lo}, {hi}]"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"<= {hi}"


class Body(dict):
    """A JSON request object; each typed getter returns `default` for a missing or null field
    and raises APIError(400) for a wrong one."""

    def get_int(self, k, default, lo=None, hi=None, what=None):
        v = self.get(k)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not is_int(v):
            raise bad(f"'{k}' must be an integer, got {type_name(v)}", k)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise bad(f"'{k}' must be {what or _range(lo, hi)}, got {v}", k)
        return v

    def get_num(self, k, default, lo=None, hi=None, lo_open=False):
        v = self.get(k)
        if v is None:
            return default
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
            got = "a non-finite number" if isinstance(v, float) else type_name(v)
            raise bad(f"'{k}' must be a finite number, got {got}", k)
        if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
            raise bad(f"'{k}' must be {_range(lo, hi, lo_open)}, got {v}", k)
        return float(v)

    def get_bool(self, k, default):
        return self.get_as(k, default, bool)

    def get_as(self, k, default, cls):
        v = self.get(k)
        if v is None:
            return default
        if not isinstance(v, cls):
            raise bad(f"'{k}' must be a {type_name(cls())}, got {type_name(v)}", k)
        return v


async def read_body(request: Request, max_bytes: int) -> Body:
    """The JSON object of a request, read up to `max_bytes` (413 beyond: nothing larger is held)."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_bytes:
            raise APIError(413, f"request body over the limit of {max_bytes} bytes", code="request_too_large")
    try:
        body = json.loads(raw)
        # a lone surrogate ("\ud800") is valid JSON but no text: tokenizing or streaming it fails
        json.dumps(body, ensure_ascii=False).encode()
    except (ValueError, UnicodeError, RecursionError) as e:   # also too deep, too many digits
        raise bad(f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type_name(body)}")
    return Body(body)


# Fields both endpoints accept; each endpoint adds its own. A field whose value would change
# the output in a way this server does not implement is refused, unless the value is harmless.
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
          "n", "stream", "stream_options", "user", "ignore_eos", "return_token_ids", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "logit_bias", "best_of", "min_p", "min_tokens",
          "metadata", "store", "service_tier", "logprobs"}


def refuse_unsupported(b: Body, allowed: set) -> None:
    unknown = sorted(k for k in b if k not in allowed)
    if unknown:
        raise bad(f"unrecognized request argument{'s' if len(unknown) > 1 else ''}: "
                  f"{', '.join(repr(k) for k in unknown)}", unknown[0], "unknown_parameter")

    def no(k, why):
        raise bad(f"'{k}' {why} is not supported by this server", k, "unsupported_parameter")
    if b.get("suffix") not in (None, ""):
        no("suffix", "(non-empty)")
    if b.get("best_of") is not None and b.get_int("best_of", 1, 1) != b.get_int("n", 1, 1):
        no("best_of", "different from n")
    rf = b.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        no("response_format", f"= {json.dumps(rf)[:80]}")
    for k in ("user", "service_tier"):
        b.get_as(k, None, str)
    for k in ("store", "parallel_tool_calls"):
        b.get_bool(k, None)
    if b.get("metadata") is not None and not isinstance(b["metadata"], dict):
        raise bad(f"'metadata' must be an object, got {type_name(b['metadata'])}", "metadata")


def text_bytes(value) -> int:
    """UTF-8 bytes of every string in a JSON value (iterative: a deep value is no recursion)."""
    n, todo = 0, [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            n += len(v) if v.isascii() else len(v.encode())
        elif isinstance(v, dict):
            todo += v.values()
        elif isinstance(v, list):
            todo += v
    return n


def check_text_sizes(b: Body, keys: tuple, max_prompt_bytes: int | None, max_stop_bytes: int) -> None:
    """Byte caps, checked before anything is tokenized: each prompt string (of 'prompt', or all
    the text of 'messages' together) and all 'stop' strings together."""
    for key in keys if max_prompt_bytes else ():
        v = b.get(key)
        many = key == "prompt" and isinstance(v, list)
        for i, p in enumerate(v if many else [v]):
            n = text_bytes(p)
            if n > max_prompt_bytes:
                raise bad(f"'{key}{f'[{i}]' if many else ''}' holds {n} bytes of text; this server takes at most "
                          f"{max_prompt_bytes} per prompt (--max-prompt-bytes)", key, "prompt_too_large")
    n = text_bytes(b.get("stop"))
    if n > max_stop_bytes:
        raise bad(f"'stop' strings hold {n} bytes; this server takes at most {max_stop_bytes} (--max-stop-bytes)",
                  "stop", "stop_too_large")


def check_model(b: Body, names: list[str]) -> None:
    m = b.get("model")
    if m is None:
        return
    if not isinstance(m, str):
        raise bad(f"'model' must be a string, got {type_name(m)}", "model")
    if m not in names:
        raise APIError(404, f"The model `{m}` does not exist. This server serves: {', '.join(names)}",
                       "model", "model_not_found")


def stream_options(b: Body, stream: bool) -> bool:
    """Validate 'stream_options'; returns include_usage."""
    so = b.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise bad(f"'stream_options' must be an object, got {type_name(so)}", "stream_options")
    if not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    extra = set(so) - {"include_usage", "continuous_usage_stats"}
    if extra:
        raise bad(f"unrecognized stream_options: {', '.join(sorted(extra))}", "stream_options")
    so = Body(so)
    so.get_bool("continuous_usage_stats", False)
    return so.get_bool("include_usage", False)


LOGIT_BIAS_MAX_ENTRIES = 300      # OpenAI's limit


def _logit_bias(lb, vocab_size: int) -> dict:
    """{token id string: bias} -> {token id: bias}; SamplingParams clamps the bias to [-100, 100]."""
    if lb is None:
        return {}
    if not isinstance(lb, dict):
        raise bad(f"'logit_bias' must be an object, got {type_name(lb)}", "logit_bias")
    if len(lb) > LOGIT_BIAS_MAX_ENTRIES:
        raise bad(f"'logit_bias' has {len(lb)} entries; at most {LOGIT_BIAS_MAX_ENTRIES} are allowed", "logit_bias")
    out = {}
    for k, v in lb.items():
        if not (k.isascii() and k.isdigit() and len(k) <= 12 and int(k) < vocab_size):
            raise bad(f"'logit_bias' keys must be token ids in [0, {vocab_size}), got {k[:40]!r}", "logit_bias")
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
            raise bad(f"'logit_bias' values must be finite numbers, got {type_name(v)} for {k!r}", "logit_bias")
        out[int(k)] = float(v)
    return out


def sampling(b: Body, fe, prompt_lens: list[int], prompt_key: str, max_tokens_keys: tuple,
             default_max: int | None) -> tuple[list[list[SamplingParams]], list[str], set]:
    """SamplingParams for each prompt's n choices (seeded choices get seed + j), the stop
    strings and the stop token ids. `default_max` None: up to the context length."""
    n = b.get_int("n", 1, 1, fe.max_n)
    if n * len(prompt_lens) > fe.max_choices:
        raise bad(f"{len(prompt_lens)} prompts x n={n} = {n * len(prompt_lens)} choices; this server "
                  f"takes at most {fe.max_choices} per request", "n", "too_many_choices")
    max_tokens = None
    for k in max_tokens_keys:
        if b.get(k) is not None:
            max_tokens = b.get_int(k, None, 1)
            break
    temperature = b.get_num("temperature", 1.0, 0.0, 2.0)
    top_p = b.get_num("top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = b.get_int("top_k", 0, -1, what="-1, 0 (off) or a positive integer")
    top_k = 0 if top_k == -1 else top_k
    seed = b.get_int("seed", None, -(2 ** 63), 2 ** 64 - 1)
    ignore_eos = b.get_bool("ignore_eos", False)
    # the penalties, min_p, min_tokens and logit_bias: vLLM's and OpenAI's ranges
    penalties = {k: b.get_num(k, 0.0, -2.0, 2.0) for k in ("presence_penalty", "frequency_penalty")}
    penalties["repetition_penalty"] = b.get_num("repetition_penalty", 1.0, 0.0, lo_open=True)
    min_p = b.get_num("min_p", 0.0, 0.0, 1.0)
    min_tokens = b.get_int("min_tokens", 0, 0)
    logit_bias = _logit_bias(b.get("logit_bias"), fe.vocab_size)
    stop = b.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise bad("'stop' must be a string or a list of strings", "stop")
    if any(s == "" for s in stops):
        raise bad("'stop' strings must not be empty", "stop")
    if stops and fe.tokenizer is None:
        raise bad("'stop' strings need a tokenizer; this model has none (use stop_token_ids)", "stop")
    sti = b.get("stop_token_ids")
    if sti is None:
        sti = []
    if not isinstance(sti, list) or not all(is_int(t) for t in sti):
        raise bad("'stop_token_ids' must be a list of integers", "stop_token_ids")
    if any(not 0 <= t < fe.vocab_size for t in sti):
        raise bad(f"'stop_token_ids' must be token ids in [0, {fe.vocab_size})", "stop_token_ids")
    longest, limit = max(prompt_lens), fe.max_model_len
    if longest >= limit:
        raise bad(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                  f"{longest} tokens. Please reduce the length of the prompt.", prompt_key,
                  "context_length_exceeded")
    if max_tokens is not None and longest + max_tokens > limit:
        raise bad(f"This model's maximum context length is {limit} tokens. However, you requested "
                  f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the "
                  f"completion). Please reduce the length of the prompt or max_tokens.",
                  max_tokens_keys[0], "context_length_exceeded")
    per_prompt = []
    for plen in prompt_lens:
        room = limit - plen
        mt = max_tokens or (room if default_max is None else min(default_max, room))
        if min_tokens > mt:
            raise bad(f"'min_tokens' ({min_tokens}) must be <= max_tokens ({mt})", "min_tokens")
        try:
            per_prompt.append([SamplingParams(max_tokens=mt, temperature=temperature, top_k=top_k, top_p=top_p,
                                              seed=None if seed is None else (seed + j) % 2 ** 64,
                                              stop_token_ids=list(sti), ignore_eos=ignore_eos, min_p=min_p,
                                              min_tokens=min_tokens, logit_bias=logit_bias, **penalties)
                               for j in range(n)])
        except ValueError as e:
            raise bad(str(e)) from None
    return per_prompt, stops, set(sti)
