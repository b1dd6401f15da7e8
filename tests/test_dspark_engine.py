"""DSpark in the engine (runtime/spec_step.py, docs/dspark.md §1-§2), float64 toy (W = 16, PAGE = 32):
greedy tokens with DSpark equal the same engine's without it, and the STATE slot after verify
steps is plain decode's. Random toy weights make the real draft's proposals almost always
wrong, so most tests also replace them ("oracle drafts") with the plain run's next tokens,
the first j of the 5 right and the rest wrong (j random in 0..5): every accepted count, and
stops and lengths landing inside an accepted run, are exercised. The real draft still runs
every step (its proposals are then overwritten)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from runtime.sequence import SamplingParams
from tests import harness as H

LENS = (5, 16, 17, 33, 9, 64, 40)       # < W, = W, > PAGE, several PAGEs
DSPARK = {"speculative_method": "dspark"}


@pytest.fixture(scope="module")
def reqs():
    return H.prompts(LENS, seed=5)


@pytest.fixture(scope="module")
def baseline(toy_weights, reqs):
    return H.run(toy_weights, reqs, max_tokens=14)


def oracle_drafts(eng, want: dict, seed: int = 0, right=None):
    """Make eng's drafts the plain run's next tokens (`want`: request id -> completion), the
    first j right (j random in 0..5, or `right`), the rest off by one."""
    rng, spec, real = random.Random(seed), eng.runner.spec, eng.runner.spec.propose

    def propose(seqs):
        real(seqs)
        for s in seqs:
            if not s.spec_token_ids:
                continue
            g = len(s.completion_token_ids)
            truth = (want[s.request_id] + [7] * 6)[g:g + 5]
            j = rng.randint(0, 5) if right is None else right
            s.spec_token_ids = truth[:j] + [(t + 1) % 1000 for t in truth[j:]]
    spec.propose = propose


def run_dspark(weights, reqs, baseline, max_tokens=14, seed=0, oracle=True, hook=None, arrivals=None,
               params=None, **engine):
    """H.run with DSpark (and oracle drafts): tokens per request index, the engine."""
    eng = H.make_engine(weights, **DSPARK, **engine)
    if oracle:
        oracle_drafts(eng, {f"r{i}": t for i, t in baseline.items()}, seed)
    rng, arrive = random.Random(seed), arrivals or [0] * len(reqs)
    live, step, cancelled = {}, 0, set()
    params = params or SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    while len(live) < len(reqs) or eng.has_unfinished():
        for i in range(len(reqs)):
            if i not in live and arrive[i] <= step:
                live[i] = eng.add_request(reqs[i], params, request_id=f"r{i}")
        if hook is not None:
            cancelled |= set(hook(eng, live, step, rng) or ())
        eng.step()
        step += 1
        assert step < 2000
    eng.bm.check([])
    assert eng.bm.all_free, "pages or slots leaked"
    return {i: s.completion_token_ids for i, s in live.items() if i not in cancelled}, eng


def test_real_draft_tokens_equal_plain(toy_weights, reqs, baseline):
    """The real draft (its proposals, whatever their quality) changes no token."""
    got, eng = run_dspark(toy_weights, reqs, baseline, oracle=False)
    assert got == baseline
    assert eng.runner.spec.stats["drafts"] > 0


@pytest.mark.parametrize("engine", [{}, {"decoder_swa_bounded_replay": False}, {"max_prefill_chunk": 7}],
                         ids=["replay", "no-replay", "chunk7"])
def test_oracle_drafts_equal_plain(toy_weights, reqs, baseline, engine):
    """Accepted runs of every length, prompts arriving beside verify steps (mixed batches)."""
    if engine.get("decoder_swa_bounded_replay") is False:      # another model: its own tokens
        baseline = H.run(toy_weights, reqs, max_tokens=14, scenario=H.Scenario("plain", engine=engine))
    got, eng = run_dspark(toy_weights, reqs, baseline, arrivals=[0, 0, 2, 3, 5, 6, 9], **engine)
    assert got == baseline
    st = eng.runner.spec.stats
    assert st["accepted"] > st["drafts"] and st["acceptance_length"][6] > 0, st   # long runs happened


def test_stops_and_lengths_inside_an_accepted_run(toy_weights, reqs, baseline):
    """A stop token (and max_tokens) landing inside an accepted run ends the request there."""
    for i in (0, 3, 5):
        stop = baseline[i][6]
        cut = baseline[i][:baseline[i].index(stop) + 1]
        p = SamplingParams(max_tokens=14, stop_token_ids=[stop])
        got, _ = run_dspark(toy_weights, [reqs[i]], {0: baseline[i]}, params=p, seed=i)
        assert got[0] == cut
    for n in (1, 2, 7, 9):
        got, _ = run_dspark(toy_weights, reqs[:3], baseline, max_tokens=n, seed=n)
        assert got == {i: baseline[i][:n] for i in range(3)}


@pytest.mark.parametrize("phase", ["decode", "any"])
def test_preemption_mid_run(toy_weights, reqs, baseline, phase):
    got, eng = run_dspark(toy_weights, reqs, baseline, hook=H.preempt_randomly(0.25, phase), seed=4)
    assert got == baseline and eng.scheduler.num_preemptions > 0


def test_tight_pool_preempts_verify_steps(toy_weights, reqs, baseline):
    got, eng = run_dspark(toy_weights, reqs, baseline, num_pages=5, max_num_batched_tokens=64)
    assert got == baseline and eng.scheduler.num_preemptions > 0


def test_abort_mid_run(toy_weights, reqs, baseline):
    got, eng = run_dspark(toy_weights, reqs, baseline, hook=H.cancel_randomly(0.08), seed=2)
    assert len(got) < len(reqs)
    assert all(got[i] == baseline[i] for i in got)


@pytest.mark.parametrize("params", [dict(presence_penalty=0.5), dict(logit_bias={5: 2.0}), dict(min_tokens=10)],
                         ids=["penalty", "logit-bias", "min-tokens"])
def test_requests_that_do_not_draft(toy_weights, reqs, params):
    """Penalties, logit bias and a pending min_tokens keep a sampled request off drafts (one
    token per step, Sequence.may_draft): its seeded tokens are the plain engine's. (Sampled
    requests without them draft: tests/test_dspark_sampled.py.)"""
    p = SamplingParams(max_tokens=10, temperature=0.8, seed=3, **params)
    plain = H.make_engine(toy_weights)
    a = plain.add_request(reqs[2], p)
    while plain.has_unfinished():
        plain.step()
    got, eng = run_dspark(toy_weights, [reqs[2]], {}, oracle=False, params=p)
    assert got[0] == a.completion_token_ids
    assert eng.runner.spec.stats["drafts"] == 0


def test_logprob_requests_are_refused(toy_weights, reqs):
    """Logprobs with DSpark are refused by name."""
    eng = H.make_engine(toy_weights, **DSPARK)
    with pytest.raises(ValueError, match="logprobs"):
        eng.add_request(reqs[0], SamplingParams(), logprobs=2)


def _slot_state(eng, seq):
    c, W, n = eng.runner.cache, eng.cfg.sliding_window, eng.cfg.num_hidden_layers
    P = seq.num_computed - 1                       # last committed position
    pos = np.arange(max(0, P - W + 1), P + 1)
    rows = torch.as_tensor(seq.slot * W + pos % W)
    tails = [(o.tail_v[seq.slot].clone(), o.tail_g[seq.slot].clone()) for o in c.owners.values() if o.tail_v is not None]
    return c.ring[:n, rows].clone(), tails, c.cursor[seq.slot].clone(), P


@pytest.mark.parametrize("length", [17, 40])
def test_state_after_verify_steps_is_plain_decode(toy_weights, length):
    """After every verify step: the ring rows a later query can read, the ratio-2 tails and
    the cursor equal a plain decode's of the same tokens (rings and tails to 1e-12 relative:
    a 6-row forward's GEMMs round differently from 1-row ones; the cursor bit for bit); and
    every ring row the rollback restored holds, bit for bit, its bytes from before the step."""
    prompt = H.prompts((length,), seed=9)[0]
    p = SamplingParams(max_tokens=24, ignore_eos=True)
    plain, eng = H.make_engine(toy_weights), H.make_engine(toy_weights, **DSPARK)
    want = plain.add_request(prompt, p, request_id="x")
    while plain.has_unfinished():
        plain.step()
    oracle_drafts(eng, {"x": want.completion_token_ids}, seed=length)
    plain, ref = H.make_engine(toy_weights), None
    ref = plain.add_request(prompt, p, request_id="x")
    seq = eng.add_request(prompt, p, request_id="x")
    W, n, verified = eng.cfg.sliding_window, eng.cfg.num_hidden_layers, 0
    while eng.has_unfinished():
        c, slot = seq.num_computed, seq.slot
        before = eng.runner.cache.ring[:n].clone()
        drafts = list(seq.spec_token_ids)
        eng.step()
        if seq.is_finished:
            break
        if drafts and c >= length:
            verified += 1
            rej = np.arange(seq.num_computed, c + 1 + len(drafts))
            rows = torch.as_tensor(slot * W + rej % W)
            assert torch.equal(eng.runner.cache.ring[:n, rows], before[:, rows])
        while ref.num_computed < seq.num_computed:
            plain.step()
        got, want_state = _slot_state(eng, seq), _slot_state(plain, ref)
        assert got[3] == want_state[3]
        scale = float(want_state[0].abs().max())
        torch.testing.assert_close(got[0], want_state[0], rtol=1e-12, atol=1e-12 * scale)
        for (gv, gg), (wv, wg) in zip(got[1], want_state[1]):
            torch.testing.assert_close(gv, wv, rtol=1e-12, atol=1e-12 * float(wv.abs().max()))
            torch.testing.assert_close(gg, wg, rtol=1e-12, atol=1e-12 * float(wg.abs().max()))
        assert torch.equal(got[2], want_state[2])
    assert verified >= 3
    assert seq.completion_token_ids == want.completion_token_ids


def test_metrics_count_drafts_and_acceptances(toy_weights, reqs, baseline):
    """/metrics' DSpark series (runtime.metrics, docs/dspark.md §6) against counts taken from
    each commit's scheduled drafts and accepted counts."""
    from runtime.metrics import ServingMetrics, parse
    eng = H.make_engine(toy_weights, **DSPARK)
    oracle_drafts(eng, {f"r{i}": t for i, t in baseline.items()}, seed=6)
    spec, seen = eng.runner.spec, []
    commit = spec.commit

    def counted(sb, accepted):
        seen.extend((len(sb.drafts[i]), a) for i, a in accepted.items())
        commit(sb, accepted)
    spec.commit = counted
    m = ServingMetrics("toy")
    for i, p in enumerate(reqs[:4]):
        eng.add_request(p, SamplingParams(max_tokens=14, ignore_eos=True), request_id=f"r{i}")
    while eng.has_unfinished():
        eng.step()
        m.spec_decode(spec.stats)               # as the server does after every step
    got = parse(m.render())
    lab = '{model_name="toy"}'
    assert got["v41:spec_decode_num_drafts_total" + lab] == len(seen) > 5
    assert got["v41:spec_decode_num_draft_tokens_total" + lab] == sum(k for k, _ in seen)
    assert got["v41:spec_decode_num_accepted_tokens_total" + lab] == sum(a for _, a in seen) > 0
    for i in range(5):
        key = f'v41:spec_decode_num_accepted_tokens_per_pos_total{{model_name="toy",position="{i}"}}'
        assert got[key] == sum(a > i for _, a in seen)
    assert got["v41:spec_decode_acceptance_length_count" + lab] == len(seen)
    assert got["v41:spec_decode_acceptance_length_sum" + lab] == sum(1 + a for _, a in seen)
    assert got['v41:spec_decode_acceptance_length_bucket{le="1.0",model_name="toy"}'] == sum(a == 0 for _, a in seen)


