"""Prefix caching with complete request-state recovery (float64).

copy (checkpoint images): every scenario's greedy tokens equal the uninterrupted run's with
caching off. replay (encoder SWA bounded replay): tokens equal the oracle run with the same
replay truncation. No page, slot or image leaks."""
import pytest
import torch

from runtime.sequence import SamplingParams
from tests import harness as H
from tests.reference.oracle import Oracle
from tests.reference.replay import bounded_replay

MAX_TOKENS = 6
COPY = {"enable_prefix_caching": True, "encoder_swa_bounded_replay": False}
REPLAY = {"enable_prefix_caching": True, "encoder_swa_bounded_replay": True}


@pytest.fixture(scope="module")
def reqs():
    return H.forks()


@pytest.fixture(scope="module")
def baseline(toy_weights, reqs):
    return H.run(toy_weights, reqs, MAX_TOKENS)


def run_forks(weights, reqs, engine, hook=None, seed=0, arrivals=None):
    sc = H.Scenario("forks", engine={"max_prefill_chunk": 48, **engine}, hook=hook, seed=seed,
                    arrival_steps=arrivals or H.fork_arrivals(len(reqs)))
    return H.run(weights, reqs, MAX_TOKENS, sc)


def engine_after(weights, reqs, engine, hook=None):
    """Run the fork scenario and return the engine for its counters."""
    eng = H.make_engine(weights, max_prefill_chunk=48, **engine)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    seqs = [eng.add_request(reqs[0], params)]
    while eng.has_unfinished():
        eng.step()
    for r in reqs[1:]:
        seqs.append(eng.add_request(r, params))
    step = 0
    while eng.has_unfinished():
        if hook:
            hook(eng, {}, step, None)
        eng.step()
        step += 1
    eng.bm.check([])
    assert eng.bm.all_free
    return eng, seqs


def test_copy_forks_are_exact(toy_weights, reqs, baseline):
    assert run_forks(toy_weights, reqs, COPY) == baseline


def test_copy_hits_restore_images(toy_weights, reqs, baseline):
    eng, seqs = engine_after(toy_weights, reqs, COPY)
    st, bm = eng.runner.state.stats, eng.bm.stats
    for s, p in zip(seqs[1:], reqs[1:]):
        assert s.num_cached_tokens == (len(p) - 1) // H.PAGE * H.PAGE > 0  # whole PAGEs, never the last token
    # decoder bounded replay: a hit resumes at an image at or below the tail start, if any
    resumed = [s for s in seqs[1:] if min(s.num_cached_tokens, s.decoder_start) >= H.PAGE]
    assert st["images_restored"] == len(resumed) > 0 and st["images_refused"] == 0
    assert bm["hit_tokens"] == sum(s.num_cached_tokens for s in resumed)
    assert [s.completion_token_ids for s in seqs] == [baseline[i] for i in range(len(reqs))]


@pytest.mark.parametrize("mode", ["copy", "replay"])
def test_a_shared_page_after_another_prefix_is_not_reused(toy_weights, mode):
    """A = X+Y, then B = Z+Y, then C = Z+Y: C hits B's PAGEs, never A's copy of Y. Copy mode is
    exact, so every request's tokens equal the uncached run's; under replay C's tokens equal
    those of the same engine that never saw A."""
    reqs = H.cross_prefixes()
    engine = COPY if mode == "copy" else REPLAY
    cached = H.run_in_order(toy_weights, reqs, MAX_TOKENS, **engine)
    if mode == "copy":
        assert cached == H.run_in_order(toy_weights, reqs, MAX_TOKENS)
    else:
        assert cached[1:] == H.run_in_order(toy_weights, reqs[1:], MAX_TOKENS, **engine)


def test_copy_replays_from_a_missing_image(toy_weights, reqs, baseline):
    assert run_forks(toy_weights, reqs, COPY, hook=H.evict_images(keep_first=1)) == baseline
    eng, seqs = engine_after(toy_weights, reqs, COPY, hook=H.evict_images(keep_first=1))
    assert eng.scheduler.stats["replayed_rows"] > 0


@pytest.mark.parametrize("kind", ["bytes", "geometry"])
def test_corrupted_or_foreign_images_are_refused(toy_weights, reqs, baseline, kind):
    eng, seqs = engine_after(toy_weights, reqs, COPY, hook=H.corrupt_images(kind))
    assert eng.runner.state.stats["images_refused"] > 0 and eng.runner.state.stats["images_restored"] == 0
    assert [s.completion_token_ids for s in seqs] == [baseline[i] for i in range(len(reqs))]


def test_copy_preemption_restores(toy_weights, reqs, baseline):
    out = run_forks(toy_weights, reqs, COPY, hook=H.preempt_randomly(0.3), seed=5)
    assert out == baseline


def test_cancel_requests_with_shared_pages(toy_weights, reqs, baseline):
    out = run_forks(toy_weights, reqs, COPY, hook=H.cancel_randomly(0.08), seed=2)
    kept = {i: t for i, t in out.items() if t is not None}
    assert kept and len(kept) < len(reqs)
    assert kept == {i: baseline[i] for i in kept}


def test_eviction_under_a_small_pool(toy_weights, reqs, baseline):
    out = run_forks(toy_weights, reqs, {**COPY, "num_pages": 14, "num_images": 4, "max_num_seqs": 3})
    assert out == baseline


def test_replay_ttft_work_is_bounded(toy_weights, reqs):
    """A resumed forward computes at most the suffix plus one hash block."""
    eng = H.make_engine(toy_weights, **REPLAY)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    eng.add_request(reqs[0], params)
    while eng.has_unfinished():
        eng.step()
    for p in reqs[1:]:
        seq = eng.add_request(p, params)
        rows = 0
        while eng.has_unfinished():
            sb = eng.scheduler.schedule()
            rows += sum(n for s, n in zip(sb.seqs, sb.num_new) if s is seq)
            logits = eng.runner.run(sb)
            eng.scheduler.postprocess(sb, {seq.seq_id: int(logits[0].argmax())})
        hit = seq.num_cached_tokens
        assert hit > 0 and rows == len(p) - hit + H.PAGE <= len(p) - hit + H.PAGE
    assert eng.scheduler.stats["replayed_rows"] == H.PAGE * (len(reqs) - 1)
    eng.bm.check([])


def test_replay_forks_match_oracle_with_truncation(toy_weights, toy_token_map, reqs):
    out = run_forks(toy_weights, reqs, REPLAY)
    oracle = Oracle(H.preset_cfg(), toy_weights, dtype=torch.float64, index_plane="fp8", token_map=toy_token_map)
    for i in (0, 1, 4, 8, 10):      # the root (cold), forks sharing 1, 2 and 4 PAGEs, a page-aligned one
        p = reqs[i]
        hit = 0 if i == 0 else (len(p) - 1) // H.PAGE * H.PAGE
        if hit:
            oracle.forward(torch.tensor(p[:hit]))
            kw = dict(window_start=bounded_replay(oracle.cfg, len(p), hit - H.PAGE), cached=(hit, oracle.last))
        else:
            kw = dict(window_start=bounded_replay(oracle.cfg, len(p)))
        assert len(out[i]) == MAX_TOKENS and out[i] == oracle.greedy_after(p, out[i], **kw), f"request {i} (hit {hit})"
