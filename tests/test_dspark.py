"""The runtime's DSpark draft (v41/dspark.py) against the oracle's (`Oracle.draft`, spec §3.6) in
float64 on the toy: logits, proposed tokens and confidence for anchors with a short context,
a context longer than the window, every ring offset, context floors (decoder tail start, inside the window), several
requests in one flat draft batch, and context rings written in prefill chunks and decode steps.
The taps come from the oracle's forward, so nothing here depends on the runner."""
from __future__ import annotations

import pytest
import torch

from tests.reference.oracle import Oracle, replay_window
from tests.test_oracle import cfg, one_thread  # noqa: F401  (the toy config; one intra-op thread)
from v41.dspark import DSpark, prepare_draft_weights
from v41.loader import dummy_weights
from v41.model import prepare_weights

RTOL = 1e-6
SLOTS = 6
L_FULL = 64          # > 3 windows of the toy (W = 16)
L_REPLAY = 50        # a prompt under decoder replay: tail start 34


@pytest.fixture(scope="module")
def weights(cfg):
    return dummy_weights(cfg, progress=False)


@pytest.fixture(scope="module")
def oracle(cfg, weights):
    return Oracle(cfg, weights, dtype=torch.float64)


@pytest.fixture(scope="module")
def dspark(cfg, weights):
    shared = prepare_weights(cfg, {k: weights[k] for k in ("embed.weight", "head.weight")}, torch.float64, None)
    return DSpark(cfg, weights, shared["embed.weight"], shared["head.weight"], torch.float64, max_pos=512)


def _ids(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g)


@pytest.fixture(scope="module")
def full(oracle):
    """(taps, logits) of an uninterrupted forward."""
    logits = oracle.forward(_ids(7, L_FULL))
    return oracle.last.taps, logits


@pytest.fixture(scope="module")
def replayed(cfg, oracle):
    """(taps, logits, tail start) of a prompt under decoder bounded replay."""
    s = L_REPLAY - cfg.sliding_window
    logits = oracle.forward(_ids(8, L_REPLAY), window_start=replay_window(s, cfg.topology.boundary))
    return oracle.last.taps, logits, s


def nan_rings(cfg, slots=SLOTS):
    # rows never written are NaN: a draft that read one would not be finite
    return torch.full((cfg.n_draft, slots * cfg.sliding_window, cfg.head_dim), float("nan"), dtype=torch.float64)


def write(dspark, cfg, rings, taps, slot, lo, hi, keep_last=None):
    """Context keys of positions lo..hi-1 into `slot`, as one forward would: only its last
    `keep_last` rows (the runner's ring_dest: rows >= end - W) are kept."""
    W = cfg.sliding_window
    pos = torch.arange(lo, hi)
    dest = slot * W + pos % W
    if keep_last is not None:
        dest = torch.where(pos >= hi - keep_last, dest, -1)
    dspark.write_context([t[lo:hi] for t in taps], pos, dest, rings)


def check(got, b, want):
    assert torch.equal(got.tokens[b], want.tokens), (got.tokens[b], want.tokens)
    torch.testing.assert_close(got.logits[b], want.logits, rtol=RTOL, atol=RTOL * float(want.logits.abs().max()))
    torch.testing.assert_close(got.confidence[b], want.confidence, rtol=RTOL, atol=0)


def test_batch_of_anchors_equals_oracle(cfg, dspark, oracle, full, replayed):
    """One flat draft batch: anchors with fewer context rows than the window, exactly the window,
    the first wrap, every ring offset further on, requests whose context starts at their decoder
    tail start or at a floor inside the window; greedy and arbitrary anchor tokens."""
    taps, logits = full
    rtaps, rlogits, s = replayed
    W = cfg.sliding_window
    rings = nan_rings(cfg, slots=20)
    reqs = []      # (slot, P, anchor token, floor, taps, logits)
    for i, P in enumerate([0, 6, W - 1, W, 37, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, L_FULL - 1]):
        tok = int(logits[P].argmax()) if i % 2 == 0 else (3 * P + 11) % cfg.vocab_size
        reqs.append((i, P, tok, 0, taps, logits))
    reqs.append((16, L_REPLAY - 1, int(rlogits[-1].argmax()), s, rtaps, rlogits))
    reqs.append((17, L_REPLAY - 1, cfg.dspark_noise_token_id, s, rtaps, rlogits))
    # a floor inside the window: a slot whose rings start at a resumed forward's first row
    # (an encoder-replay prefix hit), so the rows below it are never written and never read
    reqs.append((18, 44, int(logits[44].argmax()), 40, taps, logits))
    reqs.append((19, 44, int(logits[44].argmax()), 44, taps, logits))
    for slot, P, _, floor, t, _ in reqs:
        write(dspark, cfg, rings, t, slot, floor, P + 1)
    before = rings.clone()
    col = lambda k: torch.tensor([r[k] for r in reqs])  # noqa: E731
    got = dspark(col(2), col(1), col(0), col(3), rings)
    assert got.tokens.shape == (len(reqs), cfg.dspark_block_size)
    assert torch.equal(rings.isnan(), before.isnan()) and torch.equal(rings.nan_to_num(), before.nan_to_num()), \
        "draft rows must not write the context rings"
    for b, (slot, P, tok, floor, t, _) in enumerate(reqs):
        want = oracle.draft(taps=t, anchor_pos=P, anchor_token=tok, context_start=floor)
        check(got, b, want)
    # the window did matter: a context of one row gives other logits than the full one
    assert not torch.allclose(got.logits[0], got.logits[1])


