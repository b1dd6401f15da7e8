"""Offline API: `LLM(model="toy").generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from dataclasses import dataclass

from tqdm import tqdm

from runtime.engine import EngineArgs, LLMEngine
from runtime.sequence import SamplingParams


@dataclass
class RequestOutput:
    prompt: str | list[int]
    text: str | None
    token_ids: list[int]
    cached_tokens: int
    finish_reason: str | None

    def as_json(self) -> dict:
        return {"prompt": self.prompt, "text": self.text, "token_ids": self.token_ids,
                "cached_tokens": self.cached_tokens, "finish_reason": self.finish_reason}


class LLM:
    def __init__(self, model: str = "toy", **kw):
        self.engine = LLMEngine(EngineArgs(model=model, **kw))
        self.tokenizer = self.engine.tokenizer

    def encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt (text or token ids) to completion; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.engine.add_request(self.encode(p), sp) for p, sp in zip(prompts, plist)]
        bar = tqdm(total=len(seqs), desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished():
            bar.update(sum(s.is_finished for s in self.engine.step()))
        bar.close()
        dec = self.tokenizer.decode if self.tokenizer else (lambda ids: None)
        return [RequestOutput(p, dec(s.completion_token_ids), s.completion_token_ids,
                              s.num_cached_tokens, s.finish_reason) for p, s in zip(prompts, seqs)]
