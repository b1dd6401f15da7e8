"""The reference oracle (tests/reference/): its pieces against hand-computed numbers, and full
toy forwards that exercise every structural feature (ring wrap, odd length, top-k and candidate
pruning, both index planes, the DSpark draft, bounded-replay windows, causality)."""
from __future__ import annotations

import math
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tests.reference import quant as Q
from tests.reference.oracle import (Oracle, apply_rope, attention_indices, candidate_blocks, replay_window,
                                    rope_freqs, rope_table, sinkhorn, sparse_attn_sink, topk_rows, yarn_range)
from v41.config import preset
from v41.topology import Role

SEQ = 301   # > window (16), odd (ratio-2 tail), > 2·index_topk, > candidate rows (16)


# ---- fixtures ---------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the oracle runs many tiny ops: intra-op threads only add contention on a 2-core machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def cfg():
    return preset("toy")


@pytest.fixture(scope="module")
def weights(cfg):
    from v41.loader import ensure_preset_checkpoint, load_checkpoint
    return load_checkpoint(ensure_preset_checkpoint("toy"), cfg, progress=False)


@pytest.fixture(scope="module")
def ids(cfg):
    g = torch.Generator().manual_seed(1234)
    return torch.randint(3, cfg.vocab_size - 3, (SEQ,), generator=g)


@pytest.fixture(scope="module")
def oracle(cfg, weights):
    return Oracle(cfg, weights, dtype=torch.float64)


@pytest.fixture(scope="module")
def run64(oracle, ids):
    t = time.perf_counter()
    logits = oracle.forward(ids)
    return logits, oracle.last, time.perf_counter() - t


# ---- quantizers -------------------------------------------------------------------------------

def test_exp2_and_pow2ceil_exact():
    for dt, lo, hi in ((torch.float32, -149, 127), (torch.float64, -1074, 1023)):
        e = torch.arange(lo, hi + 1)
        m, ee = torch.frexp(Q.exp2i(e, dt))
        assert (m == 0.5).all() and (ee - 1 == e).all()
    v = torch.tensor([1.0, 1.5, 2.0, 0.75, 0.5, 3.0, 448 / 448, 1 + 2 ** -52], dtype=torch.float64)
    assert Q.pow2ceil(v).tolist() == [1.0, 2.0, 2.0, 1.0, 0.5, 4.0, 1.0, 2.0]