@pytest.mark.parametrize("replay", [True, False], ids=["encoder-replay", "copy"])
def test_prefix_hits(toy_weights, replay):
    """Forks of a root prompt hit its cached PAGEs (encoder replay, or checkpoint images that
    carry the draft rings): tokens equal the same engine's without DSpark."""
    reqs = H.forks()[:7]
    engine = {"enable_prefix_caching": True, "encoder_swa_bounded_replay": replay}
    arrivals = [0] + [20] * (len(reqs) - 1)          # the root finishes first, in both engines
    base = H.run(toy_weights, reqs, 8, H.Scenario("plain", engine=engine, arrival_steps=arrivals))
    got, eng = run_dspark(toy_weights, reqs, base, max_tokens=8, arrivals=arrivals, **engine)
    assert got == base and eng.bm.stats["hit_tokens"] > 0
    if not replay:
        assert eng.runner.state.stats["images_restored"] > 0


@pytest.mark.parametrize("forced", [None, 3.51], ids=["oracle-drafts", "forced-acceptance"])
def test_spec_step_copies_through_the_step_buffers(toy_weights, reqs, baseline, monkeypatch, forced):
    """Every row index and token a DSpark step sends to the device (stage, keep_context, accept,
    commit, roll_back) goes through the step buffers (`spec_*`: pinned mirrors, non-blocking copies), never
    a pageable torch.as_tensor / torch.tensor copy, which waits for the stream (keep_context runs
    while the target's forward may still run on the GPU)."""
    pageable, puts, inside = [], [], [0]
    for name in ("as_tensor", "tensor"):
        fn = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _fn=fn, _n=name, **k: (inside[0] and pageable.append(_n), _fn(*a, **k))[1])

    def counted(fn):
        def call(*a, **k):
            inside[0] += 1
            try:
                return fn(*a, **k)
            finally:
                inside[0] -= 1
        return call

    def hook(eng, live, step, rng):
        spec, bufs = eng.runner.spec, eng.runner.bufs
        if "commit" in vars(spec):
            return
        for phase in ("stage", "keep_context", "accept", "commit", "roll_back"):
            setattr(spec, phase, counted(getattr(spec, phase)))
        put = bufs.put
        bufs.put = lambda name, a: (puts.append(name), put(name, a))[1]

    engine = {} if forced is None else {"spec_decode_acceptance_length": forced}
    got, eng = run_dspark(toy_weights, reqs, baseline, hook=hook, oracle=forced is None, **engine)
    if forced is None:
        assert got == baseline
    assert eng.runner.spec.stats["accepted"] > 0
    assert not pageable, pageable
    want = {"spec_verify_ring", "spec_ctx_pos", "spec_ctx_dest", "spec_last", "spec_verify_rows", "spec_verify_drafts",
            "spec_rejected", "spec_tail_slots", "spec_tail_rows", "spec_cursor_slots", "spec_cursors",
            "spec_accepted_dest"} | ({"spec_forced"} if forced else set())
    assert want <= set(puts), want - set(puts)


