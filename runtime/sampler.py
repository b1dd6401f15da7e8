"""Sampling from the last-row logits: greedy, temperature, top-k, top-p; a request with a seed
draws from its own generator, so its tokens do not depend on what it is batched with."""
from __future__ import annotations

import torch

from runtime.sequence import Sequence


# Below this a temperature is greedy (vLLM's rule): logits / 1e-50 overflow to inf and softmax
# turns them into NaN, which multinomial refuses, failing every request of the step.
GREEDY_BELOW = 1e-5


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    logits = logits.float()
    out = logits.argmax(-1).tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.temperature < GREEDY_BELOW:
            continue
        if seq.generator is None:
            seq.generator = torch.Generator(device="cpu")
            if p.seed is not None:
                seq.generator.manual_seed(p.seed)
            else:
                seq.generator.seed()
        out[i] = int(torch.multinomial(probs(logits[i].cpu(), p.temperature, p.top_k, p.top_p), 1,
                                       generator=seq.generator))
    return out


def probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution a token is drawn from: temperature, then the top-k and top-p filters
    (the most likely token always stays)."""
    x = logits / temperature
    if top_k and top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    p = torch.softmax(x, -1)
    if top_p < 1:
        sp, si = torch.sort(p, descending=True)
        drop = sp.cumsum(-1) - sp > top_p
        p = p.scatter(0, si, sp.masked_fill(drop, 0))
        p = p / p.sum()
    return p


def token_logprobs(logits: torch.Tensor, tokens: list[int], num: list[int]) -> list[tuple[float, list]]:
    """Per row: the log-probability of the sampled token and the `num[i]` most likely
    (token id, log-probability) pairs, from the model's distribution (the raw logits, before
    temperature and the top-k/top-p filters), computed from the same logits the token came from."""
    lp = torch.log_softmax(logits.float(), -1)
    k = min(max(num, default=0), lp.shape[-1])
    top = torch.topk(lp, k, -1) if k else None
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device).view(-1, 1)).view(-1).tolist()
    out = []
    for i, n in enumerate(num):
        tops = list(zip(top.indices[i, :n].tolist(), top.values[i, :n].tolist())) if n else []
        out.append((chosen[i], tops))
    return out
