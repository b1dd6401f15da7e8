"""The forward as segments (runtime/compile/segments.py, forward.py): split points of any
topology, the split forward equal to the unsplit one (eager, and compiled split or as one
_Backbone graph), the per-piece check of a compiled forward (runtime/piece_check.py), and traced
segments shared only through a TraceCache."""
import pytest
import torch

from runtime import compile as C
from runtime.sequence import SamplingParams
from tests import harness as H
from tests.compile_helpers import MINI_REQS, compiled, mini, mini_engine, step_logits  # noqa: F401  (mini: a fixture)


def test_split_points_follow_the_topology(toy_cfg, mini):
    from v41.config import preset
    for cfg in (toy_cfg, preset("flash")):
        p = C.SplitPoints.of(cfg)
        assert (p.boundary, p.last, p.early, p.late, p.single) == (20, 39, range(0, 20), range(21, 39), (20, 39))
    p = C.SplitPoints.of(mini[1])
    assert (p.early, p.late, p.single) == (range(0, 5), range(6, 7), (5, 7))


def test_split_forward_equals_unsplit_eager(toy_weights):
    """_EarlyLayers + layer 20 + _LateLayers + layer 39 + final norm, run eagerly, is the eager
    Transformer.forward bit for bit, step after step (cache writes included)."""
    reqs = H.prompts((5, 17, 40, 70), seed=3)
    ref = step_logits(H.make_engine(toy_weights, "float32"), reqs)
    eng = H.make_engine(toy_weights, "float32")
    model, pts = eng.runner.model, C.SplitPoints.of(eng.cfg)
    early, late = C._EarlyLayers(model, pts.early), C._LateLayers(model, pts.late)
    eng.runner.use_forward(lambda b, c: C.split_forward(model, b, c, early, late, pts), static_shapes=False)
    got = step_logits(eng, reqs)
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.fixture(scope="module")
def mini_backbone(mini):
    """The mini model as one _Backbone graph, Dynamo's graph run as traced (a counting backend:
    no AOT, the cheapest compiled run), traced at 64 padding rows, then MINI_REQS' steps under
    fail_on_recompile: (engine, forward, counter, every step's logits). Shared by the two tests
    below."""
    from torch._dynamo.testing import CompileCounter
    eng = mini_engine(mini, decoder_swa_bounded_replay=False)
    cnt = CompileCounter()
    fwd = compiled(eng.runner, split=False, backend=cnt)
    with torch.inference_mode():
        fwd(eng.runner.padding_batch(64), eng.runner.cache)
    fwd.finish_warmup()
    return eng, fwd, cnt, step_logits(eng, MINI_REQS)


@pytest.fixture(scope="module")
def mini_split(mini):
    """The mini model compiled as _EarlyLayers/_LateLayers (the piecewise backend,
    post_grad_eager, every pass with auto lowering: on the CPU the fused ops run their reference
    impls, the eager arithmetic), traced at 64 padding rows, its _QueryLayer7 too (as
    compile_runner does): (engine, forward)."""
    eng = mini_engine(mini)
    fwd = compiled(eng.runner, split=True)
    with torch.inference_mode():
        fwd(eng.runner.padding_batch(64), eng.runner.cache)
        fwd.trace_query_layer(eng.runner, 64)
    return eng, fwd


def test_split_equals_unsplit_compiled(mini, mini_backbone, mini_split):
    """Split (decoder bounded replay) or as one _Backbone (every row through every layer): the
    eager model's logits of the same setting bit for bit, step after step."""
    ref = step_logits(mini_engine(mini), MINI_REQS)
    ref_full = step_logits(mini_engine(mini, decoder_swa_bounded_replay=False), MINI_REQS)
    eng, fwd = mini_split
    split = step_logits(eng, MINI_REQS)
    assert list(fwd.segments) == ["_EarlyLayers", "_LateLayers", "_Layer5", "_Layer7", "_QueryLayer7"]
    assert fwd.stats()["matches"]["mhc"] > 0              # the passes ran on these layers' roles
    unsplit = mini_backbone[3]
    assert len(split) == len(ref) and len(unsplit) == len(ref_full)
    assert all(torch.equal(a, r) for a, r in zip(split, ref))
    assert all(torch.equal(b, r) for b, r in zip(unsplit, ref_full))


def test_no_layer_runs_eagerly(mini, mini_split):
    """A step with a decoder plan (a prompt chunk) runs the boundary layer (5 in the mini model)
    compiled on the decoder's rows (_Layer5) and the last layer (7) compiled on its query rows
    (_QueryLayer7); decode steps run both as _Layer5 and _Layer7: no step calls a layer's Python
    forward."""
    eng, fwd = mini_split
    calls = []
    for i in (5, 7):
        block = eng.runner.model.layers[i]
        block.forward = lambda *a, _f=block.forward, _i=i, **k: (calls.append(_i), _f(*a, **k))[1]
    try:
        eng.add_request(MINI_REQS[1], SamplingParams(max_tokens=3, ignore_eos=True), "eager-layers")
        per_step = []
        while eng.has_unfinished():
            calls.clear()
            eng.step()
            per_step.append(list(calls))
    finally:
        for i in (5, 7):
            del eng.runner.model.layers[i].forward
    prompt, *decode = per_step
    assert prompt == [] and decode == [[], []], per_step


