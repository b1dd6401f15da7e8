"""FULL and TR_HYBRID CUDA graphs and the sync-free step on a GPU (`pytest -m gpu
tests/test_cuda_graph_gpu.py` on the H200; the module takes longer than one 10-minute device
call: `tools/gpu_checks.sh OUT graphtests` and `... OUT harness` run it in two calls, processes
side by side, each a group of tests that share one compile; what has passed is in
benchmarks/results/gpu-tests-h200.txt).
The CPU versions, with a recording stand-in: tests/test_cuda_graph_cpu.py, test_token_graphs.py.

- A replayed decode graph gives bitwise the logits of the same compiled forward run without
  capture at the same running width (toy in float32, flash-slice in bf16), from the same cache
  state.
- The schedule-invariance harness (chunks, preemption, cancellation, arrivals, prefix hits)
  gives the same greedy tokens with FULL and with TR_HYBRID as
  the same engine running the same steps at the same widths without graphs (the scenario run
  again on it, replay swapped for the compiled forward), and leaks no page or slot. (Not NONE's
  tokens in float32: a step padded to a captured width runs the GEMMs at another row count,
  whose float32 sums may round differently, and random weights turn one such difference into
  other tokens; in float64 on the CPU the graph path gives the eager engine's tokens,
  tests/test_token_graphs.py.)
- TR_HYBRID: a replayed prefill, mixed and decode step gives bitwise the logits and cache of the
  compiled forward without graphs at the same padded width; padding rows write nothing.
- DSpark's verify steps (the anchor and five drafts per request) replay FULL graphs, its draft
  replays graphs per request count, and the tokens are those of the same engine without
  graphs, drafts verified or acceptance forced.
- Decode steps (FULL) and a compiled prefill step run under `torch.cuda.set_sync_debug_mode("error")`
  but for the sampler's one copy of the ids.
"""
from __future__ import annotations

import pytest
import torch

from runtime.compile import TraceCache
from runtime.engine import EngineArgs, LLMEngine
from runtime.sampler import SamplingTensors, sample_tensors
from runtime.sequence import SamplingParams
from tests import harness as H
from tests.graph_checks import decoding, planes_written_by_a_step, replay_equals_plain_forward, step_equals_plain_forward

pytestmark = pytest.mark.gpu

BASE = dict(model="toy", dtype="float32", device="cuda", max_num_seqs=8, max_num_batched_tokens=256,
            max_model_len=512, enforce_eager=False, num_pages=64)


@pytest.fixture(scope="module")
def traces():
    with TraceCache().active() as t:
        yield t


@pytest.fixture(scope="module")
def cuda_weights():
    from v41.config import preset
    from v41.loader import dummy_weights
    return dummy_weights(preset("toy"), device="cuda", progress=False)


def engine(weights, **kw) -> LLMEngine:
    return LLMEngine(EngineArgs(**{**BASE, **kw}), weights=weights)


@pytest.mark.parametrize("replay", [True, False], ids=["decoder-replay", "no-decoder-replay"])
def test_replay_equals_the_compiled_forward_at_its_width(cuda_weights, traces, replay):
    eng = engine(cuda_weights, cudagraph_mode="FULL", cudagraph_capture_sizes="1,2,4,8",
                 decoder_swa_bounded_replay=replay)
    assert eng.runner.graphs is not None and eng.graph_report["sizes"] == [1, 2, 4, 8]
    assert eng.graph_report["pool_bytes"] >= 0
    # the toy's compiled forward has more pieces than the last cut: every width a chain of graphs
    from runtime.cuda_graph import CHAIN_CUTS
    assert set(eng.graph_report["graphs_per_width"].values()) == {len(CHAIN_CUTS) + 1}
    print("graph report", eng.graph_report)
    decoding(eng, 3)
    replay_equals_plain_forward(eng, 4)


def test_padding_rows_are_inert_under_replay(cuda_weights, traces):
    """3 requests replayed at width 4: the cache rows written equal those of the exact-width
    compiled step, starting from NaN-poisoned planes."""
    graphed = planes_written_by_a_step(engine(cuda_weights, cudagraph_mode="FULL", cudagraph_capture_sizes="4"))
    plain = planes_written_by_a_step(engine(cuda_weights, cudagraph_mode="NONE"))
    assert all(torch.equal(a, b) for a, b in zip(graphed, plain))
    assert any(a.any() for a in graphed)



def test_flash_slice_replays_give_the_compiled_forward_bitwise():
    """flash-slice in bf16 (random weights, ~62 GB, its own compile): one request replayed at
    width 1, then three at width 4 (a padding row), each step bit for bit the logits and cache
    of the same compiled forward without capture at that width. A small pool (num_pages) keeps
    the cache snapshots small."""
    eng = LLMEngine(EngineArgs(model="flash-slice", dtype="bfloat16", device="cuda", max_num_seqs=4,
                               max_num_batched_tokens=256, max_model_len=512, num_pages=32, enforce_eager=False,
                               cudagraph_mode="FULL", cudagraph_capture_sizes="1,4"))
    assert eng.graph_report["sizes"] == [1, 4]
    for n, width in ((1, 1), (3, 4)):
        seqs = decoding(eng, n)
        replay_equals_plain_forward(eng, width)
        for s in seqs:
            eng.abort(s.request_id)
    assert eng.runner.graphs.replays >= 6

