"""The paged runtime against the independent oracle (tests/reference), float64: teacher-forced
logits within 1e-6 relative and greedy tokens equal, single and batched, chunked, both index
plane formats."""
import pytest
import torch

from runtime.sequence import SamplingParams
from tests import harness as H
from tests.reference.oracle import Oracle, replay_window


def teacher_forced(eng, reqs):
    """Logits of every prompt row, computed by the runtime in chunks and ragged batches."""
    seqs = [eng.add_request(p, SamplingParams(max_tokens=1, ignore_eos=True)) for p in reqs]
    rows = {s.seq_id: [] for s in seqs}
    sch, runner = eng.scheduler, eng.runner
    while any(s.num_computed < s.num_prompt_tokens for s in seqs):
        sb = sch.schedule()
        lg = runner.run(sb, all_rows=True)
        off = 0
        for s, n in zip(sb.seqs, sb.num_new):
            rows[s.seq_id].append(lg[off:off + n])
            off += n
        sch.postprocess(sb, {s.seq_id: 0 for s, f in zip(sb.seqs, sb.is_final_chunk) if f})
    return [torch.cat(rows[s.seq_id]) for s in seqs]


def rel_err(a, b):
    return ((a - b).norm(dim=-1) / b.norm(dim=-1)).max().item()


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
@pytest.mark.parametrize("chunk", [None, 13])
def test_teacher_forced_logits_match_oracle(toy_cfg, toy_weights, toy_token_map, fmt, chunk):
    lens = (1, 2, 15, 16, 17, 33, 64, 127, 301, 600)
    reqs = H.prompts(lens, seed=1)
    eng = H.make_engine(toy_weights, index_cache_dtype=fmt, max_prefill_chunk=chunk,
                        max_num_batched_tokens=700 if chunk is None else 64, decoder_swa_bounded_replay=False)
    got = teacher_forced(eng, reqs)
    oracle = Oracle(toy_cfg, toy_weights, dtype=torch.float64, index_plane=fmt, token_map=toy_token_map)
    for p, g in zip(reqs, got):
        assert rel_err(g, oracle.forward(torch.tensor(p))) < 1e-6, f"prompt of {len(p)} tokens"
    eng.bm.check([])
    assert eng.bm.all_free


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_greedy_generation_matches_oracle(toy_cfg, toy_weights, toy_token_map, fmt):
    """Greedy decoding (decoder bounded replay on, the default) against the oracle truncating
    the decoder's windows at each prompt's tail start. 28 tokens: both requests compute rows
    past a PAGE boundary (32, 64) and a window boundary (16) while decoding."""
    reqs = H.prompts((7, 40), seed=2)
    new = 28
    out = H.run(toy_weights, reqs, max_tokens=new, scenario=H.Scenario("fmt", engine={"index_cache_dtype": fmt}))
    oracle = Oracle(toy_cfg, toy_weights, dtype=torch.float64, index_plane=fmt, token_map=toy_token_map)
    for i, p in enumerate(reqs):
        tail = replay_window(max(0, len(p) - toy_cfg.sliding_window), toy_cfg.topology.boundary)
        assert len(out[i]) == new and out[i] == oracle.greedy_after(p, out[i], window_start=tail)
