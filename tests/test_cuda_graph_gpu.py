"""FULL CUDA graphs and the sync-free step on a GPU (`pytest -m gpu tests/test_cuda_graph_gpu.py`
on the H200). Not yet run on a GPU: written for the first run there.

- A replayed decode graph gives bitwise the logits of the same compiled forward run without
  capture at the same running width (toy, float32), from the same cache state.
- The schedule-invariance harness gives the same greedy tokens with FULL and with NONE
  (compiled both ways), and leaks no page or slot.
- One decode step runs under `torch.cuda.set_sync_debug_mode("error")` but for the sampler's
  one copy of the ids.
"""
from __future__ import annotations

import pytest
import torch

from runtime.compile import TraceCache
from runtime.engine import EngineArgs, LLMEngine
from runtime.sampler import SamplingTensors, sample_tensors
from tests import harness as H
from tests.graph_checks import decoding, planes_written_by_a_step, replay_equals_plain_forward

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
    decoding(eng, 3)
    replay_equals_plain_forward(eng, 4)


def test_padding_rows_are_inert_under_replay(cuda_weights, traces):
    """3 requests replayed at width 4: the cache rows written equal those of the exact-width
    compiled step, starting from NaN-poisoned planes."""
    graphed = planes_written_by_a_step(engine(cuda_weights, cudagraph_mode="FULL", cudagraph_capture_sizes="4"))
    plain = planes_written_by_a_step(engine(cuda_weights, cudagraph_mode="NONE"))
    assert all(torch.equal(a, b) for a, b in zip(graphed, plain))
    assert any(a.any() for a in graphed)


SCENARIOS = [
    H.Scenario("chunks", engine={"max_prefill_chunk": 7}),
    H.Scenario("preempt", engine={"max_prefill_chunk": 9}, hook=H.preempt_randomly(0.2), seed=1),
    H.Scenario("cancel", engine={"max_num_seqs": 3}, hook=H.cancel_randomly(0.08), seed=2),
    H.Scenario("arrivals", arrival_steps=[0, 3, 3, 5, 9, 9, 12, 20]),
]


@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_schedule_invariance_full_vs_none(cuda_weights, traces, sc):
    reqs = H.prompts()
    cuda = {k: v for k, v in BASE.items() if k not in ("model", "dtype", "max_num_seqs")}
    got = {}
    for mode in ("NONE", "FULL"):
        scenario = H.Scenario(sc.name, engine={**cuda, **sc.engine, "cudagraph_mode": mode},
                              arrival_steps=sc.arrival_steps, hook=sc.hook, seed=sc.seed)
        got[mode] = H.run(cuda_weights, reqs, max_tokens=8, scenario=scenario, dtype="float32")
    assert got["FULL"] == got["NONE"]


def test_a_decode_step_does_not_synchronize(cuda_weights, traces, monkeypatch):
    """The step between schedule() and the sampled ids: no synchronization but the ids' copy."""
    import runtime.engine as E
    eng = engine(cuda_weights, cudagraph_mode="FULL", cudagraph_capture_sizes="4")
    decoding(eng, 3)
    copies = []

    def sample(rows, seqs, eos):        # runtime.sampler.sample, the one copy allowed
        st = SamplingTensors.build(seqs, rows.shape[-1], rows.device, torch.float32, eos)
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
        torch.cuda.set_sync_debug_mode("error")
        return sb

    eng.scheduler.schedule = schedule_then_error
    torch.cuda.synchronize()
    try:
        for _ in range(3):
            assert len(eng.step()) == 3
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert copies == [1, 1, 1]
