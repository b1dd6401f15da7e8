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


def test_verify_step_samples_every_row(engine):
    """A DSpark verify step reads what a prefill of as many rows reads, and multiplies the FP32
    head on every row (not once a request); an unknown kind is refused by name."""
    model = engine.runner.model
    p, v = step_floor(model, "prefill", 2, 6, 0), step_floor(model, "verify", 2, 6, 0)
    assert v["bytes"] == p["bytes"]
    assert v["flops"] - p["flops"] == pytest.approx(2 * model.head.numel() * (12 - 2), abs=2)
    with pytest.raises(ValueError, match="'draft' is not"):
        step_floor(model, "draft", 1, 1, 0)


def test_draft_floor_counts_its_blocks_and_the_shared_head():
    """The DSpark draft's floor: its stages' weights (the routed experts its rows reach), its
    heads, and the target's head it shares, read once; more rows reach more experts and
    rows of the two embeddings."""
    eng = LLMEngine(EngineArgs(model="toy", device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=256,
                               max_model_len=320, speculative_method="dspark"))
    from v41.moe import MoE
    draft, cfg = eng.runner.spec.draft, eng.cfg
    one, four = step_floor(draft, "verify", 1, 1, 0), step_floor(draft, "verify", 4, 5, 0)
    assert draft.head.nbytes < one["bytes"] < weight_bytes(draft)
    moes = [m for m in draft.modules() if isinstance(m, MoE)]
    assert len(moes) == cfg.n_draft
    reach = lambda m, rows: min(m.gate.shape[0], m.top_k * rows) / m.gate.shape[0]    # noqa: E731
    routed = sum((reach(m, 20) - reach(m, 1)) * (m.w1.nbytes + m.w3.nbytes + m.w2.nbytes) for m in moes)
    assert routed > 0
    markov_row = draft.markov_embed[0].nbytes            # the Markov embedding: a lookup, by rows too
    assert four["bytes"] - one["bytes"] == pytest.approx(routed + (cfg.hidden_size * 4 + markov_row) * 19, abs=4)
