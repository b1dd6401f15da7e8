"""A request as the scheduler sees it: its tokens, how far its state is committed, its pages
and its STATE slot."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


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
        self.generator = None            # per-request torch.Generator for seeded sampling
        self.num_logprobs: int | None = None   # top-N logprobs wanted per completion token
        self.logprobs: list | None = None
        self.page_hashes: list[int] = []  # chained hashes of full prompt PAGEs (memo)
        self.resume = None               # how a prefix hit resumes, until its first forward
        self.write_from = 0              # global rows of groups ending below this are cached
        self.swa_floor = 0               # no window reads below this position (encoder replay)

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
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self):
        return (f"Sequence({self.request_id}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed}, pages={len(self.pages)}, slot={self.slot})")
