"""Property-based run of the scheduler and runner: hypothesis drives arrivals, cancellations,
preemptions and steps; after every step no page or slot is leaked or shared, and every request
that was not cancelled finishes with its uninterrupted greedy tokens."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.sequence import SamplingParams, Status
from tests import harness as H

LENS = (3, 16, 21, 40, 7, 33)
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def pool():
    return H.prompts(LENS, seed=11)


@pytest.fixture(scope="module")
def expected(toy_weights, pool):
    return H.run(toy_weights, pool, MAX_TOKENS)


action = st.one_of(st.tuples(st.just("arrive"), st.integers(0, len(LENS) - 1)),
                   st.tuples(st.just("cancel"), st.integers(0, len(LENS) - 1)),
                   st.tuples(st.just("preempt"), st.integers(0, 7)),
                   st.tuples(st.just("step"), st.integers(1, 3)))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=st.lists(action, min_size=4, max_size=24), seqs=st.sampled_from([2, 3, 8]),
       budget=st.sampled_from([9, 40, 512]), pages=st.sampled_from([6, 64]))
def test_random_schedules_keep_invariants(toy_weights, pool, expected, actions, seqs, budget, pages):
    eng = H.make_engine(toy_weights, max_num_seqs=seqs, max_num_batched_tokens=budget, num_pages=pages,
                        max_prefill_chunk=16)
    live, cancelled, n = {}, set(), 0
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)

    def check():
        running = [s for s in live.values() if s.status is not Status.FINISHED]
        eng.bm.check(running)
        slots = [s.slot for s in eng.scheduler.running]
        assert len(slots) == len(set(slots)) and None not in slots

    for kind, arg in actions + [("drain", 0)]:
        if kind == "arrive" and arg not in live:
            live[arg] = eng.add_request(pool[arg], params, request_id=f"p{arg}")
        elif kind == "cancel" and arg in live and live[arg].status is not Status.FINISHED:
            assert eng.abort(f"p{arg}")
            cancelled.add(arg)
        elif kind == "preempt" and eng.scheduler.running:
            eng.scheduler.preempt(eng.scheduler.running[arg % len(eng.scheduler.running)])
        elif kind in ("step", "drain"):
            for _ in range(arg if kind == "step" else 10_000):
                if not eng.has_unfinished():
                    break
                eng.step()
                n += 1
                check()
        check()
    assert eng.bm.all_free and not eng.has_unfinished()
    for i, seq in live.items():
        if i not in cancelled:
            assert seq.completion_token_ids == expected[i], f"request {i}"
