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

Each row: the piece, its float outputs' and its written inputs' (cache planes) largest
relative L2 difference, and the share of differing elements of its integer outputs (top-k rows:
a near-tie resolved the other way shifts the rest of a sorted row). Every input is cloned for
the eager run (weights included): a debugging aid, not for serving.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.utils._pytree as pytree


# a row's metrics in report order (the last three come with eager_twice / reference)
METRICS = ("rel_l2", "ids_differing", "inputs_rel_l2", "eager_rel_l2", "vs_reference", "eager_vs_reference")


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 distance of float tensors; for integer ones (packed FP4, indices) the share
    of elements that differ."""
    if not (a.is_floating_point() and b.is_floating_point()):
        return (a != b).double().mean().item() if a.numel() else 0.0
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _tensors(x) -> list:
    return [t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]


def _worst(outs_a, outs_b, floats: bool = True) -> float:
    """Largest rel_l2 over the float outputs (floats) or the integer ones (ids, top-k)."""
    return max((rel_l2(a, b) for a, b in zip(outs_a, outs_b) if a.is_floating_point() == floats),
               default=0.0)


def by_piece(rows: list[dict]) -> dict:
    """Each piece's worst value of every metric over its calls, and its call count."""
    out: dict = {}
    for r in rows:
        w = out.setdefault(r["piece"], {"calls": 0})
        w["calls"] += 1
        for k, v in r.items():
            if k != "piece":
                w[k] = max(w.get(k, 0.0), v)
    return out


@contextlib.contextmanager
def compare_pieces(fwd, eager_twice: bool = False, reference: bool = False,
                   save_dir: str | None = None):
    """While active, every call of a compiled piece of `fwd` (a CompiledForward whose segments
    went through the piecewise backend) also runs the piece's Dynamo graph on clones of its
    inputs and appends a row to the yielded list.

    `eager_twice`: run the graph on a second set of clones too and report `eager_rel_l2`, the
    two eager runs apart (nonzero: an op that is not deterministic, so the comparison above has
    that floor). `reference`: run the graph once more with every v41 op on its reference impl
    (the definition) and report `vs_reference` (compiled against it) and `eager_vs_reference`
    (the eager run against it): which of the two strays when they disagree. `save_dir`: at exit,
    save each piece's worst call there (`<piece>.pt`: inputs under 64 MB each, compiled and
    eager outputs) for a look offline."""
    from custom_ops import registry
    from runtime.compile import PiecewiseBackend
    rows: list[dict] = []
    worst: dict[str, tuple] = {}
    swapped = []
    for seg, backend in fwd.backends.items():
        if not isinstance(backend, PiecewiseBackend):
            continue
        for split_gm, target, eager in backend.installed:
            compiled = split_gm.__dict__[target]

            def check(*args, _c=compiled, _e=eager, _name=f"{seg}.{target}"):
                def clones():
                    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
                ins = clones()
                ins2 = clones() if eager_twice else None
                ins3 = clones() if reference else None
                kept = clones() if save_dir else None
                out = _c(*args)
                got, want = _tensors(out), _tensors(_e(*ins))
                assert len(got) == len(want), _name
                written = [rel_l2(a, b) for a, b in zip(args, ins)
                           if isinstance(a, torch.Tensor) and not torch.equal(a, b)]
                row = {"piece": _name, "rel_l2": _worst(got, want), "ids_differing": _worst(got, want, False),
                       "inputs_rel_l2": max(written, default=0.0)}
                if eager_twice:
                    row["eager_rel_l2"] = _worst(_tensors(_e(*ins2)), want)
                if reference:
                    dev = next(a.device.type for a in args if isinstance(a, torch.Tensor))
                    with registry.using("reference", dev):
                        truth = _tensors(_e(*ins3))
                    row["vs_reference"] = _worst(got, truth)
                    row["eager_vs_reference"] = _worst(want, truth)
                rows.append(row)
                if save_dir and row["rel_l2"] >= worst.get(_name, (-1.0,))[0]:
                    small = [a if not isinstance(a, torch.Tensor) or a.nbytes < 2**26 else None for a in kept]
                    worst[_name] = (row["rel_l2"], {"inputs": small, "compiled": got, "eager": want})
                return out

            split_gm.__dict__[target] = check
            swapped.append((split_gm, target, compiled))
    try:
        yield rows
    finally:
        for split_gm, target, compiled in swapped:
            split_gm.__dict__[target] = compiled
        if save_dir:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            for name, (_, record) in worst.items():
                torch.save(record, Path(save_dir, f"{name}.pt"))


@contextlib.contextmanager
def launch_configs():
    """While active, each Inductor Triton kernel that autotunes (several candidate launch
    configs) first runs every candidate on clones of its arguments; the yielded list gets one
    row per kernel: its name and each candidate's largest rel_l2 (float outputs) or share of
    differing elements (integer outputs) against the first candidate. A kernel whose result
    depends on its block size is miscompiled (the configs only change how the work is tiled)."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    from torch._inductor.utils import clone_preserve_strides
    rows: list[dict] = []
    autotune = CachingAutotuner.autotune_to_one_config

    def checked(self, *args, **kwargs):
        stream = torch.cuda.current_stream().cuda_stream
        results = []
        for launcher in self.launchers:
            clones = [clone_preserve_strides(a) if isinstance(a, torch.Tensor) else a for a in args]
            launcher(*clones, **kwargs, stream=stream)
            results.append((str(launcher.config), _tensors(clones)))
        first = results[0][1]
        rows.append({"kernel": self.fn.__name__, "configs": {
            cfg: max((rel_l2(a, b) for a, b in zip(outs, first)), default=0.0) for cfg, outs in results}})
        return autotune(self, *args, **kwargs)

    CachingAutotuner.autotune_to_one_config = checked
    try:
        yield rows
    finally:
        CachingAutotuner.autotune_to_one_config = autotune
