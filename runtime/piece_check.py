"""Per-piece agreement of a compiled forward: each compiled layer piece against its own Dynamo
graph run eagerly on the same inputs.

Whole-model logits are no test of a compiled model on random weights: FP8 activation rounding,
the indexer's top-k and the router's top-k turn a last-bit difference into a different choice,
and after a few layers the outputs decorrelate (the 8-layer mini model in float32: compiled with
the Triton mHC kernel, whose coefficients differ from the reference by < 1e-5, gives logits 0.17
apart (relative L2); multiplying the eager Sinkhorn output by 1 + 1e-6 noise gives 0.20). A
piece compared with its eager graph on the very inputs the compiled run gave it does not
compound: what it reports is that layer's own error.

    with compare_pieces(fwd) as rows:
        engine.step()
    worst = max(r["rel_l2"] for r in rows)

Each row: the piece, its outputs' and its written inputs' (cache planes) largest relative L2
difference. Every input is cloned for the eager run (weights included): a debugging aid, not
for serving.
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 distance of float tensors; for integer ones (packed FP4, indices) the share
    of elements that differ."""
    if not (a.is_floating_point() and b.is_floating_point()):
        return (a != b).double().mean().item() if a.numel() else 0.0
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _tensors(x) -> list:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def compare_pieces(fwd):
    """While active, every call of a compiled piece of `fwd` (a CompiledForward whose segments
    went through the piecewise backend) also runs the piece's Dynamo graph on clones of its
    inputs and appends a row to the yielded list."""
    from runtime.compile import PiecewiseBackend
    rows: list[dict] = []
    swapped = []
    for seg, backend in fwd.backends.items():
        if not isinstance(backend, PiecewiseBackend):
            continue
        for split_gm, target, eager in backend.installed:
            compiled = split_gm.__dict__[target]

            def check(*args, _c=compiled, _e=eager, _name=f"{seg}.{target}"):
                ins = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
                out = _c(*args)
                ref = _e(*ins)
                got, want = _tensors(out), _tensors(ref)
                assert len(got) == len(want), _name
                written = [rel_l2(a, b) for a, b in zip(args, ins)
                           if isinstance(a, torch.Tensor) and not torch.equal(a, b)]
                rows.append({"piece": _name, "rel_l2": max((rel_l2(g, w) for g, w in zip(got, want)), default=0.0),
                             "inputs_rel_l2": max(written, default=0.0)})
                return out

            split_gm.__dict__[target] = check
            swapped.append((split_gm, target, compiled))
    try:
        yield rows
    finally:
        for split_gm, target, compiled in swapped:
            split_gm.__dict__[target] = compiled
