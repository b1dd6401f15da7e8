"""The scheduler on its own (no model; sampled tokens are given): budgets, chunking, preemption,
prefix-cache resumes in both StateTransfer modes, image captures, cancellation and the commit
of a step, each asserted exactly. Fast, so mutation testing (docs/mutation.md) runs it for
every mutant."""
import pytest

from runtime.block_manager import BlockManager
from runtime.scheduler import Scheduler
from runtime.sequence import SamplingParams, Sequence, Status

P, EOS = 4, 2


class Images:
    """StateTransfer's bookkeeping as the scheduler sees it: which images are valid."""

    def __init__(self, mode, invalid=()):
        self.mode, self.invalid, self.forgotten = mode, set(invalid), []

    def valid(self, img, position):
        return img not in self.invalid

    def forget(self, img):
        self.forgotten.append(img)


def make(pages=32, slots=4, seqs=4, budget=16, chunk=None, mode=None, images=0, invalid=()):
    bm = BlockManager(pages, slots, P, max_pages_per_seq=8, prefix_caching=mode is not None,
                      num_images=images)
    state = Images(mode, invalid) if mode else None
    return Scheduler(bm, seqs, budget, EOS, max_prefill_chunk=chunk, state=state)


def add(sch, tokens, rid=None, **params) -> Sequence:
    s = Sequence(list(tokens), SamplingParams(**{"max_tokens": 4, **params}), rid)
    sch.add(s)
    return s


def cached_root(sch, root=tuple(range(3, 16))) -> list[int]:
    """A 13-token prompt run to completion alone, so its 3 full PAGEs are cached."""
    add(sch, root, max_tokens=1)
    step(sch)
    assert not sch.has_unfinished()
    return list(root)


def step(sch, token=7):
    """Schedule and commit one step, sampling `token` for every final chunk; `sb.began` keeps
    the positions the step started from."""
    sb = sch.schedule()
    sb.began, sb.final = sb.starts, sb.is_final_chunk
    done = sch.postprocess(sb, {s.seq_id: token for s, f in zip(sb.seqs, sb.is_final_chunk) if f})
    return sb, done


def test_running_first_then_waiting_under_the_token_budget_and_chunk():
    sch = make(budget=10, chunk=6)
    a, b, c = add(sch, range(3, 12)), add(sch, range(3, 8)), add(sch, range(3, 5))
    sb, _ = step(sch)
    assert sb.seqs == [a, b] and sb.num_new == [6, 4] and sb.began == [0, 0]
    assert sb.final == [False, False] and sb.scheduled_tokens == 10 and sb.scheduled_bs == 2
    assert sb.slots.tolist() == [a.slot, b.slot] and sb.block_tables.shape == (2, 8)
    assert [s.status for s in (a, b, c)] == [Status.RUNNING, Status.RUNNING, Status.WAITING]
    sb, _ = step(sch)
    assert sb.seqs == [a, b, c] and sb.num_new == [3, 1, 2] and sb.final == [True, True, True]
    sb, _ = step(sch)
    assert sb.num_new == [1, 1, 1] and sb.began == [9, 5, 2]   # decode rows
    assert a.token_ids[9:] == [7, 7] and a.num_computed == 10


def test_max_num_seqs_bounds_the_running_set():
    sch = make(seqs=2)
    a, b, c = (add(sch, [5, 6]) for _ in range(3))
    sb, _ = step(sch)
    assert sb.seqs == [a, b] and list(sch.waiting) == [c]


def test_the_newest_running_request_is_preempted_when_pages_run_out():
    sch = make(pages=5, budget=64)
    a, b = add(sch, range(3, 11)), add(sch, range(3, 11))   # 2 pages each
    step(sch)
    assert len(sch.bm.free_pages) == 1
    for _ in range(2):
        sb, _ = step(sch)                                     # a grows into the free page, then b's
    assert sch.num_preemptions == 1 and list(sch.waiting) == [b] and sch.running == [a]
    assert b.status is Status.WAITING and b.num_computed == 0 and b.pages == [] and b.slot is None
    assert b.token_ids[8:] == [7]                             # its sampled token is kept
    sch.bm.check([a])


