"""The compile pipeline (runtime/compile.py, passes/): split points and split == unsplit, one
graph per segment and no recompiles over token counts 1..512, each pass's match count on the
toy graph with outputs equal to the unpassed graph's, backend selection, compile keys and the
keyed cache directory, dumps, flags. The acceptance (the compiled toy against the eager one
over the schedule-invariance harness) and the prebuild are tests/test_compiled_invariance.py.

Compiled runs use the "post_grad_eager" backend (Inductor's whole graph pipeline: AOT,
decompositions, joint-graph and post-grad passes, ours included, without its C++ code
generation) or, where only Dynamo's graph matters, a counting backend; models are small (the
mini model has every layer role in 8 layers, the pass tests cut the toy to 3 layers); the pass
tests share one compile (see "passes" below). Dynamo and AOT are most of a compile's cost on the
CPU. Inductor itself runs in the dump test and in the acceptance module.
"""
import copy
import dataclasses
import json
import os
import threading
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO / ".cache" / "inductor"))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from runtime import compile as C  # noqa: E402
from runtime.engine import EngineArgs, LLMEngine  # noqa: E402
from runtime.geometry import AdmissionError  # noqa: E402
from runtime.sequence import SamplingParams  # noqa: E402
from tests import harness as H  # noqa: E402

# matches of each fusion pass on the toy graph of layers 0-2 (WINDOW, WINDOW + Engram, FULL with
# ratio 2) plus the final collapse and norm: per layer inverse RoPE + wo_a 1; RoPE 2 (q, kv +
# QAT) and 3 more in a FULL layer (index query, index key, main row); mHC 6 (2 mixes, 2
# collapses, 2 expands) + the final collapse; router 1; Engram gate in layer 1; RMSNorm 4 (attn,
# q, kv, ffn) and 2 more in a FULL layer (compressor, index key) + the final norm
EXPECTED = {"inv_rope_wo_a": 3, "rope_qat": 9, "mhc": 19, "moe_route": 3, "engram_gate": 1,
            "rms_norm_quant": 15}


# ---- helpers ---------------------------------------------------------------------------------

def step_logits(eng, reqs, max_tokens=4, prefix="q"):
    """Every step's logits of all rows; greedy continuation on the engine's own argmax."""
    p = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, r in enumerate(reqs):
        eng.add_request(r, p, f"{prefix}{i}")
    out = []
    while eng.has_unfinished():
        sb = eng.scheduler.schedule()
        lg = eng.runner.run(sb, all_rows=True)
        out.append(lg)
        last = np.cumsum(sb.num_new) - 1
        eng.scheduler.postprocess(sb, {sb.seqs[i].seq_id: int(lg[last[i]].argmax())
                                       for i, f in enumerate(sb.is_final_chunk) if f})
    return out


def snapshot(cache):
    return {k: v.clone() for k, v in _planes(cache)}


def restore(cache, snap):
    for k, v in _planes(cache):
        v.copy_(snap[k])


def _planes(cache):
    for k, v in vars(cache).items():
        if isinstance(v, torch.Tensor):
            yield k, v
    for o, planes in cache.owners.items():
        for k, v in vars(planes).items():
            if isinstance(v, torch.Tensor):
                yield f"{o}.{k}", v