def test_e4m3_matches_torch_cast_on_float32():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-14, 9, (200_000,), generator=g).float())
    x = x.clamp(-448, 448)
    ref = x.to(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(Q.round_e4m3(x), ref)
    # every code round-trips
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    codes = codes[torch.isfinite(codes)]
    assert torch.equal(Q.round_e4m3(codes), codes)


def test_e4m3_exact_in_float64():
    # 1.0625 is the midpoint of 1 and 1.125: a hair above it must round up. A float32 cast would
    # first land on the midpoint and round to even (1.0).
    x = torch.tensor([1.0625 + 2 ** -40, 1.0625, 1.1875, -1.0625 - 2 ** -40, 500.0, 3 * 2 ** -11, 2 ** -10],
                     dtype=torch.float64)
    assert Q.round_e4m3(x).tolist() == [1.125, 1.0, 1.25, -1.125, 448.0, 2 ** -9, 0.0]


def test_e2m1_round_nearest_even():
    x = torch.tensor([0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, 7.0, -0.75, -5.0], dtype=torch.float64)
    assert Q.round_e2m1(x).tolist() == [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -1.0, -4.0]


def test_fp8_qat_group32():
    x = torch.zeros(2, 32, dtype=torch.float64)
    x[0, 0], x[0, 1], x[0, 2] = 56.0, 1.0625 + 2 ** -30, -3.3   # amax 56 → s = pow2ceil(56/448) = 1/8
    x[1, :] = 1e-6                                             # amax floor 1e-4 → s = 2**-22
    y = Q.fp8_qat(x, 32)
    assert y[0, 0] == 56.0 and y[0, 1] == 1.125 and y[0, 2] == -3.25   # x/s = 8.5+ε → 9; -26.4 → -26
    s = 2.0 ** -22
    assert torch.equal(y[1], Q.round_e4m3(x[1] / s) * s)
    # one scale per row when group = row width (the runtime's FP8 index plane)
    r = torch.tensor([[6.0] + [0.0] * 63, [0.01] * 64], dtype=torch.float64)
    assert torch.equal(Q.fp8_qat(r, 64)[0], r[0])


def test_fp4_qat_ue8m0_group32():
    x = torch.zeros(1, 32, dtype=torch.float64)
    x[0, :4] = torch.tensor([12.0, 5.0, 2.9, -0.3])           # amax 12 → s = 2; x/s = 6, 2.5, 1.45, -.15
    assert Q.fp4_qat_ue8m0(x, 32)[0, :4].tolist() == [12.0, 4.0, 3.0, -0.0]
    tiny = torch.full((1, 32), 1e-45, dtype=torch.float64)    # below the floor: s = 2**-126
    assert Q.fp4_qat_ue8m0(tiny, 32).abs().max() == 0.0


def test_fp4_qat_e4m3_group16():
    x = torch.zeros(2, 16, dtype=torch.float64)
    x[0, :3] = torch.tensor([3.0, 1.25, 0.8])      # s = e4m3(3/6) = 0.5: 6, 2.5→2, 1.6→1.5
    x[1, :2] = torch.tensor([7.0, -2.0])           # s = e4m3(7/6) = 1.125 (not a power of two)
    y = Q.fp4_qat_e4m3(x, 16)
    assert y[0, :3].tolist() == [3.0, 1.0, 0.75]
    assert y[1, 0] == 6 * 1.125                     # 7/1.125 = 6.22 saturates at 6
    assert y[1, 1] == -2 * 1.125                    # 2/1.125 = 1.78 → 2


def test_dequant_formats():
    # packed FP4: element 2k in the low nibble, bit 3 = sign; E8M0 = 2**(code-127)
    w = torch.tensor([[0x9A, 0x7F] + [0] * 14], dtype=torch.uint8).view(torch.int8)   # [1, 32/2]
    s = torch.tensor([[128]], dtype=torch.uint8).view(torch.float8_e8m0fnu)           # 2.0
    d = Q.dequant_fp4_packed(w, s)
    assert d.shape == (1, 32) and d[0, :4].tolist() == [-2.0, -1.0, -12.0, 12.0] and d[0, 4:].abs().sum() == 0
    # FP8 32×32 blocks with ragged edges
    q = torch.ones(40, 70).to(torch.float8_e4m3fn)
    sc = torch.tensor([[127, 128, 129], [126, 125, 124]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    d = Q.dequant_fp8_block(q, sc)
    assert d[0, 0] == 1 and d[31, 63] == 2 and d[0, 64] == 4 and d[32, 0] == 0.5 and d[39, 69] == 2 ** -3
    assert Q.e8m0_decode(torch.tensor([0, 255], dtype=torch.uint8)).tolist()[0] == 2.0 ** -127
    assert math.isnan(Q.e8m0_decode(torch.tensor([255], dtype=torch.uint8))[0])


# ---- pieces -----------------------------------------------------------------------------------

def test_sinkhorn_doubly_stochastic():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(256, 4, 4, generator=g, dtype=torch.float64)
    c = sinkhorn(logits, 20, 1e-6)
    assert (c > 0).all()
    ones = torch.ones(256, 4, dtype=torch.float64)
    assert torch.allclose(c.sum(-2), ones, rtol=0, atol=2e-6)     # columns: the last pass, up to eps
    assert torch.allclose(c.sum(-1), ones, rtol=0, atol=1e-4)     # rows: 20 iterations converge
    # one iteration = softmax + eps, then a single column normalization
    c1 = sinkhorn(logits, 1, 1e-6)
    ref = torch.softmax(logits, -1) + 1e-6
    assert torch.allclose(c1, ref / (ref.sum(-2, keepdim=True) + 1e-6), rtol=0, atol=1e-15)


def test_yarn_range_and_freqs():
    flash = preset("flash")
    assert yarn_range(64, 160000.0, 65536, 32, 1) == (15, 25)
    assert yarn_range(16, 160000.0, 65536, 32, 1) == (3, 7)
    f = rope_freqs(flash, 2)
    base = 1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    assert f.dtype == torch.float32
    assert torch.equal(f[:16], base[:16])                        # ramp 0 at i <= low: unscaled
    assert torch.allclose(f[25:], base[25:] / 16, rtol=1e-6)     # ramp 1 at i >= high: / factor
    assert ((f[16:25] < base[16:25]) & (f[16:25] > base[16:25] / 16)).all()
    w = rope_freqs(flash, 0)                                     # window layers: base 10000, no YaRN
    assert torch.equal(w, 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)))


def test_rope_interleaved_last_dims_and_inverse():
    cfg = preset("toy")
    r = cfg.qk_rope_head_dim
    pos = torch.tensor([0, 1, 7, 65535, 1_000_000])
    cos, sin = rope_table(rope_freqs(cfg, 2), pos)
    assert cos.dtype == torch.float32 and cos.shape == (5, r // 2)
    x = torch.zeros(5, 64, dtype=torch.float64)
    x[:, 64 - r] = 1.0                                           # real part of the first pair
    y = apply_rope(x, cos, sin, torch.float64)
    assert torch.equal(y[:, : 64 - r], x[:, : 64 - r])           # NoPE part untouched
    assert torch.equal(y[:, 64 - r], cos[:, 0].double()) and torch.equal(y[:, 64 - r + 1], sin[:, 0].double())
    assert torch.equal(y[0], x[0])                               # position 0 is the identity
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 3, 64, generator=g, dtype=torch.float64)
    back = apply_rope(apply_rope(z, cos[:, None], sin[:, None], torch.float64),
                      cos[:, None], sin[:, None], torch.float64, inverse=True)
    assert torch.allclose(back, z, rtol=0, atol=1e-6)           # |cis|² = 1 up to FP32 table rounding


def test_sparse_attention_with_sink_two_rows():
    q = torch.tensor([[[1.0, 0.0]]], dtype=torch.float64)      # [S=1, H=1, d=2]
    pool = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    o = sparse_attn_sink(q, pool, torch.tensor([[0, 1]]), torch.tensor([0.0]), 1.0, torch.float64)
    e = math.e
    assert torch.allclose(o[0, 0], torch.tensor([e / (2 + e), 1 / (2 + e)], dtype=torch.float64), rtol=1e-15)
    # -1 entries are skipped; a sink of -inf is plain softmax; scale multiplies the logits
    o = sparse_attn_sink(q, pool, torch.tensor([[1, -1, 0]]), torch.tensor([float("-inf")]), 2.0, torch.float64)
    assert torch.allclose(o[0, 0], torch.tensor([e * e / (1 + e * e), 1 / (1 + e * e)], dtype=torch.float64))
    # no valid index → 0
    assert o.new_zeros(1).item() == sparse_attn_sink(q, pool, torch.tensor([[-1, -1]]), torch.tensor([0.0]),
                                                     1.0, torch.float64).abs().max().item()
    # blockwise online softmax (blocks of 64) equals the one-shot formula
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 2, 8, generator=g, dtype=torch.float64)
    pool = torch.randn(200, 8, generator=g, dtype=torch.float64)
    idx = torch.randint(0, 200, (3, 150), generator=g)
    sink = torch.tensor([0.3, -1.0], dtype=torch.float64)
    o = sparse_attn_sink(q, pool, idx, sink, 0.35, torch.float64)
    s = torch.einsum("shd,sld->shl", q, pool[idx]) * 0.35
    p = torch.exp(s)
    ref = torch.einsum("shl,sld->shd", p, pool[idx]) / (p.sum(-1) + torch.exp(sink))[..., None]
    assert torch.allclose(o, ref, rtol=1e-12, atol=0)


