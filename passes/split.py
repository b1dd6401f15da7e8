"""Split a segment's Dynamo graph into one piece per layer, so Inductor compiles each distinct
layer once (spec/compile_pipeline.md §1.4: piecewise splitting dedupes identical layers).

A segment (`_Backbone`, `_EarlyLayers`, `_LateLayers`) is one Dynamo graph: one trace, one
guard set, one compiled callable. Inductor's cost grows faster than linearly with graph size
(reinplacing, lowering and scheduling a 40-layer graph of the toy takes far over ten minutes on
two cores), while the 40 layers have a handful of distinct shapes (per role: WINDOW, FULL,
REINDEX, REUSE, with or without Engram, ratio 1 or 2). So the backend splits the graph at layer
boundaries with `split_module(keep_original_order=True)`:

    before (Dynamo graph of _EarlyLayers, 3 layers shown):
        x = embed[ids] ...                          # outside any Block
        ring = l_cache_ring[0]; ... layer 0 ops ...  # nn_module_stack: L['self'].layers.0
        ring_1 = l_cache_ring[1]; ... layer 1 ops ...
        ...
    after:
        submod_0 = views(...)     # every view of a cache input (ring = l_cache_ring[0], ...)
        submod_1 = prologue(...)  # ops outside any Block before the first one
        submod_2 = layer 0        # each Block's ops, in program order
        submod_3 = layer 1
        ...

Views of the cache inputs are hoisted into the first piece (run eagerly: they cost nothing) so
no layer piece carries its layer index as a constant (`cache.ring[l]`): pieces of layers with
the same role are then the same graph, compiled once (see `runtime/compile/`) and found in the
FX graph cache by every later process. Mutations stay in the piece that makes them, in program
order, so cache writes of layer l land before layer l+1 reads.

Under `--cudagraph-mode TR_HYBRID` a layer is also cut at its splitting ops (SPLITTING_OPS): each
run of them becomes a piece of its own that runs eagerly (name `<layer>!<ops>`, `is_eager`),
and the layer's ops between them become token pieces `<layer>`, `<layer>#1`, ... that depend on
the token count alone (runtime/compile/piece_graphs.py captures them per token bucket):

        submod_2 = layer 0          # norms, projections, RoPE, FP8 QAT: token-wise
        submod_3 = layer 0!sparse_attn+scatter_rows      # eager, on the batch's metadata
        submod_4 = layer 0#1        # inverse RoPE, wo_a/wo_b, mHC, MoE: token-wise
"""
from __future__ import annotations

import operator
import re

import torch
from torch.fx.passes.split_module import split_module

VIEWS = "views"
EAGER = "!"           # marks a piece of splitting ops: `<layer>!<op>+<op>`
# The v41 ops that read or write per-request state through the batch's metadata (block table,
# window rows, batch ids, destinations) or whose work depends on the data (index top-k sizes its
# scan by the largest visible position): sparse attention, index scoring/top-k, the ratio-2
# compressor (FP32 tails across forwards) and every row scatter into rings, owner pages and
# index planes. Everything else in a layer is token-wise (RMSNorm, RoPE by position, FP8/FP4
# QAT, GEMMs, mHC, the MoE router and experts, the Engram gate on rows the runner gathered
# before the forward), so a piece without these ops depends only on the token count.
SPLITTING_OPS = ("v41::sparse_attn", "v41::index_topk", "v41::compress_pool", "v41::scatter_rows")
_LAYER = re.compile(r"layers\.(\d+)$")
# targets that only reinterpret an input (no data is read or written)
_VIEW_METHODS = {"view", "t", "transpose", "permute", "unsqueeze", "squeeze", "select", "flatten",
                 "unflatten", "expand", "size", "dim", "stride", "storage_offset", "as_strided",
                 "narrow", "detach", "unbind", "split", "chunk", "view_as", "expand_as"}
_VIEW_FUNCTIONS = {operator.getitem, getattr, torch.transpose, torch.permute, torch.unsqueeze,
                   torch.squeeze, torch.select, torch.flatten, torch.narrow, torch.t, torch.unbind,
                   torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int,
                   torch.ops.aten.sym_numel.default, torch.ops.aten.sym_storage_offset.default}


