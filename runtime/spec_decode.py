"""Verification of drafted tokens (issue 17; docs/dspark.md §5), pure functions over a batch of
B verify requests: target rows [B, k+1, vocab] (row i predicts the token after the i-th input:
the anchor, then d1..dk) and the k drafted tokens [B, k]. Each returns (accepted [B] in 0..k,
next token [B]): the request commits d1..d_accepted, then the next token.

Greedy verification is exact match with the target's argmax. Sampled verification is standard
rejection sampling, so every emitted token is distributed as the target's: accept d_i with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from max(0, p_i - q_i)
normalized; after k acceptances draw the bonus from p_k. A greedy draft is q_i = one-hot(d_i).
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
    from (None: greedy drafts, q = one-hot), u_accept [B, k] and u_draw [B] uniforms in [0, 1)."""
    k = _check(target_probs, draft_tokens)
    B, V = target_probs.shape[0], target_probs.shape[2]
    if u_accept.shape != (B, k) or u_draw.shape != (B,):
        raise ValueError(f"u_accept/u_draw: shapes {tuple(u_accept.shape)}/{tuple(u_draw.shape)}, "
                         f"expected [{B}, {k}]/[{B}]")
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_tokens, V).to(target_probs.dtype)
    elif draft_probs.shape != (B, k, V):
        raise ValueError(f"draft_probs: shape {tuple(draft_probs.shape)}, expected [{B}, {k}, {V}]")
    d = draft_tokens[..., None]
    p_d = target_probs[:, :k].gather(2, d).squeeze(2)
    q_d = draft_probs.gather(2, d).squeeze(2)
    a = _accepted(u_accept * q_d < p_d)                              # u < p/q without dividing
    rows = torch.arange(B, device=a.device)
    p = target_probs[rows, a]                                        # [B, V]
    q = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], 1)[rows, a]   # 0 after k accepts
    resid = (p - q).clamp(min=0)
    total = resid.sum(-1, keepdim=True)
    # p = q leaves no residual, but then the draft is never rejected: only rounding gets here
    dist = torch.where(total > 0, resid / total.clamp(min=torch.finfo(total.dtype).tiny), p)
    cdf = dist.cumsum(-1)
    target = u_draw[:, None].to(cdf.dtype) * cdf[:, -1:]
    nxt = torch.searchsorted(cdf, target, right=True).clamp(max=V - 1).squeeze(1)
    return a, nxt
