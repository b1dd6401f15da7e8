"""Verification of drafted tokens (runtime/spec_decode.py): greedy exact match by hand-made
rows, and rejection sampling's output distribution on a vocabulary of 5 against the target's
(chi-square, each comparison at a 0.001 false-alarm rate; seeds fixed, so a run is repeatable);
the per-count draw uniforms; the benchmark-only forced acceptance."""
from __future__ import annotations

import pytest
import torch

from runtime.spec_decode import forced_accept, greedy_accept, rejection_accept

V, K = 5, 3
CHI2_001 = 18.47          # chi-square 0.999 quantile, df = V - 1 = 4
N = 40_000


def test_greedy_accepts_the_matching_prefix_plus_one():
    # target argmax per row, for 4 requests
    best = torch.tensor([[1, 2, 3, 4],      # all three drafts match: bonus 4
                         [1, 0, 3, 4],      # d2 mismatches: 1 accepted, next 0
                         [2, 2, 3, 4],      # d1 mismatches: 0 accepted, next 2
                         [1, 2, 0, 4]])     # d3 mismatches: 2 accepted, next 0
    drafts = torch.tensor([[1, 2, 3]] * 4)
    logits = torch.nn.functional.one_hot(best, V).double()
    a, nxt = greedy_accept(logits, drafts)
    assert a.tolist() == [3, 1, 0, 2]
    assert nxt.tolist() == [4, 0, 2, 0]
    # a later match after a mismatch does not count, and ties go to the lower id
    tie = torch.zeros(1, 4, V, dtype=torch.float64)
    a, nxt = greedy_accept(tie, torch.tensor([[0, 1, 0]]))
    assert a.tolist() == [1] and nxt.tolist() == [0]


def test_bad_shapes_name_the_field():
    p = torch.full((2, K + 1, V), 1 / V)
    with pytest.raises(ValueError, match="draft_tokens"):
        greedy_accept(p, torch.zeros(2, K + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="target"):
        greedy_accept(p[0], torch.zeros(2, K, dtype=torch.long))
    with pytest.raises(ValueError, match="u_accept"):
        rejection_accept(p, torch.zeros(2, K, dtype=torch.long), torch.rand(2, K + 1), torch.rand(2))
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_accept(p, torch.zeros(2, K, dtype=torch.long), torch.rand(2, K), torch.rand(2),
                         torch.full((2, K, V + 1), 1 / (V + 1)))


def _dists(g):
    # row distributions with a zero entry (a filtered token) and uneven mass
    p = torch.rand(K + 1, V, generator=g, dtype=torch.float64) ** 2
    p[:, 4] = 0
    return p / p.sum(-1, keepdim=True)


def _chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    n = samples.numel()
    got = torch.bincount(samples, minlength=V).double()
    want = probs * n
    assert (got[want == 0] == 0).all(), "a token of probability 0 came out"
    m = want > 0
    return float(((got[m] - want[m]) ** 2 / want[m]).sum())


@pytest.mark.parametrize("draft", ["sampled", "greedy"])
def test_rejection_sampling_emits_the_target_distribution(draft):
    """A target and a draft whose rows do not depend on the prefix: the first emitted token is
    distributed as p0, and the second (emitted when d1 was accepted) as p1, whatever q is."""
    g = torch.Generator().manual_seed(11)
    p, q = _dists(g), torch.softmax(torch.randn(K, V, generator=g, dtype=torch.float64) * 2, -1)
    target = p.expand(N, -1, -1)
    if draft == "greedy":
        drafts = torch.tensor([2, 0, 3]).expand(N, -1)
        qs = None
    else:
        drafts = torch.multinomial(q, N, replacement=True, generator=g).T.contiguous()
        qs = q.expand(N, -1, -1)
    a, nxt = rejection_accept(target, drafts, torch.rand(N, K, generator=g, dtype=torch.float64),
                              torch.rand(N, generator=g, dtype=torch.float64), qs)
    first = torch.where(a > 0, drafts[:, 0], nxt)
    assert _chi2(first, p[0]) < CHI2_001
    second = torch.where(a > 1, drafts[:, 1], nxt)[a > 0]
    assert second.numel() > N // 10
    assert _chi2(second, p[1]) < CHI2_001
    # the draft matters to how much is accepted, not to what comes out
    assert 0 < float(a.double().mean()) < K


def test_all_accepted_when_draft_equals_target():
    """q = p on every row: every draft is accepted (u < p/q = 1) and the bonus comes from p_k."""
    g = torch.Generator().manual_seed(3)
    p = _dists(g)
    drafts = torch.multinomial(p[:K], 2000, replacement=True, generator=g).T.contiguous()
    a, nxt = rejection_accept(p.expand(2000, -1, -1), drafts, torch.rand(2000, K, generator=g, dtype=torch.float64),
                              torch.rand(2000, generator=g, dtype=torch.float64), p[:K].expand(2000, -1, -1))
    assert (a == K).all()
    assert _chi2(nxt, p[K]) < CHI2_001


def test_draw_uniform_per_accepted_count():
    """u_draw [B, k+1]: the draw after a acceptances takes column a (the same tokens as
    passing that column as u_draw [B])."""
    g = torch.Generator().manual_seed(5)
    n = 500
    p = _dists(g).expand(n, -1, -1)
    drafts = torch.tensor([2, 0, 3]).expand(n, -1)
    u_acc = torch.rand(n, K, generator=g, dtype=torch.float64)
    u_draw = torch.rand(n, K + 1, generator=g, dtype=torch.float64)
    a, nxt = rejection_accept(p, drafts, u_acc, u_draw)
    a1, nxt1 = rejection_accept(p, drafts, u_acc, u_draw[torch.arange(n), a])
    assert torch.equal(a, a1) and torch.equal(nxt, nxt1)
    assert len(set(a.tolist())) > 2


def test_forced_accept_takes_the_count_then_the_targets_token():
    """Benchmark only: the given count of drafts whatever the target says, then the target's
    argmax (logits) or its draw (probs at u_draw[:, a]) at that row; a count outside 0..k is
    refused."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(4, K + 1, V, generator=g, dtype=torch.float64)
    drafts = torch.tensor([[1, 2, 3]] * 4)
    count = torch.tensor([0, 1, 2, 3])
    a, nxt = forced_accept(logits, drafts, count)
    assert torch.equal(a, count)
    assert nxt.tolist() == [int(logits[i, i].argmax()) for i in range(4)]
    p = torch.softmax(logits, -1)
    u = torch.rand(4, K + 1, generator=g, dtype=torch.float64)
    _, drawn = forced_accept(p, drafts, count, u)
    for i in range(4):
        cdf = p[i, i].cumsum(-1)
        assert int(drawn[i]) == int(torch.searchsorted(cdf, u[i, i] * cdf[-1], right=True))
    with pytest.raises(ValueError, match="accepted"):
        forced_accept(logits, drafts, torch.tensor([0, 1, 2, 4]))
