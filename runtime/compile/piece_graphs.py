"""Token graphs of TR_HYBRID (`--cudagraph-mode TR_HYBRID`): each compiled token piece of the
split forward (passes/split.py cuts every layer at its splitting ops) captured as a CUDA graph per
token bucket, replayed between the splitting ops, which run eagerly on the step's real metadata.

A token piece depends on its inputs' token count T alone, so its graph at bucket b serves every
step whose forward runs b rows there: the runner pads a step to its bucket (padding rows: batch
id -1, every destination -1, so the eager ops read and write nothing for them) and the piece
replays whatever the batch is: prefill, mixed or decode.

Static inputs. A replay reads the addresses its capture read. A piece's tensor inputs are
- weights and cache views (no token dim): they must be where they were;
- token tensors that are persistent already: the runner's step and Engram buffers
  (`static_storages`), and outputs of graphs captured before (every eager op writes into an
  output a piece allocated, so a layer's pieces chain through graph outputs without a copy);
- other token tensors (what the eager parts between the segments allocate: the boundary
  layer's outputs, the decoder's gathered rows): the PieceGraph copies them into buffers of
  its own at capture, and copies again before each replay.
A piece keeps a graph per bucket and set of persistent input addresses: under decoder bounded
replay the late layers' pieces read the runner's buffers on some steps and the decoder's on
others (runtime/token_graphs.py captures both). A replay whose persistent inputs are at none of
its captures' addresses (a piece fed by a piece that did not replay) runs the compiled piece
instead, counted in `misses`: correct, only slower.

Memory. Each call site owns its graphs (identical layers share a compiled callable, never a
graph: a graph's outputs are its own buffers); all graphs share one memory pool, captured
largest bucket first, and every captured output stays referenced, so a later capture never
writes into an earlier one's outputs (only into memory earlier captures used for their
intermediates). A step replays its graphs in the order they were captured: its early pieces at
its bucket, then the late ones at the decoder's bucket, no larger, captured after (for the
same bucket, the decoder's pass follows the runner's), so no replay in a step overwrites an
output an earlier replay of that step left.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch


def _token_dim(a) -> bool:
    """An example input whose dim 0 is the (symbolic) token count."""
    return isinstance(a, torch.Tensor) and a.dim() > 0 and isinstance(a.shape[0], torch.SymInt)


def _tensors(out):
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


class PieceGraphs:
    """Every PieceGraph of one compiled forward and the state they share: the width being
    replayed or captured, the memory pool and the persistent storages."""

    def __init__(self):
        self.pieces: list[PieceGraph] = []
        self.width: int | None = None     # the step's bucket while replaying (None: run compiled)
        self.capturing = False
        self.pool = None
        self.static_storages: set[int] = set()

    def add(self, fn: Callable, example_args, name: str) -> "PieceGraph":
        p = PieceGraph(fn, example_args, name, self)
        self.pieces.append(p)
        return p

    def persistent(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.static_storages

    @contextlib.contextmanager
    def replaying(self, width: int, capture: bool = False):
        """Pieces replay their graph of the token count they see (capture: capture it first)."""
        self.width, self.capturing = width, capture
        try:
            yield
        finally:
            self.width, self.capturing = None, False

    def counts(self) -> dict:
        return {"pieces": len(self.pieces), "graphs": sum(map(len, (c for p in self.pieces for c in p.graphs.values()))),
                "replays": sum(p.replays for p in self.pieces), "misses": sum(p.misses for p in self.pieces)}


class _Captured:
    """One graph of a piece: the arguments it was captured with, which of them it copies in,
    which must stay where they were, and its outputs."""

    def __init__(self, graph, args, copies, fixed, out):
        self.graph, self.args, self.copies, self.fixed, self.out = graph, args, copies, fixed, out

    def replay(self, args):
        for i, ptr in self.fixed:
            if args[i].data_ptr() != ptr:
                return None
        for i in self.copies:
            self.args[i].copy_(args[i])
        self.graph.replay()
        return self.out


class PieceGraph:
    """One token piece at one call site: its compiled callable and its graph per bucket."""

    def __init__(self, fn: Callable, example_args, name: str, owner: PieceGraphs):
        self.fn, self.name, self.owner = fn, name, owner
        self.token_args = tuple(i for i, a in enumerate(example_args) if _token_dim(a))
        self.graphs: dict[int, list[_Captured]] = {}     # bucket -> its captures
        self.replays = self.misses = 0

    def __call__(self, *args):
        own = self.owner
        if own.width is None or not self.token_args:
            return self.fn(*args)
        n = args[self.token_args[0]].shape[0]
        for cap in self.graphs.get(n, ()):
            out = cap.replay(args)
            if out is not None:
                self.replays += 1
                return out
        if own.capturing and n == own.width:
            return self.capture(n, args)
        self.misses += 1
        return self.fn(*args)

    def capture(self, n: int, args):
        """Capture this piece at token count `n` on `args` (a warm-up call first), then replay it
        once so that its outputs hold this call's values."""
        own = self.owner
        static = list(args)
        copies = []
        for i in self.token_args:
            if not own.persistent(args[i]):
                static[i] = args[i].clone()
                copies.append(i)
        fixed = [(i, a.data_ptr()) for i, a in enumerate(static) if isinstance(a, torch.Tensor) and i not in copies]
        self.fn(*static)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=own.pool):
            out = self.fn(*static)
        if own.pool is None:
            own.pool = g.pool()
        own.static_storages.update(t.untyped_storage().data_ptr() for t in _tensors(out))
        self.graphs.setdefault(n, []).append(_Captured(g, static, copies, fixed, out))
        g.replay()
        return out
