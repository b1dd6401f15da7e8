"""The DSpark draft's blocks compiled (v41/dspark.py, runtime/spec_step.py).

The draft's three stages are Blocks like the target's layers (window attention over their own
rings, MoE with the draft's experts), and a proposal runs them over 5·B rows: eagerly that is
~750 ATen ops a block, each a kernel launch, or a node of the draft's CUDA graph
(`eager-ops-toy-cpu.json`). `compile_draft` makes them one more segment, `_DraftBlocks`, compiled
like the target's segments (the piecewise backend and the target's pass manager; the draft rows'
dim marked dynamic, traced once at the largest request count, then warm at every count and
failing on a recompile) and installs it as `DSpark.run_blocks`. The draft batch is built and the
heads (a GEMM, five Markov steps, the confidence head) run eagerly around it.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from runtime.compile.backend import PiecewiseBackend
from runtime.compile.config import CompileConfig
from runtime.compile.segments import _drop_all_guards, _fresh_function


class _DraftBlocks(nn.Module):
    """The draft stages (`layers`: passes/split.py cuts a segment at each `layers.<i>` block)."""

    def __init__(self, draft):
        super().__init__()
        self.layers = draft.blocks

    def forward(self, X, pre, batch, cache):
        for block in self.layers:
            X, pre = block(X, pre, batch, cache, {})
        return X, pre


def draft_rows(X, pre, batch) -> list:
    """The tensors whose dim 0 is the draft rows (5·B)."""
    return [X, pre, batch.input_ids, batch.positions, batch.batch_ids, batch.win_idx, batch.ring_dest]


def compile_draft(spec, ccfg: CompileConfig, pass_manager, counts) -> dict:
    """Compile `spec.draft`'s blocks and warm them at each request count in `counts` (inert
    requests: no context row, nothing written). Returns {"counts", "stats"}."""
    draft = spec.draft
    seg = _DraftBlocks(draft)
    ccfg = dataclasses.replace(ccfg, splitting_ops=())
    if ccfg.backend in ("inductor", "post_grad_eager"):
        backend = PiecewiseBackend("_DraftBlocks", ccfg, pass_manager, None)
    else:
        backend = ccfg.backend
    options = {"guard_filter_fn": _drop_all_guards} if ccfg.drop_guards else None
    fn = torch.compile(_fresh_function(_DraftBlocks.forward, f"draft_{id(seg):x}"), backend=backend,
                       fullgraph=True, dynamic=False, options=options)
    warm = False

    def run_blocks(X, pre, batch, cache):
        if warm:
            with torch.compiler.set_stance("fail_on_recompile"):
                return fn(seg, X, pre, batch, cache)
        for t in draft_rows(X, pre, batch):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        with torch.fx.experimental._config.patch(backed_size_oblivious=True):
            return fn(seg, X, pre, batch, cache)

    draft.run_blocks = run_blocks
    rings, dev = spec.draft_rings, spec.draft_rings.device
    with torch.inference_mode():
        for i, b in enumerate(sorted(set(counts), reverse=True)):
            zeros = torch.zeros(b, dtype=torch.long, device=dev)
            floors = torch.full((b,), draft.max_pos, dtype=torch.long, device=dev)   # no context row
            draft(zeros, zeros, zeros, floors, rings, check=False)
            warm = True
    stats = {}
    if isinstance(backend, PiecewiseBackend):
        stats = {"graphs": backend.graphs, "pieces": len(backend.stats),
                 "compiled": sum(not s.reused for s in backend.stats)}
    return {"counts": sorted(set(counts)), "stats": stats}
