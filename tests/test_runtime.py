"""Runtime units: cancellation at every phase, padding rows are inert, the block manager,
sampling, admission, geometry."""
import json
import subprocess
import sys

import pytest
import torch

from runtime.geometry import AdmissionError, PoolGeometry
from runtime.sequence import SamplingParams, Status
from tests import harness as H
from v41.config import ConfigError


def test_cancel_at_every_phase(toy_weights):
    """Waiting, mid prefill chunk, final chunk scheduled but no token yet, first decode step."""
    eng = H.make_engine(toy_weights, max_num_seqs=2, max_prefill_chunk=8)
    reqs = H.prompts((40, 40, 40, 5), seed=4)
    seqs = [eng.add_request(p, SamplingParams(max_tokens=4, ignore_eos=True), f"c{i}") for i, p in enumerate(reqs)]
    assert eng.abort("c3")                      # still waiting
    eng.step()                                  # c0, c1 in their first prefill chunk
    assert seqs[0].num_computed == 8 and not seqs[0].completion_token_ids
    assert eng.abort("c0")                      # mid prefill, no sampled token yet
    while seqs[1].num_computed < 32:
        eng.step()
    sb = eng.scheduler.schedule()               # c1's final chunk scheduled ...
    assert sb.is_final_chunk[sb.seqs.index(seqs[1])]
    assert eng.abort("c1")                      # ... and cancelled before it ran
    eng.scheduler.postprocess(sb, {})
    while not seqs[2].completion_token_ids:
        eng.step()
    assert eng.abort("c2")                      # on its first decode step
    assert not eng.has_unfinished() and not eng.abort("c2")
    eng.bm.check([])
    assert eng.bm.all_free
    assert all(s.finish_reason == "abort" for s in seqs)


def test_padding_rows_and_requests_are_inert(toy_weights):
    """A step run at a wider width (padding rows with batch id -1, zero-length padding
    requests) gives the logits of the exact-width step and writes exactly the same cache rows:
    the planes start poisoned (NaN) and the written rows must coincide."""
    reqs = H.prompts((20, 3), seed=5)
    outs, written = [], []
    for pad in (False, True):
        eng = H.make_engine(toy_weights, max_num_seqs=4, max_num_batched_tokens=64, decoder_swa_bounded_replay=False)
        c = eng.runner.cache
        planes = [c.ring] + [t for o in c.owners.values() for t in (o.main, o.tail_v, o.tail_g) if t is not None]
        for t in planes:
            t.fill_(float("nan"))
        for p in reqs:
            eng.add_request(p, SamplingParams(max_tokens=2, ignore_eos=True))
        sb = eng.scheduler.schedule()
        width = {"running_tokens": 40, "running_bs": 4} if pad else {}
        outs.append(eng.runner.run(sb, all_rows=True, **width))
        written.append([~t.isnan() for t in planes])
    assert ((outs[0] - outs[1]).norm() / outs[0].norm()) < 1e-12
    assert all(torch.equal(a, b) for a, b in zip(*written))
    assert any(a.any() for a in written[0])


def test_sampler_seeded_and_filters():
    from runtime.sampler import probs, sample
    from runtime.sequence import Sequence
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5]] * 2)
    p = probs(logits[0], 1.0, top_k=2, top_p=1.0)
    assert p[0] == 0 and p[3] == 0 and abs(p.sum() - 1) < 1e-6
    p = probs(logits[0], 1.0, top_k=0, top_p=0.5)   # the top token alone holds > 0.5
    assert p.argmax() == 1 and p[1] == 1
    mk = lambda: Sequence([1], SamplingParams(temperature=1.0, seed=7))  # noqa: E731
    a = [sample(logits, [mk(), mk()]) for _ in range(3)]
    assert a[0] == a[1] == a[2] and a[0][0] == a[0][1]
    assert sample(logits, [Sequence([1], SamplingParams())] * 2) == [1, 1]


def test_sampling_params_are_validated():
    for bad in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