def test_a_request_that_does_not_fit_keeps_waiting_with_nothing_held():
    sch = make(pages=2, budget=64, mode="replay")
    a = add(sch, range(3, 10))
    step(sch)
    b = add(sch, range(3, 14))                                # its hit is shared, then given back
    sb, _ = step(sch)
    assert sb.seqs == [a] and list(sch.waiting) == [b]
    assert b.pages == [] and b.num_computed == b.write_from == b.swa_floor == b.num_cached_tokens == 0
    assert b.resume is None
    sch.bm.check([a])


def test_replay_resumes_one_hash_block_below_the_hit():
    sch = make(mode="replay")
    root = cached_root(sch)
    b = add(sch, root[:12] + [99, 98])
    sb, _ = step(sch)
    assert b.num_cached_tokens == 12 and b.write_from == 12 and b.swa_floor == 8
    assert sb.began == [8] and sb.num_new == [6] and sb.resumes == [(0, ("replay",))]
    assert b.resume is None and sch.stats["replayed_rows"] == 4 and sch.bm.stats["hit_tokens"] == 12
    sb, _ = step(sch)
    assert sb.resumes == [] and sch.bm.stats["hit_tokens"] == 12


@pytest.mark.parametrize("invalid, start, forgotten, images", [((), 12, [], [0, 1, 2]), ((2,), 8, [2], [0, 1, 3]),
                                                             ((1, 2), 4, [2, 1], [0, 3, 2])])