def test_topk_and_candidate_ties_small_position_first():
    inf = float("inf")
    score = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.5, -inf, -inf]], dtype=torch.float64)
    assert topk_rows(score, torch.tensor([6]), 2).tolist() == [[1, 2]]
    assert topk_rows(score, torch.tensor([6]), 4).tolist() == [[1, 2, 3, 4]]
    assert topk_rows(score, torch.tensor([2]), 4).tolist() == [[0, 1, -1, -1]]      # k = min(topk, visible)
    # a visible row at -inf fills a slot only after every finite one, never an invisible row
    s2 = torch.tensor([[-inf, 1.0, -inf, -inf]], dtype=torch.float64)
    assert topk_rows(s2, torch.tensor([3]), 3).tolist() == [[0, 1, 2]]
    # blocks of 2: maxima [3, 3, 3, 0.5]; newest visible row 5 → block 2 forced; keep 2 → blocks 0 and 2
    cand = candidate_blocks(score[:, :6].clone(), torch.tensor([6]), 2, 2)
    assert cand.tolist() == [[True, True, False, False, True, True]]
    cand = candidate_blocks(score[:, :6].clone(), torch.tensor([1]), 2, 2)          # only block 0 visible
    assert cand.tolist() == [[True, True, False, False, False, False]]


