"""The sync-free step (issue 14, item 1), checked on the CPU.

Between `schedule()` and the sampled ids coming back a step must not read the device: the one
read is the sampler's copy of the chosen ids. On the CPU there is no device to wait on, so the
check counts what would be a read on a GPU: a TorchFunctionMode sees every Python-level call
that turns a tensor into host values (`.item()`, `.tolist()`, `.numpy()`, `.cpu()`,
`bool/int/float/index(tensor)`, `np.asarray(tensor)`) or whose output shape depends on tensor
values (`.nonzero()`, `masked_select`, `unique`, boolean-mask indexing), made anywhere during
the step: runner, engine, sampler, cache, state transfer, and the model's own Python.

What it cannot see, and why it still means something: `tensor.to("cpu")` (on the CPU the same
call as the host-to-device copies the sampler makes, so it is not counted; the step's own code
reads through `.cpu()`, `.tolist()` or `.numpy()`), calls made inside another call the mode
hands on (a custom op's reference impl, C++ kernels: on CUDA the ops run Triton kernels, and
`tests/test_cuda_graph_gpu.py` runs a decode step under `torch.cuda.set_sync_debug_mode`), a
blocking host-to-device copy (`tensor.to(device)` from pageable memory also waits on CUDA; the
runner's copies go through `runtime.batch.StepBuffers`, which this file checks are the only
copies `prepare` issues), and reads of tensors created on the host itself (none are made in a
step: host data stays numpy). Every read the step had before this change (the STATE cursor
read for the Engram history, the image checksum on seal, the sampled-row index copy) goes
through a call the mode does see; `test_the_counter_sees_the_old_reads` shows it.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from runtime.step_rows import StepRows
from runtime.sequence import SamplingParams
from tests import harness as H

READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "__array__",
         "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}


class DeviceReads(TorchFunctionMode):
    """Counts the calls that read tensor values back to the host while `counting`."""

    def __init__(self):
        super().__init__()
        self.reads, self.counting = [], True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if self.counting:
            bool_index = name == "__getitem__" and _has_bool_tensor(args[1:])
            if name in READS or bool_index:
                t = args[0] if args else None
                self.reads.append((name, tuple(t.shape) if isinstance(t, torch.Tensor) else None,
                                   t.dtype if isinstance(t, torch.Tensor) else None))
        return func(*args, **(kwargs or {}))


def _has_bool_tensor(idx) -> bool:
    items = idx[0] if idx and isinstance(idx[0], tuple) else idx
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def counted_steps(eng, add, steps: int = 10_000, mode: DeviceReads | None = None) -> list:
    """Run the engine to completion (`add(eng, step)` adds requests); per step with work, the
    reads made after `schedule()` returns and the number of requests that sampled."""
    mode = mode or DeviceReads()
    schedule = eng.scheduler.schedule

    def uncounted_schedule():      # schedule() may read (a restore's checksum): not the step's
        mode.counting = False
        try:
            return schedule()
        finally:
            mode.counting = True

    eng.scheduler.schedule = uncounted_schedule
    out, step = [], 0
    while step == 0 or eng.has_unfinished():
        add(eng, step)
        mode.reads = []
        with mode:
            got = eng.step()
        if got or mode.reads:
            out.append((list(mode.reads), len(got)))
        step += 1
        assert step < steps
    return out


def assert_one_result_read(per_step):
    assert per_step
    for reads, sampled in per_step:
        if sampled:
            assert [r[0] for r in reads] == ["tolist"] and reads[0][1:] == ((sampled,), torch.int64), reads
        else:
            assert reads == [], reads


def test_the_counter_sees_the_old_reads():
    """Each kind of read is counted once; host numpy and device-side work are not."""
    t = torch.arange(6)
    mode = DeviceReads()
    with mode:
        t.item() if t.numel() == 1 else t[0].item()
        t.tolist(), t.numpy(), t.cpu(), bool(t[1]), int(t[2]), float(t[3]), np.asarray(t)
        t.nonzero(), t[t > 2], torch.unique(t)
        t.sum() * 2 + t.index_select(0, t[:2])         # device work: no read
        np.arange(3).sum()
    names = [r[0] for r in mode.reads]
    assert names == ["item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__array__",
                     "nonzero", "__getitem__", "unique"], names


def test_the_counter_sees_a_cursor_read(toy_weights, monkeypatch):
    """The read this issue removed (the STATE cursor read back for the Engram history; here the
    test-only check that still does it) is seen in every step that runs a forward."""
    monkeypatch.setattr(StepRows, "verify_history", True)
    eng = H.make_engine(toy_weights, dtype="float32")
    per_step = counted_steps(eng, lambda e, s: s == 0 and e.add_request(
        H.prompts((9,))[0], SamplingParams(max_tokens=3, ignore_eos=True)))
    assert all("cpu" in [r[0] for r in reads] for reads, _ in per_step)


MODES = {
    "chunked": ({"max_prefill_chunk": 7, "max_num_batched_tokens": 24}, (5, 16, 33, 40)),
    "no-decoder-replay": ({"max_prefill_chunk": 11, "decoder_swa_bounded_replay": False}, (5, 16, 33)),
    "prefix-replay": ({"enable_prefix_caching": True, "max_prefill_chunk": 20}, None),
    "prefix-copy": ({"enable_prefix_caching": True, "encoder_swa_bounded_replay": False,
                     "max_prefill_chunk": 20}, None),
}


@pytest.mark.parametrize("mode", MODES)
def test_a_step_reads_only_the_sampled_ids(toy_weights, mode):
    """Prefill chunks, mixed and decode steps, prefix hits (replay cursors, image restores and
    captures): one read per sampling step, the ids; none in a step that samples nothing."""
    engine, lens = MODES[mode]
    reqs = H.prompts(lens, seed=4) if lens else H.forks(root_len=80, suffix=5)[:6]
    arrive = [0] * len(reqs) if lens else H.fork_arrivals(len(reqs), after=5)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.7, top_k=20, seed=3)

    def add(eng, step):
        for i, p in enumerate(reqs):
            if arrive[i] == step:
                eng.add_request(p, params if i % 2 else SamplingParams(max_tokens=4, ignore_eos=True))

    eng = H.make_engine(toy_weights, dtype="float32", **engine)
    per_step = counted_steps(eng, add)
    assert_one_result_read(per_step)
    if mode == "prefix-copy":
        st = eng.runner.state.stats
        assert st["images_stored"] and st["images_restored"], st
    if mode == "prefix-replay":
        assert eng.bm.stats["hit_tokens"] > 0


@pytest.mark.parametrize("forced", [None, 3.51], ids=["verified", "forced"])
def test_a_dspark_step_reads_its_verdicts_and_drafts(toy_weights, forced):
    """DSpark (greedy and seeded sampled requests, chunked prompts; acceptance verified or, the
    benchmark's mode, forced): a step reads, in this order, the verdicts of the requests that
    verified ([n, 2]: accepted count and next token, every group in one copy), the sampled ids of
    those that did not, and the next drafts ([n, k]); nothing else, so no range check, input
    check or copy of the draft's inputs waits for the device. Where every request that samples
    verified, the draft ran before the verdicts were read (launched from them on the device)."""
    reqs, seqs = H.prompts((5, 16, 33), seed=4), []
    extra = {} if forced is None else {"spec_decode_acceptance_length": forced}

    def add(eng, step):
        if step == 0:
            for i, p in enumerate(reqs):
                sampled = {"temperature": 0.7, "seed": i} if i == 1 else {}
                seqs.append(eng.add_request(p, SamplingParams(max_tokens=14, ignore_eos=True, **sampled)))

    eng = H.make_engine(toy_weights, dtype="float32", speculative_method="dspark", max_prefill_chunk=12, **extra)
    k, mode = eng.runner.spec.k, DeviceReads()
    draft = eng.runner.spec.draft
    draft.forward = lambda *a, _f=draft.forward, **kw: (mode.reads.append(("draft", None, None)), _f(*a, **kw))[1]
    per_step = counted_steps(eng, add, mode=mode)
    ahead = behind = 0
    for reads, _ in per_step:
        ran = [r[0] for r in reads].index("draft") if ("draft", None, None) in reads else None
        reads = [r for r in reads if r[0] != "draft"]
        assert [r[0] for r in reads] in (["tolist"], ["tolist", "tolist"], ["tolist"] * 3), reads
        kinds = [("verdicts" if s[1:] == (2,) else "drafts" if s[1:] == (k,) else "ids") for _, s, _ in reads]
        assert len(set(kinds)) == len(kinds) and kinds == sorted(kinds, key=["verdicts", "ids", "drafts"].index), reads
        if "verdicts" in kinds:
            assert ran is not None and (ran == 0) == ("ids" not in kinds), (ran, kinds)
            ahead, behind = ahead + (ran == 0), behind + (ran != 0)
    assert ahead >= 3 and behind >= 1 and [len(s.completion_token_ids) for s in seqs] == [14] * 3, per_step


SCENARIOS = [
    H.CHUNKS,
    H.PREEMPT,
    H.CANCEL,
    H.Scenario("replay-hits", engine={"enable_prefix_caching": True, "max_prefill_chunk": 20},
               arrival_steps=H.fork_arrivals(11)),
    H.Scenario("image-hits", engine={"enable_prefix_caching": True, "encoder_swa_bounded_replay": False,
                                     "max_prefill_chunk": 20}, arrival_steps=H.fork_arrivals(11)),
    H.Scenario("image-evicted", engine={"enable_prefix_caching": True, "encoder_swa_bounded_replay": False},
               arrival_steps=H.fork_arrivals(11), hook=H.evict_images()),
]


@pytest.mark.parametrize("sc", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_host_history_equals_the_cursor(toy_weights, monkeypatch, sc):
    """The Engram history the runner takes from the host's tokens equals the STATE cursor's in
    every state a request reaches: fresh and reused slots, chunks, preemption, cancellation,
    replay resumes, image restores and captures (`verify_history` raises on a difference)."""
    monkeypatch.setattr(StepRows, "verify_history", True)
    reqs = H.forks() if sc.arrival_steps else H.prompts((5, 16, 17, 33, 9, 64), seed=2)
    H.run(toy_weights, reqs, max_tokens=4, scenario=sc, dtype="float32")


def test_prepare_copies_through_the_step_buffers(toy_weights, monkeypatch):
    """Every host-to-device transfer `prepare` makes is a StepBuffers copy (a mirror row range
    into its device buffer): no `torch.as_tensor(..., device)` or `.to(device)` of host data."""
    eng = H.make_engine(toy_weights, dtype="float32", enable_prefix_caching=True,
                        encoder_swa_bounded_replay=False, max_prefill_chunk=20)
    for i, p in enumerate(H.forks(root_len=80, suffix=5)[:4]):
        eng.add_request(p, SamplingParams(max_tokens=2, ignore_eos=True))
    host = {t.data_ptr() for t in eng.runner.bufs._host.values()}
    seen = []

    class Copies(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("to", "as_tensor", "tensor", "from_numpy") or name == "copy_" and \
                    args[1].untyped_storage().data_ptr() not in host:
                seen.append(name)
            return func(*args, **(kwargs or {}))

    while eng.has_unfinished():
        sb = eng.scheduler.schedule()
        with Copies():
            eng.runner.prepare(sb)
        eng.runner.commit(sb)
        eng.scheduler.postprocess(sb, {s.seq_id: 5 for s, f in zip(sb.seqs, sb.is_final_chunk) if f})
    assert seen == [], seen
