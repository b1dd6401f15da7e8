"""DSpark with the compiled forward, with its verify and decode steps replayed as FULL graphs
(widths 6 x batch) and its draft as graphs per request count (runtime/draft_graphs.py), and with its token pieces replayed as TR_HYBRID graphs (torch.cuda's graph
API replaced by the recorder of tests/test_cuda_graph_cpu.py). The target writes its taps into
SpecStep's buffer (`Transformer.record_taps`) from inside the compiled pieces and the captured
graphs, so the draft must read this step's taps, not a stale buffer. The draft's blocks run
compiled too (runtime/compile/draft.py): no proposal calls a draft block's Python forward.

The mini model (8 layers, taps at 5-7) in float64, compiled with post_grad_eager (Inductor's
graph pipeline and our passes, no code generation), oracle drafts as in
tests/test_dspark_engine.py (every accepted count occurs): greedy tokens equal the plain eager
engine's, with decoder bounded replay on and off, and the draft's context rings equal those of
the eager DSpark engine after the same requests.
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from passes.split import SPLITTING_OPS
from runtime import compile as C
from runtime.cuda_graph import CUDAGraphRunner
from runtime.draft_graphs import DraftGraphRunner
from runtime.engine import EngineArgs, LLMEngine
from runtime.sequence import SamplingParams
from runtime.token_graphs import TokenGraphRunner
from tests import harness as H
from tests.test_cuda_graph_cpu import RecordedGraph, recorded, recording
from tests.test_dspark_engine import DSPARK, oracle_drafts, run_dspark

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 64}
# FULL's default widths for this engine on CUDA: decode sizes 1, 2, 4 and 6x each (verify)
WIDTHS = (1, 2, 4, 6, 12, 24)
MAX_TOKENS = 10


@pytest.fixture(scope="module", autouse=True)
def shared_traces():
    """Engines of one compile key share its traced segments (runtime/compile: TraceCache): the
    FULL test's target and test_compile_runner_compiles_the_draft's trace once between them."""
    with C.TraceCache().active() as traces:
        yield traces


@pytest.fixture(scope="module")
def mini():
    from v41.loader import dummy_weights
    cfg = H.mini_cfg()
    return cfg, dummy_weights(cfg, progress=False)


@pytest.fixture(scope="module")
def mini_dir(mini, tmp_path_factory):
    d = tmp_path_factory.mktemp("mini")
    (d / "config.json").write_text(json.dumps(mini[0].to_hf_dict()))
    return str(d)


@pytest.fixture(scope="module")
def reqs():
    return H.prompts((5, 17, 40), seed=4)


def mini_engine(mini_dir, weights, **kw) -> LLMEngine:
    args = EngineArgs(model=mini_dir, device="cpu", enable_prefix_caching=False, **{"dtype": "float64", **ENGINE, **kw})
    return LLMEngine(args, weights=weights)


def until_done(eng, reqs, params) -> dict:
    live = {i: eng.add_request(r, params, request_id=f"r{i}") for i, r in enumerate(reqs)}
    while eng.has_unfinished():
        eng.step()
    return {i: s.completion_token_ids for i, s in live.items()}


def compile_config(args, cache_dir, hybrid: bool = False) -> C.CompileConfig:
    return C.CompileConfig(backend="post_grad_eager", split=args.decoder_swa_bounded_replay, cache_dir=str(cache_dir),
                           splitting_ops=SPLITTING_OPS if hybrid else ())


def compile_engine(eng, mode: str, patch, cache_dir) -> None:
    """Install the compiled forward on `eng` (the engine's compile_runner, draft included) and,
    for FULL or TR_HYBRID, its graphs as the engine's capture does on a GPU."""
    r = eng.runner
    hybrid = mode == "TR_HYBRID"
    C.compile_runner(r, eng.args, compile_config(eng.args, cache_dir, hybrid))
    fwd = r.forward
    if mode == "NONE":
        return
    if hybrid:
        for p in fwd.piece_graphs.pieces:
            p.fn = recorded(p.fn)
    else:
        r.graph_forward = recorded(r.graph_forward)     # what a FULL graph captures
    with patch.context() as m:
        m.setattr(r, "device", SimpleNamespace(type="cuda"))      # the graph runners' device check
        r.graphs = TokenGraphRunner(r, BUCKETS) if hybrid else CUDAGraphRunner(r, WIDTHS)
        r.graphs.capture(progress=False)
        if r.spec is not None and not hybrid:                      # the draft, per request count
            r.spec.graphs = DraftGraphRunner(r.spec, (1, 2, 4), r.graphs.pool)
            r.spec.graphs.fn = recorded(r.spec.graphs.fn)
            r.spec.graphs.capture()


def test_full_widths_hold_verify_steps():
    args = EngineArgs(model="toy", device="cuda", enforce_eager=False, speculative_method="dspark", **ENGINE)
    assert args.graph_sizes() == WIDTHS
    plain = EngineArgs(model="toy", device="cuda", enforce_eager=False, **ENGINE)
    assert plain.graph_sizes() == (1, 2, 4)


@pytest.mark.parametrize("mode,replay", [("NONE", False), ("FULL", True), ("TR_HYBRID", True)],
                         ids=["compiled-no-decoder-replay", "full-decoder-replay", "tr_hybrid-decoder-replay"])
def test_compiled_dspark_tokens_equal_plain(mini, mini_dir, reqs, monkeypatch, tmp_path, mode, replay):
    weights = mini[1]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    baseline = until_done(mini_engine(mini_dir, weights, decoder_swa_bounded_replay=replay), reqs, params)
    for name, fake in (("CUDAGraph", RecordedGraph), ("graph", recording), ("synchronize", lambda *a, **k: None),
                       ("memory_reserved", lambda *a, **k: 0)):
        monkeypatch.setattr(torch.cuda, name, fake)

    eager_draft_blocks = []          # calls of a draft block's Python forward after the compile

    def make_engine(w, **kw):
        eng = mini_engine(mini_dir, w, **kw)
        compile_engine(eng, mode, monkeypatch, tmp_path)
        for block in eng.runner.spec.draft.blocks:
            block.forward = lambda *a, _f=block.forward, **k: (eager_draft_blocks.append(1), _f(*a, **k))[1]
        return eng

    monkeypatch.setattr(H, "make_engine", make_engine)
    got, eng = run_dspark(weights, reqs, baseline, max_tokens=MAX_TOKENS, decoder_swa_bounded_replay=replay)
    assert got == baseline
    s = eng.runner.spec.stats
    assert s["drafts"] > 0 and 0 < s["accepted"] < s["draft_tokens"]
    assert not eager_draft_blocks        # every proposal ran the compiled _DraftBlocks
    if mode == "TR_HYBRID":
        counts = eng.runner.graphs.pieces.counts()
        assert counts["graphs"] > 0 and counts["misses"] == 0, counts
    if mode == "FULL":        # verify steps replayed (at 6, 12 or 24 rows)
        replays = {w: g.replays for w, g in eng.runner.graphs.graphs.items()}
        assert sum(replays[w] for w in (6, 12, 24)) > 0, replays
        # each capture saw the compiled pieces announce themselves (a chain's cut points)
        assert min(g.pieces for g in eng.runner.graphs.graphs.values()) >= eng.cfg.num_hidden_layers
        assert eng.runner.spec.graphs.replays > 0       # the draft replayed its graphs
    # the draft's context rings (ring layers past the target's) are the eager DSpark engine's
    ref = mini_engine(mini_dir, weights, **DSPARK, decoder_swa_bounded_replay=replay)
    oracle_drafts(ref, {f"r{i}": t for i, t in baseline.items()}, 0)
    assert until_done(ref, reqs, params) == baseline
    n = eng.cfg.num_hidden_layers
    torch.testing.assert_close(eng.runner.cache.ring[n:], ref.runner.cache.ring[n:], rtol=1e-12, atol=1e-12)


def test_compile_runner_compiles_the_draft(mini, mini_dir, tmp_path):
    """compile_runner (the engine's compile) compiles a DSpark engine's draft blocks as one
    Dynamo graph of one piece per stage, warm at every draft request count."""
    eng = mini_engine(mini_dir, mini[1], **DSPARK)
    rep = C.compile_runner(eng.runner, eng.args, compile_config(eng.args, tmp_path))
    n_draft = len(eng.runner.spec.draft.blocks)
    assert rep["draft"]["counts"] == list(eng.args.decode_sizes())
    assert rep["draft"]["stats"]["graphs"] == 1 and rep["draft"]["stats"]["pieces"] == n_draft
    assert rep["draft"]["keys"]["stats"]["graphs"] == 1 and rep["draft"]["keys"]["rows"] == rep["capture_sizes"]


def draft_outputs(draft, rings, counts, taps) -> dict:
    """The draft's logits and tokens at each request count, reading context rows of `rings`,
    and the context keys of the first 3·count rows of `taps`."""
    out = {}
    g = torch.Generator().manual_seed(6)
    with torch.inference_mode():
        for b in counts:
            anchors = torch.randint(0, draft.cfg.vocab_size, (b,), generator=g)
            pos = torch.arange(b) + 3 * draft.W
            d = draft(anchors, pos, torch.arange(b), torch.zeros(b, dtype=torch.long), rings)
            keys = draft.context_keys([t[:3 * b] for t in taps], torch.arange(3 * b) + 5)
            out[b] = (d.logits.clone(), d.tokens.clone(), [k.clone() for k in keys])
    return out


@pytest.mark.parametrize("dtype,weight_format,backend", [("float64", "dequant", "inductor"),
                                                         ("float32", "native", "post_grad_eager")])
def test_compiled_draft_equals_eager(mini, mini_dir, tmp_path, dtype, weight_format, backend):
    """The draft's compiled blocks and context keys give the eager draft's at every request count: with
    Inductor's generated code (which asserts every static input size, so each dim that follows
    the request count must be dynamic) and with native weights (the draft's format follows the
    target's; their E8M0 scales go through Inductor's decomposition of the functionalized native
    GEMM ops)."""
    eng = mini_engine(mini_dir, mini[1], **DSPARK, dtype=dtype, weight_format=weight_format)
    spec = eng.runner.spec
    native = weight_format == "native"
    assert eng.runner.model.native == native and spec.draft.blocks[0].ffn.native == native
    rings = spec.draft_rings
    rings.copy_(torch.randn(rings.shape, generator=torch.Generator().manual_seed(5)).to(rings.dtype))
    taps = torch.randn(spec.taps.shape, generator=torch.Generator().manual_seed(7)).to(spec.taps.dtype)
    counts = (1, 2, 4)
    want = draft_outputs(spec.draft, rings, counts, taps)
    ccfg = C.CompileConfig(backend=backend, split=True, cache_dir=str(tmp_path))
    from passes.manager import PassManager
    rep = C.compile_draft(spec, ccfg, PassManager(eng.cfg, eng.runner.dtype), counts, (4, 12))
    assert rep["keys"]["rows"] == [4, 12]
    got = draft_outputs(spec.draft, rings, counts, taps)
    for b in counts:
        for x, y in [(got[b][0], want[b][0]), *zip(got[b][2], want[b][2], strict=True)]:
            if dtype == "float64":
                torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
            else:       # the CPU keeps every op (backend_select): the eager arithmetic, bit for bit
                assert torch.equal(x, y), b
        assert torch.equal(got[b][1], want[b][1]), b


def test_draft_weight_format_follows_the_target(mini, mini_dir, monkeypatch):
    """Where native weights are the device default (CUDA with the Triton impls), a dequant engine's
    draft is dequantized too: the draft's format is the target's, never the device default."""
    import v41.model
    monkeypatch.setattr(v41.model, "native_weights", lambda device, dtype: True)
    eng = mini_engine(mini_dir, mini[1], **DSPARK, dtype="float32", weight_format="dequant")
    assert not eng.runner.model.native and not eng.runner.spec.draft.blocks[0].ffn.native