def test_context_written_in_chunks_and_decode_steps(cfg, dspark, oracle, full):
    """The rings filled as the runner would (a prefill chunk keeps only its last W rows, then one
    row per decode step, wrapping several times) give the oracle's draft after every step."""
    taps, logits = full
    rings = nan_rings(cfg)
    slot = 3
    write(dspark, cfg, rings, taps, slot, 0, 20, keep_last=cfg.sliding_window)
    write(dspark, cfg, rings, taps, slot, 20, 27, keep_last=cfg.sliding_window)
    for P in range(27, L_FULL):
        write(dspark, cfg, rings, taps, slot, P, P + 1, keep_last=1)
        if P % 9 == 0 or P == L_FULL - 1:
            tok = int(logits[P].argmax())
            got = dspark(torch.tensor([tok]), torch.tensor([P]), torch.tensor([slot]), torch.tensor([0]), rings)
            check(got, 0, oracle.draft(taps=taps, anchor_pos=P, anchor_token=tok))


def test_context_keys_equal_oracle_window_kv(cfg, dspark, oracle, full):
    """Each stage's context key is the stage's window KV of main_x (spec §3.6), bit for bit."""
    taps, _ = full
    pos = torch.arange(L_FULL)
    keys = dspark.context_keys(taps, pos)
    main_hidden = torch.cat(taps, -1)
    main_x = oracle.norm(oracle.qlinear(main_hidden, "mtp.0.main_proj"), "mtp.0.main_norm.weight")
    cos, sin = oracle.rope(0, pos)
    for s, k in enumerate(keys):
        assert torch.equal(k, oracle.window_kv(f"mtp.{s}.attn", main_x, cos, sin)), s


def test_chosen_tokens_feed_the_markov_head(cfg, dspark, full):
    """With `choose`, row i+1's Markov bias comes from the token chosen at row i: the logits
    differ from greedy by exactly (E[chosen] - E[greedy]) @ H^T and the base logits are shared."""
    taps, logits = full
    rings = nan_rings(cfg)
    P, slot = 40, 1
    write(dspark, cfg, rings, taps, slot, 0, P + 1)
    args = (torch.tensor([int(logits[P].argmax())]), torch.tensor([P]), torch.tensor([slot]), torch.tensor([0]))
    greedy = dspark(*args, rings)
    fixed = torch.tensor([[5, 900, 17, 5, 1000]])
    chosen = dspark(*args, rings, choose=lambda lg, i: fixed[:, i])
    assert torch.equal(chosen.tokens, fixed)
    E, H = dspark.markov_embed, dspark.markov_head
    for i in range(1, cfg.dspark_block_size):
        delta = (E[fixed[0, i - 1]] - E[greedy.tokens[0, i - 1]]) @ H.T
        torch.testing.assert_close(chosen.logits[0, i] - greedy.logits[0, i], delta, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(chosen.logits[0, 0], greedy.logits[0, 0], rtol=0, atol=0)


def test_bad_input_names_the_field(cfg, weights, dspark, full):
    taps, _ = full
    rings = nan_rings(cfg)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="taps"):
        dspark.write_context(taps[:2], torch.arange(4), torch.arange(4), rings)
    with pytest.raises(ValueError, match="dest"):
        dspark.write_context([t[:4] for t in taps], torch.arange(4), torch.arange(3), rings)
    with pytest.raises(ValueError, match="rings"):
        dspark(one, one + 5, one, one, rings[:2])
    with pytest.raises(ValueError, match="slots"):
        dspark(one, one + 5, one + SLOTS, one, rings)
    with pytest.raises(ValueError, match="anchor_pos"):
        dspark(one, one + dspark.max_pos, one, one, rings)
    with pytest.raises(ValueError, match="anchor_pos"):
        dspark(one, one - 1, one, one, rings)
    with pytest.raises(ValueError, match="floors"):
        dspark(one, one + 5, one, torch.tensor([0, 0]), rings)
    no_stage = {k: v for k, v in weights.items() if not k.startswith("mtp.1.")}
    with pytest.raises(KeyError, match=r"mtp\.1"):
        prepare_draft_weights(cfg, no_stage, torch.float64)
    no_markov = {k: v for k, v in weights.items() if "markov_head.embed" not in k}
    with pytest.raises(KeyError, match="markov_head.embed"):
        prepare_draft_weights(cfg, no_markov, torch.float64)