def compiled(runner, **kw) -> C.CompiledForward:
    """Install a CompiledForward (default: post_grad_eager, passes on) as the runner's forward."""
    pm = kw.pop("pass_manager", None)
    fwd = C.CompiledForward(runner.model, runner.cache, C.CompileConfig(**{"backend": "post_grad_eager", **kw}),
                            pass_manager=pm)
    runner.use_forward(fwd, static_shapes=True)
    return fwd


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    """H.mini_cfg() written as a checkpoint directory, with dummy weights."""
    from v41.loader import dummy_weights
    cfg = H.mini_cfg()
    d = tmp_path_factory.mktemp("mini")
    (d / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    return str(d), cfg, dummy_weights(cfg, progress=False)


def mini_engine(mini, **kw):
    path, _, w = mini
    args = EngineArgs(model=path, dtype="float32", device="cpu",
                      **{"max_num_seqs": 4, "max_num_batched_tokens": 64, **kw})
    return LLMEngine(args, weights=w)


# ---- split ----------------------------------------------------------------------------------

def test_split_points_follow_the_topology(toy_cfg, mini):
    from v41.config import preset
    for cfg in (toy_cfg, preset("flash")):
        p = C.SplitPoints.of(cfg)
        assert (p.boundary, p.last, p.early, p.late, p.eager) == (20, 39, range(0, 20), range(21, 39), (20, 39))
    p = C.SplitPoints.of(mini[1])
    assert (p.early, p.late, p.eager) == (range(0, 5), range(6, 7), (5, 7))


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


MINI_REQS = H.prompts((5, 17, 40), seed=4)


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
    impls, the eager arithmetic), traced at 64 padding rows: (engine, forward)."""
    eng = mini_engine(mini)
    fwd = compiled(eng.runner, split=True)
    with torch.inference_mode():
        fwd(eng.runner.padding_batch(64), eng.runner.cache)
    return eng, fwd


def test_split_equals_unsplit_compiled(mini, mini_backbone, mini_split):
    """Split or as one _Backbone: the eager model's logits bit for bit, step after step."""
    ref = step_logits(mini_engine(mini), MINI_REQS)
    eng, fwd = mini_split
    split = step_logits(eng, MINI_REQS)
    assert list(fwd.segments) == ["_EarlyLayers", "_LateLayers"]
    assert fwd.stats()["matches"]["mhc"] > 0              # the passes ran on these layers' roles
    unsplit = mini_backbone[3]
    assert len(split) == len(unsplit) == len(ref)
    for a, b, r in zip(split, unsplit, ref):
        assert torch.equal(a, r) and torch.equal(b, r)


def test_piece_check_finds_the_wrong_piece(mini_split, monkeypatch, tmp_path):
    """compare_pieces: every compiled layer piece against its Dynamo graph on the same inputs.
    Reference impls: all equal. RMSNorm ops that forget their weight: the layer pieces (each
    normalizes) stand out, the embedding piece does not."""
    from runtime.piece_check import by_piece, compare_pieces
    eng, fwd = mini_split
    with compare_pieces(fwd, eager_twice=True, save_dir=tmp_path) as rows:
        step_logits(eng, MINI_REQS[:1], max_tokens=2, prefix="check")
    pieces = {r["piece"] for r in rows}
    assert len(pieces) == 7                   # embedding, layers 0-4, layer 6 (5 and 7 eager)
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


# ---- one trace, no recompiles ---------------------------------------------------------------

def _late_inputs(fwd, runner, T):
    """X, pre and sel as _LateLayers receives them, for T padding rows (run eagerly)."""
    b = runner.padding_batch(T)
    sel: dict = {}
    with torch.inference_mode():
        X, pre = fwd.segments["_EarlyLayers"](b, runner.cache, sel)
        X, pre = runner.model.layers[fwd.points.boundary](X, pre, b, runner.cache, sel)
    return X, pre, sel


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
    assert rec.counter.frame_count == 2
    entries = {n: _debug_get_cache_entry_list(f.__code__) for n, f in fwd.raw.items()}
    assert {n: len(e) for n, e in entries.items()} == {"_EarlyLayers": 1, "_LateLayers": 1}
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
    X4, pre4, sel4 = _late_inputs(fwd, runner, 4)
    seg_e, seg_l = fwd.segments["_EarlyLayers"], fwd.segments["_LateLayers"]
    snap = snapshot(runner.cache)   # (padding rows write nothing; checked below)
    with torch.inference_mode():
        for T in range(2, 513):
            b = runner.padding_batch(T)
            assert entries["_EarlyLayers"][0].guard_manager.check(
                {"self": seg_e, "batch": b, "cache": runner.cache, "sel": {}}), T
            sel = {k: v.new_empty((T,) + v.shape[1:]) for k, v in sel4.items()}
            X, pre = X4.new_empty((T,) + X4.shape[1:]), pre4.new_empty((T,) + pre4.shape[1:])
            assert entries["_LateLayers"][0].guard_manager.check(
                {"self": seg_l, "X": X, "pre": pre, "batch": b, "cache": runner.cache, "sel": sel}), T
    served = compiled(runner, backend=rec)          # as served: guards dropped
    for T in (512, 1, 2, 3, 17, 255, 511):
        with torch.inference_mode():
            served(runner.padding_batch(T), runner.cache)
        if T == 512:
            served.finish_warmup()
    assert all(torch.equal(v, snap[k]) for k, v in _planes(runner.cache)), "padding rows wrote state"
    step_logits(eng, H.prompts((1, 5, 33), seed=5))
    assert rec.counter.frame_count == 4            # 2 traced with guards, 2 for the served graphs


