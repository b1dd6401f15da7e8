"""One trace, no recompiles (runtime/compile/segments.py, forward.py): only the token dim is
dynamic, so each segment is one Dynamo graph, traced once, for every token count 1..512; padding
rows write nothing; a recompile while serving is an error."""
import pytest
import torch

from tests import harness as H
from tests.compile_helpers import _planes, compiled, mini, mini_engine, snapshot, step_logits  # noqa: F401


def _layer_inputs(fwd, runner, T):
    """X and pre after the early layers (as every layer segment receives them: same shapes), and
    the sel dict each of _Layer<boundary>, _LateLayers and _Layer<last> receives, for T padding
    rows (run eagerly)."""
    b, pts = runner.padding_batch(T), fwd.points
    sel: dict = {}
    sels = {}
    with torch.inference_mode():
        X, pre = fwd.segments["_EarlyLayers"](b, runner.cache, sel)
        sels[f"_Layer{pts.boundary}"] = dict(sel)
        X, pre = runner.model.layers[pts.boundary](X, pre, b, runner.cache, sel)
        sels["_LateLayers"] = dict(sel)
        for i in pts.late:
            X, pre = runner.model.layers[i](X, pre, b, runner.cache, sel)
        sels[f"_Layer{pts.last}"] = dict(sel)
    return X, pre, sels


class ShapeRecorder:
    """A counting Dynamo backend that also keeps each graph's shape environment."""

    def __init__(self):
        from torch._dynamo.testing import CompileCounter
        self.counter, self.shape_envs = CompileCounter(), []

    def __call__(self, gm, example_inputs):
        self.shape_envs.append(torch._guards.TracingContext.get().fake_mode.shape_env)
        return self.counter(gm, example_inputs)


@pytest.fixture(scope="module")
def mini_guarded(mini):
    """The split mini model traced by a ShapeRecorder with Dynamo's guards kept, once, at 512
    rows (the step budget), then warm: (engine, forward, recorder)."""
    eng = mini_engine(mini, max_num_seqs=8, max_num_batched_tokens=512)
    rec = ShapeRecorder()
    fwd = compiled(eng.runner, backend=rec, drop_guards=False)
    with torch.inference_mode():
        fwd(eng.runner.padding_batch(512), eng.runner.cache)
    fwd.finish_warmup()
    return eng, fwd, rec


def test_one_graph_per_segment_and_no_recompiles(mini_guarded):
    """Counting backend, guards kept, on the mini model (every layer role, a fifth of the toy's
    trace): one Dynamo graph per segment, traced once at 512 rows. Nothing in it is specialized
    on the token count: every guard holds for every count 2..512 (each shape environment's
    guards, and Dynamo's own guard check, no model run) and, at 1, only the 0/1-specialization
    artifacts `T != 1` fail (from torch.einsum's size-1 fast path; the served graphs drop every
    guard, and the acceptance test runs 1-row steps bitwise equal to eager). Real steps of 1..39
    rows and padding widths up to 512 then run under fail_on_recompile."""
    import sympy
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    eng, fwd, rec = mini_guarded
    runner = eng.runner
    layer_segments = ("_LateLayers", "_Layer5", "_Layer7")        # same inputs: X, pre, batch, cache, sel
    assert rec.counter.frame_count == 4
    entries = {n: _debug_get_cache_entry_list(f.__code__) for n, f in fwd.raw.items()}
    assert {n: len(e) for n, e in entries.items()} == {"_EarlyLayers": 1, **{n: 1 for n in layer_segments}}
    for env in rec.shape_envs:
        for T in range(1, 513):
            bad = []
            for g in env.guards:     # (xreplace: subs' evaluation, 20x faster)
                v = g.expr.xreplace({s: sympy.Integer(T) for s in g.expr.free_symbols})
                if v is not sympy.true and not (isinstance(v, sympy.logic.boolalg.BooleanAtom) and bool(v)):
                    bad.append(g.expr)
            if T == 1:
                assert all(isinstance(e, sympy.Ne) and 1 in e.args for e in bad), bad
            else:
                assert not bad, (T, bad)
    X4, pre4, sels4 = _layer_inputs(fwd, runner, 4)
    seg_e = fwd.segments["_EarlyLayers"]
    snap = snapshot(runner.cache)   # (padding rows write nothing; checked below)
    with torch.inference_mode():
        for T in range(2, 513):
            b = runner.padding_batch(T)
            assert entries["_EarlyLayers"][0].guard_manager.check(
                {"self": seg_e, "batch": b, "cache": runner.cache, "sel": {}}), T
            X, pre = X4.new_empty((T,) + X4.shape[1:]), pre4.new_empty((T,) + pre4.shape[1:])
            for n in layer_segments:
                sel = {k: v.new_empty((T,) + v.shape[1:]) for k, v in sels4[n].items()}
                assert entries[n][0].guard_manager.check(
                    {"self": fwd.segments[n], "X": X, "pre": pre, "batch": b, "cache": runner.cache, "sel": sel}), (n, T)
    served = compiled(runner, backend=rec)          # as served: guards dropped
    for T in (512, 1, 2, 3, 17, 255, 511):
        with torch.inference_mode():
            served(runner.padding_batch(T), runner.cache)
        if T == 512:
            served.finish_warmup()
    assert all(torch.equal(v, snap[k]) for k, v in _planes(runner.cache)), "padding rows wrote state"
    step_logits(eng, H.prompts((1, 5, 33), seed=5))
    assert rec.counter.frame_count == 8            # 4 traced with guards, 4 for the served graphs


def test_recompile_while_serving_is_an_error(mini_guarded):
    """With guards kept, an input the graph was not traced for fails instead of recompiling."""
    eng, fwd, _ = mini_guarded
    b = eng.runner.padding_batch(8)
    b.positions = b.positions.to(torch.int32)          # a dtype the trace did not see
    with pytest.raises(Exception, match="(?i)recompil"), torch.inference_mode():
        fwd(b, eng.runner.cache)
