"""Counted, not timed: the ATen ops a decode step runs op by op, outside the compiled segments
(each is a kernel launch, or a graph node once captured: on the H200 a FULL decode step's
replay idles ~0.5 us between nodes and most eager ops are 1-2 us kernels).

With decoder bounded replay the compiled forward runs no layer eagerly (but the last layer of a
step whose decoder rows sample nothing, and of TR_HYBRID's decoder plans), and DSpark runs its context
keys, verification, commit and its three draft blocks eagerly (the draft graph of
runtime/draft_graphs.py captures those eager ops). This counts, on the CPU toy (Flash's
40-layer topology, tiny widths; op counts do not depend on widths), one decode step of one
request with DSpark on: the non-view ATen ops of every backbone layer run eagerly (what an
eager layer costs; a compiled one is fused), of each draft block, and of each DSpark phase.

    PYTHONPATH=. python benchmarks/eager_ops.py --out benchmarks/results/eager-ops-toy-cpu.json
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.engine import EngineArgs, LLMEngine
from runtime.sequence import SamplingParams

# ops that make no kernel (views, metadata)
VIEWS = {"aten.view", "aten._unsafe_view", "aten.slice", "aten.select", "aten.unsqueeze", "aten.squeeze",
         "aten.expand", "aten.t", "aten.transpose", "aten.permute", "aten.alias", "aten.detach", "aten.unbind",
         "aten.split", "aten.split_with_sizes", "aten.as_strided", "aten.lift_fresh", "aten.reshape"}
SPEC_PHASES = ("stage", "keep_context", "accept", "commit", "propose")


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def counted(obj, name: str, into: dict, key: str) -> None:
    """Wrap obj.name (an instance attribute) so each call's op counts land in into[key]."""
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        mode = OpCount()
        with mode:
            out = fn(*a, **k)
        into[key] = mode.ops
        return out
    setattr(obj, name, wrapper)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--steps", type=int, default=4, help="decode steps before the counted one")
    a = ap.parse_args(argv)
    eng = LLMEngine(EngineArgs(model="toy", device="cpu", dtype="float32", speculative_method="dspark",
                               spec_decode_acceptance_length=3.51, enable_prefix_caching=False))
    eng.add_request(list(range(3, 43)), SamplingParams(max_tokens=8 * (a.steps + 2), ignore_eos=True))
    layers, blocks, phases = {}, {}, {}
    for i, layer in enumerate(eng.runner.model.layers):
        counted(layer, "forward", layers, i)
    spec = eng.runner.spec
    for j, block in enumerate(spec.draft.blocks):
        counted(block, "forward", blocks, j)
    for p in SPEC_PHASES:
        counted(spec, p, phases, p)
    for _ in range(a.steps + 1):       # the prompt, then decode steps; the last one is counted
        eng.step()
    topo = eng.cfg.topology
    total = lambda c: sum(c.values())  # noqa: E731
    res = {"benchmark": "eager_ops", "model": "toy (Flash topology)", "device": "cpu", "torch": torch.__version__,
           "date": datetime.date.today().isoformat(),
           "what": "non-view ATen ops of one DSpark decode step of one request run op by op (TorchDispatchMode), "
                   "per backbone layer (eager model), per draft block and per DSpark phase",
           "boundary_layer": topo.boundary, "last_layer": topo.n_backbone - 1,
           "per_layer": {str(i): total(c) for i, c in sorted(layers.items())},
           "boundary_and_last_layers": total(layers[topo.boundary]) + total(layers[topo.n_backbone - 1]),
           "draft_blocks": [total(blocks[j]) for j in sorted(blocks)],
           "spec_phases": {p: total(phases[p]) for p in SPEC_PHASES if p in phases},
           "propose_top_ops": dict(phases["propose"].most_common(10)) if "propose" in phases else {}}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "per_layer"}))
    return res


if __name__ == "__main__":
    main()