SCENARIOS = [
    H.CHUNKS,
    H.PREEMPT,
    H.CANCEL,
    H.Scenario("arrivals", arrival_steps=[0, 3, 3, 5, 9, 9, 12, 20]),
    H.FORKS,
]


def watching(hook, engines: list, replay: bool = True):
    """`hook` that also keeps the engine it sees in `engines`, with its replay count then (its
    capture and any earlier run replayed too), and, unless `replay`, swaps that engine's graph
    replay for the compiled function it captured, run on the same published buffers (every step
    then runs at the width it would replay, without graphs). A FULL graph captured
    `graph_forward`, which gathers the step's Engram rows that `prepare` then leaves out."""
    def watched(eng, live, step, rng):
        if not engines:
            engines.extend((eng, eng.runner.graphs.replays))
            if not replay:
                r = eng.runner
                captured = r.graph_forward if r.graphs.gathers_engram else r.forward
                r.graphs.replay = lambda width, batch, cache: captured(batch, cache)
        return hook(eng, live, step, rng) if hook is not None else None
    return watched


@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
@pytest.mark.parametrize("mode", ["FULL", "TR_HYBRID"])
def test_schedule_invariance_graphs_vs_the_same_widths_without(cuda_weights, traces, monkeypatch, sc, mode):
    """One engine runs the scenario twice: replaying its graphs, then with replay swapped for the
    compiled forward (a TR_HYBRID engine compiles its own pieces, which a second engine would
    compile again: minutes on the H200). A run leaves every page and slot free (H.run checks).
    The forks scenario's requests hit the prefix cache, which each run starts empty."""
    reqs, caching = sc.requests(), sc.engine.get("enable_prefix_caching", False)
    cuda = {k: v for k, v in BASE.items() if k not in ("model", "dtype", "max_num_seqs")}
    engine = {**cuda, **sc.engine, "cudagraph_mode": mode}
    eng = H.make_engine(cuda_weights, "float32", **engine)
    monkeypatch.setattr(H, "make_engine", lambda *a, **kw: eng)
    got, engines = {}, {"graphs": [], "plain": []}
    for name in engines:
        hook = watching(sc.hook, engines[name], replay=name == "graphs")
        scenario = H.Scenario(sc.name, engine=engine, arrival_steps=sc.arrival_steps, hook=hook, seed=sc.seed)
        assert eng.bm.reset_prefix_cache()
        hits = eng.bm.stats["hit_tokens"]
        got[name] = H.run(cuda_weights, reqs, max_tokens=8, scenario=scenario, dtype="float32")
        assert (eng.bm.stats["hit_tokens"] > hits) == caching, name
    assert got["graphs"] == got["plain"]
    replayed = {name: e.runner.graphs.replays - at_start for name, (e, at_start) in engines.items()}
    assert replayed["graphs"] > 0 and replayed["plain"] == 0, replayed


@pytest.mark.parametrize("replay", [True, False], ids=["decoder-replay", "no-decoder-replay"])
def test_tr_hybrid_replays_equal_the_compiled_forward(cuda_weights, replay):
    """A prefill step, mixed steps (a prompt arriving while others decode, chunked) and decode
    steps, each replayed at its token bucket: the compiled forward's logits and cache at that
    width, bit for bit; no page or slot leaked."""
    eng = engine(cuda_weights, cudagraph_mode="TR_HYBRID", decoder_swa_bounded_replay=replay, max_prefill_chunk=9)
    rep = eng.graph_report
    # a graph per piece and bucket; under decoder replay the late layers' pieces a second one,
    # on the decoder's buffers
    late = sum(p.name.startswith("_LateLayers.") for p in eng.runner.forward.piece_graphs.pieces)
    assert (late > 0) == replay
    assert rep["graphs"] == (rep["pieces"] + late) * len(rep["sizes"]) and rep["pool_bytes"] >= 0
    p = SamplingParams(max_tokens=6, ignore_eos=True)
    seqs = [eng.add_request(t, p) for t in H.prompts((5, 17, 40), seed=4)]
    steps = 0
    while eng.has_unfinished():
        if steps == 2:
            seqs.append(eng.add_request(H.prompts((23,), seed=9)[0], p))
        step_equals_plain_forward(eng, eng.scheduler.schedule())
        steps += 1
    eng.bm.check([])
    assert eng.bm.all_free and eng.runner.forward.piece_graphs.counts()["replays"] > 0


