"""A request as the scheduler sees it: its tokens, how far its state is committed, its pages
and its STATE slot."""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field
from enum import Enum


# OpenAI's bounds: a bias outside them is clamped, as the API documents.
LOGIT_BIAS_LIMIT = 100.0


def _finite(name: str, v, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
        lo_s = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {lo_s}{lo}, {hi}], got {v}" if hi is not None
                         else f"{name} must be {'>' if lo_open else '>='} {lo}, got {v}")


def _int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {v!r}")


@dataclass
class SamplingParams:
    """How one request samples (vLLM's semantics). The penalties apply to the logits before
    temperature: repetition to every token of the prompt and the output, presence and frequency
    to the output's tokens. `logit_bias` {token id: bias} is clamped to [-100, 100];
    `min_tokens` keeps EOS and `stop_token_ids` out until that many tokens were generated."""
    max_tokens: int = 16
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0     # subtracted once from each token already in the output
    frequency_penalty: float = 0.0    # subtracted per occurrence in the output
    repetition_penalty: float = 1.0   # divides positive / multiplies negative logits of seen tokens
    min_p: float = 0.0                # drop tokens below min_p x the top token's probability
    logit_bias: dict = field(default_factory=dict)
    min_tokens: int = 0

    def __post_init__(self):
        _int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _finite("temperature", self.temperature, 0.0)
        _int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        _finite("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if self.seed is not None:
            _int("seed", self.seed)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            _int("stop_token_ids", t)
        for name in ("presence_penalty", "frequency_penalty"):
            _finite(name, getattr(self, name), -2.0, 2.0)
        _finite("repetition_penalty", self.repetition_penalty, 0.0, lo_open=True)
        _finite("min_p", self.min_p, 0.0, 1.0)
        _int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict {{token id: bias}}, got {self.logit_bias!r}")
        bias = {}
        for t, b in self.logit_bias.items():
            _int("logit_bias token id", t)
            if t < 0:
                raise ValueError(f"logit_bias token id must be >= 0, got {t}")
            _finite(f"logit_bias[{t}]", b)
            bias[t] = min(max(float(b), -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)
        self.logit_bias = bias

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()
_seeds = random.Random()         # seeded from the OS: unseeded requests differ per run


class Sequence:
    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None):
        if not prompt_token_ids:
            raise ValueError("empty prompt")
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed = 0            # committed position: tokens whose state is in the cache
        self.pages: list[int] = []
        self.slot: int | None = None
        self.status = Status.WAITING
        self.params = params
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0       # prompt tokens served from the prefix cache (the hit)
        # the seed of this request's draws (a random one when the request has none)
        self.sampling_seed = params.seed if params.seed is not None else _seeds.getrandbits(64)
        self.error: str | None = None    # why the request failed, when finish_reason is 'error'
        self.num_logprobs: int | None = None   # top-N logprobs wanted per completion token
        self.logprobs: list | None = None
        self.page_hashes: list[int] = []  # chained hashes of full prompt PAGEs (memo)
        self.resume = None               # how a prefix hit resumes, until its first forward
        self.write_from = 0              # global rows of groups ending below this are cached
        self.swa_floor = 0               # no window reads below this position (encoder replay)
        self.decoder_start = None        # first position the decoder runs on (runtime.replay), or
                                         # None: every position (decoder bounded replay off)
        self.spec_token_ids: list[int] = []   # DSpark's drafts after the last token: never in
                                              # token_ids until a verify step accepts them

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def may_draft(self) -> bool:
        """The request may carry DSpark drafts: greedy, or sampled with any temperature, top-k,
        top-p and min-p (verified by rejection sampling, runtime.spec_step). Excluded, decoding
        one token per step under DSpark: penalties and a pending min_tokens (they make a verify
        row's distribution depend on the drafts before it), logit bias (not built on verify
        rows: SamplingTensors lays it out one row per request), and logprobs (refused with
        DSpark)."""
        p = self.params
        return (not p.penalized and not p.logit_bias and self.num_logprobs is None
                and len(self.token_ids) - self.num_prompt_tokens >= p.min_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self):
        return (f"Sequence({self.request_id}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed}, pages={len(self.pages)}, slot={self.slot})")
