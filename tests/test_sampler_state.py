"""The sampler's distributions and logprobs, and StateTransfer's image bookkeeping, exactly and
without a forward. Fast, so mutation testing (docs/mutation.md) runs them for every mutant."""
import pytest
import torch

from runtime.sampler import probs, sample, token_logprobs, uniforms
from runtime.sequence import SamplingParams, Sequence
from runtime.state import StateTransfer
from tests import harness as H

LOGITS = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3], dtype=torch.float64))


def test_temperature_scales_the_logits():
    for t in (0.5, 1.0, 2.0):
        assert torch.allclose(probs(LOGITS, t, 0, 1.0), torch.softmax(LOGITS / t, -1), rtol=0, atol=1e-15)


@pytest.mark.parametrize("k, kept", [(1, [1]), (2, [1, 3]), (3, [1, 2, 3]), (4, [0, 1, 2, 3]), (9, [0, 1, 2, 3]),
                                     (0, [0, 1, 2, 3])])
def test_top_k_keeps_the_k_most_likely(k, kept):
    p = probs(LOGITS, 1.0, k, 1.0)
    assert torch.nonzero(p).view(-1).tolist() == kept
    want = torch.zeros(4, dtype=torch.float64)
    want[kept] = torch.softmax(LOGITS[kept], -1)
    assert torch.allclose(p, want, rtol=0, atol=1e-15)