def test_attention_indices_layout():
    t = torch.tensor([0, 1, 5])
    lo = torch.tensor([0, 0, 3])
    sel = torch.tensor([[-1, -1], [0, -1], [0, 2]])
    idx = attention_indices(t, lo, sel, 6)
    assert idx.tolist() == [[0, -1, -1, -1, -1], [0, 1, 6, -1, -1], [3, 4, 5, 6, 8]]


def test_engram_hash_ids_formula(cfg):
    """The runtime's hash ids at two positions, recomputed by hand from the spec."""
    from v41.engram.hashing import EngramLayout, hash_ids
    lay = EngramLayout(cfg, pad_id=7)
    c = torch.tensor([11, 12, 13, 14, 15])
    got = hash_ids(c, lay, 1)
    mask = (1 << 64) - 1
    def wrap(v):
        v &= mask
        return v - (1 << 64) if v >= 1 << 63 else v
    for p in (1, 4):
        toks = [int(c[p - k]) if p - k >= 0 else 7 for k in range(4)]
        prods = [wrap(t * m) for t, m in zip(toks, lay.multipliers[1])]
        rolling, want = prods[0], []
        for o in range(2, 5):
            rolling = wrap(rolling ^ prods[o - 1])
            for h in range(cfg.engram_n_heads):
                j = (o - 2) * cfg.engram_n_heads + h
                want.append(rolling % lay.primes[1][j] + lay.offsets[1][j])
        assert got[p].tolist() == want