def test_backbone_is_one_graph(mini_backbone):
    """Bounded replay off: the whole forward is one graph, traced once, for every width."""
    eng, fwd, cnt, _ = mini_backbone          # traced once at 64 rows, then real steps
    for T in (1, 2, 64):
        with torch.inference_mode():
            fwd(eng.runner.padding_batch(T), eng.runner.cache)
    assert cnt.frame_count == 1 and list(fwd.segments) == ["_Backbone"]


def test_recompile_while_serving_is_an_error(mini_guarded):
    """With guards kept, an input the graph was not traced for fails instead of recompiling."""
    eng, fwd, _ = mini_guarded
    b = eng.runner.padding_batch(8)
    b.positions = b.positions.to(torch.int32)          # a dtype the trace did not see
    with pytest.raises(Exception, match="(?i)recompil"), torch.inference_mode():
        fwd(b, eng.runner.cache)


# ---- passes ---------------------------------------------------------------------------------
#
# Dynamo and AOT cost most of a compile (about 17 of the 22 s of the toy graph below on two CPU
# cores), so the toy graph is compiled once: a recording custom pass keeps every piece's
# graph exactly as our pass manager receives it, and that piece's real inputs, then
# runs all passes (auto lowering). Each test then runs passes on copies of those graphs and
# compares the pieces with the unpassed ones on clones of the same inputs: outputs, and every
# input a piece writes (cache planes).

@dataclasses.dataclass
class ToyPrefix:
    runner: Any
    batch: Any
    snap: dict               # the cache before the step
    eager: torch.Tensor      # the eager model's output
    eager_cache: dict        # and the cache after it


def toy_prefix(toy_weights, n_layers) -> ToyPrefix:
    """The toy with its first `n_layers` layers and the final norm, and one prefill batch (5, 17,
    40 tokens)."""
    eng = H.make_engine(toy_weights, "float32")
    runner = eng.runner
    runner.use_forward(runner.model, static_shapes=True)
    runner.model.layers = runner.model.layers[:n_layers]
    for i, p in enumerate(H.prompts((5, 17, 40), seed=0)):
        eng.add_request(p, SamplingParams(max_tokens=2, ignore_eos=True), f"r{i}")
    batch = runner.prepare(eng.scheduler.schedule())
    with torch.inference_mode():
        snap = snapshot(runner.cache)
        eager = runner.model(batch, runner.cache)
        eager_cache = snapshot(runner.cache)
        restore(runner.cache, snap)
    return ToyPrefix(runner, batch, snap, eager, eager_cache)


@pytest.fixture(scope="module")
def toy3(toy_weights):
    """Layers 0-2 (WINDOW, WINDOW + Engram, FULL with ratio 2) and the final norm."""
    return toy_prefix(toy_weights, 3)


def _clone(a):
    return a.clone() if isinstance(a, torch.Tensor) else a


@dataclasses.dataclass
class Piece:
    graph: torch.fx.Graph              # as the pass manager receives it (a copy)
    root: torch.nn.Module              # the GraphModule that owned it: its constants
    inputs: list | None = None         # the piece's first runtime call, cloned


