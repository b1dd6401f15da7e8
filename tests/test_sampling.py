"""The batched sampler against per-row references written out here: greedy, the filters
(top-k, top-p, min_p), each penalty, logit_bias, min_tokens, seeded draws alone vs batched, the
draw frequencies against `probs`; SamplingParams' checks; and a request whose data makes the
sampler raise failing alone inside a running batch (float64 toy)."""
import math

import pytest
import torch

from runtime.sampler import SamplingTensors, filter_logits, probs, process_logits, sample
from runtime.sequence import SamplingParams, Sequence
from tests import harness as H

V = 32


def seq(prompt=(1, 2, 3), out=(), **kw):
    s = Sequence(list(prompt), SamplingParams(max_tokens=64, **kw))
    s.token_ids += list(out)
    return s


def rand_logits(rows, vocab=V, seed=0, ties=False):
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2
    return (x * 2).round() / 2 if ties else x      # halves: many equal values


def ref_probs(row, temperature, top_k, top_p, min_p):
    """One row, loop by loop: temperature; top-k keeps k tokens (ties by lower id); min_p drops
    p < min_p * p_max; top-p keeps a token when the strictly more likely kept tokens hold at
    most top_p of the kept mass."""
    x = [float(v) / temperature for v in row]
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    keep = set(order[:top_k] if 0 < top_k < len(x) else order)
    top = max(x)
    keep = {i for i in keep if math.exp(x[i] - top) >= min_p}
    mass = {i: math.exp(x[i] - top) for i in keep}
    total = sum(mass.values())
    if top_p < 1:
        keep = {i for i in keep if sum(m for j, m in mass.items() if x[j] > x[i]) <= top_p * total}
    z = sum(mass[i] for i in keep)
    return torch.tensor([mass[i] / z if i in keep else 0.0 for i in range(len(x))], dtype=torch.float64)


def batch_probs(logits, seqs):
    st = SamplingTensors.build(seqs, logits.shape[1], logits.device, torch.float64)
    x = filter_logits(process_logits(logits, st), st.temperature, st.top_k, st.top_p, st.min_p,
                      st.top_k_max, st.use_top_p, st.use_min_p, st.top_p_sorts_all)
    return torch.softmax(x, -1)


# ---- greedy and the filters -----------------------------------------------------------------

def test_greedy_is_the_argmax():
    logits = rand_logits(6)
    seqs = [seq(), seq(temperature=1e-9), seq(temperature=0.0, top_k=2, top_p=0.1, min_p=0.9)] * 2
    assert sample(logits, seqs) == logits.argmax(-1).tolist()
    assert sample(logits.float(), seqs) == logits.float().argmax(-1).tolist()


FILTERS = [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.6, 0.0), (1.0, 0, 1.0, 0.2), (0.8, 7, 0.5, 0.0),
           (1.0, 9, 0.9, 0.05), (2.0, 1, 1.0, 0.0), (0.5, 0, 0.3, 0.3), (1.0, 40, 0.95, 0.0), (1.0, 3, 0.999, 0.5)]


@pytest.mark.parametrize("ties", [False, True])
def test_filters_match_the_per_row_reference(ties):
    logits = rand_logits(len(FILTERS), ties=ties, seed=3)
    seqs = [seq(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in FILTERS]
    got = batch_probs(logits, seqs)
    for i, (t, k, p, m) in enumerate(FILTERS):
        want = ref_probs(logits[i].tolist(), t, k, p, m)
        assert torch.equal(got[i] > 0, want > 0), (i, FILTERS[i])
        assert torch.allclose(got[i], want, rtol=0, atol=1e-12), (i, FILTERS[i])
        alone = probs(logits[i], t, k, p, m)
        assert torch.allclose(alone, want, rtol=0, atol=1e-12), (i, FILTERS[i])


def test_top_p_alone_and_with_top_k_sort_the_same():
    """Every top-p row with a top-k takes the top values only; one without sorts everything:
    each row's distribution is the same either way."""
    logits = rand_logits(3, ties=True, seed=5)
    rows = [seq(temperature=1.0, top_k=4, top_p=0.7), seq(temperature=1.0, top_k=6, top_p=0.8)]
    with_all = batch_probs(logits, rows + [seq(temperature=1.0, top_p=0.5)])
    assert torch.equal(batch_probs(logits[:2], rows), with_all[:2])


# ---- penalties, logit_bias, min_tokens --------------------------------------------------------

def test_repetition_penalty_on_prompt_and_output_tokens():
    row = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 4.0]], dtype=torch.float64)
    s = seq(prompt=[0, 1], out=[3, 3], repetition_penalty=2.0)
    got = process_logits(row, SamplingTensors.build([s], 6, "cpu", torch.float64))
    assert got.tolist() == [[1.0, -2.0, 0.5, -6.0, 1.0, 4.0]]       # positive / r, negative * r


