"""DSpark's sampled verification in the engine (runtime/spec_step.py `SpecStep._draws`,
docs/dspark.md §5), float64 toy: the drafts are matched against the plain sampler's own draw at
each row, so a seeded request's tokens are the plain engine's, and the output follows the
target's distribution.

Statistics: 512 seeded requests of one prompt (temperature 0.9, top-k 3, so the first three
tokens take 27 values), with DSpark and without; the empirical distribution of the first three
generated tokens against the target's exact one, P(t1) P(t2 | t1) P(t3 | t1, t2), computed from
the plain engine's logits by `runtime.sampler.probs`. Pearson's chi-square, cells of expected
count below 5 pooled, against its 0.999 quantile (Wilson-Hilferty, within 0.5% of the exact
one and above it): each comparison's false-alarm rate is at most 1e-3, and the seeds are fixed,
so a run is repeatable. The toy's random draft rarely proposes a likely token, so the drafts
are replaced by the target's most likely token at each known context ("argmax drafts"):
accepted about half the time, so acceptances, rejections with their residual draws, and
bonus tokens all occur. Half the requests stop at 3 tokens (one draft: a test, then a bonus or
a plain draw), half at 4 (two drafts: two tests). The same statistic rejects a wrong
acceptance (accept every draft) on the same requests: the test can fail.

Then: seeded requests (temperature, top-k, top-p, min-p, beside greedy ones) give the plain
engine's tokens in ragged batches, with chunked prompts, preemption and a step budget that
cuts drafts; the STATE slot after sampled verify steps is a plain decode's of the same tokens;
no page or slot leaks."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

import runtime.spec_step
from runtime.sampler import probs
from runtime.sequence import SamplingParams
from tests import harness as H
from tests.test_dspark_engine import DSPARK, LENS, _slot_state, oracle_drafts

TEMPERATURE, TOP_K = 0.9, 3
PROMPT = H.prompts((4,), seed=21)[0]      # not shorter: float64 subnormals slow the toy's first positions
N = 512
Z_999 = 3.090232306167813                 # the standard normal's 0.999 quantile


def params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=3 + i % 2, temperature=TEMPERATURE, top_k=TOP_K, seed=1000 + i, ignore_eos=True)


@pytest.fixture(scope="module")
def exact(toy_weights):
    """context (tokens after PROMPT) -> the sampling distribution of the next token, for every
    context of up to two tokens the filters allow."""
    eng = H.make_engine(toy_weights, max_num_seqs=16, max_model_len=32)
    dist = {}

    def level(ctxs):
        for c in ctxs:
            eng.add_request(PROMPT + list(c), SamplingParams(max_tokens=1, ignore_eos=True))
        sb = eng.scheduler.schedule()
        assert len(sb.seqs) == len(ctxs) and all(sb.is_final_chunk)
        rows = eng.runner.run(sb, final_only=True)
        eng.scheduler.postprocess(sb, {s.seq_id: 0 for s in sb.seqs})
        for c, row in zip(ctxs, rows):
            dist[c] = probs(row, TEMPERATURE, TOP_K, 1.0)

    support = lambda c: torch.nonzero(dist[c]).flatten().tolist()  # noqa: E731
    level([()])
    level([(a,) for a in support(())])
    level([(a, b) for a in support(()) for b in support((a,))])
    assert not eng.has_unfinished()
    return dist


def argmax_drafts(eng, dist):
    """Each draft the target's most likely token where its context is known (the rest: the
    real draft's proposals)."""
    real = eng.runner.spec.propose

    def propose(seqs):
        real(seqs)
        for s in seqs:
            ctx, d = tuple(s.completion_token_ids), list(s.spec_token_ids)
            for i in range(len(d)):
                if ctx not in dist:
                    break
                d[i] = int(dist[ctx].argmax())
                ctx += (d[i],)
            s.spec_token_ids = d
    eng.runner.spec.propose = propose


def first_three(weights, dist, dspark: bool, n: int = N):
    eng = H.make_engine(weights, max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=32,
                        **(DSPARK if dspark else {}))
    if dspark:
        argmax_drafts(eng, dist)
    seqs = [eng.add_request(PROMPT, params(i), request_id=f"r{i}") for i in range(n)]
    while eng.has_unfinished():
        eng.step()
    eng.bm.check([])
    assert eng.bm.all_free, "pages or slots leaked"
    return [tuple(s.completion_token_ids[:3]) for s in seqs], eng


