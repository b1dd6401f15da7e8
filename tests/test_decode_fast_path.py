"""The decode fast paths give what the general paths give on the same step: the step rows
from per-slot mirrors (`StepRows.decode`) against `StepRows.general` (every host field, Engram ids
and commit cursor), and the sampler's per-slot SamplingTable against a build from the requests.
Runs with a stub forward, so every step of chunked prefill, decode, preemption, slot reuse,
prefix hits and decoder replay is compared fast."""
import dataclasses

import numpy as np
import pytest
import torch

from runtime.sampler import SamplingTable, SamplingTensors
from runtime.sequence import SamplingParams, Sequence
from tests import harness as H

FIELDS = ("input_ids", "positions", "batch_ids", "win_idx", "ring_dest", "tail_src", "tail_dst", "dest1",
          "dest2", "image_dest", "block_table", "commit_slots", "commit_cursor", "sample_rows", "final_rows",
          "final_last")


def compared_engine(weights, hook=None, **engine):
    """An engine whose every step is prepared twice, general path then fast path; the host
    mirrors must agree row for row. Returns the engine and a list of (decode?, fast?) per step."""
    eng = H.make_engine(weights, **engine)
    runner, seen = eng.runner, []
    width = runner.cfg.hidden_size
    runner.use_forward(lambda batch, cache: torch.randn(
        batch.input_ids.shape[0] if batch.decoder is None else batch.decoder.queries.rows.shape[0], width,
        dtype=runner.dtype), static_shapes=False)
    prepare = runner.prepare
    host = runner.bufs._np

    def twice(sb, **width):
        runner.decode_fast_path = False
        prepare(sb, **width)
        T, B = sb.scheduled_tokens, sb.scheduled_bs
        # a steady step rewrites only the table rows that changed: the mirror is still the table
        assert np.array_equal(host["block_table"][:B], eng.bm.table[sb.slots])
        keys = FIELDS + tuple(k for k in host if k.startswith("engram_ids."))
        want = {k: host[k][:T if host[k].shape[0] == runner.max_tokens else B].copy() for k in keys}
        want_mirror = [np.array(a, copy=True) for a in runner._mirror]
        before = runner.fast_steps
        runner.decode_fast_path = True
        batch = prepare(sb, **width)
        fast = runner.fast_steps > before
        for k, a in want.items():
            assert np.array_equal(host[k][:len(a)], a), (k, host[k][:len(a)], a)
        for a, b in zip(runner._mirror, want_mirror):
            assert np.array_equal(a, b)
        seen.append((sb.decode, fast))
        eng.steady_steps = getattr(eng, "steady_steps", 0) + sb.steady
        return batch

    runner.prepare = twice
    return eng, seen


def drive(eng, reqs, params, hook=None, arrivals=None):
    arrive = arrivals or [0] * len(reqs)
    step, pending = 0, list(range(len(reqs)))
    while pending or eng.has_unfinished():
        for i in [i for i in pending if arrive[i] <= step]:
            eng.add_request(reqs[i], params(i), request_id=f"r{i}")
            pending.remove(i)
        if hook:
            hook(eng, step)
        eng.step()
        for seq in eng.scheduler.running:
            assert int(eng.runner.cache.cursor[seq.slot, 0]) == seq.num_computed
        step += 1
    eng.bm.check([])


def seeded(i):
    return SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=i)


@pytest.mark.parametrize("engine", [{"max_prefill_chunk": 7, "max_num_seqs": 3},
                                    {"decoder_swa_bounded_replay": False, "max_prefill_chunk": 9},
                                    {"enable_prefix_caching": True},
                                    {"enable_prefix_caching": True, "encoder_swa_bounded_replay": True}])
def test_fast_decode_rows_equal_general_rows(toy_weights, engine):
    reqs = H.prompts((3, 21, 40, 1, 17, 2), seed=5)
    if engine.get("enable_prefix_caching"):
        reqs = reqs + [reqs[2][:35] + [7, 8]]
    eng, seen = compared_engine(toy_weights, **engine)
    eng.runner.step_rows.verify_history = True
    drive(eng, reqs, seeded, arrivals=[0, 0, 2, 5, 9, 9, 14][:len(reqs)])
    assert any(fast for _, fast in seen), "the fast path never ran"
    assert all(d or not f for d, f in seen), "the fast path ran on a step that is not pure decode"
    assert eng.steady_steps > 0, "no steady decode step (the step before's batch, one row on)"


def test_decode_rows_around_preemption(toy_weights):
    """A preempted request recomputes from 0 through StepRows.general; the decode steps around
    it still agree."""
    def preempt(eng, step):
        if step in (6, 9) and eng.scheduler.running:
            eng.scheduler.preempt(eng.scheduler.running[0])
    eng, seen = compared_engine(toy_weights, max_num_seqs=3)
    drive(eng, H.prompts((5, 9, 4), seed=2), seeded, hook=preempt)
    assert eng.scheduler.num_preemptions == 2
    assert any(f for _, f in seen)


