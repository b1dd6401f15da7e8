"""The v41 passes (passes/, installed by runtime/compile/backend.py): each pass's match count on
the toy graph with outputs equal to the unpassed graph's, all passes then backend selection,
the pattern matcher's search cost, the pass manager's uuid."""
import copy
import dataclasses
import threading
import types

import pytest
import torch

from runtime import compile as C
from tests.compile_helpers import restore, snapshot, toy_prefix

# matches of each fusion pass on the toy graph of layers 0-2 (WINDOW, WINDOW + Engram, FULL with
# ratio 2) plus the final collapse and norm: per layer inverse RoPE + wo_a 1; RoPE 2 (q, kv +
# QAT) and 3 more in a FULL layer (index query, index key, main row); mHC 6 (2 mixes, 2
# collapses, 2 expands) + the final collapse; router 1; Engram gate in layer 1; RMSNorm 4 (attn,
# q, kv, ffn) and 2 more in a FULL layer (compressor, index key) + the final norm; kv norm +
# RoPE + QAT 1; routed experts beside the shared expert 1
EXPECTED = {"inv_rope_wo_a": 3, "rope_qat": 9, "mhc": 19, "moe_route": 3, "engram_gate": 1,
            "rms_norm_quant": 15, "norm_rope": 3, "moe_overlap": 3}
# the passes whose ops a pass rewrites: kv_norm's rms_norm and the window row's rope_fp8_qat; the
# shared expert's own norm + QAT, whose out buffer moe_overlap threads through the fork
PREREQUISITES = {"norm_rope": ("rope_qat", "rms_norm_quant"), "moe_overlap": ("rms_norm_quant",)}
# passes with nothing to match in a dequantized graph (test_native_act_quant_on_native_weights)
NATIVE_ONLY = {"native_act_quant": 0}


# ---- passes ---------------------------------------------------------------------------------
#
# Dynamo and AOT cost most of a compile (about 17 of the 22 s of the toy graph below on two CPU
# cores), so the toy graph is compiled once: a recording custom pass keeps every piece's
# graph exactly as our pass manager receives it, and that piece's real inputs, then
# runs all passes (auto lowering). Each test then runs passes on copies of those graphs and
# compares the pieces with the unpassed ones on clones of the same inputs: outputs, and every
# input a piece writes (cache planes).

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


def record_compile(prefix, pass_names=None):
    """The prefix's graph compiled once (post_grad_eager, auto lowering) through a PieceRecorder
    running `pass_names` (default all): pieces, output, cache after the step, pass manager."""
    from passes import PASS_NAMES
    from passes.manager import PassManager
    runner = prefix.runner
    pm = PassManager(runner.cfg, runner.dtype, lowering="auto", only=pass_names or PASS_NAMES)
    rec = PieceRecorder(pm)
    fwd = C.CompiledForward(runner.model, runner.cache, C.CompileConfig(split=False, backend="post_grad_eager",
                                                                       passes=False), pass_manager=rec)
    with torch.inference_mode():
        out = fwd(prefix.batch, runner.cache)
        cache = snapshot(runner.cache)
        restore(runner.cache, prefix.snap)
    assert all(p.inputs is not None for p in rec.pieces)
    return types.SimpleNamespace(pieces=rec.pieces, out=out, cache=cache, pm=pm)


@pytest.fixture(scope="module")
def toy3_compiled(toy3):
    """The toy graph compiled once, every pass."""
    compiled = record_compile(toy3)
    # prologue (embedding), layers 0, 1, 2 (distinct roles: none reused), epilogue (collapse, norm)
    assert len(compiled.pieces) == 5
    return compiled