class PieceRecorder:
    """A custom graph pass (the interface of PassManager) that records each piece,
    then runs `pm` on the graph. The compiled piece is its owning GraphModule (post_grad_eager
    returns the module), so a forward pre-hook on it sees the inputs it is called with."""

    def __init__(self, pm):
        self.pm, self.pieces = pm, []

    def __call__(self, graph: torch.fx.Graph) -> None:
        piece = Piece(copy.deepcopy(graph), graph.owning_module)
        self.pieces.append(piece)

        def keep_inputs(module, args):
            if piece.inputs is None:
                piece.inputs = [_clone(a) for a in args]
        graph.owning_module.register_forward_pre_hook(keep_inputs)
        self.pm(graph)

    def uuid(self):
        return self.pm.uuid()


@pytest.fixture(scope="module")
def toy3_compiled(toy3):
    """The toy graph compiled once (post_grad_eager, all passes, auto lowering) through a
    PieceRecorder: pieces, output, cache after the step, pass manager."""
    from passes import PASS_NAMES
    from passes.manager import PassManager
    runner = toy3.runner
    pm = PassManager(runner.cfg, runner.dtype, lowering="auto", only=PASS_NAMES)
    rec = PieceRecorder(pm)
    fwd = C.CompiledForward(runner.model, runner.cache, C.CompileConfig(split=False, backend="post_grad_eager",
                                                                       passes=False), pass_manager=rec)
    with torch.inference_mode():
        out = fwd(toy3.batch, runner.cache)
        cache = snapshot(runner.cache)
        restore(runner.cache, toy3.snap)
    # prologue (embedding), layers 0, 1, 2 (distinct roles: none reused), epilogue (collapse, norm)
    assert len(rec.pieces) == 5 and all(p.inputs is not None for p in rec.pieces)
    return types.SimpleNamespace(pieces=rec.pieces, out=out, cache=cache, pm=pm)