@pytest.mark.parametrize("kw, msg", [
    ({"index_cache_dtype": "int8"}, "index_cache_dtype"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
    ({"block_size": 31}, "even"),
    ({"block_size": 8}, "sliding_window - 1"),
    ({"block_size": 16}, "PAGE >= 32"),
    ({"pipeline_parallel_size": 2}, "pipeline"),
    ({"context_parallel_size": 2}, "context parallelism"),
    ({"tensor_parallel_size": 3}, "tensor_parallel_size"),
    ({"speculative_method": "medusa"}, "only dspark"),
    ({"speculative_method": "dspark", "num_speculative_tokens": 3}, "DSpark drafts five tokens"),
    ({"num_speculative_tokens": 5}, "needs --speculative-method dspark"),
    ({"max_model_len": 10**7}, "max_model_len"),
    ({"dtype": "int4"}, "dtype"),
    ({"model": "no-such-model"}, "preset"),
])
def test_admission_refuses_before_weights(kw, msg, monkeypatch):
    from runtime.engine import EngineArgs, LLMEngine
    import v41.loader
    monkeypatch.setattr(v41.loader, "load_weights", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises((AdmissionError, ConfigError), match=msg):
        LLMEngine(EngineArgs(**kw))


def test_engine_rejects_bad_requests(toy_weights):
    eng = H.make_engine(toy_weights)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="out of range"):
        eng.add_request([5, 10**6], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request([5] * 9000, SamplingParams())
    assert not eng.has_unfinished()


def test_geometry_flash_matches_spec(toy_cfg):
    from v41.config import preset
    g = PoolGeometry(preset("flash"), None, "fp8")
    assert g.page_tokens == 128 and g.global_bytes_per_token == 2890       # spec §9.1 BF16/FP8
    assert g.rows_per_page(2) == 64 and g.rows_per_page(20) == 128
    ring = 40 * 128 * 512 * 2
    assert g.bytes_per_state == ring + 2 * 3 * 512 * 4 + 256               # + tails + cursor slot
    assert PoolGeometry(preset("flash"), None, "fp4").layout_id != g.layout_id
    out = subprocess.run([sys.executable, "-m", "runtime.geometry", "toy", "--index-cache-dtype", "fp8", "--json"],
                         capture_output=True, text=True, check=True)
    d = json.loads(out.stdout)
    assert {"page_tokens", "bytes_per_page", "bytes_per_state", "global_bytes_per_token"} <= set(d)
    assert d["page_tokens"] == 32


def test_cursor_tracks_committed_position(toy_weights):
    eng = H.make_engine(toy_weights, max_prefill_chunk=10)
    seq = eng.add_request(H.prompts((23,))[0], SamplingParams(max_tokens=3, ignore_eos=True))
    while seq.status is not Status.FINISHED:
        eng.step()
        if seq.slot is not None:
            assert int(eng.runner.cache.cursor[seq.slot, 0]) == seq.num_computed


def test_padding_rows_read_and_write_nothing(toy_weights):
    """Every field a padding row carries is the sentinel (-1 wherever it could read or write a
    request's rows), and in the forward its index selections are all -1 and its attention output
    0: a padding row tagged with a real batch id would select and read that request's rows,
    which no compared output shows (CUDA-graph replay relies on this contract)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    eng = H.make_engine(toy_weights, max_num_seqs=4, max_num_batched_tokens=128,
                        enable_prefix_caching=True, encoder_swa_bounded_replay=False)
    for p in H.prompts((70, 40), seed=6):      # past a PAGE, so compressed rows exist to select
        eng.add_request(p, SamplingParams(max_tokens=2, ignore_eos=True))
    eng.step()
    sb = eng.scheduler.schedule()
    T, Tr, Br = sb.scheduled_tokens, sb.scheduled_tokens + 24, 4
    batch = eng.runner.prepare(sb, running_tokens=Tr, running_bs=Br)
    pad = slice(T, Tr)
    assert (batch.batch_ids[pad] == -1).all() and (batch.batch_ids[:T] >= 0).all()
    for name in ("win_idx", "ring_dest", "tail_src", "tail_dst"):
        assert (getattr(batch, name)[pad] == -1).all(), name
    for r, dest in batch.owner_dest.items():
        assert (dest[pad] == -1).all(), f"owner_dest[{r}]"
    if batch.image_dest is not None:
        assert (batch.image_dest[pad] == -1).all()
    assert batch.block_table.shape[0] >= Br and (batch.block_table[sb.scheduled_bs:Br] == 0).all()

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.topk, self.attn = [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func._schema.name
            if name == "v41::index_topk":
                self.topk.append(args[12][pad].clone())
            elif name == "v41::sparse_attn":
                self.attn.append(args[12][pad].clone())
            return out

    with torch.inference_mode(), Record() as rec:
        eng.runner.forward(batch, eng.runner.cache)
    assert rec.topk and rec.attn
    assert all((t == -1).all() for t in rec.topk), "a padding row selected compressed rows"
    assert all((o == 0).all() for o in rec.attn), "a padding row attended to something"
