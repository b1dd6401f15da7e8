"""Decoder SWA bounded replay (runtime/replay.py) against the oracle truncating the decoder's
windows as the seed states it (tests/reference/replay.py), float64 toy (W = 16, PAGE = 32)."""
import numpy as np
import pytest
import torch

from runtime import replay
from runtime.sequence import SamplingParams
from tests import harness as H
from tests.reference.oracle import Oracle
from tests.reference.replay import bounded_replay

W = 16


@pytest.fixture(scope="module")
def oracle(toy_cfg, toy_weights, toy_token_map):
    return Oracle(toy_cfg, toy_weights, dtype=torch.float64, index_plane="fp8", token_map=toy_token_map)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def last_row_logits(eng, reqs) -> list[torch.Tensor]:
    """The logits each prompt's first token is sampled from."""
    seqs = [eng.add_request(p, SamplingParams(max_tokens=1, ignore_eos=True)) for p in reqs]
    got = {}
    while eng.has_unfinished():
        sb = eng.scheduler.schedule()
        lg = eng.runner.run(sb)
        final = [i for i, f in enumerate(sb.is_final_chunk) if f]
        got.update({sb.seqs[i].seq_id: lg[i] for i in final})
        eng.scheduler.postprocess(sb, {sb.seqs[i].seq_id: 0 for i in final})
    eng.bm.check([])
    assert eng.bm.all_free
    return [got[s.seq_id] for s in seqs]


def test_prompts_ending_at_every_offset_of_a_page(toy_cfg, toy_weights, oracle):
    """Lengths 17..48 end at every offset inside a PAGE (and straddle one): each first-token
    distribution is the truncating oracle's, and differs from the full model's."""
    reqs = H.prompts(tuple(range(17, 49)), seed=11)
    got = last_row_logits(H.make_engine(toy_weights), reqs)
    for p, g in zip(reqs, got):
        assert rel(g, oracle.forward(p, window_start=bounded_replay(toy_cfg, len(p)))[-1]) < 1e-6, len(p)
    assert rel(got[-1], oracle.forward(reqs[-1])[-1]) > 1e-3        # the truncation is real


@pytest.mark.parametrize("chunk", [7, 20])
def test_chunked_prompts(toy_cfg, toy_weights, oracle, chunk):
    """Chunks shorter than W (the tail then spans chunks) and longer: the same logits."""
    reqs = H.prompts((17, 31, 40, 57), seed=12)
    got = last_row_logits(H.make_engine(toy_weights, max_prefill_chunk=chunk), reqs)
    for p, g in zip(reqs, got):
        assert rel(g, oracle.forward(p, window_start=bounded_replay(toy_cfg, len(p)))[-1]) < 1e-6, len(p)


def generate(eng, reqs, n) -> list[list[int]]:
    """Greedy tokens of each request run alone to completion, one after the other."""
    out = []
    for p in reqs:
        seq = eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        out.append(seq.completion_token_ids)
    return out


def greedy_after(oracle, cfg, p, tokens, **hook):
    """The truncating oracle's greedy tokens after `p`, checked against `tokens` (Oracle.greedy_after)."""
    return oracle.greedy_after(p, tokens, window_start=bounded_replay(cfg, len(p), **hook))


def test_mixed_steps_and_preemption(toy_cfg, toy_weights, oracle):
    """Prompts finishing beside decoding requests, chunked, with decode-phase preemption (the
    recompute rebuilds the decoder rows from the tail start): the truncating oracle's tokens."""
    reqs = H.prompts((40, 33, 21), seed=13)
    sc = H.Scenario("mixed", engine={"max_prefill_chunk": 12, "max_num_batched_tokens": 24},
                    arrival_steps=[0, 3, 5], hook=H.preempt_randomly(0.3, "decode"), seed=3)
    out = H.run(toy_weights, reqs, max_tokens=5, scenario=sc)
    for i, p in enumerate(reqs):
        assert len(out[i]) == 5 and out[i] == greedy_after(oracle, toy_cfg, p, out[i]), i


def test_replay_off_runs_every_row(toy_cfg, toy_weights, oracle):
    reqs = H.prompts((40,), seed=12)
    eng = H.make_engine(toy_weights, decoder_swa_bounded_replay=False)
    got = last_row_logits(eng, reqs)
    assert rel(got[0], oracle.forward(reqs[0])[-1]) < 1e-6
    assert eng.runner.rows_run == {"encoder": 40, "decoder": 40}


def test_switching_replay_in_one_engine(toy_cfg, toy_weights, oracle):
    """set_decoder_replay: off, then on again, in one engine; never under running requests."""
    p = H.prompts((40,), seed=12)[0]
    eng = H.make_engine(toy_weights)
    eng.set_decoder_replay(False)
    assert rel(last_row_logits(eng, [p])[0], oracle.forward(p)[-1]) < 1e-6
    eng.set_decoder_replay(True)
    assert rel(last_row_logits(eng, [p])[0], oracle.forward(p, window_start=bounded_replay(toy_cfg, 40))[-1]) < 1e-6
    eng.add_request(p, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="no request"):
        eng.set_decoder_replay(False)


