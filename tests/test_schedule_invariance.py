"""Schedule invariance (float64, no oracle): every scenario finishes with the tokens of the
uninterrupted run, and frees every page and slot."""
import pytest

from tests import harness as H

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def reqs():
    return H.prompts()


@pytest.fixture(scope="module")
def baseline(toy_weights, reqs):
    return H.run(toy_weights, reqs, MAX_TOKENS)


def check(out, baseline):
    kept = {i: t for i, t in out.items() if t is not None}
    assert kept == {i: baseline[i] for i in kept}


@pytest.mark.parametrize("chunk", [1, 7, 32, 97])
def test_chunk_sizes(toy_weights, reqs, baseline, chunk):
    check(H.run(toy_weights, reqs, MAX_TOKENS, H.Scenario(f"chunk{chunk}", engine={"max_prefill_chunk": chunk})),
          baseline)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_arrivals_and_batch_composition(toy_weights, reqs, baseline, seed):
    import random
    rng = random.Random(seed)
    sc = H.Scenario("arrivals", seed=seed, arrival_steps=[rng.randrange(0, 12) for _ in reqs],
                    engine={"max_num_seqs": rng.choice([2, 3, 5]), "max_num_batched_tokens": rng.choice([24, 61, 128]),
                            "max_prefill_chunk": rng.choice([None, 11])})
    check(H.run(toy_weights, reqs, MAX_TOKENS, sc), baseline)


def test_tight_page_pool_preempts(toy_weights, reqs, baseline):
    """Too few pages for everyone: the scheduler itself preempts and recomputes."""
    sc = H.Scenario("tight", engine={"num_pages": 10, "max_num_batched_tokens": 64})
    check(H.run(toy_weights, reqs, MAX_TOKENS, sc), baseline)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_forced_preemption(toy_weights, reqs, baseline, phase):
    sc = H.Scenario(f"preempt-{phase}", seed=3, hook=H.preempt_randomly(0.25, phase),
                    engine={"max_prefill_chunk": 16})
    check(H.run(toy_weights, reqs, MAX_TOKENS, sc), baseline)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_cancellation(toy_weights, reqs, baseline, seed):
    sc = H.Scenario("cancel", seed=seed, hook=H.cancel_randomly(0.04), engine={"max_prefill_chunk": 16},
                    arrival_steps=[i for i in range(len(reqs))])
    out = H.run(toy_weights, reqs, MAX_TOKENS, sc)
    assert any(t is None for t in out.values()) and any(t is not None for t in out.values())
    check(out, baseline)
