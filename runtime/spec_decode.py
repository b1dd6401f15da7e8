"""Verification of drafted tokens (issue 17; docs/dspark.md §5), pure functions over a batch of
B verify requests: target rows [B, k+1, vocab] (row i predicts the token after the i-th input:
the anchor, then d1..dk) and the k drafted tokens [B, k]. Each returns (accepted [B] in 0..k,
next token [B]): the request commits d1..d_accepted, then the next token.

Greedy verification is exact match with the target's argmax. Sampled verification is standard
rejection sampling, so every emitted token is distributed as the target's: accept d_i with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from max(0, p_i - q_i)
normalized; after k acceptances draw the bonus from p_k. A greedy draft is q_i = one-hot(d_i).

`forced_accept` is the benchmark-only override (EngineArgs.dspark_forced_acceptance): a given
count of drafts is taken whatever the target says, then the target's own token at that row.
"""
from __future__ import annotations

import torch


def _check(target: torch.Tensor, draft_tokens: torch.Tensor) -> int:
    if target.dim() != 3:
        raise ValueError(f"target: shape {tuple(target.shape)}, expected [B, k+1, vocab]")
    B, k1, _ = target.shape
    if draft_tokens.shape != (B, k1 - 1):
        raise ValueError(f"draft_tokens: shape {tuple(draft_tokens.shape)}, expected [{B}, {k1 - 1}]")
    return k1 - 1


def _accepted(ok: torch.Tensor) -> torch.Tensor:
    """Length of each row's leading run of True."""
    return ok.long().cumprod(1).sum(1)


def greedy_accept(target_logits: torch.Tensor, draft_tokens: torch.Tensor):
    """Longest prefix of the drafts equal to the target's argmax (lowest id on ties), plus the
    target's argmax at the first mismatch (or after the last draft)."""
    _check(target_logits, draft_tokens)
    best = target_logits.argmax(-1)                                      # [B, k+1]
    a = _accepted(best[:, :-1] == draft_tokens)
    return a, best.gather(1, a[:, None]).squeeze(1)


def rejection_accept(target_probs: torch.Tensor, draft_tokens: torch.Tensor, u_accept: torch.Tensor,
                     u_draw: torch.Tensor, draft_probs: torch.Tensor | None = None):
    """Sampled verification. target_probs [B, k+1, V] (the request's sampling distribution at
    each row, filters applied), draft_probs [B, k, V] the distributions the drafts were drawn
    from (None: greedy drafts, q = one-hot), u_accept [B, k] uniforms in [0, 1), and u_draw the
    uniform of the final draw: [B], or [B, k+1] where the draw after a acceptances takes
    u_draw[:, a] (so each output position can have its own)."""
    k = _check(target_probs, draft_tokens)
    B, V = target_probs.shape[0], target_probs.shape[2]
    if u_accept.shape != (B, k) or u_draw.shape not in ((B,), (B, k + 1)):
        raise ValueError(f"u_accept/u_draw: shapes {tuple(u_accept.shape)}/{tuple(u_draw.shape)}, "
                         f"expected [{B}, {k}]/[{B}] or [{B}, {k + 1}]")
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_tokens, V).to(target_probs.dtype)
    elif draft_probs.shape != (B, k, V):
        raise ValueError(f"draft_probs: shape {tuple(draft_probs.shape)}, expected [{B}, {k}, {V}]")
    d = draft_tokens[..., None]
    p_d = target_probs[:, :k].gather(2, d).squeeze(2)
    q_d = draft_probs.gather(2, d).squeeze(2)
    a = _accepted(u_accept * q_d < p_d)                              # u < p/q without dividing
    rows = torch.arange(B, device=a.device)
    if u_draw.dim() == 2:
        u_draw = u_draw[rows, a]
    p = target_probs[rows, a]                                        # [B, V]
    q = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], 1)[rows, a]   # 0 after k accepts
    resid = (p - q).clamp(min=0)
    total = resid.sum(-1, keepdim=True)
    # p = q leaves no residual, but then the draft is never rejected: only rounding gets here
    dist = torch.where(total > 0, resid / total.clamp(min=torch.finfo(total.dtype).tiny), p)
    return a, _draw(dist, u_draw)


def _draw(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of dist [B, V], the token whose CDF interval (vocab order) holds u x the mass."""
    cdf = dist.cumsum(-1)
    target = u[:, None].to(cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).clamp(max=dist.shape[-1] - 1).squeeze(1)


def forced_accept(target: torch.Tensor, draft_tokens: torch.Tensor, accepted: torch.Tensor,
                  u_draw: torch.Tensor | None = None):
    """Benchmark only: `accepted` [B] (each in 0..k) drafts are taken whatever the target says,
    then the target's own token at row `accepted`: the argmax of target logits (u_draw None:
    greedy requests), or a draw from target probs at u_draw [B, k+1] (its column `accepted`)."""
    k = _check(target, draft_tokens)
    if accepted.shape != (target.shape[0],) or bool(((accepted < 0) | (accepted > k)).any()):
        raise ValueError(f"accepted: {accepted.tolist()}, expected [{target.shape[0]}] counts in 0..{k}")
    rows = torch.arange(target.shape[0], device=target.device)
    at = target[rows, accepted]
    return accepted, at.argmax(-1) if u_draw is None else _draw(at, u_draw[rows, accepted])
