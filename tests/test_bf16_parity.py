"""The runtime in bf16 against the oracle (tests/reference) in bf16, bit for bit: both round at the
spec's points, so on the same rows they give the same bits. Eager, CPU.

What this does not cover, because it cannot be bitwise (README, Correctness): a request batched
with others, or chunked, runs its rows through GEMMs and elementwise kernels of other shapes than
the oracle's whole-sequence forward (CPU GEMM row tails, vectorized vs scalar tails of sigmoid),
which moves single values by an ulp; the attention list's -1 padding differs in length from the
oracle's, so a padded reduction may sum in another order."""
import pytest
import torch

import custom_ops  # noqa: F401  (registers torch.ops.v41)
from custom_ops import attention as ref_attn
from tests import harness as H
from tests.kernel_cases import flash_width_case
from tests.reference.oracle import Oracle, sparse_attn_sink
from tests.test_runtime_parity import teacher_forced
from v41.engram.device import Engram
from v41.model import prepare_weights

BF16 = torch.bfloat16


# ---- Engram (spec §3.2): w = q_weight ⊙ k_weight formed in FP32 -------------------------------

@pytest.mark.parametrize("layer", [1, 14])
def test_engram_sublayer_matches_oracle(toy_cfg, toy_weights, toy_token_map, layer):
    cfg, g = toy_cfg, torch.Generator().manual_seed(layer)
    w = prepare_weights(cfg, {k: v for k, v in toy_weights.items() if k.startswith(f"layers.{layer}.")},
                        BF16, "cpu")[f"layers.{layer}"]
    eng = Engram(w, cfg.hc_mult, cfg.rms_norm_eps)
    table = toy_weights[f"layers.{layer}.engram.embed.weight"]
    scale = toy_weights[f"layers.{layer}.engram.embed.scale"]
    T, n = 40, cfg.engram_width // table.shape[1]
    hids = torch.randint(0, table.shape[0], (T, n), generator=g)
    X = torch.randn(T, cfg.hc_mult, cfg.hidden_size, generator=g).to(BF16)
    rows = torch.empty(T, cfg.engram_width, dtype=BF16)
    torch.ops.v41.engram_gather(table, scale, hids, rows)
    oracle = Oracle(cfg, toy_weights, dtype=BF16, token_map=toy_token_map)
    want = oracle.engram_layer(layer, X, hids)
    assert torch.equal(eng(X, rows), want)
    # the product rounded to bf16 (what the runtime did before) is visibly another result
    eng.wqk = eng.wqk.to(BF16)
    assert not torch.equal(eng(X, rows), want)


# ---- sparse attention (spec §3.3 i): online softmax over blocks of 64 rows --------------------

def run_ref(args):
    q = args[0]
    out = torch.empty_like(q)
    ref_attn.sparse_attn(*args, out)
    return out


@pytest.mark.parametrize("holes", [False, True])
def test_sparse_attn_blocks_of_64_match_oracle(holes, monkeypatch):
    g = torch.Generator().manual_seed(7 + holes)
    args, oargs = flash_width_case(g, BF16, holes=holes)
    got = run_ref(args)
    assert torch.equal(got, sparse_attn_sink(*oargs, torch.float32))
    # above 64 rows the blocks matter in bf16: one pass over the list is another result
    monkeypatch.setattr(ref_attn, "BLOCK", 1 << 20)
    assert not torch.equal(run_ref(args), got)


def test_sparse_attn_blocks_float64_as_one_pass():
    """In float64 the blockwise softmax is the plain one, to rounding."""
    g = torch.Generator().manual_seed(3)
    args, _ = flash_width_case(g, torch.float64)
    q, _, ring, win, pool, topk, *_, sink, scale = args
    rows = torch.cat([ring[win.clamp(min=0)], pool[topk.clamp(min=0)]], 1)
    valid = torch.cat([win >= 0, topk >= 0], 1)
    s = (torch.einsum("thd,tnd->thn", q, rows) * scale).masked_fill(~valid[:, None], float("-inf"))
    full = torch.cat([s, sink.double().expand(s.shape[:2])[..., None]], -1)
    want = torch.einsum("thn,tnd->thd", torch.softmax(full, -1)[..., :-1], rows)
    assert ((run_ref(args) - want).norm() / want.norm()).item() < 1e-14


# ---- the whole forward ------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_teacher_forced_bf16_logits_equal_oracle(toy_cfg, toy_weights, toy_token_map, fmt):
    """Each prompt alone and in one chunk, so the runtime's GEMMs and elementwise kernels see
    the oracle's shapes; 600 tokens span many windows, owner rows and top-k selections."""
    eng = H.make_engine(toy_weights, dtype="bfloat16", index_cache_dtype=fmt, max_num_batched_tokens=700,
                        decoder_swa_bounded_replay=False)
    oracle = Oracle(toy_cfg, toy_weights, dtype=BF16, index_plane=fmt, token_map=toy_token_map)
    for p in H.prompts((1, 10, 33, 150, 600), seed=1):
        (got,) = teacher_forced(eng, [p])
        assert torch.equal(got, oracle.forward(torch.tensor(p))), f"prompt of {len(p)} tokens"
    assert eng.bm.all_free