def block_path(node: torch.fx.Node) -> str | None:
    """The module path of the Block that created `node` (from Dynamo's nn_module_stack), or None
    for ops outside every block."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, typ in stack.values():
        name = getattr(typ, "__name__", str(typ))
        if name == "Block" or _LAYER.search(str(path)):
            return str(path)
    return None


def _is_tensor_node(a) -> bool:
    return isinstance(a, torch.fx.Node) and isinstance(a.meta.get("example_value"), torch.Tensor)


def _is_view(node: torch.fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _VIEW_METHODS
    if node.op != "call_function" or node.target not in _VIEW_FUNCTIONS:
        return False
    if node.target is operator.getitem:          # x[i], x[a:b], x[..., None]; not x[index_tensor]
        idx = node.args[1]
        return not any(_is_tensor_node(a) for a in (idx if isinstance(idx, (tuple, list)) else (idx,)))
    return True


def _inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [a for a in node.all_input_nodes]


def _source_name(ph: torch.fx.Node) -> str:
    ga = ph.meta.get("grapharg")
    src = getattr(ga, "source", None)
    return src.name() if callable(getattr(src, "name", None)) else str(getattr(src, "name", ph.name))


def is_cache_input(ph: torch.fx.Node) -> bool:
    """A graph input that is runtime state (the KV cache), not a weight or an activation."""
    name = _source_name(ph)
    return name.startswith("L['cache']") or ph.name.startswith("l_cache_")


def hoist_input_views(graph: torch.fx.Graph, roots_of=is_cache_input) -> set[torch.fx.Node]:
    """Move every view of a cache input (transitively: `cache.ring[l]`, `cache.image_ring[l]`)
    to just after the placeholders; returns the hoisted nodes. Safe: a view depends on nothing
    but its input and reads no data. Views of weights stay with their layer: the patterns of
    the v41 passes (passes/manager.py) contain them (`fn.T`, `scale[0]`)."""
    hoisted: set[torch.fx.Node] = set()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    anchor = placeholders[-1] if placeholders else None
    roots = {p for p in placeholders if roots_of(p)}
    for n in list(graph.nodes):
        if n.op in ("placeholder", "output") or not _is_view(n):
            continue
        if all(a in roots or a in hoisted for a in _inputs(n)):
            hoisted.add(n)
            if anchor is not None:
                anchor.append(n)
                anchor = n
    return hoisted


def op_name(target) -> str | None:
    """"v41::sparse_attn" for torch.ops.v41.sparse_attn or any of its overloads, else None."""
    packet = getattr(target, "overloadpacket", target)
    return getattr(packet, "_qualified_op_name", None)


def is_eager(name: str) -> bool:
    """A piece of splitting ops (runs eagerly, never captured)."""
    return EAGER in name


def partition_by_layer(graph: torch.fx.Graph, splitting_ops=()) -> tuple[dict, list[str]]:
    """Node -> partition id (0: hoisted views; then one partition per contiguous run of one
    Block's ops, or of ops outside every Block, cut further at each run of `splitting_ops`
    (qualified names), which gets a partition of its own), and the partitions' names."""
    hoisted = hoist_input_views(graph)
    splitting = set(splitting_ops)
    part: dict[torch.fx.Node, int] = {}
    names = [VIEWS]
    key = None                   # (block path, in a run of splitting ops)
    done: set[str] = set()       # block paths whose ops have ended
    runs: dict[str, int] = {}    # block path -> token runs so far
    outside = 0
    for n in graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n in hoisted:
            part[n] = 0
            continue
        path = block_path(n)
        if path is None:
            if key is not None and key[0].startswith("outside"):
                path = key[0]
            else:
                path, outside = f"outside{outside}", outside + 1
        eager = n.op == "call_function" and op_name(n.target) in splitting
        if key is None or path != key[0]:
            if path in done:
                raise RuntimeError(f"graph split: ops of {path} are not contiguous (node {n.name})")
            if key is not None:
                done.add(key[0])
        if (path, eager) != key:
            if eager:
                names.append(f"{path}{EAGER}{op_name(n.target).split('::')[1]}")
            else:
                k = runs[path] = runs.get(path, -1) + 1
                names.append(path if k == 0 else f"{path}#{k}")
            key = (path, eager)
        elif eager and not names[-1].endswith(op_name(n.target).split("::")[1]):
            names[-1] += f"+{op_name(n.target).split('::')[1]}"
        part[n] = len(names) - 1
    return part, names


def split_by_layer(gm: torch.fx.GraphModule, splitting_ops=()) -> tuple[torch.fx.GraphModule, dict[str, str]]:
    """The split module and {submodule name: partition name} (layer path, "outside<k>",
    "views", or with `splitting_ops` also `<path>#<k>` and `<path>!<ops>`). Submodules are
    called in the original order."""
    part, names = partition_by_layer(gm.graph, splitting_ops)
    gm.recompile()
    split = split_module(gm, None, lambda n: part[n], keep_original_order=True)
    pieces = {}
    for n in split.graph.nodes:
        if n.op == "call_module":
            pieces[n.target] = names[int(n.target.rsplit("_", 1)[1])]
    return split, pieces
