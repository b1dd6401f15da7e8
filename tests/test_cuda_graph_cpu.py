"""The FULL CUDA-graph path on the CPU, with torch.cuda's graph API replaced by a recorder.

A CUDA graph replays the kernels it captured on the tensors it captured: whatever `prepare`
does for a replayed step must land in the buffers the capture read, and the forward's Python
control flow is frozen at capture. `RecordedGraph` emulates that on the CPU: capture keeps the
forward and the Python objects it was called with (the padding Batch over the persistent step
buffers, the cache) and the address of every tensor in them; replay checks that those tensors
are still where they were, runs the forward on the captured objects again and copies the result
into the captured output. With the eager model under static shapes (what the compiled forward
sees), the runtime's own CUDAGraphRunner, width selection and padding then run here, in float64:
- a replayed step equals the plain forward at the same width, logits and cache, bit for bit;
- requests decoded through replays get the tokens of the engine without graphs (no leaks),
  prefix hits too;
- padding rows of a replay write nothing: NaN-poisoned planes come back as a plain step's.
The same checks on the H200 with real graphs: tests/test_cuda_graph_gpu.py.
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from runtime.cuda_graph import CUDAGraphRunner
from runtime.sequence import SamplingParams
from tests import harness as H
from tests.graph_checks import decoding, planes_written_by_a_step, replay_equals_plain_forward


def tensors_in(obj, seen=None):
    """Every tensor reachable from obj's fields (dataclasses, dicts, lists, attributes)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        for v in vars(obj).values():
            yield from tensors_in(v, seen)


def outputs(out) -> list:
    """The tensors a call returned (one, or a tuple/list of them and plain values)."""
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


def recorded(fn):
    """`fn`, recording each call made while a RecordedGraph captures."""
    def call(*args):
        out = fn(*args)
        if RecordedGraph.recording is not None:
            RecordedGraph.recording.record(fn, args, out)
        return out
    return call


class RecordedGraph:
    """torch.cuda.CUDAGraph stand-in: see the module docstring."""
    recording: RecordedGraph | None = None

    def __init__(self):
        self.call = None
        self.replays = 0

    def pool(self):
        return ("pool", id(self))

    def capture_begin(self, pool=None):
        RecordedGraph.recording = self

    def capture_end(self):
        RecordedGraph.recording = None

    def record(self, forward, args, out):
        self.call = (forward, args, out, [(t, t.data_ptr(), t.shape) for a in args for t in tensors_in(a)])

    def replay(self):
        forward, args, out, inputs = self.call
        moved = [tuple(shape) for t, ptr, shape in inputs if t.data_ptr() != ptr or t.shape != shape]
        assert not moved, f"a captured input was reallocated: {moved[:4]}"
        for o, v in zip(outputs(out), outputs(forward(*args)), strict=True):
            o.copy_(v)
        self.replays += 1


@contextlib.contextmanager
def recording(g, pool=None):
    RecordedGraph.recording = g
    try:
        yield
    finally:
        RecordedGraph.recording = None


@pytest.fixture
def cpu_graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", RecordedGraph)
    monkeypatch.setattr(torch.cuda, "graph", recording)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: 0)


def graphed(weights, sizes, **kw):
    """A float64 CPU engine whose runner replays recorded graphs at decode `sizes`."""
    eng = H.make_engine(weights, **kw)
    r = eng.runner
    r.use_forward(r.model, static_shapes=True)
    r.graph_forward = recorded(r.graph_forward)     # what a FULL graph captures
    device, r.device = r.device, SimpleNamespace(type="cuda")      # CUDAGraphRunner's device check
    try:
        r.graphs = CUDAGraphRunner(r, sizes)
        r.graphs.capture(progress=False)
    finally:
        r.device = device
    return eng


@pytest.mark.parametrize("replay", [True, False], ids=["decoder-replay", "no-decoder-replay"])
def test_replay_equals_the_plain_forward_at_its_width(toy_weights, cpu_graphs, replay):
    eng = graphed(toy_weights, (1, 2, 4), decoder_swa_bounded_replay=replay)
    decoding(eng, 3, max_tokens=24)
    before = eng.runner.graphs.graphs[4].replays
    replay_equals_plain_forward(eng, 4)
    assert eng.runner.graphs.graphs[4].replays == before + 3


