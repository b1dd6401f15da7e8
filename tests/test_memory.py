"""The KV pool sized from memory (runtime.memory.plan_pool) with made-up numbers, the CPU rule
left as it was, and the gpu-marked check of the CUDA path (profile, plan, allocate)."""
from __future__ import annotations

import logging

import pytest
import torch

from runtime.geometry import AdmissionError
from runtime.memory import GiB, graph_pool_overrun, plan_pool
from tests import harness as H

MiB = 2 ** 20
BASE = dict(total_bytes=80 * GiB, utilization=0.9, weight_bytes=40 * GiB, activation_peak=4 * GiB,
            graph_pool_bytes=1 * GiB, scorer_scratch=64 * MiB, bytes_per_page=3 * MiB,
            bytes_per_state=5 * MiB, max_model_len=8192, page_tokens=128, num_slots=64)


def test_pool_gets_what_is_left():
    p = plan_pool(**BASE)
    budget = int(80 * GiB * 0.9)
    left = budget - (40 * GiB + 4 * GiB + 1 * GiB + 64 * MiB) - 64 * 5 * MiB
    assert p.num_pages == left // (3 * MiB) and p.num_slots == 64
    assert p.budget_bytes == budget and p.page_bytes == p.num_pages * 3 * MiB
    assert p.reserved_bytes + p.state_bytes + p.page_bytes <= budget < p.reserved_bytes + p.state_bytes \
        + p.page_bytes + 3 * MiB


def test_a_graph_pool_over_its_plan_is_named():
    """The plan keeps the graph pool's share; a capture that outgrew it (TR_HYBRID's per-bucket
    piece outputs) gets a warning with both sizes, one within it none."""
    p = plan_pool(**BASE)
    assert p.graph_pool_bytes == 1 * GiB
    assert graph_pool_overrun(p, 1 * GiB) is None
    msg = graph_pool_overrun(p, 3 * GiB)
    assert "3.00 GiB captured, 1.00 GiB planned" in msg and "--gpu-memory-utilization" in msg


def test_images_and_utilization_take_their_share():
    reserved = 40 * GiB + 4 * GiB + 1 * GiB + 64 * MiB
    left = int(80 * GiB * 0.9) - reserved - 64 * 5 * MiB
    assert plan_pool(**BASE, bytes_per_image=2 * MiB, num_images=100).num_pages == (left - 200 * MiB) // (3 * MiB)
    lower = int(80 * GiB * 0.8) - reserved - 64 * 5 * MiB
    assert plan_pool(**{**BASE, "utilization": 0.8}).num_pages == lower // (3 * MiB)


def test_one_max_length_request_must_fit():
    need = 8192 // 128
    fits = dict(BASE, total_bytes=0, utilization=1.0, weight_bytes=0, activation_peak=0, graph_pool_bytes=0,
                scorer_scratch=0, num_slots=1)
    fits["total_bytes"] = 5 * MiB + need * 3 * MiB
    assert plan_pool(**fits).num_pages == need
    with pytest.raises(AdmissionError, match=r"leaves? 63 PAGEs .* needs 64") as e:
        plan_pool(**{**fits, "total_bytes": fits["total_bytes"] - 1})
    msg = str(e.value)
    assert msg.startswith("gpu_memory_utilization: ") and "--gpu-memory-utilization" in msg
    with pytest.raises(AdmissionError, match="leave 0 PAGEs"):        # weights alone overflow
        plan_pool(**{**BASE, "weight_bytes": 100 * GiB})


@pytest.mark.parametrize("bad", [{"utilization": 0}, {"utilization": 1.01}, {"bytes_per_page": 0},
                                 {"weight_bytes": -1}, {"num_slots": 0}])
def test_bad_inputs_are_named(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name if name != "utilization" else "gpu_memory_utilization"):
        plan_pool(**{**BASE, **bad})


def test_cpu_keeps_its_rule_and_logs_num_pages(toy_weights, caplog):
    """On the CPU no sizing: every running request gets max_model_len; --num-pages wins."""
    with caplog.at_level(logging.INFO, logger="v41"):
        eng = H.make_engine(toy_weights, dtype="float32", max_num_seqs=3, max_model_len=100)
    assert eng.bm.num_pages == 3 * -(-100 // 32) and eng.pool_plan is None
    assert any("num_pages 12 of 32 tokens" in r.getMessage() for r in caplog.records)
    assert H.make_engine(toy_weights, dtype="float32", num_pages=7).bm.num_pages == 7


@pytest.mark.gpu
def test_cuda_pool_is_sized_from_memory():
    """The CUDA path: a profiling forward of the largest batch on a one-request pool, then the
    planned pool; --num-pages still wins; an impossible utilization is refused with numbers."""
    from runtime.engine import EngineArgs, LLMEngine
    base = dict(model="toy", dtype="float32", device="cuda", max_num_seqs=4, max_num_batched_tokens=256,
                max_model_len=512, cudagraph_mode="NONE")
    eng = LLMEngine(EngineArgs(**base, gpu_memory_utilization=0.5))
    free, total = torch.cuda.mem_get_info()
    p = eng.pool_plan
    assert p is not None and p.num_pages == eng.bm.num_pages == eng.runner.cache.num_pages
    assert p.num_pages >= 512 // 32 and p.budget_bytes == int(total * 0.5)
    assert torch.cuda.memory_allocated() <= p.budget_bytes
    assert LLMEngine(EngineArgs(**base, num_pages=40)).bm.num_pages == 40
    with pytest.raises(AdmissionError, match="gpu_memory_utilization: 1e-06"):
        LLMEngine(EngineArgs(**base, gpu_memory_utilization=1e-6))


def test_dequantized_weights_free_the_checkpoint(monkeypatch):
    """Where weights are dequantized (the CPU; CUDA without the native GEMMs), the engine keeps
    the compute copies only: the loaded FP8/FP4 checkpoint tensors are unreferenced once it is
    built. (On the H200, flash-slice's pool plan counted both: 122 GiB of 'weights'.)"""
    import gc
    import weakref

    import v41.loader
    from runtime.engine import EngineArgs, LLMEngine
    refs = []
    load = v41.loader.load_weights

    def tracked(*a, **kw):
        w = load(*a, **kw)
        refs.extend(weakref.ref(t) for k, t in w.items()      # (Engram tables stay: gathered per step)
                    if t.dtype in (torch.float8_e4m3fn, torch.int8) and ".engram.embed." not in k)
        return w

    monkeypatch.setattr(v41.loader, "load_weights", tracked)
    eng = LLMEngine(EngineArgs(model="toy", dtype="float32", max_num_seqs=2, max_model_len=128))
    gc.collect()
    assert refs and eng.runner is not None
    assert [r for r in refs if r() is not None] == []
