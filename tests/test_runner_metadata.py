"""The model runner's step metadata against a per-token rebuild written from the `Batch`
contract (one Python loop per row, no numpy tricks): every field of every step of runs that
chunk, decode, pad, preempt and resume from the prefix cache in both StateTransfer modes.

The forward cannot show a wrong destination that only matters later, or a padding row that
reads a request's rows; this test sees both at once, without a forward of its own, so mutation
testing (docs/mutation.md) runs it for every mutant of the runner."""
import numpy as np
import pytest
import torch

from runtime.sequence import SamplingParams
from tests import harness as H
from tests.reference import quant as Q
from tests.reference.engram_hashing import hash_ids

PAD_ROWS, PAD_SEQS = 5, 1   # up to the buffers' capacity


def widths(runner, sb) -> tuple[int, int]:
    return (min(sb.scheduled_tokens + PAD_ROWS, runner.max_tokens),
            min(sb.scheduled_bs + PAD_SEQS, runner.max_seqs))


def expected_rows(runner, sb) -> dict:
    """What each row of the step must carry (scheduled rows only; padding is checked apart)."""
    W, P, S = runner.W, runner.page, runner.cache.num_slots
    rows = {k: [] for k in ("input_ids", "positions", "batch_ids", "win_idx", "ring_dest", "tail_src",
                            "tail_dst", "dest1", "dest2")}
    first = 0
    for i, (seq, n) in enumerate(zip(sb.seqs, sb.num_new)):
        a, slot, bt = seq.num_computed, int(sb.slots[i]), sb.block_tables[i]
        end = a + n
        for p in range(a, end):
            rows["input_ids"].append(seq.token_ids[p])
            rows["positions"].append(p)
            rows["batch_ids"].append(i)
            win = []
            for q in range(p - W + 1, p + 1):
                if q < max(0, seq.swa_floor):
                    win.append(-1)
                elif q >= a:                     # computed in this step: a row of the batch
                    win.append(S * W + first + (q - a))
                else:
                    win.append(slot * W + q % W)
            rows["win_idx"].append(win)
            rows["ring_dest"].append(slot * W + p % W if p >= end - W else -1)
            rows["tail_src"].append(slot if p % 2 == 1 and p == a else -1)
            rows["tail_dst"].append(slot if p % 2 == 0 and p == end - 1 else -1)
            for r in (1, 2):
                if p % r == r - 1 and p >= seq.write_from:
                    group = p // r
                    page = int(bt[group * r // P])
                    rows[f"dest{r}"].append(page * (P // r) + group % (P // r))
                else:
                    rows[f"dest{r}"].append(-1)
        first += n
    rows["image_dest"] = [-1] * first
    starts = np.cumsum([0] + list(sb.num_new))
    for i, boundary, img in sb.captures:
        a = sb.seqs[i].num_computed
        for p in range(max(0, boundary - W), boundary):
            if p >= a:
                rows["image_dest"][starts[i] + p - a] = img * W + p % W
    return rows


def expected_engram(runner, sb, layer_index: int, layer: int) -> torch.Tensor:
    """Table rows of the step's tokens, hashed over each request's whole token sequence."""
    table, scale = runner.engram_tables[layer]
    out = []
    for seq, n in zip(sb.seqs, sb.num_new):
        comp = runner.token_map[np.asarray(seq.token_ids[: seq.num_computed + n])]
        hids = hash_ids(comp, runner.step_rows.layout, layer_index)[seq.num_computed:]
        out.append(Q.dequant_fp8_rows(table[hids], scale[hids], torch.float64).reshape(n, -1))
    return torch.cat(out).to(runner.dtype)


def check_step(runner, sb, batch) -> None:
    T, B = sb.scheduled_tokens, sb.scheduled_bs
    Tr, Br = widths(runner, sb)
    want = expected_rows(runner, sb)
    got = {"input_ids": batch.input_ids, "positions": batch.positions, "batch_ids": batch.batch_ids,
           "win_idx": batch.win_idx, "ring_dest": batch.ring_dest, "tail_src": batch.tail_src,
           "tail_dst": batch.tail_dst, "dest1": batch.owner_dest[1], "dest2": batch.owner_dest[2]}
    if batch.image_dest is not None:
        got["image_dest"] = batch.image_dest
    else:
        assert not sb.captures and all(d == -1 for d in want["image_dest"])
    for k, v in got.items():
        assert v.shape[0] == Tr, k
        assert v[:T].tolist() == want[k], f"{k} of the scheduled rows"
        sentinel = 0 if k in ("input_ids", "positions") else -1
        assert (v[T:] == sentinel).all(), f"{k} of the padding rows"
    assert batch.max_position.device.type == "cpu" and batch.max_position.tolist() == [max(want["positions"])]
    assert batch.block_table.shape[0] == Br
    assert batch.block_table[:B].tolist() == sb.block_tables.tolist()
    assert (batch.block_table[B:] == 0).all()
    c, W = runner.cache, runner.W
    for i, boundary, img in sb.captures:      # rows of earlier forwards: copied from the ring now
        slot, a = int(sb.slots[i]), sb.seqs[i].num_computed
        for p in range(max(0, boundary - W), a):
            assert torch.equal(c.image_ring[:, img * W + p % W], c.ring[:, slot * W + p % W]), "image row"
    for i, l in enumerate(runner.cfg.engram_layer_ids):
        assert batch.engram_rows[l].shape[0] == Tr
        assert torch.equal(batch.engram_rows[l][:T], expected_engram(runner, sb, i, l)), f"Engram layer {l}"
    check_decoder(runner, sb, batch)


def check_decoder(runner, sb, batch) -> None:
    """Decoder bounded replay: the rows from each request's tail start, their windows (nothing
    below the tail start; this step's decoder rows, else the ring) and the sampled rows."""
    W, S = runner.W, runner.cache.num_slots
    rows, win, queries, first = [], [], [], 0
    for i, (seq, n) in enumerate(zip(sb.seqs, sb.num_new)):
        a, s, slot = seq.num_computed, seq.decoder_start or 0, int(sb.slots[i])
        lo = max(a, s)
        base = len(rows)
        for p in range(lo, a + n):
            rows.append(first + p - a)
            win.append([-1 if q < s else S * W + base + q - lo if q >= lo else slot * W + q % W
                        for q in range(p - W + 1, p + 1)])
        if a + n == seq.num_tokens:
            queries.append(len(rows) - 1)
        first += n
    dec = batch.decoder
    if not runner.decoder_replay or (len(rows) == first == len(queries)):
        assert dec is None
        return
    assert dec.rows.tolist() == rows and dec.batch.win_idx.tolist() == win
    assert dec.queries.rows.tolist() == queries
    assert dec.batch.max_position is batch.max_position      # an upper bound of the decoder's positions
    assert dec.queries.win_idx.tolist() == [win[q] for q in queries]
    assert dec.batch.positions.tolist() == batch.positions[rows].tolist()
    assert dec.batch.ring_dest.tolist() == batch.ring_dest[rows].tolist()
    assert all((d == -1).all() for d in (*dec.batch.owner_dest.values(), dec.batch.tail_src, dec.batch.tail_dst))


def run_checked(weights, reqs, engine: dict, arrivals=None, hook=None, max_tokens=3):
    """Run the requests with a stub forward; every step's metadata is checked against the
    rebuild. Returns (resumes, captures) per step and the engine."""
    eng = H.make_engine(weights, **engine)
    runner, steps = eng.runner, []
    prepare = runner.prepare
    # the metadata does not depend on what the forward computes: a stub keeps this test fast
    # enough to run for every mutant (the sampled tokens are then all one id)
    width = runner.cfg.hidden_size
    g = torch.Generator().manual_seed(0)   # distinct ring rows, so a misplaced image copy shows
    runner.cache.ring.copy_(torch.randn(runner.cache.ring.shape, generator=g, dtype=torch.float64))
    def stub(batch, cache):   # rows out: every row, or the decoder's query rows (bounded replay)
        rows = batch.input_ids if batch.decoder is None else batch.decoder.queries.rows
        return torch.zeros(rows.shape[0], width, dtype=runner.dtype)
    runner.use_forward(stub, static_shapes=False)

    def checked(sb, **width):
        Tr, Br = widths(runner, sb)
        batch = prepare(sb, running_tokens=Tr, running_bs=Br)
        check_step(runner, sb, batch)
        steps.append((len(sb.resumes), len(sb.captures)))
        return batch

    runner.prepare = checked
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    arrive = arrivals or [0] * len(reqs)
    step, pending = 0, list(range(len(reqs)))
    while pending or eng.has_unfinished():
        for i in [i for i in pending if arrive[i] <= step]:
            eng.add_request(reqs[i], params, request_id=f"r{i}")
            pending.remove(i)
        if hook:
            hook(eng, step)
        if eng.has_unfinished():
            eng.step()
            for seq in eng.scheduler.running:            # the committed position, after the step
                assert int(runner.cache.cursor[seq.slot, 0]) == seq.num_computed
        step += 1
    eng.bm.check([])
    return steps, eng


def test_chunked_prefill_and_decode(toy_weights):
    reqs = H.prompts((3, 16, 21, 40, 1), seed=3)
    steps, _ = run_checked(toy_weights, reqs, {"max_prefill_chunk": 7, "max_num_batched_tokens": 24})
    assert len(steps) >= 8


def test_slots_reused_by_later_requests(toy_weights):
    """A slot keeps its last request's Engram history: a new request must not read it."""
    reqs = H.prompts((9, 4, 12, 6, 3), seed=12)
    _, eng = run_checked(toy_weights, reqs, {"max_num_seqs": 2, "max_prefill_chunk": 5})


def test_preemption_restarts_from_zero(toy_weights):
    def preempt(eng, step):
        if step in (3, 6) and eng.scheduler.running:
            eng.scheduler.preempt(eng.scheduler.running[0])
    reqs = H.prompts((30, 19, 8), seed=8)
    _, eng = run_checked(toy_weights, reqs, {"max_prefill_chunk": 9}, hook=preempt)
    assert eng.scheduler.num_preemptions == 2


@pytest.mark.parametrize("mode, chunk", [("copy", 20), ("copy", 40), ("replay", 20)])
def test_prefix_hits(toy_weights, mode, chunk):
    """Forks of a root resume from the cache: images restored and captured (copy) or a replay
    floor and cursor (replay); rows below the hit are never written again. Chunks of 20 start
    forwards less than a window before a boundary (image rows copied from the ring), chunks of
    40 more than a window before it (image rows written by the forward alone)."""
    reqs = H.forks(root_len=80, suffix=5)[:1] + H.forks(root_len=80, suffix=5)[3:8:2]
    engine = {"enable_prefix_caching": True, "encoder_swa_bounded_replay": mode == "replay",
              "max_prefill_chunk": chunk}
    steps, eng = run_checked(toy_weights, reqs, engine, arrivals=[0] + [6] * (len(reqs) - 1))
    assert sum(r for r, _ in steps) == len(reqs) - 1
    assert (sum(c for _, c in steps) > 0) == (mode == "copy")
    restored = eng.runner.state.stats["images_restored"]
    assert restored == (len(reqs) - 1 if mode == "copy" else 0)


def test_every_row_and_the_sampled_rows_match_the_oracle(toy_cfg, toy_weights, toy_token_map):
    """The short end-to-end check beside the metadata: teacher-forced logits of every row and
    greedy tokens through chunks and decode equal the oracle's (float64)."""
    from tests.reference.oracle import Oracle
    from tests.test_runtime_parity import rel_err, teacher_forced
    from tests.reference.replay import bounded_replay
    reqs = H.prompts((3, 20), seed=9)
    oracle = Oracle(toy_cfg, toy_weights, dtype=torch.float64, index_plane="fp8", token_map=toy_token_map)
    got = teacher_forced(H.make_engine(toy_weights, max_prefill_chunk=7, decoder_swa_bounded_replay=False), reqs)
    for p, g in zip(reqs, got):
        assert rel_err(g, oracle.forward(torch.tensor(p))) < 1e-6
    out = H.run(toy_weights, reqs, max_tokens=3, scenario=H.Scenario("chunks", engine={"max_prefill_chunk": 7}))
    for i, p in enumerate(reqs):
        assert len(out[i]) == 3 and out[i] == oracle.greedy_after(p, out[i], window_start=bounded_replay(toy_cfg, len(p)))


def test_static_shapes_pass_the_whole_block_table_and_image_rows(toy_weights):
    """Under a compiled forward every step has one structure: the block table at capacity (rows
    past the step's requests zero) and image rows whenever the cache has images."""
    eng = H.make_engine(toy_weights, enable_prefix_caching=True, encoder_swa_bounded_replay=False, num_images=2)
    runner = eng.runner
    eng.add_request(H.prompts((6,), seed=1)[0], SamplingParams(max_tokens=1, ignore_eos=True))
    sb = eng.scheduler.schedule()
    batch = runner.prepare(sb)
    assert batch.block_table.shape[0] == 1 and batch.image_dest is None
    runner.buf["block_table"].fill_(7)                   # what a wider step left there
    runner.use_forward(runner.forward, static_shapes=True)
    batch = runner.prepare(sb)
    assert batch.block_table.shape[0] == runner.max_seqs and (batch.block_table[1:] == 0).all()
    assert batch.image_dest is not None and (batch.image_dest == -1).all()
    plain = H.make_engine(toy_weights).runner               # no images: no image rows, ever
    plain.use_forward(plain.forward, static_shapes=True)
    assert plain.image_rows([], plain.buf["image_dest"]) is None


def test_running_width_must_hold_the_step(toy_weights):
    eng = H.make_engine(toy_weights, max_num_seqs=3, max_num_batched_tokens=16)
    for p in H.prompts((5, 4), seed=2):
        eng.add_request(p, SamplingParams(max_tokens=1, ignore_eos=True))
    sb, runner = eng.scheduler.schedule(), eng.runner
    for bad in ({"running_tokens": 8}, {"running_bs": 1}, {"running_tokens": 17}, {"running_bs": 4}):
        with pytest.raises(ValueError, match=r"^step of 9 tokens / 2 requests does not fit running width"):
            runner.prepare(sb, **bad)
    batch = runner.prepare(sb, running_tokens=16, running_bs=3)    # the full capacity fits
    assert batch.input_ids.shape[0] == 16 and batch.block_table.shape[0] == 3


def test_padding_batch_reads_and_writes_nothing(toy_weights):
    """The step that traces and warms compiled segments: padding rows only."""
    runner = H.make_engine(toy_weights, num_images=2, enable_prefix_caching=True,
                           encoder_swa_bounded_replay=False).runner
    for b in runner.buf.values():
        b.fill_(5)
    for b in runner.engram_buf.values():
        b.fill_(5)
    runner.use_forward(runner.forward, static_shapes=True)
    batch = runner.padding_batch(7)
    for k, sentinel in runner.PAD.items():
        v = batch.image_dest if k == "image_dest" else batch.owner_dest[int(k[-1])] if k.startswith("dest") \
            else getattr(batch, k)
        assert v.shape[0] == 7 and (v == sentinel).all(), k
    assert batch.block_table.shape[0] == runner.max_seqs and (batch.block_table == 0).all()
    assert all(r.shape[0] == 7 and (r == 0).all() for r in batch.engram_rows.values())
    for bad in (0, runner.max_tokens + 1):
        with pytest.raises(ValueError, match="^padding batch of"):
            runner.padding_batch(bad)
    assert runner.padding_batch(1).input_ids.shape[0] == 1
    assert runner.padding_batch(runner.max_tokens).input_ids.shape[0] == runner.max_tokens
    runner.use_forward(runner.forward, static_shapes=False)
    assert runner.padding_batch(3).block_table.shape[0] == 1


def test_cursor_at_pads_history_before_the_first_token(toy_weights):
    """The resumed cursor: (position, the compressed ids of the 3 tokens before it, DEAD before
    position 0)."""
    from v41.engram.hashing import DEAD
    runner = H.make_engine(toy_weights).runner
    ids = [11, 12, 13, 14, 15]
    c = [int(runner.token_map[t]) for t in ids]
    assert runner.step_rows.cursor_at(ids, 0) == [0, DEAD, DEAD, DEAD]
    assert runner.step_rows.cursor_at(ids, 2) == [2, DEAD, c[0], c[1]]
    assert runner.step_rows.cursor_at(ids, 5) == [5, c[2], c[3], c[4]]
