"""Verification of drafted tokens (runtime/spec_decode.py) on hand-made rows: the drafts
matched against the target's token at each row (the accepted prefix plus one), and the
benchmark-only forced acceptance. That matching against the plain sampler's draws is rejection
sampling is checked on the engine by its output distribution (tests/test_dspark_sampled.py)."""
from __future__ import annotations

import pytest
import torch

from runtime.spec_decode import forced_accept, match_accept

V, K = 5, 3


def test_match_accepts_the_matching_prefix_plus_one():
    # the target's token per row, for 4 requests
    best = torch.tensor([[1, 2, 3, 4],      # all three drafts match: bonus 4
                         [1, 0, 3, 4],      # d2 mismatches: 1 accepted, next 0
                         [2, 2, 3, 4],      # d1 mismatches: 0 accepted, next 2
                         [1, 2, 0, 4]])     # d3 mismatches: 2 accepted, next 0
    drafts = torch.tensor([[1, 2, 3]] * 4)
    a, nxt = match_accept(best, drafts)
    assert a.tolist() == [3, 1, 0, 2]
    assert nxt.tolist() == [4, 0, 2, 0]
    # a later match after a mismatch does not count
    a, nxt = match_accept(torch.tensor([[0, 0, 0, 3]]), torch.tensor([[0, 1, 0]]))
    assert a.tolist() == [1] and nxt.tolist() == [0]


def test_bad_shapes_name_the_field():
    t = torch.zeros(2, K + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="draft_tokens"):
        match_accept(t, torch.zeros(2, K + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="target_tokens"):
        match_accept(t[None], torch.zeros(2, K, dtype=torch.long))
    with pytest.raises(ValueError, match="draft_tokens"):
        forced_accept(t, torch.zeros(3, K, dtype=torch.long), torch.zeros(2, dtype=torch.long))


def test_forced_accept_takes_the_count_then_the_targets_token():
    """Benchmark only: the given count of drafts whatever the target says, then the target's
    token at that row; a count outside 0..k is refused."""
    g = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, V, (4, K + 1), generator=g)
    drafts = torch.tensor([[1, 2, 3]] * 4)
    count = torch.tensor([0, 1, 2, 3])
    a, nxt = forced_accept(tokens, drafts, count)
    assert torch.equal(a, count)
    assert nxt.tolist() == [int(tokens[i, i]) for i in range(4)]
    with pytest.raises(ValueError, match="accepted"):
        forced_accept(tokens, drafts, torch.tensor([0, 1, 2, 4]))