def test_roll_back_runs_while_the_draft_runs(toy_weights, reqs, baseline):
    """A verify step's roll-back of the target (rejected ring rows, staged tails, cursors) is
    queued after the next draft's launch, so the host does it while the device drafts, and
    before the drafts are read; requests that finish in the step are skipped, and the tokens
    stay plain decode's."""
    log = []

    def hook(eng, live, step, rng):
        spec = eng.runner.spec
        if "roll_back" in vars(spec):
            return
        forward, roll_back, put = spec.draft.forward, spec.roll_back, eng.runner.bufs.put
        spec.draft.forward = lambda *a, **k: (log.append("draft"), forward(*a, **k))[1]
        spec.roll_back = lambda: (log.append("roll_back" if spec._rollback is not None else "-"), roll_back())[1]
        eng.runner.bufs.put = lambda name, a: (log.append(name) if name == "spec_cursors" else None, put(name, a))[1]

    got, eng = run_dspark(toy_weights, reqs, baseline, hook=hook)
    assert got == baseline
    rolls = [i for i, e in enumerate(log) if e == "roll_back"]
    assert 0 < log.count("spec_cursors") <= len(rolls)        # none when every request finished
    # each roll-back follows a draft launch, unless no request drafts any more (the last steps)
    drafted = [i for i in rolls if "draft" in log[i:]]
    assert len(drafted) >= 3 and all(log[i - 1] == "draft" for i in drafted), log
    assert eng.runner.spec._rollback is None and eng.bm.all_free


