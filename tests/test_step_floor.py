"""benchmarks/floor.py: the bytes and FLOPs a step's floor counts, checked against the toy's
config (the routed experts a step can reach, the embedding rows, the held KV state)."""
import math

import pytest

from benchmarks.floor import COPY_RATE, held_state_bytes, step_floor, weight_bytes
from runtime.engine import EngineArgs, LLMEngine


@pytest.fixture(scope="module", params=["dequant", "native"])
def engine(request):
    return LLMEngine(EngineArgs(model="toy", device="cpu", dtype="float32", max_num_seqs=4,
                                max_num_batched_tokens=256, max_model_len=320, weight_format=request.param))


def routed_bytes(cfg, native: bool) -> int:
    """Bytes of one MoE layer's routed experts from the config: w1, w3 [I, D], w2 [D, I] per
    expert; native: FP4 pairs in bytes plus an E8M0 byte per 32 elements; dequant: float32."""
    elems = 3 * cfg.moe_intermediate_size * cfg.hidden_size * cfg.n_routed_experts
    return elems // 2 + elems // 32 if native else 4 * elems


def test_decode_floor_counts_the_experts_a_token_reaches(engine):
    model, cfg = engine.runner.model, engine.runner.model.cfg
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    one = step_floor(model, "decode", 1, 64, 0)
    every = step_floor(model, "decode", e, 64, 0)        # e tokens x k >= e: every expert read
    per_layer = routed_bytes(cfg, model.native) * (1 - k / e)
    emb = cfg.vocab_size * cfg.hidden_size * 4
    diff = every["bytes"] - one["bytes"]
    assert diff == pytest.approx(len(cfg.topology.backbone) * per_layer + emb * (e - 1) / cfg.vocab_size, abs=2)
    assert every["bytes"] < weight_bytes(model)          # RoPE tables and unread embedding rows out
    assert one["floor_ms"] == pytest.approx(max(one["bytes"] / COPY_RATE * 1e3, one["flops_ms"]), abs=1e-3)


def test_state_and_prefill_flops(engine):
    model, geo = engine.runner.model, engine.runner.cache.geo
    state = held_state_bytes(geo, 3, 100)
    assert state == 3 * (math.ceil(100 / geo.page_tokens) * geo.bytes_per_page + geo.bytes_per_state)
    a, b = step_floor(model, "decode", 3, 100, 0), step_floor(model, "decode", 3, 100, state)
    assert b["bytes"] - a["bytes"] == state
    p1, p2 = step_floor(model, "prefill", 1, 100, 0), step_floor(model, "prefill", 1, 200, 0)
    head = 2 * model.head.numel()                 # once per sampled row, not per token
    assert p2["flops"] - p1["flops"] == pytest.approx(p1["flops"] - head, abs=2)
    assert p1["flops"] > head