@pytest.mark.parametrize("suffix", [3, 30])
def test_copy_mode_hits_resume_at_or_below_the_tail(toy_cfg, toy_weights, oracle, suffix):
    """A checkpoint image above the tail start holds another request's decoder rings: the hit
    resumes at an image at or below it, recomputing exactly; tokens equal a cold run's."""
    root = H.prompts((100,), seed=14)[0]
    p = root[:96] + H.prompts((suffix,), seed=15)[0]
    eng = H.make_engine(toy_weights, enable_prefix_caching=True, encoder_swa_bounded_replay=False)
    generate(eng, [root], 1)
    seq = eng.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True))
    sb = eng.scheduler.schedule()
    start = seq.num_computed
    assert seq.num_cached_tokens == 96 and start <= seq.decoder_start == len(p) - W and start % H.PAGE == 0
    assert start == (64 if suffix < W else 96)
    eng.scheduler.postprocess(sb, {seq.seq_id: int(eng.runner.run(sb)[0].argmax())})
    while eng.has_unfinished():
        eng.step()
    out = seq.completion_token_ids
    assert len(out) == 4 and out == greedy_after(oracle, toy_cfg, p, out)


@pytest.mark.parametrize("suffix", [3, 30])
def test_encoder_replay_hits(toy_cfg, toy_weights, oracle, suffix):
    """Encoder replay (the default transfer) from one block below the hit, decoder replay from the
    tail start: the oracle with both truncations and the cached global rows."""
    root = H.prompts((100,), seed=14)[0]
    p = root[:96] + H.prompts((suffix,), seed=15)[0]
    eng = H.make_engine(toy_weights, enable_prefix_caching=True, encoder_swa_bounded_replay=True)
    generate(eng, [root], 1)
    out = generate(eng, [p], 4)[0]
    oracle.forward(p[:96])
    cold = oracle.last
    assert len(out) == 4 and out == oracle.greedy_after(
        p, out, window_start=bounded_replay(toy_cfg, len(p), encoder_start=96 - H.PAGE), cached=(96, cold))


def test_a_chunk_below_the_tail_runs_no_decoder(toy_cfg, toy_weights):
    """Counted per layer: a chunk that ends at or below the tail start runs no decoder block; the
    forward finishing the prompt runs the decoder on its W tail rows and the last layer's
    attention and FFN on one row."""
    eng = H.make_engine(toy_weights, max_prefill_chunk=24)
    b, last = toy_cfg.topology.boundary, toy_cfg.topology.n_backbone - 1
    rows = {}
    hooks = [blk.attn.register_forward_hook(lambda m, a, o, l=l: rows.setdefault(("attn", l), []).append(o.shape[0]))
             for l, blk in enumerate(eng.runner.model.layers)]
    hooks += [blk.ffn.register_forward_hook(lambda m, a, o, l=l: rows.setdefault(("ffn", l), []).append(o.shape[0]))
              for l, blk in enumerate(eng.runner.model.layers)]
    eng.add_request(H.prompts((60,), seed=16)[0], SamplingParams(max_tokens=1, ignore_eos=True))
    per_step = []
    while eng.has_unfinished():
        rows.clear()
        sb = eng.scheduler.schedule()
        lg = eng.runner.run(sb)
        eng.scheduler.postprocess(sb, {sb.seqs[0].seq_id: int(lg[0].argmax())} if sb.is_final_chunk[0] else {})
        per_step.append((sb.num_new[0], dict(rows)))
    for h in hooks:
        h.remove()
    # 60 tokens, tail start 44: chunks 24, 20 (cut at the tail start), then the final 16
    assert [n for n, _ in per_step] == [24, 20, 16]
    for n, r in per_step[:2]:
        assert all(r[k, l] == [n] for k in ("attn", "ffn") for l in range(b))
        assert not any(l >= b for _, l in r)
    final = per_step[2][1]
    assert all(final[k, l] == [W] for k in ("attn", "ffn") for l in range(b, last))
    assert final["attn", last] == [1] and final["ffn", last] == [1]
    assert eng.runner.rows_run == {"encoder": 60, "decoder": W}


def test_teacher_forcing_needs_replay_off(toy_weights):
    eng = H.make_engine(toy_weights)
    eng.add_request(H.prompts((20,), seed=1)[0], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="no-decoder-swa-bounded-replay"):
        eng.runner.run(eng.scheduler.schedule(), all_rows=True)


def test_cut_chunk():
    assert replay.cut_chunk(0, 24, 60, 44) == 24            # ends below the tail start
    assert replay.cut_chunk(24, 24, 60, 44) == 20           # would cross it: ends there
    assert replay.cut_chunk(24, 36, 60, 44) == 36           # finishes the prompt
    assert replay.cut_chunk(44, 7, 60, 44) == 7             # inside the tail (a budget < W)
    assert replay.decoder_start(60, W, True) == 44 and replay.decoder_start(5, W, True) == 0
    assert replay.decoder_start(60, W, False) is None and replay.cut_chunk(24, 24, 60, None) == 24


def test_plan_windows():
    """Two requests: one finishing its prompt (positions 0..5, tail start 2, window 4), one
    decoding at position 9 (slot 1): the decoder's rows, windows and query rows."""
    pos = np.array([0, 1, 2, 3, 4, 5, 9])
    bid = np.array([0, 0, 0, 0, 0, 0, 1])
    rows, win, q = replay.plan(pos, bid, np.array([0, 9]), np.array([2, 6]), np.array([0, 1]),
                               np.array([5, 6]), W=4, S=2)
    assert rows.tolist() == [2, 3, 4, 5, 6] and q.tolist() == [3, 4]
    ring = 2 * 4
    assert win[0].tolist() == [-1, -1, -1, ring + 0]                       # position 2 reads itself
    assert win[3].tolist() == [ring + 0, ring + 1, ring + 2, ring + 3]     # position 5: 2..5
    assert win[4].tolist() == [4 + 6 % 4, 4 + 7 % 4, 4 + 8 % 4, ring + 4]  # position 9: 6..8 from its ring
