"""TR_HYBRID on the CPU: the forward compiled with splitting ops (passes/split.py), each token
piece behind a PieceGraph (runtime/compile/piece_graphs.py) captured per token bucket by the
runtime's TokenGraphRunner, with torch.cuda's graph API replaced by the recorder of
tests/test_cuda_graph_cpu.py (a replay re-runs the captured piece on the captured tensors, so a
wrapper that forgot to copy an input, or a graph fed from a moved tensor, computes stale rows).

The mini model (every layer role in 8 layers) in float64, compiled with post_grad_eager
(Inductor's graph pipeline and our passes, no code generation), one engine per module fixture:
- the split: which pieces each layer role has, no splitting op inside a compiled piece, every
  eager piece made of splitting ops only, one graph per piece and bucket;
- a replayed decode, prefill and mixed step equals the compiled forward without graphs at the
  same padded width, logits and every cache plane bit for bit, and every piece replays (decoder
  bounded replay off; on, with the decoder's rows padded to a bucket);
- under decoder bounded replay the decoder's padding rows are inert: a prompt-finishing and a
  mixed step leave the cache planes of the same forward on the exact rows (logits: to rounding);
- requests through the engine get the tokens of the eager engine, with no leaked page or slot;
- padding rows of a replay write nothing (NaN-poisoned planes come back as a plain step's);
- prefix hits and cancellations through the engine leave the eager engine's tokens.
The GPU versions: tests/test_cuda_graph_gpu.py (marked gpu).
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from passes.split import SPLITTING_OPS, is_eager, op_name
from runtime import compile as C
from runtime.engine import EngineArgs, LLMEngine
from runtime.sequence import SamplingParams
from runtime.token_graphs import TokenGraphRunner, token_buckets
from tests import harness as H
from tests.graph_checks import planes_written_by_a_step
from tests.test_cuda_graph_cpu import cpu_graphs, recorded  # noqa: F401  (cpu_graphs: a fixture)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
REQS = H.prompts((5, 17, 40), seed=4)
# token pieces of a layer, by role: before and after its attention (sparse_attn and the ring's
# scatter_rows run as one eager piece between them); a FULL owner also cuts at its compression
# (compress_pool with ratio 2, the main, index and scale scatters) and a scorer at its top-k
EXPECTED_PIECES = {"WINDOW": {2}, "REUSE2": {2}, "REUSE1": {2}, "REINDEX1": {3}, "FULL1": {5}, "FULL2": {6}}


@pytest.fixture(scope="module")
def mini_dir(tmp_path_factory):
    from v41.loader import dummy_weights
    cfg = H.mini_cfg()
    d = tmp_path_factory.mktemp("mini")
    (d / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    return str(d), dummy_weights(cfg, progress=False)


def engine(mini_dir, **kw) -> LLMEngine:
    path, w = mini_dir
    args = EngineArgs(model=path, device="cpu", **{"dtype": "float64", "max_num_seqs": 4,
                                                   "max_num_batched_tokens": 64, **kw})
    return LLMEngine(args, weights=w)


def hybrid(mini_dir, monkeypatch, **kw) -> LLMEngine:
    """A float64 CPU engine whose forward is compiled with the splitting ops and whose token
    pieces replay recorded graphs at BUCKETS."""
    eng = engine(mini_dir, **kw)
    r = eng.runner
    fwd = C.CompiledForward(r.model, r.cache, C.CompileConfig(backend="post_grad_eager", splitting_ops=SPLITTING_OPS,
                                                              split=eng.args.decoder_swa_bounded_replay))
    r.use_forward(fwd, static_shapes=True)
    with torch.inference_mode():
        fwd(r.padding_batch(BUCKETS[-1]), r.cache)
    fwd.finish_warmup()
    for p in fwd.piece_graphs.pieces:
        p.fn = recorded(p.fn)
    with monkeypatch.context() as m:
        m.setattr(r, "device", SimpleNamespace(type="cuda"))      # TokenGraphRunner's device check
        r.graphs = TokenGraphRunner(r, BUCKETS)
        eng.graph_report = r.graphs.capture(progress=False)
    return eng


@pytest.fixture(scope="module")
def module_patch():
    with pytest.MonkeyPatch.context() as m:
        yield m


@pytest.fixture(scope="module")
def every_row(mini_dir, module_patch):
    """TR_HYBRID with decoder bounded replay off: every layer runs every row."""
    from tests.test_cuda_graph_cpu import RecordedGraph, recording
    module_patch.setattr(torch.cuda, "CUDAGraph", RecordedGraph)
    module_patch.setattr(torch.cuda, "graph", recording)
    module_patch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    module_patch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: 0)
    return hybrid(mini_dir, module_patch, decoder_swa_bounded_replay=False)


@pytest.fixture(scope="module")
def bounded(mini_dir, module_patch, every_row):
    """TR_HYBRID with decoder bounded replay on (the default): _EarlyLayers/_LateLayers."""
    return hybrid(mini_dir, module_patch)


def test_the_split_cuts_each_layer_at_its_splitting_ops(every_row):
    eng = every_row
    fwd = eng.runner.forward
    graphs = fwd.piece_graphs
    (seg, be), = fwd.backends.items()
    assert seg == "_Backbone"
    split_gm = be.installed[0][0]
    for gm, target, sub in be.installed:
        for n in sub.graph.nodes:            # the Dynamo piece behind each compiled one
            assert n.op != "call_function" or op_name(n.target) not in SPLITTING_OPS, (target, n)
    installed = {t for _, t, _ in be.installed}
    eager = [n.target for n in split_gm.graph.nodes if n.op == "call_module" and n.target not in installed]
    ops_in_eager = set()
    for t in eager[1:]:                      # eager[0]: the hoisted cache views
        sub = getattr(split_gm, t)
        calls = [n for n in sub.graph.nodes if n.op == "call_function"]
        assert calls and all(op_name(n.target) in SPLITTING_OPS for n in calls), t
        ops_in_eager |= {op_name(n.target) for n in calls}
    assert ops_in_eager == set(SPLITTING_OPS)
    # token pieces per layer, by role: one before and one after attention (WINDOW; REUSE reads
    # its owner's top-k), more where a FULL owner compresses and scores between them
    per_layer = {}
    for p in graphs.pieces:
        layer = p.name.split("layers.")[1].split("#")[0] if "layers." in p.name else "outside"
        per_layer[layer] = per_layer.get(layer, 0) + 1
    roles = [s.role.name + (str(s.ratio) if s.ratio else "") for s in eng.cfg.topology.backbone]
    assert per_layer.pop("outside") == 2                     # the embedding, the final norm
    got = {}
    for k, v in per_layer.items():
        got.setdefault(roles[int(k)], set()).add(v)
    assert got == EXPECTED_PIECES, got
    assert graphs.counts()["graphs"] == len(graphs.pieces) * len(BUCKETS)
    assert eng.graph_report["graphs"] == len(graphs.pieces) * len(BUCKETS)


def steps_through(eng, step, max_tokens=6) -> tuple[list, list]:
    """REQS through `eng`, `step(sb)` running each scheduled step (a prefill step first, then
    decode steps, and a prompt arriving on the third step: mixed steps); returns the step kinds
    and each request's tokens, after checking that no page or slot leaked."""
    p = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    seqs = [eng.add_request(t, p) for t in REQS]
    kinds = []
    while eng.has_unfinished():
        if len(kinds) == 2:
            seqs += [eng.add_request(t, p) for t in H.prompts((23,), seed=9)]
        sb = eng.scheduler.schedule()
        kinds.append("decode" if sb.decode else "prefill" if not any(s.num_computed for s in sb.seqs) else "mixed")
        step(sb)
    eng.bm.check([])
    assert eng.bm.all_free
    return kinds, [s.completion_token_ids for s in seqs]