def test_piece_check_finds_the_wrong_piece(mini_split, monkeypatch, tmp_path):
    """compare_pieces: every compiled layer piece against its Dynamo graph on the same inputs.
    Reference impls: all equal. RMSNorm ops that forget their weight: the layer pieces (each
    normalizes) stand out, the embedding piece does not."""
    from runtime.piece_check import by_piece, compare_pieces
    eng, fwd = mini_split
    with compare_pieces(fwd, eager_twice=True, save_dir=tmp_path) as rows:
        step_logits(eng, MINI_REQS[:1], max_tokens=2, prefix="check")
    pieces = {r["piece"] for r in rows}
    # embedding, layers 0-4 and 6, 5 and 7 as _Layer5 / _Layer7 (decode steps), 7 as _QueryLayer7 (the prompt step)
    assert len(pieces) == 10 and {"_Layer5.submod_1", "_Layer7.submod_1", "_QueryLayer7.submod_1"} <= pieces, pieces
    assert all(r["rel_l2"] == r["ids_differing"] == r["inputs_rel_l2"] == r["eager_rel_l2"] == 0 for r in rows)
    saved = torch.load(tmp_path / "_EarlyLayers.submod_2.pt")
    assert all(torch.equal(a, b) for a, b in zip(saved["compiled"], saved["eager"]))

    import custom_ops.norm
    norm = custom_ops.norm._rms_norm       # what the rms_norm ops' reference impls call
    monkeypatch.setattr(custom_ops.norm, "_rms_norm", lambda x, w, eps: norm(x, torch.ones_like(w), eps))
    with compare_pieces(fwd) as rows:
        step_logits(eng, MINI_REQS[:1], max_tokens=2, prefix="broken")
    worst = {p: w["rel_l2"] for p, w in by_piece(rows).items()}
    assert worst.pop("_EarlyLayers.submod_1") == 0
    assert min(worst.values()) > 1e-3, worst


def test_piece_check_reference_catches_an_impl_wrong_in_both_paths(mini_split):
    """An impl of an op of the model's own graph (here the experts) that is wrong the same way in
    the compiled and the eager run agrees with itself (rel_l2 0); `reference=True` runs the
    graph once more on the definitions and shows both runs apart from it."""
    from custom_ops import registry
    from runtime.piece_check import by_piece, compare_pieces
    eng, fwd = mini_split
    ref = registry._reference_fns["v41::moe_experts"]

    def loud(*args):
        ref(*args)
        args[-1].mul_(1.5)
    registry.register_impl("moe_experts", "loud", loud, device_type="cpu")
    try:
        with compare_pieces(fwd, reference=True) as rows:
            step_logits(eng, MINI_REQS[:1], max_tokens=2, prefix="both-wrong")
    finally:
        registry.select("moe_experts", "reference", "cpu")
    worst = by_piece(rows)
    assert all(w["rel_l2"] == 0 for w in worst.values()), worst
    emb = worst.pop("_EarlyLayers.submod_1")
    assert emb["vs_reference"] == emb["eager_vs_reference"] == 0
    assert all(w["vs_reference"] > 1e-3 and w["eager_vs_reference"] > 1e-3 for w in worst.values()), worst


def test_trace_cache_is_opt_in(mini):
    """Forwards share traced segments only through a TraceCache they are given (or the active
    one, for compile_runner): same key and signature, one set of segment functions."""
    r = mini_engine(mini).runner
    cc = C.CompileConfig(backend="eager")
    traces = C.TraceCache()
    a = C.CompiledForward(r.model, r.cache, cc, share_key="k", traces=traces)
    b = C.CompiledForward(r.model, r.cache, cc, share_key="k", traces=traces)
    alone = C.CompiledForward(r.model, r.cache, cc, share_key="k")
    assert not a.shared and b.shared and b.fns is a.fns and not alone.shared and len(traces) == 1
    a.finish_warmup()
    assert C.CompiledForward(r.model, r.cache, cc, share_key="k", traces=traces).warm and not alone.warm
    assert C.TraceCache.current() is None
    with traces.active():
        assert C.TraceCache.current() is traces
    assert C.TraceCache.current() is None


def test_backbone_is_one_graph(mini_backbone):
    """Bounded replay off: the whole forward is one graph, traced once, for every width."""
    eng, fwd, cnt, _ = mini_backbone          # traced once at 64 rows, then real steps
    for T in (1, 2, 64):
        with torch.inference_mode():
            fwd(eng.runner.padding_batch(T), eng.runner.cache)
    assert cnt.frame_count == 1 and list(fwd.segments) == ["_Backbone"]