def test_mirror_of_another_request_is_not_used(toy_weights):
    """A decode row whose slot mirror holds another request (or another position) is
    refused by StepRows.decode."""
    eng = H.make_engine(toy_weights, max_num_seqs=2)
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    for _ in range(3):
        eng.step()
    steady = eng.scheduler.schedule()
    assert steady.decode and steady.steady         # the step before's requests: positions checked
    sb = dataclasses.replace(steady, positions=None)  # a batch scheduled afresh: ids and positions
    host = eng.runner.bufs.begin()
    assert eng.runner.step_rows.decode(sb, host) is not None and eng.runner.step_rows.decode(steady, host) is not None
    slot = int(sb.slots[0])
    eng.runner.step_rows.slot_meta[slot, 0] += 1                        # another request's mirror
    assert eng.runner.step_rows.decode(sb, host) is None
    eng.runner.step_rows.slot_meta[slot, 0] -= 1
    eng.runner.step_rows.slot_meta[slot, 1] -= 1                        # an older position
    assert eng.runner.step_rows.decode(sb, host) is None and eng.runner.step_rows.decode(steady, host) is None
    eng.runner.step_rows.slot_meta[slot, 1] += 2                        # the step run already (a rerun of it)
    assert eng.runner.step_rows.decode(steady, host) is None


def test_sampling_table_equals_build_from_the_requests():
    """Gathering by slot from a SamplingTable gives the tensors of a build from the requests,
    and a slot taken by a new request gets that request's row."""
    vocab = 50
    ps = [SamplingParams(), SamplingParams(temperature=0.7, top_k=5, seed=3),
          SamplingParams(temperature=1.3, top_p=0.8, min_p=0.1, seed=9),
          SamplingParams(temperature=0.9, presence_penalty=0.5, repetition_penalty=1.2, logit_bias={4: 2.0},
                         min_tokens=3, seed=1)]
    seqs = [Sequence([1, 2, 3 + i], p) for i, p in enumerate(ps)]
    for s in seqs:
        s.token_ids += [7, 8]
    table = SamplingTable(6)
    slots = np.array([4, 0, 5, 2])

    def same(a, b):
        for k, v in vars(a).items():
            w = getattr(b, k)
            assert (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w), k

    same(SamplingTensors.build(seqs, vocab, "cpu", eos_token_id=0, table=table, slots=slots),
         SamplingTensors.build(seqs, vocab, "cpu", eos_token_id=0))
    order = [2, 0, 3, 1]                      # another batch order, the rows stay the requests'
    same(SamplingTensors.build([seqs[i] for i in order], vocab, "cpu", eos_token_id=0, table=table,
                               slots=slots[order]),
         SamplingTensors.build([seqs[i] for i in order], vocab, "cpu", eos_token_id=0))
    fresh = Sequence([9], SamplingParams(temperature=0.5, top_k=2, seed=77))
    mixed = [fresh, seqs[1]]
    same(SamplingTensors.build(mixed, vocab, "cpu", table=table, slots=np.array([4, 0])),
         SamplingTensors.build(mixed, vocab, "cpu"))
    assert table.owner[4] == fresh.seq_id


def test_sampling_table_reuses_the_last_build_only_for_the_same_requests():
    """Between steps of the same requests only the draws' steps change: the reused tensors equal
    a fresh build after tokens are appended; a new request in a slot, another row order or a
    special row (min_tokens) builds afresh."""
    vocab = 40
    seqs = [Sequence([1, 2], SamplingParams(temperature=0.8, top_k=4, seed=i)) if i % 2 else
            Sequence([3], SamplingParams()) for i in range(5)]
    table, slots = SamplingTable(8), np.array([3, 1, 7, 0, 2])

    def check(batch, at):
        got = SamplingTensors.build(batch, vocab, "cpu", table=table, slots=at)
        want = SamplingTensors.build(batch, vocab, "cpu")
        for k, v in vars(want).items():
            w = getattr(got, k)
            assert (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w), k
        return got

    first = check(seqs, slots)
    for step in range(3):
        for s in seqs:
            s.token_ids.append(5 + step)
        again = check(seqs, slots)
        assert again.top_k is first.top_k and again.step.tolist() == [step + 1] * 2   # reused, steps moved
    fresh = Sequence([4], SamplingParams(temperature=0.5, seed=11))
    assert check([fresh] + seqs[1:], slots).top_k is not first.top_k
    assert check(seqs[::-1], slots[::-1]).top_k is not first.top_k
    special = Sequence([4], SamplingParams(temperature=0.5, seed=12, min_tokens=2))
    batch = [special] + seqs[1:]
    a = check(batch, slots)
    assert check(batch, slots).top_k is not a.top_k and a.banned_at.numel() == 0   # eos None: nothing banned


def test_steady_decode_steps_give_the_tokens_of_fresh_schedules(toy_weights, monkeypatch):
    """Seeded and greedy requests with staggered arrivals and lengths: the engine whose decode
    steps repeat the step before's batch (Scheduler._next_decode, the runner's and the sampler's
    steady paths) gives the tokens of one that schedules every step afresh."""
    from runtime.scheduler import Scheduler
    reqs = H.prompts((3, 30, 9, 1), seed=7)

    def tokens():
        eng = H.make_engine(toy_weights, "float32", max_num_seqs=4)
        out, seen = {}, []
        schedule = eng.scheduler.schedule
        eng.scheduler.schedule = lambda: seen.append(schedule()) or seen[-1]
        for step in range(40):
            if step in (0, 3, 5, 6):
                i = (0, 3, 5, 6).index(step)
                params = SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True, **(dict(temperature=0.9, seed=i) if i % 2 else {}))
                out[i] = eng.add_request(reqs[i], params, request_id=f"r{i}")
            eng.step()
        assert not eng.has_unfinished()
        return {i: s.completion_token_ids for i, s in out.items()}, sum(sb.steady for sb in seen)

    got, steady = tokens()
    assert steady > 5
    monkeypatch.setattr(Scheduler, "_next_decode", lambda self: None)
    assert tokens() == (got, 0)