@pytest.mark.parametrize("top_p, kept", [(0.4, [1]), (0.5, [1, 3]), (0.79, [1, 3]), (0.81, [1, 2, 3]),
                                         (0.999, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_tokens_until_the_mass_before_them_passes_p(top_p, kept):
    p = probs(LOGITS, 1.0, 0, top_p)
    assert torch.nonzero(p).view(-1).tolist() == kept
    base = torch.tensor([0.05, 0.5, 0.15, 0.3], dtype=torch.float64)
    assert torch.allclose(p[kept], base[kept] / base[kept].sum(), rtol=0, atol=1e-12)


def test_top_k_then_top_p():
    p = probs(LOGITS, 1.0, 3, 0.6)            # top-3 renormalized: 0.5/.95, 0.3/.95, 0.15/.95
    assert torch.nonzero(p).view(-1).tolist() == [1, 3]


def draw(logits_row, seed, step, temperature, top_k=0, top_p=1.0):
    """The draw written out for one row: the first token whose CDF passes the hash's uniform."""
    u = float(uniforms(torch.tensor([seed % 2**32]), torch.tensor([seed >> 32]), torch.tensor([step]))[0])
    cdf = probs(logits_row, temperature, top_k, top_p).double().cumsum(0)
    return int((cdf > u * cdf[-1]).nonzero()[0])


def test_greedy_and_seeded_rows_in_one_batch():
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS]).float()
    greedy = Sequence([1], SamplingParams())
    seeded = lambda: Sequence([1], SamplingParams(temperature=0.7, top_k=3, seed=5))  # noqa: E731
    a, b = seeded(), seeded()
    draws = []
    for step in range(12):                     # a request's draw depends on its seed and step only
        got = sample(logits, [greedy, a, Sequence([1], SamplingParams())])
        assert got[0] == 1 and got[2] == 1
        assert sample(logits[1:2], [a]) == [got[1]]
        draws.append(got[1])
        a.token_ids.append(got[1])
    want = [draw(logits[1].double(), 5, step, 0.7, 3) for step in range(12)]
    assert draws == want
    for tok in want:
        assert sample(logits[1:2], [b]) == [tok]
        b.token_ids.append(tok)
    assert len(set(want)) > 1 and 3 not in want    # top_k=3 drops token 3 of the flipped row


def test_top_k_one_samples_the_argmax():
    logits = torch.stack([LOGITS, LOGITS.flip(0)]).float()
    seqs = [Sequence([1], SamplingParams(temperature=2.0, top_k=1, seed=s)) for s in range(2)]
    assert all(sample(logits, seqs) == [1, 2] for _ in range(20))


@pytest.mark.parametrize("t", [1e-50, 1e-300, 5e-324, 9.9e-6])
def test_a_tiny_temperature_is_greedy_and_hurts_no_other_row(t):
    """logits / 1e-50 overflow and softmax gives NaN: such a row samples greedily, and the
    seeded row beside it draws what it draws alone."""
    logits = torch.stack([LOGITS.flip(0), LOGITS]).float()
    tiny = Sequence([1], SamplingParams(temperature=t, seed=3))
    alone = sample(logits[1:], [Sequence([1], SamplingParams(temperature=1.0, seed=4))])
    assert sample(logits, [tiny, Sequence([1], SamplingParams(temperature=1.0, seed=4))]) == [2] + alone
    assert sample(logits[:1], [Sequence([1], SamplingParams(temperature=1e-5, seed=3))])[0] in range(4)


def test_unseeded_requests_get_a_random_seed_at_admission():
    seqs = [Sequence([1], SamplingParams(temperature=1.0)) for _ in range(4)]
    assert len({s.sampling_seed for s in seqs}) == 4
    assert Sequence([1], SamplingParams(temperature=1.0, seed=9)).sampling_seed == 9
    s = seqs[0]
    first = sample(LOGITS.float()[None], [s])
    assert sample(LOGITS.float()[None], [s]) == first           # the same step draws the same token
    assert first == [draw(LOGITS, s.sampling_seed, 0, 1.0)]


def test_token_logprobs_are_the_models_distribution():
    logits = torch.stack([LOGITS, LOGITS.flip(0)]).float()
    out = token_logprobs(logits, [2, 0], [2, 0])
    lp = torch.log_softmax(logits.float(), -1)
    assert out[0][0] == pytest.approx(float(lp[0, 2]), abs=1e-7) and out[1][0] == pytest.approx(float(lp[1, 0]), abs=1e-7)
    assert [t for t, _ in out[0][1]] == [1, 3] and out[1][1] == []
    assert out[0][1][0][1] == pytest.approx(float(lp[0, 1]), abs=1e-7)
    assert token_logprobs(logits, [1, 1], [0, 0]) == [(pytest.approx(float(lp[0, 1])), []),
                                                      (pytest.approx(float(lp[1, 1])), [])]
    assert [t for t, _ in token_logprobs(logits, [0, 0], [4, 1])[0][1]] == [1, 3, 2, 0]
    assert token_logprobs(logits[:0], [], []) == []


# ---- StateTransfer ---------------------------------------------------------------------------

@pytest.fixture(params=["float64", "float32", "bfloat16"])
def state(toy_weights, request):
    eng = H.make_engine(toy_weights, request.param, num_images=3, enable_prefix_caching=True,
                        encoder_swa_bounded_replay=False)
    st = eng.runner.state
    c = st.cache
    g = torch.Generator().manual_seed(0)
    c.image_ring.copy_(torch.randn(c.image_ring.shape, generator=g, dtype=torch.float64).to(c.image_ring.dtype))
    c.image_cursor.copy_(torch.randint(0, 99, c.image_cursor.shape, generator=g))
    return st


def test_mode_is_checked(state):
    with pytest.raises(ValueError, match="copy"):
        StateTransfer(state.cache, "swap")


def test_a_sealed_image_is_valid_only_as_it_was(state):
    c, W = state.cache, state.W
    state.seal(0, 32)
    state.seal(1, 64)
    assert state.meta[1][:2] == (c.geo.layout_id, 64) and state.stats["images_stored"] == 2
    assert state.valid(1, 64) and state.stats["images_refused"] == 0
    assert not state.valid(1, 32) and not state.valid(0, 64) and state.stats["images_refused"] == 2
    assert state.valid(0, 32)
    for alter in (lambda: c.image_ring[3, W + 5, 7].add_(1), lambda: c.image_ring[0, 2 * W - 1, 0].neg_(),
                  lambda: c.image_cursor[1, 2].add_(1), lambda: c.image_cursor[1, 0].add_(1)):
        keep = (c.image_ring.clone(), c.image_cursor.clone())
        alter()
        assert not state.valid(1, 64)
        c.image_ring.copy_(keep[0]), c.image_cursor.copy_(keep[1])
        assert state.valid(1, 64)
    c.image_ring[:, :W].add_(1)                           # another image's rows do not matter
    c.image_ring[:, 2 * W:].add_(1)
    assert state.valid(1, 64)
    state.forget(1)
    assert not state.valid(1, 64)
    state.forget(1)                                       # forgetting twice is harmless


def test_restore_copies_every_layer_and_the_cursor_into_the_slot(state):
    c, W = state.cache, state.W
    ring = c.ring.clone()
    state.restore(0, 2)
    state.restore(2, 1)
    assert torch.equal(c.ring[:, W:2 * W], c.image_ring[:, 2 * W:3 * W])
    assert torch.equal(c.ring[:, :W], ring[:, :W]) and torch.equal(c.ring[:, 3 * W:], ring[:, 3 * W:])
    assert torch.equal(c.ring[:, 2 * W:3 * W], c.image_ring[:, :W]) and torch.equal(c.cursor[2], c.image_cursor[0])
    assert torch.equal(c.cursor[1], c.image_cursor[2]) and state.stats["images_restored"] == 2
