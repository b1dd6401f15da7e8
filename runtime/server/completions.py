"""/v1/completions: a prompt (text or token ids, one or many) in, text choices out."""
from __future__ import annotations

from dataclasses import dataclass, field

from runtime.server.protocol import (COMMON, Body, bad, check_model, is_int, refuse_unsupported, sampling,
                                     stream_options, type_name)
from runtime.server.detokenize import TextOffsets
from runtime.server.serving import Choice, Job, choice

FIELDS = COMMON | {"prompt", "echo", "suffix"}


def parse_prompts(fe, p) -> tuple[list[str | None], list[list[int]]]:
    """prompt: a string, a list of strings, a list of token ids, or a list of lists of ids.
    Returns each prompt's text (None when given as ids) and its ids."""
    shape = ("'prompt' must be a string, a list of strings, a list of token ids or a list of lists "
             "of token ids")
    if isinstance(p, str):
        items = [p]
    elif isinstance(p, list):
        if not p:
            raise bad("'prompt' is empty", "prompt", "empty_prompt")
        if all(is_int(x) for x in p):
            items = [p]
        elif all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            items = p
        else:
            raise bad(shape, "prompt")
    else:
        raise bad(f"{shape}, got {type_name(p)}", "prompt")
    if len(items) > fe.max_choices:   # before any prompt is tokenized
        raise bad(f"'prompt' holds {len(items)} prompts; this server takes at most {fe.max_choices} "
                  f"choices per request", "prompt", "too_many_choices")
    texts, prompts = [], []
    for x in items:
        if isinstance(x, str):
            if fe.tokenizer is None:
                raise bad("this model has no tokenizer: send the prompt as token ids", "prompt")
            ids = fe.tokenizer.encode(x)
            texts.append(x)
        else:
            if not all(is_int(t) for t in x):
                raise bad(shape, "prompt")
            bad_ids = [t for t in x if not 0 <= t < fe.vocab_size]
            if bad_ids:
                raise bad(f"token ids out of range [0, {fe.vocab_size}): {bad_ids[:5]}", "prompt")
            ids = list(x)
            texts.append(None)
        if not ids:
            raise bad("the prompt is empty (it has no tokens)", "prompt", "empty_prompt")
        prompts.append(ids)
    return texts, prompts


@dataclass
class Completion(Job):
    object = chunk_object = "text_completion"
    prefix = "cmpl"
    offsets: dict = field(default_factory=dict)        # streamed TextOffsets, per choice index

    @classmethod
    def parse(cls, fe, b: Body) -> Completion:
        refuse_unsupported(b, FIELDS)
        check_model(b, fe.names)
        if "prompt" not in b:
            raise bad("'prompt' is required", "prompt")
        texts, prompts = parse_prompts(fe, b["prompt"])
        echo = b.get_bool("echo", False)
        stream = b.get_bool("stream", False)
        include_usage = stream_options(b, stream)
        if isinstance(b.get("logprobs"), bool):
            raise bad("'logprobs' must be an integer (the number of top logprobs) for completions", "logprobs")
        logprobs = b.get_int("logprobs", None, 0, fe.max_logprobs)
        if echo and logprobs is not None:
            raise bad("'echo' with 'logprobs' needs prompt logprobs, which this server does not compute",
                      "echo", "unsupported_parameter")
        want_ids = b.get_bool("return_token_ids", False)
        params, stops, stop_ids = sampling(b, fe, [len(p) for p in prompts], "prompt", ("max_tokens",), 16)
        echoes = [(t if t is not None else fe.codec.decode(p)) if echo else "" for t, p in zip(texts, prompts)]
        return cls(fe.codec, prompts, params, stops, stop_ids, logprobs, want_ids, stream, include_usage, echoes)

    def opening(self, c: Choice) -> dict | None:
        if not (c.echo or self.want_ids):
            return None
        ch = choice(c, {"text": c.echo}, None, None, False)
        if self.want_ids:
            ch["prompt_token_ids"] = c.prompt_ids
        return ch

    def chunk(self, c: Choice, text: str, ids: list[int], lps: list) -> dict:
        lp = None
        if self.logprobs is not None:
            at = self.offsets.setdefault(c.index, TextOffsets(self.codec, len(c.echo)))
            lp = self._logprobs(ids, lps, at)
        return choice(c, {"text": text}, lp, ids if self.want_ids else None, c.done)

    def whole(self, c: Choice) -> dict:
        lp = self._logprobs(c.token_ids, c.logprobs, TextOffsets(self.codec, len(c.echo))) \
            if self.logprobs is not None else None
        ch = choice(c, {"text": c.echo + c.text.text}, lp, None, True)
        if self.want_ids:
            ch["prompt_token_ids"], ch["token_ids"] = c.prompt_ids, c.token_ids
        return ch

    def _logprobs(self, ids: list[int], lps: list, at: TextOffsets) -> dict:
        """The legacy logprobs object of these tokens; `at` moves past them."""
        toks, tlp, top, offs = [], [], [], []
        for t, (lp, tops) in zip(ids, lps):
            toks.append(self.codec.token_str(t))
            tlp.append(lp)
            top.append({self.codec.token_str(i): v for i, v in tops})
            offs.append(at.advance(t))
        return {"tokens": toks, "token_logprobs": tlp, "top_logprobs": top, "text_offset": offs}