def test_frequency_and_presence_penalties_count_output_tokens_only():
    row = torch.zeros(1, 6, dtype=torch.float64)
    s = seq(prompt=[0, 5, 5], out=[2, 2, 2, 4], frequency_penalty=0.5, presence_penalty=0.25)
    got = process_logits(row, SamplingTensors.build([s], 6, "cpu", torch.float64))
    assert got.tolist() == [[0.0, 0.0, -1.75, 0.0, -0.75, 0.0]]
    s = seq(prompt=[0], out=[1, 1], frequency_penalty=-1.0, presence_penalty=-2.0)   # negative: favour repeats
    assert process_logits(row, SamplingTensors.build([s], 6, "cpu", torch.float64)).tolist() == [[0, 4.0, 0, 0, 0, 0]]


def test_penalties_apply_per_row_and_in_vllms_order():
    """Repetition first, then frequency and presence; a row without penalties is untouched."""
    logits = torch.tensor([[3.0, 1.0, -1.0], [3.0, 1.0, -1.0]], dtype=torch.float64)
    s = seq(prompt=[2], out=[0, 0], repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=1.0)
    got = process_logits(logits, SamplingTensors.build([s, seq(prompt=[2], out=[0, 0])], 3, "cpu", torch.float64))
    assert got.tolist() == [[3.0 / 1.5 - 0.5 * 2 - 1.0, 1.0, -1.5], [3.0, 1.0, -1.0]]


def test_logit_bias_is_added_and_clamped():
    assert SamplingParams(logit_bias={3: 250, 4: -1e9, 5: 0.5}).logit_bias == {3: 100.0, 4: -100.0, 5: 0.5}
    logits = torch.zeros(2, 8, dtype=torch.float64)
    rows = [seq(logit_bias={3: 2.5, 7: -1.0}), seq(logit_bias={0: 101})]
    got = process_logits(logits, SamplingTensors.build(rows, 8, "cpu", torch.float64))
    assert got[0].tolist() == [0, 0, 0, 2.5, 0, 0, 0, -1.0] and got[1].tolist() == [100.0] + [0.0] * 7
    assert sample(logits, rows) == [3, 0]
    with pytest.raises(ValueError, match=r"logit_bias: token ids \[8\] out of range \[0, 8\)"):
        sample(logits, [seq(logit_bias={8: 1.0})])


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]], dtype=torch.float64)   # EOS (0) is the argmax
    for n_out, want in [(0, 2), (1, 2), (2, 0)]:
        s = seq(out=[3] * n_out, min_tokens=2, stop_token_ids=[1, 99])   # 99: out of vocab, harmless
        assert sample(logits, [s], eos_token_id=0) == [want]
    assert sample(logits, [seq(min_tokens=2, ignore_eos=True)], eos_token_id=0) == [0]   # EOS is no stop
    assert sample(logits, [seq(min_tokens=2)], eos_token_id=None) == [0]


# ---- seeded draws -------------------------------------------------------------------------

def mixed_rows(n):
    kinds = [dict(temperature=0.8), dict(temperature=1.2, top_k=5), dict(temperature=1.0, top_p=0.8),
             dict(temperature=0.9, min_p=0.1), dict(), dict(temperature=1.0, top_k=8, top_p=0.9, repetition_penalty=1.3),
             dict(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.2, logit_bias={4: 3.0})]
    return [seq(prompt=[i % V, 4], out=[(3 * i) % V] * (i % 3), seed=1000 + i, **kinds[i % len(kinds)]) for i in range(n)]


def test_seeded_rows_draw_the_same_alone_or_batched():
    logits = rand_logits(21, seed=9)
    rows = mixed_rows(21)
    batched = sample(logits, rows)
    assert batched == [sample(logits[i:i + 1], [s])[0] for i, s in enumerate(rows)]
    perm = list(reversed(range(21)))
    assert sample(logits[perm], [rows[i] for i in perm]) == [batched[i] for i in perm]
    assert sample(logits.float(), rows) == [sample(logits[i:i + 1].float(), [s])[0] for i, s in enumerate(rows)]
    again = mixed_rows(21)
    assert sample(logits, again) == batched
    for s in again:
        s.token_ids.append(0)                      # the next step draws afresh
    assert sample(logits, again) != batched