def chi_square(samples: list, dist: dict) -> tuple[float, float]:
    """(statistic, its 0.999 quantile) of the samples against P(t1) P(t2|t1) P(t3|t1,t2)."""
    want = {}
    for t1, p1 in enumerate(dist[()].tolist()):
        for t2, p2 in enumerate(dist[(t1,)].tolist() if p1 else ()):
            for t3, p3 in enumerate(dist[(t1, t2)].tolist() if p2 else ()):
                if p3:
                    want[(t1, t2, t3)] = p1 * p2 * p3 * len(samples)
    got = Counter(samples)
    assert set(got) <= set(want), f"filtered tokens came out: {set(got) - set(want)}"
    small = [c for c in want if want[c] < 5]
    cells = [(got[c], want[c]) for c in want if want[c] >= 5]
    cells.append((sum(got[c] for c in small), sum(want[c] for c in small)))
    stat = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    df = sum(e > 0 for _, e in cells) - 1
    return stat, df * (1 - 2 / (9 * df) + Z_999 * math.sqrt(2 / (9 * df))) ** 3


@pytest.fixture(scope="module")
def plain_run(toy_weights, exact):
    return first_three(toy_weights, exact, dspark=False)[0]


def test_sampled_tokens_follow_the_target(toy_weights, exact, plain_run):
    """With DSpark and without, the first three tokens' distribution is the target's, and
    with DSpark every request's tokens are the plain engine's (drafts accepted and rejected)."""
    stat, crit = chi_square(plain_run, exact)
    assert stat < crit, ("plain", stat, crit)
    got, eng = first_three(toy_weights, exact, dspark=True)
    stat, crit = chi_square(got, exact)
    assert stat < crit, ("dspark", stat, crit)
    assert got == plain_run
    st = eng.runner.spec.stats
    hist = st["acceptance_length"]
    assert hist[1] > N // 10 and hist[2] > N // 10 and hist[3] > N // 20, st   # rejected, 1 and 2 accepted


def test_a_wrong_acceptance_fails_the_same_statistic(toy_weights, exact, monkeypatch):
    """Accepting every draft (then the draw at the last row) on the first 128 of the same
    requests: the statistic passes its critical value. The test above can fail."""
    def accept_all(tokens, d):
        return torch.full((d.shape[0],), d.shape[1], dtype=torch.long), tokens[:, -1]
    monkeypatch.setattr(runtime.spec_step, "match_accept", accept_all)
    got, _ = first_three(toy_weights, exact, dspark=True, n=128)
    stat, crit = chi_square(got, exact)
    assert stat > crit, (stat, crit)


def _run(weights, reqs, want: dict | None = None, **engine):
    """The DSpark engine on `reqs` [(prompt, params)]: completions; drafts from `want` (request
    id -> tokens, all five drafts taken from it) when given."""
    eng = H.make_engine(weights, **DSPARK, **engine)
    if want is not None:
        oracle_drafts(eng, want, right=5)
    seqs = [eng.add_request(p, sp, request_id=f"q{i}") for i, (p, sp) in enumerate(reqs)]
    while eng.has_unfinished():
        eng.step()
    eng.bm.check([])
    assert eng.bm.all_free, "pages or slots leaked"
    return [s.completion_token_ids for s in seqs], eng


def greedy_tokens(weights, prompts: list, max_tokens: int) -> dict:
    """request id -> the plain engine's greedy tokens: drafts a low-temperature sampled request
    accepts until it draws a token other than the most likely one."""
    return {f"q{i}": t for i, t in H.run(weights, prompts, max_tokens).items()}


SEEDED = [SamplingParams(max_tokens=14, temperature=0.8, seed=1, ignore_eos=True),
          SamplingParams(max_tokens=14, temperature=1.1, top_k=5, seed=2, ignore_eos=True),
          SamplingParams(max_tokens=14, ignore_eos=True),                                      # greedy
          SamplingParams(max_tokens=14, temperature=0.9, top_p=0.8, seed=3, ignore_eos=True),
          SamplingParams(max_tokens=11, temperature=1.0, min_p=0.05, seed=4, ignore_eos=True),
          SamplingParams(max_tokens=14, temperature=0.7, top_k=4, top_p=0.9, min_p=0.02, seed=5, ignore_eos=True),
          SamplingParams(max_tokens=9, temperature=1.3, seed=6, ignore_eos=True)]
ARRIVALS = [0, 0, 2, 3, 5, 6, 9]


def _seeded_run(weights, reqs, dspark: bool, want: dict | None = None, hook=None, **engine):
    """Every request with its SEEDED params, arriving at ARRIVALS: completions, the engine, and
    (with DSpark) how many verify steps the step budget cut short."""
    eng = H.make_engine(weights, **(DSPARK if dspark else {}), **engine)
    cut = 0             # verify steps that checked fewer drafts than max_tokens allows: the step budget's cut
    if want is not None:
        oracle_drafts(eng, want, seed=3)
        accept = eng.runner.spec.accept

        def counted(rows, drafts, seqs, *ahead):
            nonlocal cut
            for d, s in zip(drafts, seqs):
                left = s.params.max_tokens - (len(s.token_ids) - s.num_prompt_tokens) - 1
                cut += 0 < len(d) < min(5, left)
            return accept(rows, drafts, seqs, *ahead)
        eng.runner.spec.accept = counted
    rng, live, step = random.Random(4), {}, 0
    while len(live) < len(reqs) or eng.has_unfinished():
        for i in range(len(reqs)):
            if i not in live and ARRIVALS[i] <= step:
                live[i] = eng.add_request(reqs[i], SEEDED[i], request_id=f"r{i}")
        if hook is not None:
            hook(eng, live, step, rng)
        eng.step()
        step += 1
        assert step < 2000
    eng.bm.check([])
    assert eng.bm.all_free, "pages or slots leaked"
    return {i: s.completion_token_ids for i, s in live.items()}, eng, cut