def engine_step(eng):
    """What LLMEngine.step does with a scheduled batch (run, sample, commit)."""
    def step(sb):
        eng.scheduler.schedule = lambda: sb
        try:
            eng.step()
        finally:
            del eng.scheduler.schedule
    return step


def planes(cache) -> list[torch.Tensor]:
    """Every cache plane: ring, cursors, images, and each owner's main, index and tail planes."""
    owned = [t for o in cache.owners.values() for t in (o.main, o.index, o.index_scale, o.tail_v, o.tail_g)
             if t is not None]
    return [cache.ring, cache.cursor, cache.image_ring, cache.image_cursor, *owned]


def run_from(r, sb, state, **width) -> tuple[torch.Tensor, list]:
    """`sb` run from cache `state` (a planes() copy): its logits and the planes after it."""
    for t, v in zip(planes(r.cache), state):
        t.copy_(v)
    lg = r.run(sb, **width).clone()
    return lg, [t.clone() for t in planes(r.cache)]


def same(a, b) -> bool:
    """Bit for bit (NaN rows and FP8/FP4 planes included)."""
    return all(torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
               for x, y in zip(a, b, strict=True))


def replayed_equals_plain(eng, sb, seen: list) -> None:
    """`sb` replayed at its width == the compiled forward without graphs at that width (logits,
    NaN rows included, and every cache plane, bit for bit); `seen` gets (decoder rows, of them
    padding) of the step. Then the step is committed."""
    r = eng.runner
    width = r.graphs.width_for(sb)
    assert width is not None
    state = [t.clone() for t in planes(r.cache)]
    graphed, after = run_from(r, sb, state)
    dec = r.prepare(sb, **r.graphs.running(width)).decoder
    if dec is not None:
        seen.append((len(dec.rows), int((dec.batch.batch_ids == -1).sum())))
    plain, after_plain = run_from(r, sb, state, **r.graphs.running(width))
    assert same([graphed, *after], [plain, *after_plain])
    final = np.flatnonzero(sb.is_final_chunk)
    eng.scheduler.postprocess(sb, {sb.seqs[i].seq_id: int(plain[i].argmax()) for i in final})


