"""The DSpark draft's blocks compiled (v41/dspark.py, runtime/spec_step.py).

The draft's three stages are Blocks like the target's layers (window attention over their own
rings, MoE with the draft's experts), and a proposal runs them over 5·B rows: eagerly that is
~750 ATen ops a block, each a kernel launch, or a node of the draft's CUDA graph
(`eager-ops-toy-cpu.json`). `compile_draft` makes them one more segment, `_DraftBlocks`, compiled
like the target's segments (the piecewise backend and the target's pass manager; the dims that
follow the request count marked dynamic, traced once at the largest request count, then warm at every count and
failing on a recompile) and installs it as `DSpark.run_blocks`. The draft batch is built and the
heads (a GEMM, five Markov steps, the confidence head) run eagerly around it.

The context keys of each step's tapped rows (`DSpark.keys`: the main projection and norm, then
per stage the wkv GEMM, its norm, RoPE and the FP8 round trip; ~390 eager ops with their
scatters, `eager-ops-toy-cpu.json`) run after every target step, graphed or not; `_ContextKeys`
compiles them the same way (the row count dynamic, traced at the largest step) and installs
them as `DSpark.keys`.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from runtime.compile.backend import PiecewiseBackend, compile_segment
from runtime.compile.config import CompileConfig
from runtime.compile.segments import _LateLayers, call_context


class _DraftBlocks(_LateLayers):
    """The draft stages, run as _LateLayers runs its layers (`layers`: passes/split.py cuts a
    segment at each `layers.<i>` block)."""

    def __init__(self, draft):
        nn.Module.__init__(self)
        self.layers = draft.blocks


class _ContextKeys(nn.Module):
    """The draft's context keys of tapped rows, `DSpark.keys` (no `layers`: one piece)."""

    def __init__(self, draft):
        super().__init__()
        self.draft = draft

    def forward(self, taps, positions):
        return type(self.draft).keys(self.draft, taps, positions)


class _WarmSegment:
    """`seg` compiled as segment `name` like the target's (the piecewise backend, `pass_manager`,
    no splitting ops): while cold, dim 0 of each tensor `dynamic(*args)` lists is marked
    dynamic; once `warm`, a recompile is an error."""

    def __init__(self, name: str, seg: nn.Module, ccfg: CompileConfig, pass_manager, dynamic):
        self.seg, self.dynamic, self.warm = seg, dynamic, False
        self.fn, _, self.backend = compile_segment(name, type(seg).forward, f"{name}_{id(seg):x}",
                                                   dataclasses.replace(ccfg, splitting_ops=()), pass_manager)

    def __call__(self, *args):
        with call_context(self.warm):
            if not self.warm:
                for t in self.dynamic(*args):
                    torch._dynamo.maybe_mark_dynamic(t, 0)
            return self.fn(self.seg, *args)

    def summary(self) -> dict:
        return self.backend.summary() if isinstance(self.backend, PiecewiseBackend) else {}


def dynamic_tensors(X, pre, batch, cache, sel) -> list:
    """The tensors whose dim 0 varies with the request count B: the draft rows (5·B) and the
    block table (B rows; a size left static would be asserted by Inductor's generated code)."""
    return [X, pre, batch.input_ids, batch.positions, batch.batch_ids, batch.win_idx, batch.ring_dest,
            batch.block_table]


def compile_draft(spec, ccfg: CompileConfig, pass_manager, counts, rows) -> dict:
    """Compile `spec.draft`'s blocks and warm them at each request count in `counts` (inert
    requests: no context row, nothing written), and its context keys at each step width in `rows`.
    Returns {"counts", "stats", "keys": {"rows", "stats"}}."""
    draft = spec.draft
    keys = compile_keys(draft, ccfg, pass_manager, rows, spec.taps)
    blocks = _WarmSegment("_DraftBlocks", _DraftBlocks(draft), ccfg, pass_manager, dynamic_tensors)
    draft.run_blocks = lambda X, pre, batch, cache: blocks(X, pre, batch, cache, {})
    counts = sorted(set(counts))
    rings = spec.draft_rings
    with torch.inference_mode():
        for b in reversed(counts):          # traced at the largest count, then warm
            zeros = torch.zeros(b, dtype=torch.long, device=rings.device)
            floors = torch.full((b,), draft.max_pos, dtype=torch.long, device=rings.device)   # no context row
            draft(zeros, zeros, zeros, floors, rings, check=False)
            blocks.warm = True
    return {"counts": counts, "stats": blocks.summary(), "keys": keys}


def compile_keys(draft, ccfg: CompileConfig, pass_manager, rows, taps) -> dict:
    """Compile `draft.keys` and warm it at each width in `rows` (taps: SpecStep's buffer
    [n_taps, rows, D], read for its shape)."""
    keys = _WarmSegment("_ContextKeys", _ContextKeys(draft), ccfg, pass_manager, lambda x, positions: (x, positions))
    draft.keys = keys
    rows = sorted(set(rows))
    n_taps, _, D = taps.shape
    with torch.inference_mode():
        for t in reversed(rows):            # traced at the largest width, then warm
            keys(torch.zeros(t, n_taps * D, dtype=taps.dtype, device=taps.device),
                 torch.zeros(t, dtype=torch.long, device=taps.device))
            keys.warm = True
    return {"rows": rows, "stats": keys.summary()}