def passed(piece: Piece, pm=None) -> torch.fx.GraphModule:
    """A copy of the piece's graph module, passed through `pm` (None: no pass) as the compile's
    fake mode would."""
    from torch._inductor.virtualized import V
    gm = torch.fx.GraphModule(piece.root, copy.deepcopy(piece.graph))
    if pm is not None:
        fake = torch._guards.detect_fake_mode([n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")])
        with V.set_fake_mode(fake):
            pm(gm.graph)
        gm.graph.lint()
        gm.recompile()
    return gm


def run_piece(piece: Piece, pm=None):
    """A copy of the piece's graph, passed through `pm` (None: no pass) as post_grad_eager would,
    run on clones of its inputs: (outputs, inputs after the run)."""
    gm = passed(piece, pm)
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
    pm = PassManager(toy3.runner.cfg, toy3.runner.dtype, lowering="op", only=(*PREREQUISITES.get(name, ()), name))
    got = [run_piece(p, pm) for p in toy3_compiled.pieces]
    assert pm.totals()[name] == EXPECTED[name]
    assert_pieces_equal(got, unpassed, exact=name not in NOT_BITWISE)
    # the layers repeat their shapes: the exact re-checks reuse the search traces (passes/base.py
    # SearchTraces) while the outputs above still equal the unpassed graph's
    from passes.base import PatternPass
    (p,) = [q for q in pm.passes if q.name == name]
    if EXPECTED[name] > 1 and isinstance(p, PatternPass):
        assert p.search_traces.hits > 0, (name, len(p.search_traces.graphs))


def test_all_passes_then_backend_selection(toy3, toy3_compiled, unpassed):
    from passes import PASS_NAMES
    from passes.backend_select import FUSED_OPS
    from passes.manager import PassManager
    # CPU, auto (the recorded compile ran every pass): every fused op stays an op (its reference
    # impl is the eager arithmetic), so the step is bitwise the eager model's, output and cache
    pm = toy3_compiled.pm
    assert torch.equal(toy3_compiled.out, toy3.eager)
    assert all(torch.equal(v, toy3.eager_cache[k]) for k, v in toy3_compiled.cache.items())
    assert {k: v for k, v in pm.totals().items() if k != "backend_select"} == {**EXPECTED, **NATIVE_ONLY}
    sel = pm.passes[-1]
    assert pm.totals()["backend_select"] > 0 and set(sel.decisions.values()) == {"kept (reference)"}
    # every fused op on this graph, but rope_fp8_qat: each window KV row's joined its norm
    assert {k.split("@")[0] for k in sel.decisions} == set(FUSED_OPS) - {"rope_fp8_qat"}
    # inline: every op lowered back to its reference composition, for Inductor to generate; that
    # is the unpassed graph's arithmetic again, bit for bit
    pm = PassManager(toy3.runner.cfg, toy3.runner.dtype, lowering="inline", only=PASS_NAMES)
    got = [run_piece(p, pm) for p in toy3_compiled.pieces]
    assert {k: v for k, v in pm.totals().items() if k != "backend_select"} == {**EXPECTED, **NATIVE_ONLY}
    assert set(pm.passes[-1].decisions.values()) == {"inlined"}
    assert_pieces_equal(got, unpassed, exact=True)


def _ops_in(graph, name: str) -> int:
    from passes.base import _AF
    op = getattr(torch.ops.v41, name).default
    return sum(1 for n in graph.nodes if n.target in _AF and n.args[0] is op)


NATIVE_PRODUCERS = ("rope_qat", "mhc", "rms_norm_quant")


@pytest.fixture(scope="module")
def native3(toy_cfg):
    """The toy graph of layers 0-2 with native weights (wo_a FP8 too), compiled once through the
    passes that make native_act_quant's inputs."""
    from v41.loader import dummy_weights
    prefix = toy_prefix(dummy_weights(toy_cfg, progress=False, wo_a="fp8"), 3, weight_format="native")
    assert prefix.runner.model.native
    return prefix, record_compile(prefix, NATIVE_PRODUCERS)


def test_native_act_quant_on_native_weights(native3):
    """Native weights, wo_a FP8 too: each FP8 GEMM reading an RMSNorm takes the codes the norm's
    op writes beside the norm (mHC's collapse before it joining the op); each reading pointwise
    ATen ops takes codes quantized by ATen ops after them (Inductor's kernel for the producer);
    wo_b takes the codes wo_a's GEMM writes; bit for bit the graph before the pass, outputs and
    cache."""
    from passes.manager import PassManager
    prefix, compiled = native3
    producers = NATIVE_PRODUCERS
    before = [run_piece(p, PassManager(prefix.runner.cfg, torch.float32, only=producers)) for p in compiled.pieces]
    pm = PassManager(prefix.runner.cfg, torch.float32, only=(*producers, "native_act_quant"))
    got = [run_piece(p, pm) for p in compiled.pieces]
    assert_pieces_equal(got, before, exact=True)
    # per layer three norms, each read by one (stacked) GEMM: attention norm -> wq_a + wkv, q norm
    # -> wq_b (and the index query in the FULL layer), FFN norm -> shared w1 + w3; two GEMMs on
    # pointwise ops: wo_a on the inverse RoPE, shared w2 on SwiGLU; and wo_b on wo_a's output
    assert pm.totals()["native_act_quant"] == 6 * 3
    graphs = [passed(p, pm).graph for p in compiled.pieces]
    # the attention and FFN norms read mHC's collapse, which joins them; the q norm reads wq_a
    assert sum(_ops_in(g, "hc_collapse_rms_norm_act_quant") for g in graphs) == 2 * 3
    assert sum(_ops_in(g, "rms_norm_act_quant") for g in graphs) == 3
    assert sum(_ops_in(g, "hc_collapse") for g in graphs) == 1                     # the final norm's
    before_norms = sum(_ops_in(passed(p, PassManager(prefix.runner.cfg, torch.float32, only=producers)).graph,
                               "rms_norm") for p in compiled.pieces)
    assert sum(_ops_in(g, "rms_norm") for g in graphs) == before_norms - 3 * 3     # none left behind
    # wo_a quantizes its output for wo_b in its epilogue
    assert sum(_ops_in(g, "fp8_block_gemm_act_quant") for g in graphs) == 3
    assert sum(_ops_in(g, "fp8_block_gemm") for g in graphs) == 5 * 3
    # still quantized by the GEMM op: Engram's projection (the piece's input) in layer 1
    assert sum(_ops_in(g, "fp8_linear") for g in graphs) == 1


def _forks_and_joins(graphs, fork_name: str) -> list:
    """(fork, the first reader of its `after` output, join, sum) of each layer, checking what
    every overlap shares: no experts' op left, the join reads the fork's out and keeps its x, ids
    and weights and the shared expert's output as its GEMM made it (f32 here; bf16 converts
    after the join), and fork < reader < join < sum in graph order."""
    from passes.base import _AF
    from passes.moe_overlap import _unconverted
    fork_op, join_op = getattr(torch.ops.v41, fork_name).default, torch.ops.v41.join.default
    out = []
    for g in graphs:
        order = {n: i for i, n in enumerate(g.nodes)}
        forks = [n for n in g.nodes if n.target in _AF and n.args[0] is fork_op]
        joins = [n for n in g.nodes if n.target in _AF and n.args[0] is join_op]
        assert len(forks) == len(joins) <= 1
        for fork, join in zip(forks, joins):
            after = fork.kwargs["after"]
            assert after.users.keys() == {fork}
            (after2,) = [u for u in fork.users if u.args[1] == 2]
            (reader,) = after2.users
            y = join.kwargs["out"]
            assert y.args[0] is fork and y.args[1] == 1
            assert [k.name for k in join.kwargs["keep"][:3]] == [fork.kwargs[k].name for k in ("x", "ids", "weights")]
            (total,) = [u for u in join.users][0].users
            assert total.target is torch.ops.aten.add.Tensor and _unconverted(total.args[1]) is join.kwargs["keep"][3]
            assert order[fork] < order[reader] < order[join] < order[total]
            out.append((fork, reader, join, total))
    return out


def test_moe_overlap_forks_the_experts_beside_the_shared_expert(native3):
    """Native weights: each layer's routed experts become a fork whose `after` is the shared
    expert's input codes (so the shared GEMM reads the fork's output of them: scheduled after
    it), and a join before the sum; bit for bit the graph before the pass, outputs and cache."""
    from passes.manager import PassManager
    prefix, compiled = native3
    producers = (*NATIVE_PRODUCERS, "native_act_quant")
    before = [run_piece(p, PassManager(prefix.runner.cfg, torch.float32, only=producers)) for p in compiled.pieces]
    pm = PassManager(prefix.runner.cfg, torch.float32, only=(*producers, "moe_overlap"))
    got = [run_piece(p, pm) for p in compiled.pieces]
    assert_pieces_equal(got, before, exact=True)
    assert pm.totals()["moe_overlap"] == 3
    graphs = [passed(p, pm).graph for p in compiled.pieces]
    assert sum(_ops_in(g, "moe_experts_w4a8") for g in graphs) == 0
    forked = _forks_and_joins(graphs, "moe_experts_w4a8_fork")
    assert len(forked) == 3
    for fork, view, _, _ in forked:
        assert fork.kwargs["after"].args[0].args[0] is torch.ops.v41.hc_collapse_rms_norm_act_quant.default
        (gemm,) = view.users
        assert gemm.args[0] is torch.ops.v41.fp8_block_gemm.default


def test_moe_overlap_on_dequantized_experts(toy3, toy3_compiled):
    """Dequantized weights (outputs and match count: test_pass_matches_and_keeps_outputs): the
    shared expert's input is its own RMSNorm + QAT (rms_norm_quant's `rms_norm_fp8`, placed
    before the router), whose fresh out buffer the fork declares written: the norm moves after
    the fork and writes into the fork's output of that buffer."""
    from passes.manager import PassManager
    pm = PassManager(toy3.runner.cfg, toy3.runner.dtype, lowering="op", only=("rms_norm_quant", "moe_overlap"))
    graphs = [passed(p, pm).graph for p in toy3_compiled.pieces]
    assert sum(_ops_in(g, "moe_experts") for g in graphs) == 0
    forked = _forks_and_joins(graphs, "moe_experts_fork")
    assert len(forked) == 3
    for fork, norm, _, _ in forked:
        assert fork.kwargs["after"].target is torch.ops.aten.empty.memory_format
        assert norm.args[0] is torch.ops.v41.rms_norm_fp8.default


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