@pytest.mark.parametrize("name", ["every_row", "bounded"])
def test_a_replayed_step_equals_the_compiled_forward_at_its_width(request, name):
    eng = request.getfixturevalue(name)
    graphs = eng.runner.forward.piece_graphs
    before, seen = graphs.counts(), []
    kinds, _ = steps_through(eng, lambda sb: replayed_equals_plain(eng, sb, seen))
    assert {"prefill", "decode", "mixed"} <= set(kinds)
    after = graphs.counts()
    assert after["replays"] - before["replays"] >= len(kinds) * len(graphs.pieces) // 2
    assert after["misses"] == before["misses"]           # every piece of every step replayed
    if name == "bounded":        # the prompt-finishing steps ran the decoder on padded rows
        assert len(seen) >= 2 and all(n in BUCKETS for n, _ in seen) and any(pad for _, pad in seen), seen


def test_padding_the_decoder_rows_changes_no_real_row(bounded):
    """A prompt-finishing step and a mixed step, compiled without graphs at the step's width:
    the decoder's rows padded to a bucket are inert (batch id, window and every destination -1,
    never a query row) and leave the cache planes of the exact rows bit for bit. The logits
    agree to rounding only: the CPU's float64 GEMM rounds a row by the row count (rows of a
    [37, K] @ W differ in the last bit from the same rows of [64, K] @ W), as for the main
    batch's padding to its bucket, which is why replay is compared at the same width."""
    eng, r = bounded, bounded.runner
    graphs, padded = r.graphs, 0

    def step(sb):
        nonlocal padded
        width = graphs.running(graphs.width_for(sb))
        state = [t.clone() for t in planes(r.cache)]
        exact = run_from(r, sb, state, running_tokens=width["running_tokens"])
        pad = run_from(r, sb, state, **width)
        assert same(exact[1], pad[1])
        torch.testing.assert_close(pad[0], exact[0], rtol=1e-12, atol=1e-12, equal_nan=True)
        dec = r.prepare(sb, **width).decoder
        if dec is not None:
            b, n = dec.batch, int((dec.batch.batch_ids >= 0).sum())
            assert len(dec.rows) in BUCKETS and (b.batch_ids[:n] >= 0).all() and bool((dec.queries.rows < n).all())
            for t in (b.batch_ids, b.win_idx, b.ring_dest, b.tail_src, b.tail_dst, *b.owner_dest.values()):
                assert (t[n:] == -1).all()
            assert b.image_dest is None or (b.image_dest[n:] == -1).all()
            padded += n < len(dec.rows)
        final = np.flatnonzero(sb.is_final_chunk)
        eng.scheduler.postprocess(sb, {sb.seqs[i].seq_id: int(pad[0][i].argmax()) for i in final})
    kinds, _ = steps_through(eng, step)
    assert {"prefill", "mixed"} <= set(kinds) and padded >= 2