def test_draws_follow_probs():
    """4,000 draws (distinct seeds, and one seed over 4,000 steps) on a 4-token vocab: the
    chi-square statistic against `probs` stays below the 0.001 critical value (df = 3: 16.27),
    and filtered tokens are never drawn."""
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64))
    n = 4000
    for params, p in [(dict(temperature=1.0), probs(logits[0], 1.0, 0, 1.0)),
                      (dict(temperature=0.6), probs(logits[0], 0.6, 0, 1.0)),
                      (dict(temperature=1.0, top_k=3, top_p=0.6), probs(logits[0], 1.0, 3, 0.6))]:
        by_seed = [seq(seed=s, **params) for s in range(n)]
        by_step = [seq(out=[2] * k, seed=77, **params) for k in range(n)]
        for rows in (by_seed, by_step):
            got = torch.bincount(torch.tensor(sample(logits.expand(n, 4), rows)), minlength=4).double()
            want = p * n
            assert torch.all(got[want == 0] == 0), (params, got)
            chi2 = float((((got - want) ** 2)[want > 0] / want[want > 0]).sum())
            assert chi2 < 16.27, (params, got.tolist(), want.tolist(), chi2)


# ---- SamplingParams -----------------------------------------------------------------------

@pytest.mark.parametrize("kw, field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"), (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=17), "min_tokens"), (dict(min_tokens=1.5), "min_tokens"),
    (dict(logit_bias=[1]), "logit_bias"), (dict(logit_bias={"5": 1.0}), "logit_bias token id"),
    (dict(logit_bias={-1: 1.0}), "logit_bias token id"), (dict(logit_bias={5: float("nan")}), r"logit_bias\[5\]"),
    (dict(temperature=float("nan")), "temperature"), (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids"), (dict(seed=1.5), "seed"), (dict(top_k=1.5), "top_k"),
])
def test_sampling_params_name_the_bad_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_sampling_params_accept_the_edges():
    SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-3, min_p=1, min_tokens=16)
    assert not SamplingParams().penalized and SamplingParams(repetition_penalty=1.1).penalized


# ---- one request fails alone in a running batch (float64 toy) ---------------------------------

REQS = H.prompts((5, 17, 40, 9), seed=4)
KINDS = [SamplingParams(max_tokens=8, ignore_eos=True),
         SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, seed=11),
         SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.1, top_k=20, top_p=0.9, seed=12,
                        presence_penalty=0.5, repetition_penalty=1.2, logit_bias={7: 2.0}),
         SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.7, min_p=0.05, seed=13, min_tokens=4)]


def run_engine(weights, bad_at=None):
    eng = H.make_engine(weights)
    live, step = {}, 0
    while step == 0 or eng.has_unfinished():
        if step < len(REQS):
            live[step] = eng.add_request(REQS[step], KINDS[step], request_id=f"r{step}", logprobs=2)
        if step == bad_at:
            live["bad"] = eng.add_request(REQS[0], SamplingParams(max_tokens=8, logit_bias={5000: 1.0}),
                                          request_id="bad")
        eng.step()
        step += 1
    eng.bm.check([])
    assert eng.bm.all_free
    return live


def test_a_request_whose_sampling_raises_fails_alone(toy_weights, caplog):
    alone = {}
    for i in range(len(REQS)):                         # each alone, then all with a failing request
        eng = H.make_engine(toy_weights)
        s = eng.add_request(REQS[i], KINDS[i], logprobs=2)
        while eng.has_unfinished():
            eng.step()
        alone[i] = s
    with caplog.at_level("WARNING", logger="v41"):
        live = run_engine(toy_weights, bad_at=2)
    # the batch that raised is named once, then sampled row by row
    named = [r.message for r in caplog.records if "one by one" in r.message]
    assert len(named) == 1 and "rows raised ValueError: logit_bias: token ids [5000]" in named[0], named
    bad = live.pop("bad")
    assert bad.finish_reason == "error" and bad.completion_token_ids == []
    assert "logit_bias: token ids [5000] out of range [0, 1024)" in bad.error
    for i, s in live.items():
        assert s.completion_token_ids == alone[i].completion_token_ids, i
        assert s.finish_reason == "length" and s.error is None
        assert [lp[0] for lp in s.logprobs] == pytest.approx([lp[0] for lp in alone[i].logprobs], abs=1e-9)
    assert len({tuple(s.completion_token_ids) for s in live.values()}) == len(live)