def test_oracle_imports_no_model_code():
    code = ("import sys, tests.reference.oracle, tests.reference.quant\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('custom_ops', 'runtime', 'passes') or m in "
            "('v41.model', 'v41.attention', 'v41.moe', 'v41.quant', 'v41.layers', 'v41.engram.device', 'v41.dspark')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- full toy forwards ------------------------------------------------------------------------

def test_toy_forward_long(cfg, run64, oracle, ids):
    logits, st, dt = run64
    print(f"\noracle toy forward, {SEQ} tokens, float64: {dt:.2f}s")
    assert logits.shape == (SEQ, cfg.vocab_size) and logits.dtype == torch.float64
    assert torch.isfinite(logits).all()
    topo = cfg.topology
    W = cfg.sliding_window
    # ring wrap: late queries lose their oldest rows
    assert SEQ > W and SEQ % 2 == 1
    assert all(int(st.window_lo[l][-1]) == SEQ - W for l in st.window_lo)
    # owner rows: ratio 2 → floor(S/2) (the odd last token stays in the tail), ratio 1 → S
    for s in topo.backbone:
        if s.role is Role.FULL:
            assert st.main_rows[s.layer].shape[0] == SEQ // s.ratio
            assert st.index_rows[s.layer].shape == (SEQ // s.ratio, cfg.index_head_dim)
    # top-k actually drops rows; level-1 candidates actually drop blocks; REINDEX never underfull
    for l, stats in st.stats["layers"].items():
        assert stats["topk_dropped"] > 0, l
    prod = cfg.candidate_source_layer_id
    assert st.stats["layers"][prod]["candidate_blocks_dropped"] > 0
    cand = st.candidates[prod]
    vis = torch.arange(SEQ) + 1
    assert (cand[-1, : vis[-1]].sum() < vis[-1]) and cand[-1, SEQ - 1]          # newest block kept
    cb = cfg.candidate_block_size
    blocks = torch.nn.functional.pad(cand, (0, -SEQ % cb)).view(SEQ, -1, cb).any(-1)
    assert (blocks.sum(-1) <= cfg.candidate_topk_blocks).all() and blocks.sum(-1).max() == cfg.candidate_topk_blocks
    for s in topo.backbone:
        if s.role is Role.REINDEX:
            assert st.stats["layers"][s.layer]["reindex_underfull"] == 0
            sel = st.selections[s.layer]
            ok = sel >= 0
            assert cand.gather(1, sel.clamp(min=0))[ok].all()                  # inside the candidates
    # selections: ascending, unique, visible, k = min(topk, visible)
    for l, sel in st.selections.items():
        r = topo.layers[l].ratio
        k = (sel >= 0).sum(1)
        assert torch.equal(k, torch.clamp((torch.arange(SEQ) + 1) // r, max=cfg.index_topk))
        assert torch.equal(sel >= 0, torch.arange(sel.shape[1])[None, :] < k[:, None])   # -1 pad at the end
        assert (sel[:, 1:] > sel[:, :-1])[sel[:, 1:] >= 0].all()                           # ascending, unique
        assert (sel < ((torch.arange(SEQ) + 1) // r)[:, None]).all()
    # REUSE layers read their top-k owner's list (checked through the layer table)
    assert len(st.taps) == len(cfg.dspark_target_layer_ids) and st.taps[0].shape == (SEQ, cfg.hidden_size)
    # deterministic
    assert torch.equal(oracle.forward(ids[:40]), oracle.forward(ids[:40]))


def test_toy_forward_float32_and_bf16(cfg, weights, ids):
    o32 = Oracle(cfg, weights, dtype=torch.float32)
    t = time.perf_counter()
    l32 = o32.forward(ids)
    print(f"\noracle toy forward, {SEQ} tokens, float32: {time.perf_counter() - t:.2f}s")
    assert l32.dtype == torch.float32 and torch.isfinite(l32).all()
    lbf = Oracle(cfg, weights, dtype=torch.bfloat16).forward(ids[:64])
    assert lbf.dtype == torch.float32 and torch.isfinite(lbf).all()


def test_index_planes(cfg, weights, ids, run64):
    logits, st, _ = run64
    o8 = Oracle(cfg, weights, dtype=torch.float64, index_plane="fp8")
    l8 = o8.forward(ids)
    assert torch.isfinite(l8).all()
    # the FP8 plane quantizes the query on its own grid (no FP4 round trip), so its selections
    # may differ from the FP4 plane's; they are still ascending, visible and -1 padded
    for l, sel in o8.last.selections.items():
        assert sel.shape == st.selections[l].shape
        valid = sel >= 0
        assert (sel[:, 1:][valid[:, 1:]] > sel[:, :-1][valid[:, 1:]]).all()
    # with several FP4 groups of very different magnitude in one row the FP8 plane does round
    k = torch.zeros(1, 128, dtype=torch.float64)
    k[0, :32], k[0, 32:64] = 5.0, 3 * 2.0 ** -16   # 6·2**-17 → 1.5·2**-9 in the row scale
    k4 = Q.fp4_qat_ue8m0(k, 32)
    assert not torch.equal(Q.fp8_qat(k4, 128), k4)
    with pytest.raises(ValueError):
        Oracle(cfg, weights, index_plane="bf16")


def test_causality(oracle, ids, run64):
    full = run64[0]
    for k in (1, 2, 17, 150):
        part = oracle.forward(ids[:k])
        assert torch.allclose(part, full[:k], rtol=1e-10, atol=1e-10), k


def test_greedy_after_is_greedy_decoding(cfg, oracle, ids):
    """Oracle.greedy_after (one teacher-forced forward) gives the tokens of greedy decoding with
    one forward per token, truncated windows included, and flags a wrong continuation at its
    first wrong token."""
    prompt, n = ids[:21].tolist(), 6
    kw = dict(window_start=replay_window(len(prompt) - cfg.sliding_window, cfg.topology.boundary))
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(oracle.forward(torch.tensor(seq), **kw)[-1].argmax()))
    greedy = seq[len(prompt):]
    assert oracle.greedy_after(prompt, greedy, **kw) == greedy
    wrong = greedy[:2] + [(greedy[2] + 1) % cfg.vocab_size] + greedy[3:]
    got = oracle.greedy_after(prompt, wrong, **kw)
    assert got[:3] == greedy[:3] and got != wrong


def test_replay_window_hook(cfg, oracle, ids, run64):
    full, st_full, _ = run64
    tail = SEQ - cfg.sliding_window
    boundary = cfg.topology.boundary
    lr = oracle.forward(ids, window_start=replay_window(tail, boundary))
    st = oracle.last
    assert torch.equal(lr[:tail], full[:tail]) or torch.allclose(lr[:tail], full[:tail], rtol=1e-12, atol=1e-12)
    for l, lo in st.window_lo.items():
        want = st_full.window_lo[l].clone()
        if l >= boundary:
            want[tail:] = torch.clamp(want[tail:], min=tail)
        assert torch.equal(lo, want), l
    assert not torch.allclose(lr[tail + 1:], full[tail + 1:])     # truncated windows change the tail
    # the encoder-side global path is untouched
    for l in oracle.last.main_rows:
        assert torch.equal(oracle.last.main_rows[l], st_full.main_rows[l])


def test_start_offset(cfg, oracle, ids):
    lg = oracle.forward(ids[:48], start=65536)
    assert torch.isfinite(lg).all() and int(oracle.last.positions[0]) == 65536
    with pytest.raises(ValueError):
        oracle.forward(ids[:8], start=3)


def test_dspark_draft(cfg, oracle, ids, run64):
    logits, st, _ = run64
    d = oracle.draft(taps=st.taps, anchor_pos=SEQ - 1, anchor_token=int(logits[-1].argmax()))
    T = cfg.dspark_block_size
    assert d.logits.shape == (T, cfg.vocab_size) and torch.isfinite(d.logits).all()
    assert d.tokens.shape == (T,) and ((0 <= d.tokens) & (d.tokens < cfg.vocab_size)).all()
    assert torch.equal(d.tokens, d.logits.argmax(-1))
    assert ((d.confidence > 0) & (d.confidence < 1)).all()
    assert d.positions.tolist() == list(range(SEQ, SEQ + T))
    assert d.context.tolist() == list(range(SEQ - cfg.sliding_window, SEQ))    # context (P-W, P]
    # the default path (run the target, greedy anchor) gives the same block
    d2 = oracle.draft(ids)
    assert torch.equal(d2.tokens, d.tokens) and torch.allclose(d2.logits, d.logits, rtol=1e-12, atol=1e-12)
    # an earlier anchor with a short context (fewer rows than the window)
    d3 = oracle.draft(taps=st.taps, anchor_pos=5, anchor_token=3)
    assert d3.context.tolist() == list(range(6)) and torch.isfinite(d3.logits).all()