def run_piece(piece: Piece, pm=None):
    """A copy of the piece's graph, passed through `pm` (None: no pass) as post_grad_eager would,
    run on clones of its inputs: (outputs, inputs after the run)."""
    from torch._inductor.virtualized import V
    gm = torch.fx.GraphModule(piece.root, copy.deepcopy(piece.graph))
    if pm is not None:
        fake = torch._guards.detect_fake_mode([n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")])
        with V.set_fake_mode(fake):
            pm(gm.graph)
        gm.graph.lint()
        gm.recompile()
    args = [_clone(a) for a in piece.inputs]
    with torch.inference_mode():
        out = gm(*args)           # auto_functionalized nodes left by our passes run eagerly
    return list(out), args


@pytest.fixture(scope="module")
def unpassed(toy3_compiled):
    pieces = toy3_compiled.pieces
    got = [run_piece(p) for p in pieces]
    # the inputs-after comparison below is not vacuous: the layer pieces write cache planes
    assert any(not torch.equal(a, b) for p, (_, after) in zip(pieces, got)
               for a, b in zip(p.inputs, after) if isinstance(a, torch.Tensor))
    return got


def assert_pieces_equal(got, ref, exact: bool):
    """Every piece's outputs and inputs after the run: bitwise, or within 1e-5 (FP8 planes
    bitwise still: assert_close has no tolerance for them, and the last-bit differences
    upstream flip no FP8 rounding on this graph)."""
    for i, ((out, after), (ref_out, ref_after)) in enumerate(zip(got, ref, strict=True)):
        for a, b in zip(out + after, ref_out + ref_after, strict=True):
            if not isinstance(a, torch.Tensor):
                assert a == b, i
            elif exact or a.dtype.itemsize == 1:
                assert torch.equal(a, b), f"piece {i}: {(a.double() - b.double()).abs().max()}"
            else:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"piece {i}: {m}")


# mhc_mix's reference impl is the eager MHC.forward, whose torch.softmax (the CPU kernel) differs
# in the last bit from the decomposition (exp / sum) Inductor puts in the unpassed graph; every
# other pass keeps the unpassed graph's arithmetic bit for bit
NOT_BITWISE = {"mhc"}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_pass_matches_and_keeps_outputs(toy3, toy3_compiled, unpassed, name):
    from passes.manager import PassManager
    pm = PassManager(toy3.runner.cfg, toy3.runner.dtype, lowering="op", only=(name,))
    got = [run_piece(p, pm) for p in toy3_compiled.pieces]
    assert pm.totals()[name] == EXPECTED[name]
    assert_pieces_equal(got, unpassed, exact=name not in NOT_BITWISE)


def test_all_passes_then_backend_selection(toy3, toy3_compiled, unpassed):
    from passes import PASS_NAMES
    from passes.backend_select import FUSED_OPS
    from passes.manager import PassManager
    # CPU, auto (the recorded compile ran every pass): every fused op stays an op (its reference
    # impl is the eager arithmetic), so the step is bitwise the eager model's, output and cache
    pm = toy3_compiled.pm
    assert torch.equal(toy3_compiled.out, toy3.eager)
    assert all(torch.equal(v, toy3.eager_cache[k]) for k, v in toy3_compiled.cache.items())
    assert {k: v for k, v in pm.totals().items() if k != "backend_select"} == EXPECTED
    sel = pm.passes[-1]
    assert pm.totals()["backend_select"] > 0 and set(sel.decisions.values()) == {"kept (reference)"}
    assert {k.split("@")[0] for k in sel.decisions} == set(FUSED_OPS)      # all ten on this graph
    # inline: every op lowered back to its reference composition, for Inductor to generate; that
    # is the unpassed graph's arithmetic again, bit for bit
    pm = PassManager(toy3.runner.cfg, toy3.runner.dtype, lowering="inline", only=PASS_NAMES)
    got = [run_piece(p, pm) for p in toy3_compiled.pieces]
    assert {k: v for k, v in pm.totals().items() if k != "backend_select"} == EXPECTED
    assert set(pm.passes[-1].decisions.values()) == {"inlined"}
    assert_pieces_equal(got, unpassed, exact=True)


def _registered_patterns(p):
    """A pattern pass's registered patterns (registering them on an empty graph first)."""
    g = torch.fx.Graph()
    g.output(g.placeholder("x"))
    p(torch.fx.GraphModule(torch.nn.Module(), g).graph)
    seen = {}
    for entries in p._pm.patterns.values():
        for e in entries:
            seen[id(e)] = e.pattern
    return list(seen.values())


def _paths(pattern, memo) -> int:
    """Nodes of a pattern unfolded into a tree: how many the matcher's search up from an
    already matched node (`find_anchor_nodes`, which does not remember what it visited) walks."""
    from torch._inductor.pattern_matcher import PatternExpr
    if id(pattern) not in memo:
        args = getattr(pattern, "flat_args_kwargs", ([],))[0]
        memo[id(pattern)] = 1 + sum(_paths(a, memo) for a in args if isinstance(a, PatternExpr))
    return memo[id(pattern)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_output_patterns_search_few_paths(toy_cfg, dtype):
    """A multi-output pattern's first output is matched down from a candidate node; the others
    are searched up from it, along every path of their unfolded pattern. Sinkhorn's chain reads
    each `c` twice (2^40 paths): it must be the first output, or a graph that almost matches
    (H200, flash-slice, bf16) keeps the matcher busy until the process dies."""
    from passes import build_passes
    from passes.base import PatternPass
    from torch._inductor.pattern_matcher import MultiOutputPattern
    multi = 0
    for p in build_passes(toy_cfg, dtype):
        if not isinstance(p, PatternPass):
            continue
        for pat in _registered_patterns(p):
            if isinstance(pat, MultiOutputPattern):
                multi += 1
                later = [_paths(o, {}) for o in pat.outputs[1:]]
                assert max(later) < 10_000, (p.name, later)
    assert multi >= 3              # mHC mix, the router, RMSNorm + quant


def test_mhc_near_miss_is_rejected_quickly(toy_cfg):
    """pre and post of an mHC mix match; its Sinkhorn (one iteration short) does not: the pass
    leaves the graph alone, at once."""
    from passes.base import trace
    from passes.mhc import make
    from v41.model import MHC
    hc, n, D = toy_cfg.hc_mult, toy_cfg.hc_mult * (toy_cfg.hc_mult + 2), 48

    def mix(X, fn, base, scale, iters):
        return MHC(fn, base, scale, hc, iters, toy_cfg.hc_eps, toy_cfg.rms_norm_eps)(X)

    args = [torch.randn(10, hc, D), torch.randn(n, hc * D), torch.randn(n), torch.randn(3)]
    p = make(toy_cfg, torch.float32)
    for iters, want in ((toy_cfg.hc_sinkhorn_iters, 1), (toy_cfg.hc_sinkhorn_iters - 1, 0)):
        g = trace(lambda *a: mix(*a, iters), args).graph
        got = []
        worker = threading.Thread(target=lambda: got.append(p(g)), daemon=True)  # a hang fails
        worker.start()
        worker.join(30)
        assert got == [want], "no answer in 30 s" if worker.is_alive() else got


def test_backend_choice_depends_on_device_and_registry(toy_cfg, monkeypatch):
    from custom_ops import registry
    from passes.backend_select import BackendSelect
    sel = {"v41::rms_norm": {"cpu": "reference", "cuda": "triton"}, "v41::rope": {"cpu": "reference",
                                                                                "cuda": "reference"}}
    monkeypatch.setattr(registry, "selected", lambda: sel)
    auto = BackendSelect(toy_cfg, torch.float32, "auto")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert auto.choose("rms_norm", cuda) == (True, "triton")
    assert auto.choose("rope", cuda) == (False, "reference")      # Inductor generates it
    assert auto.choose("rope", cpu) == (True, "reference")        # eager-exact on the CPU
    assert BackendSelect(toy_cfg, torch.float32, "inline").choose("rms_norm", cuda)[0] is False
    assert BackendSelect(toy_cfg, torch.float32, "op").choose("rope", cuda)[0] is True
    with pytest.raises(ValueError):
        BackendSelect(toy_cfg, torch.float32, "fastest")


def test_pass_manager_uuid_hashes_files_config_and_policy(toy_cfg):
    from passes.manager import PassManager
    a = PassManager(toy_cfg, torch.float32).uuid()
    assert a == PassManager(toy_cfg, torch.float32).uuid()
    assert a != PassManager(toy_cfg, torch.bfloat16).uuid()
    assert a != PassManager(toy_cfg, torch.float32, lowering="inline").uuid()
    assert a != PassManager(dataclasses.replace(toy_cfg, hc_sinkhorn_iters=19), torch.float32).uuid()


# ---- dumps ----------------------------------------------------------------------------------

def test_dumps_written(toy_weights, tmp_path):
    """--dump-dir: the computation graph, the split, each pass's graph before and after, match
    counts, Inductor's output code (Inductor compiles here, caches off), depyf's dump. On the toy
    cut to layer 0 (Inductor's C++ build of each piece is most of this test)."""
    from passes.manager import PassManager
    toy1 = toy_prefix(toy_weights, 1)
    runner = toy1.runner
    pm = PassManager(runner.cfg, runner.dtype, lowering="auto", only=("mhc", "backend_select"))
    fwd = C.CompiledForward(runner.model, runner.cache, C.CompileConfig(split=False, backend="inductor", passes=False,
                                                                       dump_dir=str(tmp_path)), pass_manager=pm)
    with torch.inference_mode(), C._depyf(str(tmp_path)):
        h = fwd(toy1.batch, runner.cache)
    torch.testing.assert_close(h, toy1.eager, rtol=1e-5, atol=1e-5)
    seg = tmp_path / "_Backbone"
    assert (seg / "computation_graph.py").exists() and (seg / "split_graph.py").exists()
    layer = next(p for p in seg.iterdir() if p.is_dir() and p.name.endswith("layers.0"))
    for f in ("post_grad.0.mhc.before.py", "post_grad.0.mhc.after.py", "post_grad.1.backend_select.before.py",
              "post_grad.1.backend_select.after.py", "output_code.py", "match_counts.json", "piece_graph.py"):
        assert (layer / f).exists(), f
    assert "v41.mhc_mix" in (layer / "post_grad.0.mhc.after.py").read_text()
    assert "v41.mhc_mix" not in (layer / "post_grad.0.mhc.before.py").read_text()
    assert json.loads((layer / "match_counts.json").read_text())["mhc"] == 6
    assert "def call(" in (layer / "output_code.py").read_text()
    try:
        import depyf  # noqa: F401
    except ImportError:
        return
    names = [p.name for p in (tmp_path / "depyf").iterdir()]
    assert any("transformed_code" in n or n.startswith("full_code") for n in names), names


# ---- keys, cache directory ------------------------------------------------------------------

def test_compile_key_changes_with_each_factor(toy_cfg, monkeypatch):
    args = EngineArgs(model="toy", dtype="float32", device="cpu")
    ccfg = C.CompileConfig(capture_sizes=(1, 8))

    def key(cfg=toy_cfg, a=args, cc=ccfg, dev="cpu"):
        return C.compile_key(C.key_factors(cfg, a, cc, dev))

    base = key()
    assert base == key()
    # settings that cannot change a graph keep the key
    for same in (dataclasses.replace(args, seed=3), dataclasses.replace(args, dump_dir="/tmp/x"),
                 dataclasses.replace(args, max_prefill_chunk=7), dataclasses.replace(args, load_format="dummy")):
        assert key(a=same) == base
    changed = {
        "config": key(cfg=dataclasses.replace(toy_cfg, rms_norm_eps=1e-6)),
        "dtype": key(a=dataclasses.replace(args, dtype="bfloat16")),
        "token budget": key(a=dataclasses.replace(args, max_num_batched_tokens=256)),
        "slots": key(a=dataclasses.replace(args, max_num_seqs=3)),
        "index plane": key(a=dataclasses.replace(args, index_cache_dtype="fp4")),
        "split points": key(cc=dataclasses.replace(ccfg, split=False)),
        "capture sizes": key(cc=dataclasses.replace(ccfg, capture_sizes=(1, 16))),
        "passes": key(cc=dataclasses.replace(ccfg, passes=False)),
        "lowering": key(cc=dataclasses.replace(ccfg, fused_lowering="inline")),
        "device arch": key(dev="meta"),
    }
    hashes = C.source_hashes()
    for part in ("model", "passes", "ops"):
        monkeypatch.setattr(C.cache, "source_hashes", lambda part=part: {**hashes, part: "edited"})
        changed[f"{part} sources"] = key()
    monkeypatch.setattr(C.cache, "source_hashes", lambda: hashes)
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    changed["torch"] = key()
    monkeypatch.undo()
    real = C.cache._version
    for mod in ("triton", "aiter"):
        monkeypatch.setattr(C.cache, "_version", lambda m, mod=mod: "9.9" if m == mod else real(m))
        changed[mod] = key()
    monkeypatch.undo()
    monkeypatch.setattr(C.cache, "device_arch", lambda d: "cuda:sm_90")
    changed["gpu arch"] = key()
    assert base not in changed.values() and len(set(changed.values())) == len(changed), changed


def test_traced_sources_cover_the_model_imports():
    """Every module the model imports (at module level, transitively, within v41) is hashed into
    the key, but the config, which the key holds by value."""
    from tests.test_imports import MODULES, import_graph
    graph, seen, todo = import_graph(), set(), ["v41.model"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += [t for t in graph[m] if t.startswith("v41")]
    files = {str(MODULES[m].relative_to(REPO)) for m in seen if m not in ("v41.config", "v41.engram")}
    assert files <= set(C.TRACED_SOURCES), files - set(C.TRACED_SOURCES)
    assert all((REPO / f).exists() for f in C.TRACED_SOURCES)
    assert {str(p.relative_to(REPO)) for p in (REPO / "runtime" / "compile").glob("*.py")} <= set(C.TRACED_SOURCES)


def test_cache_dir_lock_and_ready_marker(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ["TORCHINDUCTOR_CACHE_DIR"])
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    d = C.CacheDir(str(tmp_path), {"a": 1})
    assert d.path == tmp_path / C.compile_key({"a": 1}) and not d.ready
    d.activate()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(d.path / "inductor")
    assert json.loads((d.path / "factors.json").read_text()) == {"a": 1}
    got = []
    with d.lock():
        t = threading.Thread(target=lambda: got.append(_try_lock(d)))
        t.start()
        t.join()
    assert got == [False] and _try_lock(d)
    d.mark_ready({"built_seconds": 1.0})
    assert C.CacheDir(str(tmp_path), {"a": 1}).ready and not C.CacheDir(str(tmp_path), {"a": 2}).ready


def test_keyed_dir_second_builder_waits_and_reuses(tmp_path):
    """v41/keyed_dir.py, as parallel pytest workers use it: two builders of one key, the second
    arriving while the first writes: one write, the second waits for the lock and returns the
    finished directory; no temporary directory is left."""
    import time
    from v41.keyed_dir import KeyedDir
    calls, writing = [], threading.Event()

    def write(tmp):
        calls.append(tmp)
        writing.set()
        time.sleep(0.3)
        tmp.mkdir()
        (tmp / "x").write_text("1")

    a, b = KeyedDir(tmp_path, "k"), KeyedDir(tmp_path, "k")
    out = []
    t = threading.Thread(target=lambda: out.append(a.build(write, {"by": "a"})))
    t.start()
    assert writing.wait(10) and not b.ready
    out.append(b.build(write))
    t.join()
    assert len(calls) == 1 and out == [a.path, a.path] and (a.path / "x").read_text() == "1"
    assert json.loads(a.marker.read_text()) == {"by": "a"}
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def _try_lock(d):
    try:
        with d.lock(blocking=False):
            return True
    except BlockingIOError:
        return False


# ---- flags and the eager path ---------------------------------------------------------------

def test_flags(tmp_path):
    from v41 import generate
    from v41.serve import build_parser
    ap, names = build_parser()
    a = ap.parse_args(["--no-enforce-eager", "--level", "3", "--no-decoder-swa-bounded-replay",
                       "--dump-dir", str(tmp_path), "--compile-cache-dir", str(tmp_path), "--capture-sizes", "1,4"])
    args = EngineArgs(**{n: getattr(a, n) for n in names})
    assert (args.enforce_eager, args.compilation_level, args.decoder_swa_bounded_replay) == (False, 3, False)
    ccfg = C.CompileConfig.from_engine_args(args, args.max_num_batched_tokens)
    assert (ccfg.split, ccfg.dump_dir, ccfg.capture_sizes) == (False, str(tmp_path), (1, 4))
    assert ap.parse_args([]).enforce_eager is True and ap.parse_args(["--compilation-level", "0"]).compilation_level == 0
    with pytest.raises(SystemExit):
        ap.parse_args(["--level", "2"])
    assert C.CompileConfig.from_engine_args(EngineArgs(), 2048) is None                      # enforce_eager
    assert C.CompileConfig.from_engine_args(EngineArgs(enforce_eager=False, compilation_level=0), 2048) is None
    for bad in (dict(compilation_level=2), dict(capture_sizes="0,4"), dict(capture_sizes="4096")):
        with pytest.raises(AdmissionError):
            EngineArgs(model="toy", **bad).admit()
    with pytest.raises(SystemExit):
        generate.main(["--level", "1", "--prompt", "x"])


def test_eager_path_unchanged(toy_weights):
    eng = H.make_engine(toy_weights, "float32")
    assert eng.runner.forward is eng.runner.model and eng.compile_report is None
    assert not eng.runner.static_shapes