def test_copy_resumes_at_the_newest_valid_image(invalid, start, forgotten, images):
    sch = make(mode="copy", images=4, invalid=invalid)
    root = list(range(3, 16))
    a = add(sch, root, max_tokens=1)
    sb = sch.schedule()
    assert sb.captures == [(0, 4, 0), (0, 8, 1), (0, 12, 2)]  # every full prompt PAGE boundary
    sch.postprocess(sb, {a.seq_id: 7})
    b = add(sch, root[:12] + [99])
    sb, _ = step(sch)
    assert b.num_computed == 13 and b.num_cached_tokens == 12 and b.write_from == 12
    assert sb.began == [start] and sch.stats["replayed_rows"] == 12 - start
    assert sb.resumes == [(0, ("image", start // P - 1))]
    assert sch.state.forgotten == forgotten
    # refused images went back to the free list; the resumed forward captures those PAGEs again
    assert [sch.bm.image_of[p] for p in b.pages[:3]] == images


def test_copy_without_any_image_recomputes_from_zero():
    sch = make(mode="copy", images=0)
    root = list(range(3, 12))
    add(sch, root, max_tokens=1)
    step(sch)
    b = add(sch, root)
    sb, _ = step(sch)
    assert sb.began == [0] and sb.resumes == [] and b.num_cached_tokens == 8 and b.write_from == 8


def test_captures_cover_the_boundaries_each_chunk_crosses():
    sch = make(mode="copy", images=8, chunk=7)
    a = add(sch, range(3, 16))                                # prompt 13: boundaries 4, 8, 12
    got = []
    while a.num_computed < 13:
        sb, _ = step(sch)
        got.append([(e, i) for _, e, i in sb.captures])
    assert got == [[(4, 0)], [(8, 1), (12, 2)]]               # chunks 0-7 (ends next to 8), 7-13
    sb, _ = step(sch)
    assert sb.captures == []                                  # decode crosses no prompt boundary


def test_postprocess_finishes_on_eos_stop_ids_and_length():
    sch = make()
    a, b, c = add(sch, [5]), add(sch, [5], stop_token_ids=[9]), add(sch, [5], max_tokens=2)
    d = add(sch, [5], ignore_eos=True, max_tokens=3)
    sb = sch.schedule()
    done = sch.postprocess(sb, {a.seq_id: EOS, b.seq_id: 9, c.seq_id: 8, d.seq_id: EOS})
    assert done == [a, b] and a.finish_reason == b.finish_reason == "stop"
    assert a.status is Status.FINISHED and a.pages == [] and a.slot is None
    sb, done = step(sch, token=8)
    assert done == [c] and c.finish_reason == "length" and c.completion_token_ids == [8, 8]
    sb, done = step(sch, token=EOS)
    assert done == [d] and d.finish_reason == "length" and d.completion_token_ids == [EOS, 8, EOS]
    assert not sch.has_unfinished() and sch.bm.all_free


def test_postprocess_skips_requests_cancelled_or_preempted_after_scheduling():
    sch = make(mode="replay", budget=32)
    a, b, c = add(sch, range(3, 12), "a"), add(sch, range(3, 12), "b"), add(sch, [5], "c", max_tokens=1)
    sb = sch.schedule()
    sch.preempt(b)
    assert sch.abort("a") is a and a.finish_reason == "abort"
    assert sch.postprocess(sb, {a.seq_id: 7, b.seq_id: 7, c.seq_id: 7}) == [c]   # c still commits
    assert a.num_computed == 0 and b.num_computed == 0 and b.token_ids == list(range(3, 12))
    assert sch.bm.cached == {}                                # nothing published
    sch.bm.check([])


def test_abort_finds_requests_wherever_they_are():
    sch = make(seqs=1)
    a, b = add(sch, [5, 6], "a"), add(sch, [5, 6], "b")
    step(sch)
    assert sch.abort("b") is b and list(sch.waiting) == []
    assert sch.abort("a") is a and sch.running == [] and sch.bm.all_free
    assert sch.abort("a") is None and sch.abort("x") is None
    assert a.status is b.status is Status.FINISHED


def test_preempt_puts_the_request_first_in_line():
    sch = make(seqs=1)
    a, b = add(sch, [5, 6], "a"), add(sch, [5, 6], "b")
    step(sch)
    sch.preempt(a)
    assert list(sch.waiting) == [a, b] and sch.num_preemptions == 1
    sb, _ = step(sch)
    assert sb.seqs == [a] and sb.began == [0] and sb.num_new == [3]   # prompt + its sampled token


def test_a_two_token_prompt_is_chunked_too():
    sch = make(chunk=1)
    add(sch, [5, 6])
    sb, _ = step(sch)
    assert sb.num_new == [1]


def test_running_requests_stop_at_the_budget():
    sch = make(budget=16, chunk=4)
    a, b = add(sch, range(3, 15)), add(sch, range(3, 15))
    step(sch)                                             # both admitted, 4 tokens each
    sch.max_tokens = 4
    sb, _ = step(sch)
    assert sb.seqs == [a] and sb.num_new == [4]           # b gets no 0-token chunk
    sch.max_tokens = 5
    sb, _ = step(sch)
    assert sb.seqs == [a, b] and sb.num_new == [4, 1]     # the last budget token still runs


def test_a_waiting_request_takes_the_last_budget_token():
    sch = make(budget=5)
    a, b = add(sch, range(3, 7)), add(sch, range(3, 9))
    sb, _ = step(sch)
    assert sb.seqs == [a, b] and sb.num_new == [4, 1]


def test_preemption_takes_the_newest_of_three():
    sch = make(pages=6, budget=64)
    a, b, c = (add(sch, range(3, 11)) for _ in range(3))  # 2 pages each: the pool is full
    step(sch)
    sb, _ = step(sch)                                     # a needs a page: c goes, then b runs
    assert sch.num_preemptions == 1 and list(sch.waiting) == [c] and sch.running == [a, b]
    sch.bm.check([a, b])


def test_a_request_that_must_grow_preempts_itself_when_newest():
    sch = make(pages=4, budget=64)
    a, b = add(sch, [5, 6, 7]), add(sch, range(3, 15))   # 1 + 3 pages: the pool is full
    step(sch)
    sb, _ = step(sch)                                     # a fits its page; b needs a fourth
    assert sb.seqs == [a] and list(sch.waiting) == [b] and sch.num_preemptions == 1
    sch.bm.check([a])


def test_hit_and_replay_counters_accumulate():
    sch = make(mode="replay")
    root = cached_root(sch)
    for tail in ([99, 98], [97]):
        add(sch, root[:12] + tail, max_tokens=1)
        step(sch)
    assert sch.bm.stats["hit_tokens"] == 24 and sch.stats["replayed_rows"] == 8


def _abort_all_newest_first(n: int) -> float:
    """Seconds to abort n waiting requests, newest first (the order a linear scan from the
    head pays most for)."""
    import time
    sch = make(pages=4, slots=1, seqs=1)
    ids = [add(sch, [5], f"r{i}").request_id for i in range(n)]
    t0 = time.perf_counter()
    for rid in reversed(ids):
        assert sch.abort(rid) is not None
    dt = time.perf_counter() - t0
    assert not sch.has_unfinished() and sch.bm.all_free
    return dt


def test_aborting_waiting_requests_costs_o1_each():
    """10,000 aborts cost about 10x what 1,000 do (a linear scan per abort made it 100x: an
    abort storm of 128,000 requests wedged the server for minutes)."""
    small = min(_abort_all_newest_first(1_000) for _ in range(3))
    large = min(_abort_all_newest_first(10_000) for _ in range(3))
    assert large < 30 * small, (small, large)


def test_the_wait_queue_keeps_fcfs_order_through_aborts_and_preemption():
    sch = make(seqs=1)
    a, b, c, d = (add(sch, [5, 6], r) for r in "abcd")
    step(sch)                                             # a runs
    assert sch.abort("c") is c
    sch.preempt(a)
    assert list(sch.waiting) == [a, b, d] and len(sch.waiting) == 3
    assert sch.waiting[0] is a
    with pytest.raises(ValueError, match="already waiting"):
        add(sch, [5], "b")
    sb, _ = step(sch)
    assert sb.seqs == [a] and list(sch.waiting) == [b, d]


# ---- steady decode: the batch of the step before, one row on --------------------------------

def decoding(sch, *prompts, max_tokens=12):
    """Requests with these prompt lengths, prefilled and through their first decode step."""
    seqs = [add(sch, range(3, 3 + n), max_tokens=max_tokens) for n in prompts]
    step(sch)
    sb, _ = step(sch)
    assert sb.decode and not sb.steady           # the first decode step is scheduled afresh
    return seqs


def test_steady_decode_repeats_the_batch_and_takes_pages_on_the_way():
    sch = make()
    a, b = decoding(sch, 3, 5)                   # next rows: a at 4, b at 6; pages of P = 4
    rows = []
    for _ in range(6):
        sb, _ = step(sch)
        assert sb.steady and sb.seqs == [a, b] and sb.num_new == [1, 1] and sb.began == [a.num_computed - 1,
                                                                                          b.num_computed - 1]
        assert (sb.block_tables == sch.bm.table[sb.slots]).all()
        rows.append(sb.table_rows.tolist())
    # a opens a page at positions 4 and 8, b at 8
    assert rows == [[0], [], [1], [], [0], []]
    assert [len(a.pages), len(b.pages)] == [3, 3]


def test_steady_decode_ends_when_the_batch_changes():
    sch = make(seqs=3)
    a, b = decoding(sch, 3, 5)
    assert step(sch)[0].steady
    c = add(sch, range(3, 6))                    # room for it: admitted, the batch scheduled afresh
    sb, _ = step(sch)
    assert not sb.steady and sb.seqs == [a, b, c]
    assert not step(sch)[0].steady               # the first decode step of the three
    assert step(sch)[0].steady
    d = add(sch, range(3, 6))                    # no room (3 running): the steady batch goes on
    assert step(sch)[0].steady and d.status is Status.WAITING
    sch.abort(b.request_id)
    sb, _ = step(sch)
    assert not sb.steady and b not in sb.seqs and d in sb.seqs


def test_steady_decode_after_a_finish_or_without_a_sample_is_scheduled_afresh():
    sch = make()
    a, b = decoding(sch, 3, 5, max_tokens=4)     # a and b took 2 tokens each
    assert step(sch)[0].steady
    _, done = step(sch)                          # the 4th token: both finish
    assert done == [a, b] and not sch.has_unfinished()
    a, b = decoding(sch, 3, 5)
    sb = sch.schedule()
    assert sb.steady
    sch.postprocess(sb, {a.seq_id: 7})           # b's token did not come (its sampling failed)
    assert not sch.schedule().steady


def test_steady_decode_without_a_page_preempts_as_a_fresh_schedule():
    sch = make(pages=3)
    a, b = decoding(sch, 3, 5)                   # 3 pages held; a's next row opens a 4th
    sb, _ = step(sch)
    assert not sb.steady and sb.seqs == [a] and sch.num_preemptions == 1 and b.status is Status.WAITING