@pytest.mark.parametrize("name", ["every_row", "bounded"])
def test_tokens_through_the_engine_equal_the_eager_engine(request, mini_dir, name):
    eng = request.getfixturevalue(name)
    plain = engine(mini_dir, decoder_swa_bounded_replay=eng.args.decoder_swa_bounded_replay)
    for e in (plain, eng):
        e.scheduler.max_prefill_chunk = 9                     # chunked prompts beside decode rows
    graphs = eng.runner.forward.piece_graphs
    replays = graphs.counts()["replays"]
    want = steps_through(plain, engine_step(plain))
    got = steps_through(eng, engine_step(eng))
    eng.scheduler.max_prefill_chunk = eng.args.max_num_batched_tokens
    assert got == want
    assert graphs.counts()["replays"] > replays
    assert graphs.counts()["misses"] == 0


def test_padding_rows_of_a_replay_write_nothing(every_row, mini_dir):
    graphed = planes_written_by_a_step(every_row)         # 3 decoding requests at bucket 4
    plain = planes_written_by_a_step(engine(mini_dir, decoder_swa_bounded_replay=False))
    assert all(torch.equal(a, b) for a, b in zip(graphed, plain))
    assert any(a.any() for a in graphed)


def test_token_buckets():
    assert token_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert token_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert token_buckets(8192) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@pytest.mark.parametrize("name", ["every_row", "bounded"])
def test_prefix_hits_leave_the_tokens_of_the_eager_engine(request, mini_dir, monkeypatch, name):
    """The fork prompts (H.FORKS: hits of 1-4 PAGEs, on and off a PAGE boundary) on the replaying
    engine, its prefix cache emptied first: the eager engine's greedy tokens, hits replayed.
    After the padding test, which compares cache rows with a fresh engine's."""
    eng = request.getfixturevalue(name)
    for rid in list(eng.seqs):
        eng.abort(rid)
    assert eng.bm.prefix_caching and eng.bm.reset_prefix_cache()
    sc = H.FORKS
    kw = {"decoder_swa_bounded_replay": eng.args.decoder_swa_bounded_replay, **sc.engine}
    monkeypatch.setattr(H, "make_engine", lambda w, dtype, **_: engine(mini_dir, **kw))
    want = H.run(None, sc.requests(), max_tokens=6, scenario=sc)
    monkeypatch.setattr(eng.scheduler, "max_prefill_chunk", sc.engine["max_prefill_chunk"])
    monkeypatch.setattr(H, "make_engine", lambda w, dtype, **_: eng)
    hits, replays = eng.bm.stats["hit_tokens"], eng.runner.forward.piece_graphs.counts()["replays"]
    got = H.run(None, sc.requests(), max_tokens=6, scenario=sc)
    assert got == want
    assert eng.bm.stats["hit_tokens"] - hits >= 10 * H.PAGE
    assert eng.runner.forward.piece_graphs.counts()["replays"] > replays


@pytest.mark.parametrize("name", ["every_row", "bounded"])
def test_cancellations_leave_the_tokens_of_the_eager_engine(request, mini_dir, monkeypatch, name):
    """tests/test_cuda_graph_gpu.py's cancel scenario (requests cancelled waiting, mid prefill,
    mid decode; at most 3 running, so slots and pages are reused) on the replaying engine: the
    eager engine's greedy tokens. Last in the file: it leaves the shared engine's cache rows other
    than a fresh engine's, which test_padding_rows_of_a_replay_write_nothing compares; the
    requests earlier tests left running are cancelled first."""
    eng = request.getfixturevalue(name)
    for rid in list(eng.seqs):
        eng.abort(rid)
    assert eng.bm.all_free
    sc = H.CANCEL
    kw = {"decoder_swa_bounded_replay": eng.args.decoder_swa_bounded_replay, **sc.engine}
    monkeypatch.setattr(H, "make_engine", lambda w, dtype, **_: engine(mini_dir, **kw))
    want = H.run(None, H.prompts(), scenario=sc)
    monkeypatch.setattr(eng.scheduler, "max_num_seqs", 3)
    monkeypatch.setattr(H, "make_engine", lambda w, dtype, **_: eng)
    replays = eng.runner.forward.piece_graphs.counts()["replays"]
    got = H.run(None, H.prompts(), scenario=sc)
    assert None in got.values() and got == want
    assert eng.runner.forward.piece_graphs.counts()["replays"] > replays
