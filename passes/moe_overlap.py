"""The routed experts beside the shared expert, on a second stream.

An MoE layer's routed experts and its shared expert read the same normed input and meet only at
their sum (v41.moe.MoE.forward). At decode both are GEMVs that leave part of the GPU idle: one
token's FP4 expert GEMVs read their bytes at about half the copy rate (docs/kernels.md), and the
shared expert's two FP8 GEMVs and its SwiGLU are three launches more in a row. This pass turns
the experts' op (`v41::moe_experts_w4a8`, or `v41::moe_experts` on dequantized weights) into its
fork, whose CUDA impl enqueues them on a second stream, and puts a `v41::join` before the sum
(custom_ops/overlap.py). The shared expert's first input is threaded through the fork (declared
written, left unchanged) so that every schedule runs it after the fork; the join reads the
shared expert's output and the fork's inputs, so it comes after the one and keeps the others
alive. Bit for bit the same arithmetic.
f32 shown (a bf16 model converts the shared output before the sum):

    before:
        af = auto_functionalized_v2(v41.moe_experts_w4a8, x=h, ids=ids, weights=wts, ...,
                                    limit=10.0, _out_base_index=0, _all_bases=[empty([s0, 64])])
        y = af[1]
        lin = auto_functionalized_v2(v41.fp8_block_gemm, xq=view(q, [-1, 64]), xs=view(s, [-1, 2]), ...)
        ... SwiGLU, its act quant, the second GEMM: shared ...
        z = add(y, shared)
    after:
        af = auto_functionalized(v41.moe_experts_w4a8_fork, x=h, ids=ids, weights=wts, ...,
                                 limit=10.0, out=empty([s0, 64]), after=q)
        y = af[1]; q2 = af[2]
        lin = auto_functionalized_v2(v41.fp8_block_gemm, xq=view(q2, [-1, 64]), xs=view(s, [-1, 2]), ...)
        ... SwiGLU, its act quant, the second GEMM: shared ...
        j = auto_functionalized(v41.join, out=y, keep=[h, ids, wts, shared])   # bf16: shared unconverted
        z = add(j[1], shared)

On dequantized weights the shared expert's input is its own RMSNorm + QAT (`v41::rms_norm_fp8`,
rms_norm_quant's, placed before the router): the fork declares that norm's fresh out buffer
written, and the norm moves after the fork to write into the fork's output of it.

A layer whose sum has no shared expert (a tensor-parallel rank without it), or whose shared
expert reads no tensor made for it alone, is left as it is.
"""
from __future__ import annotations

import operator

import torch

from passes.base import _AF, V41Pass, add_node, calls_of, output_of

aten = torch.ops.aten
AF = torch.ops.higher_order.auto_functionalized
# the experts' op -> (its fork, the arguments they share: all but out)
FORKS = {"moe_experts_w4a8": ("moe_experts_w4a8_fork", ("x", "ids", "weights", "w1", "s1", "w3", "s3", "w2", "s2", "limit")),
         "moe_experts": ("moe_experts_fork", ("x", "ids", "weights", "w1", "w3", "w2", "limit"))}


class MoeOverlap(V41Pass):
    name = "moe_overlap"

    def __call__(self, graph: torch.fx.Graph) -> int:
        matched = 0
        for name, (fork, args) in FORKS.items():
            for experts in calls_of(graph, getattr(torch.ops.v41, name).default):
                matched += self._overlap(graph, experts, getattr(torch.ops.v41, fork).default, args)
        return matched

    def _overlap(self, graph, experts, fork_op, args) -> int:
        y = output_of(experts)
        if y is None or len(y.users) != 1 or set(experts.kwargs) != {*args, "_out_base_index", "_all_bases"}:
            return 0
        total = next(iter(y.users))
        if total.target is not aten.add.Tensor or total.args[0] is not y or not isinstance(total.args[1], torch.fx.Node):
            return 0
        shared = total.args[1]
        order = {n: i for i, n in enumerate(graph.nodes)}
        beside = _ancestors(shared) - _ancestors(experts) - {experts}
        after = _first_buffer(beside, order)
        if after is None:
            return 0
        # what reads `after` must run after the fork: the shared expert's nodes placed before the
        # experts' op move behind it, unless something else placed there reads them
        moved = [n for n in sorted(_reach(after, lambda n: n.users, beside), key=order.get) if order[n] < order[experts]]
        if any(order[u] < order[experts] and u not in moved for n in moved for u in n.users):
            return 0
        with graph.inserting_before(experts):
            fork = add_node(graph, AF, fork_op, **{k: experts.kwargs[k] for k in args},
                            out=experts.kwargs["_all_bases"][0], after=after)
            y2, after2 = (add_node(graph, operator.getitem, fork, i) for i in (1, 2))
        last = after2
        for node in moved:
            last.append(node)
            last = node
        for reader in list(after.users):
            if reader is not fork:
                reader.replace_input_with(after, after2)
        keep = [experts.kwargs[k] for k in ("x", "ids", "weights")] + [_unconverted(shared)]
        y.replace_all_uses_with(y2)
        graph.erase_node(y)
        graph.erase_node(experts)
        with graph.inserting_before(total):
            done = add_node(graph, AF, torch.ops.v41.join.default, out=y2, keep=keep)
            y3 = add_node(graph, operator.getitem, done, 1)
        total.replace_input_with(y2, y3)
        return 1


def _unconverted(node: torch.fx.Node) -> torch.fx.Node:
    """`node` before its dtype conversions and views: the join reads the shared expert's GEMM
    output itself, so that the conversion stays fused into the sum's kernel (a join reading the
    converted value would make Inductor write it out in a kernel of its own)."""
    while node.target in (torch.ops.prims.convert_element_type.default, aten.view.default, aten.reshape.default):
        node = node.args[0]
    return node


def _reach(node: torch.fx.Node, step, within: set | None = None) -> set:
    """The nodes reached from `node` (not itself) by repeating `step` (a node's inputs or its
    users), staying inside `within` if given."""
    seen, todo = set(), [node]
    while todo:
        for n in step(todo.pop()):
            if n not in seen and (within is None or n in within):
                seen.add(n)
                todo.append(n)
    return seen


def _ancestors(node: torch.fx.Node) -> set:
    return _reach(node, lambda n: n.all_input_nodes)


def _first_buffer(beside: set, order: dict):
    """The first (in graph order) buffer only `beside` reads, which the fork may declare
    written: an output of a mutating op made outside `beside` (native weights: the FFN norm's
    codes for the shared GEMM), or a fresh `empty` (dequantized: the out buffer of the shared
    expert's own norm + QAT). None if there is none."""
    for node in sorted(beside, key=order.get):
        made_outside = node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and \
            node.args[0].target in _AF and node.args[0] not in beside
        if (made_outside or node.target is aten.empty.memory_format) and node.users and \
                all(u in beside for u in node.users):
            return node
    return None


def make(cfg, dtype, lowering="auto"):
    return MoeOverlap(cfg, dtype, lowering)