@pytest.fixture(scope="module")
def seeded_plain(toy_weights):
    reqs = H.prompts(LENS, seed=5)
    return reqs, _seeded_run(toy_weights, reqs, dspark=False)[0]


@pytest.mark.parametrize("case", ["batch", "chunk7", "preempt", "tight-budget"])
def test_seeded_tokens_equal_plain(toy_weights, seeded_plain, case):
    """Seeded sampled requests (temperature, top-k, top-p, min-p) beside a greedy one, ragged
    prompts arriving beside verify steps: with DSpark each gives the plain engine's tokens,
    with prompts in chunks of 7, with requests preempted mid-stream, and with a step budget of
    8 tokens that cuts verify steps short (fewer drafts checked, the case that changed a seeded
    request's tokens when acceptance had uniforms of its own). Drafts: the plain tokens, the
    first j of five right (j random), so runs of every length are accepted and rejected."""
    reqs, plain = seeded_plain
    engine = {"chunk7": {"max_prefill_chunk": 7}, "tight-budget": {"max_num_batched_tokens": 8}}.get(case, {})
    hook = H.preempt_randomly(0.2, "decode") if case == "preempt" else None
    got, eng, cut = _seeded_run(toy_weights, reqs, dspark=True, want={f"r{i}": t for i, t in plain.items()},
                                hook=hook, **engine)
    assert got == plain
    st = eng.runner.spec.stats
    assert st["accepted"] > st["drafts"] and st["acceptance_length"][1] > 0, st      # long runs and rejections
    if case == "preempt":
        assert eng.scheduler.num_preemptions > 0
    assert (cut > 0) == (case == "tight-budget"), cut


def test_state_after_sampled_verify_steps_is_plain_decode(toy_weights):
    """After every sampled verify step the STATE slot (readable ring rows, tails, cursor)
    equals a plain engine's that decoded the same tokens (its draws replaced by them), as in
    tests/test_dspark_engine.py's greedy state check."""
    prompt = H.prompts((21,), seed=4)[0]
    p = SamplingParams(max_tokens=24, temperature=0.1, top_k=2, seed=11, ignore_eos=True)
    want = greedy_tokens(toy_weights, [prompt], 24)
    (tokens,), _ = _run(toy_weights, [(prompt, p)], want)
    eng = H.make_engine(toy_weights, **DSPARK)
    oracle_drafts(eng, want, right=5)
    seq, verified = follow_with_plain(toy_weights, eng, prompt, p, tokens)
    assert seq.completion_token_ids == tokens          # the second run: the same tokens
    st = eng.runner.spec.stats
    assert verified >= 3 and st["accepted"] > 0 and st["acceptance_length"][1] > 0, st


def follow_with_plain(weights, eng, prompt: list, p: SamplingParams, tokens: list):
    """Run `prompt` on the DSpark engine `eng`; after every step, check its STATE slot against a
    plain engine's that decoded the same `tokens` (its draws replaced by them): readable ring
    rows and tails to 1e-12 relative, the cursor bit for bit. Returns (the request, the number
    of verify steps)."""
    plain = H.make_engine(weights)
    plain._sample = lambda rows, seqs, *_: ([tokens[len(s.completion_token_ids)] for s in seqs], {})
    seq, ref = eng.add_request(prompt, p, request_id="q0"), plain.add_request(prompt, p, request_id="q0")
    verified = 0
    while eng.has_unfinished():
        drafts = list(seq.spec_token_ids)
        eng.step()
        if seq.is_finished:
            break
        verified += bool(drafts)
        while ref.num_computed < seq.num_computed:
            plain.step()
        got, exp = _slot_state(eng, seq), _slot_state(plain, ref)
        assert got[3] == exp[3]
        torch.testing.assert_close(got[0], exp[0], rtol=1e-12, atol=1e-12 * float(exp[0].abs().max()))
        for (gv, gg), (wv, wg) in zip(got[1], exp[1]):
            torch.testing.assert_close(gv, wv, rtol=1e-12, atol=1e-12 * float(wv.abs().max()))
            torch.testing.assert_close(gg, wg, rtol=1e-12, atol=1e-12 * float(wg.abs().max()))
        assert torch.equal(got[2], exp[2])
    eng.bm.check([])
    assert eng.bm.all_free, "pages or slots leaked"
    return seq, verified