def test_tr_hybrid_replays_equal_the_compiled_forward_under_cancellations(cuda_weights, monkeypatch):
    """The cancel scenario of test_schedule_invariance_graphs_vs_the_same_widths_without (same
    engine settings), every step replayed at its token bucket and checked against the compiled
    forward at that width: requests cancelled waiting, mid prefill and mid decode, their slots
    and pages reused, change no replay. Prints the tokens."""
    sc = H.CANCEL
    eng = engine(cuda_weights, cudagraph_mode="TR_HYBRID", enable_prefix_caching=False, **sc.engine)
    monkeypatch.setattr(eng, "step", lambda: step_equals_plain_forward(eng, eng.scheduler.schedule()))
    monkeypatch.setattr(H, "make_engine", lambda *a, **k: eng)
    got = H.run(cuda_weights, H.prompts(), max_tokens=8, scenario=sc, dtype="float32")
    print("tokens", got)
    assert None in got.values() and eng.runner.forward.piece_graphs.counts()["replays"] > 0


def test_tr_hybrid_padding_rows_are_inert(cuda_weights):
    graphed = planes_written_by_a_step(engine(cuda_weights, cudagraph_mode="TR_HYBRID", cudagraph_capture_sizes="4"))
    plain = planes_written_by_a_step(engine(cuda_weights, cudagraph_mode="NONE"))
    assert all(torch.equal(a, b) for a, b in zip(graphed, plain))
    assert any(a.any() for a in graphed)


@pytest.mark.parametrize("forced", [None, 3.51], ids=["verified", "forced-3.51"])
def test_dspark_verify_steps_replay_full_graphs(cuda_weights, traces, forced):
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    got, replays = {}, []
    for mode in ("NONE", "FULL"):
        eng = engine(cuda_weights, cudagraph_mode=mode, speculative_method="dspark",
                     spec_decode_acceptance_length=forced)
        if mode == "FULL":
            replay = eng.runner.graphs.replay
            eng.runner.graphs.replay = lambda w, *a: replays.append(w) or replay(w, *a)
        seqs = [eng.add_request(t, p) for t in H.prompts((5, 17, 40), seed=4)]
        while eng.has_unfinished():
            eng.step()
        got[mode] = [s.completion_token_ids for s in seqs]
        eng.bm.check([])
        assert eng.bm.all_free
        if mode == "FULL":
            assert eng.runner.spec.graphs.replays > 0                # the draft's graphs too
    assert got["FULL"] == got["NONE"]
    assert any(w % 6 == 0 for w in replays), replays                 # verify widths: 6 x batch


def steps_without_sync(eng, n: int, monkeypatch) -> list:
    """`n` engine steps, each under `torch.cuda.set_sync_debug_mode("error")` from schedule()'s
    return to the sampled ids' copy (the one read allowed); returns each step's schedule."""
    import runtime.engine as E
    copies, schedules = [], []

    def sample(rows, seqs, *rest):      # runtime.sampler.sample (same arguments), the one copy allowed
        st = SamplingTensors.build(seqs, rows.shape[-1], rows.device, torch.float32, *rest)
        ids = sample_tensors(rows, st)
        torch.cuda.set_sync_debug_mode(0)
        copies.append(1)
        out = ids.tolist()
        torch.cuda.set_sync_debug_mode("error")
        return out

    monkeypatch.setattr(E, "sample", sample)
    schedule = eng.scheduler.schedule

    def schedule_then_error():
        sb = schedule()
        schedules.append(sb)
        torch.cuda.set_sync_debug_mode("error")
        return sb

    monkeypatch.setattr(eng.scheduler, "schedule", schedule_then_error)
    torch.cuda.synchronize()
    try:
        for _ in range(n):
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert copies == [1] * n            # one batched sample per step: no row-by-row retry
    return schedules


def test_a_decode_step_does_not_synchronize(cuda_weights, traces, monkeypatch):
    """The step between schedule() and the sampled ids: no synchronization but the ids' copy."""
    eng = engine(cuda_weights, cudagraph_mode="FULL", cudagraph_capture_sizes="4")
    decoding(eng, 3)
    schedules = steps_without_sync(eng, 3, monkeypatch)
    assert all(sb.decode and sb.scheduled_bs == 3 for sb in schedules)
    assert [sb.steady for sb in schedules] == [False, True, True]  # the first decode batch afresh, then repeated one row on


def test_a_prefill_step_does_not_synchronize(cuda_weights, traces, monkeypatch):
    """A compiled prefill step (no graph holds it) neither: the indexers size their scores from
    the host's largest position (Batch.max_position), not from the device."""
    eng = engine(cuda_weights, cudagraph_mode="NONE")
    p = SamplingParams(max_tokens=1, ignore_eos=True)
    eng.add_request(H.prompts((150,), seed=5)[0], p)         # warm: every kernel of a prefill built
    while eng.has_unfinished():
        eng.step()
    eng.add_request(H.prompts((200,), seed=6)[0], p)
    (sb,) = steps_without_sync(eng, 1, monkeypatch)
    assert not sb.decode and sb.scheduled_tokens == 200 and not eng.has_unfinished()