def test_decoding_through_replays_gives_the_tokens_without_graphs(toy_weights, cpu_graphs):
    reqs = H.prompts((5, 16, 17, 33, 9, 64), seed=3)
    want = H.run(toy_weights, reqs, max_tokens=10)
    eng = graphed(toy_weights, (1, 2, 4, 8))
    seqs = [eng.add_request(p, SamplingParams(max_tokens=10, ignore_eos=True)) for p in reqs]
    replays = 0
    while eng.has_unfinished():
        before = sum(g.replays for g in eng.runner.graphs.graphs.values())
        eng.step()
        replays += sum(g.replays for g in eng.runner.graphs.graphs.values()) - before
    assert {i: s.completion_token_ids for i, s in enumerate(seqs)} == want
    assert replays >= 9                 # every decode step after the prompts replayed
    eng.bm.check([])
    assert eng.bm.all_free


@pytest.mark.parametrize("encoder_replay", [True, False], ids=["encoder-replay", "checkpoint-copy"])
def test_prefix_hits_through_replays_give_the_tokens_without_graphs(toy_weights, cpu_graphs, monkeypatch,
                                                                    encoder_replay):
    """The fork prompts with prefix caching (hits of 1-4 PAGEs, on and off a PAGE boundary, under
    either state transfer), decoded through replays: the tokens of the same settings without graphs."""
    reqs = H.FORKS.requests()
    sc = H.Scenario("forks", engine={**H.FORKS.engine, "encoder_swa_bounded_replay": encoder_replay},
                    arrival_steps=H.FORKS.arrival_steps)
    want = H.run(toy_weights, reqs, max_tokens=6, scenario=sc)
    eng = graphed(toy_weights, (1, 2, 4, 8), **sc.engine)
    monkeypatch.setattr(H, "make_engine", lambda *a, **kw: eng)
    assert H.run(toy_weights, reqs, max_tokens=6, scenario=sc) == want
    assert eng.bm.stats["hit_tokens"] >= 10 * H.PAGE and eng.runner.graphs.replays > 0


def test_padding_rows_of_a_replay_write_nothing(toy_weights, cpu_graphs):
    graphed_step = planes_written_by_a_step(graphed(toy_weights, (4,)))
    plain_step = planes_written_by_a_step(H.make_engine(toy_weights))
    assert all(torch.equal(a, b) for a, b in zip(graphed_step, plain_step))
    assert any(a.any() for a in graphed_step)


def test_a_chain_cuts_at_its_pieces_and_replays_in_capture_order(monkeypatch):
    """GraphChain on "CUDA": graphs end and begin at CHAIN_CUTS' piece calls, share the first
    graph's pool, and replay in capture order."""
    from runtime import cuda_graph as cg
    events = []

    class Graph:
        def __init__(self):
            self.n = len(events)

        def capture_begin(self, pool=None):
            events.append(("begin", pool))

        def capture_end(self):
            events.append(("end",))

        def pool(self):
            return "pool"

        def replay(self):
            events.append(("replay", self.n))

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(cg, "_capture_stream", None)

    def forward(x):
        for _ in range(40):
            cg.piece_boundary()
            x = x + 1
        return x
    chain, out = cg.capture_chain(forward, (torch.zeros(2),), None, "cuda")
    assert cg.GraphChain.active is None and torch.equal(out, torch.full((2,), 40.0))
    assert chain.pieces == 40 and len(chain.graphs) == len(cg.CHAIN_CUTS) + 1
    begins = [e for e in events if e[0] == "begin"]
    assert begins == [("begin", None)] + [("begin", "pool")] * len(cg.CHAIN_CUTS)
    assert [e[0] for e in events] == ["begin", "end"] * (len(cg.CHAIN_CUTS) + 1)
    events.clear()
    chain.replay()
    assert [e[1] for e in events] == [g.n for g in chain.graphs] and chain.replays == 1
