"""Verification of drafted tokens (issue 17; docs/dspark.md §5), pure functions over a batch of
B verify requests: the target's token at each of its k+1 rows [B, k+1] (row i follows the i-th
input: the anchor, then d1..dk) and the k drafted tokens [B, k]. Each returns (accepted [B] in
0..k, next token [B]): the request commits d1..d_accepted, then the next token.

The target's token at a row is what a plain step would emit there: the argmax for a greedy
request, the plain sampler's draw (its uniform for that output position) for a sampled one
(runtime.spec_step). With greedy drafts (q = one-hot at d_i) matching those tokens IS
rejection sampling: P(accept d_i) = p_i(d_i) = min(1, p_i(d_i) / q_i(d_i)), and on a mismatch the
emitted x_i is distributed as p_i restricted to x != d_i, renormalized = max(0, p_i - q_i) / Z.
So the output follows the target's distribution, and every emitted token is the one plain
decoding draws at that position from the same logits and seed.

`forced_accept` is the benchmark-only override (EngineArgs.spec_decode_acceptance_length): a
given count of drafts is taken whatever the target says, then the target's own token at that row.
"""
from __future__ import annotations

import torch


def _check(target_tokens: torch.Tensor, draft_tokens: torch.Tensor) -> int:
    if target_tokens.dim() != 2:
        raise ValueError(f"target_tokens: shape {tuple(target_tokens.shape)}, expected [B, k+1]")
    B, k1 = target_tokens.shape
    if draft_tokens.shape != (B, k1 - 1):
        raise ValueError(f"draft_tokens: shape {tuple(draft_tokens.shape)}, expected [{B}, {k1 - 1}]")
    return k1 - 1


def match_accept(target_tokens: torch.Tensor, draft_tokens: torch.Tensor):
    """The longest prefix of the drafts equal to the target's tokens, then the target's token
    at the first mismatch (or after the last draft: the bonus)."""
    _check(target_tokens, draft_tokens)
    a = (target_tokens[:, :-1] == draft_tokens).long().cumprod(1).sum(1)
    return a, target_tokens.gather(1, a[:, None]).squeeze(1)


def forced_accept(target_tokens: torch.Tensor, draft_tokens: torch.Tensor, accepted: torch.Tensor,
                  check: bool = True):
    """Benchmark only: `accepted` [B] (each in 0..k) drafts are taken whatever the target says,
    then the target's own token at row `accepted`. `check=False`: the caller built the counts in
    0..k on the host (the range check reads the device)."""
    k = _check(target_tokens, draft_tokens)
    if accepted.shape != (target_tokens.shape[0],):
        raise ValueError(f"accepted: shape {tuple(accepted.shape)}, expected [{target_tokens.shape[0]}]")
    if check and bool(((accepted < 0) | (accepted > k)).any()):
        raise ValueError(f"accepted: {accepted.tolist()}, expected counts in 0..{k}")
    return accepted, target_tokens.gather(1, accepted[:, None]).squeeze(1)