def test_drafts_launched_ahead_are_the_drafts_launched_after(toy_weights, reqs, baseline):
    """In a step where every request that samples verified, the commit's scatter and the next
    drafts run from the verdicts on the device (SpecStep._draft_ahead). Two engines in
    lockstep over the same requests and oracle drafts, one never drafting ahead: after every
    step their draft rings are bit-equal and the real draft proposed the same tokens (the
    anchors and their positions taken on the device are the host's)."""
    engs, proposed, ahead = [], ([], []), [0]
    for i in range(2):
        eng = H.make_engine(toy_weights, **DSPARK)
        spec = eng.runner.spec
        if i == 1:
            spec._fits_ahead = lambda verify, seqs: False
        else:
            launch = spec._draft_ahead
            spec._draft_ahead = lambda *a: (ahead.__setitem__(0, ahead[0] + 1), launch(*a))[1]
        real = spec.propose

        def recorded(seqs, _real=real, _out=proposed[i], _eng=eng):
            _real(seqs)
            _out.append({s.request_id: list(s.spec_token_ids) for s in _eng.seqs.values()})
        spec.propose = recorded
        oracle_drafts(eng, {f"r{j}": t for j, t in baseline.items()}, seed=2)
        engs.append(eng)
    p = SamplingParams(max_tokens=14, ignore_eos=True)
    live = [[e.add_request(r, p, request_id=f"r{j}") for j, r in enumerate(reqs)] for e in engs]
    n = engs[0].cfg.num_hidden_layers
    while engs[0].has_unfinished():
        for e in engs:
            e.step()
        assert torch.equal(engs[0].runner.cache.ring[n:], engs[1].runner.cache.ring[n:])
        assert proposed[0][-1] == proposed[1][-1]
    assert not engs[1].has_unfinished() and ahead[0] >= 5
    for seqs in live:
        assert {j: s.completion_token_ids for j, s in enumerate(seqs)} == baseline


def test_steps_whose_every_token_is_verified_do_not_sample(toy_weights, reqs, baseline):
    """A step where acceptance chose every request's token (every final request verified)
    launches no sampling; a step with any other final request samples."""
    now, verified_all, sampled = [0], {}, set()

    def hook(eng, live, step, rng):
        now[0] = step
        if "_sample" in vars(eng):
            return
        sample, accept = eng._sample, eng.runner.spec.accept
        eng._sample = lambda rows, seqs, *a: (sampled.add(now[0]), sample(rows, seqs, *a))[1]

        def counted(rows, drafts, seqs, *ahead):
            last, verified = accept(rows, drafts, seqs, *ahead)
            verified_all[now[0]] = len(verified) == len(seqs)
            return last, verified
        eng.runner.spec.accept = counted

    got, eng = run_dspark(toy_weights, reqs, baseline, hook=hook)
    assert got == baseline
    every = {st for st, v in verified_all.items() if v}
    assert len(every) >= 2 and len(verified_all) > len(every), verified_all
    assert not every & sampled
    assert set(verified_all) - every <= sampled
