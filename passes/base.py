"""What every v41 pass shares: the pass interface, pattern registration against the eager model's
own functions, functional calls of the mutating v41 ops, and a CSE of pure ops.

Patterns are the model's code, not copies of it: a search function calls `v41.layers.rms_norm`,
`v41.quant.fp8_qat`, `Rope.forward`, `MHC.forward`, `MoE.route`, `Engram.forward`, ... on its
arguments, and Inductor's pattern matcher traces it to the ATen ops the model's own graph
holds when the passes run (passes/manager.py: AOT's functional graph, before Inductor rewrites
it). `register_replacement` matches loosely first (ints, floats, shapes ignored), then
retraces the search function with the matched inputs' (symbolic) shapes and matches exactly, so
a constant of the model (eps, the rotary width, the FP8 group, Sinkhorn's iteration count) must
equal the pass's. Passes are built per model config for that reason.

Replacements call the fused op functionally, as AOT's graph holds every mutating custom op:
`auto_functionalized(op, ..., out=empty(...))[1]`; Inductor's reinplacing later writes the op's
output straight into that buffer.
"""
from __future__ import annotations

import copy
import logging
import operator
from types import SimpleNamespace

import torch
from torch._inductor.pattern_matcher import PatternMatcherPass, register_replacement

import custom_ops  # noqa: F401  (defines torch.ops.v41)

log = logging.getLogger("v41.passes")
aten = torch.ops.aten


def acc_of(dtype: torch.dtype) -> torch.dtype:
    from v41.layers import acc_dtype
    return acc_dtype(dtype)


def op_defined(name: str) -> bool:
    return hasattr(torch.ops.v41, name)


def call(name: str, *args):
    """`torch.ops.v41.<name>(*args)` as a functional call; returns the new values of its mutable
    (out) arguments, in schema order."""
    op = getattr(torch.ops.v41, name).default
    schema = op._schema
    kwargs = {a.name: v for a, v in zip(schema.arguments, args)}
    res = torch.ops.higher_order.auto_functionalized(op, **kwargs)
    n_out = max(1, len(schema.returns))
    return res[n_out:]


def ns(**kw) -> SimpleNamespace:
    """A stand-in `self` for a module's forward (its tensors become pattern arguments)."""
    return SimpleNamespace(**kw)


class V41Pass:
    """One transformation of the graph; `__call__` returns its match count."""
    name = "pass"

    def __init__(self, cfg, dtype: torch.dtype, lowering: str = "auto"):
        self.cfg, self.dtype, self.acc, self.lowering = cfg, dtype, acc_of(dtype), lowering

    def __call__(self, graph: torch.fx.Graph) -> int:
        raise NotImplementedError


class PatternPass(V41Pass):
    """A pass made of `register_replacement` patterns, registered on first use (tracing the
    patterns costs a few seconds; an eager engine never pays it). `ops` lists the fused ops the
    pass emits: a pass whose ops are not all defined does nothing and says so once."""
    ops: tuple = ()

    def __init__(self, cfg, dtype, lowering="auto"):
        super().__init__(cfg, dtype, lowering)
        self._pm: PatternMatcherPass | None = None
        self.search_traces = SearchTraces()
        self.missing = [o for o in self.ops if not op_defined(o)]
        if self.missing:
            log.warning("pass %s disabled: fused op(s) %s not defined", self.name, self.missing)

    def register(self, pm: PatternMatcherPass) -> None:
        raise NotImplementedError

    def add(self, pm, search, replace, example_inputs, **kw) -> None:
        def trace_fn(fn, args, **tkw):
            return trace(fn, args, **tkw) if fn is replace else self.search_traces.get(search, fn, args, **tkw)
        register_replacement(search, replace, example_inputs, trace_fn, pm, **kw)

    def before(self, graph: torch.fx.Graph) -> None:
        """What the graph needs before the patterns match (a CSE, say): nothing by default."""

    def __call__(self, graph: torch.fx.Graph) -> int:
        if self.missing:
            return 0
        self.before(graph)
        if self._pm is None:
            self._pm = PatternMatcherPass(pass_name=f"v41.{self.name}")
            with torch.no_grad(), _real_mode():
                self.register(self._pm)
        return self._pm.apply(graph)


class _real_mode:
    """Patterns are traced with real example tensors: leave any ambient fake mode first."""

    def __enter__(self):
        from torch._guards import detect_fake_mode
        from torch.utils._python_dispatch import _disable_current_modes
        self._ctx = _disable_current_modes() if detect_fake_mode() is not None else None
        if self._ctx is not None:
            self._ctx.__enter__()

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


def trace(fn, args, **kw) -> torch.fx.GraphModule:
    """`fwd_only` under a fake mode: the pattern as AOT traces the model (Inductor's
    decompositions, functional ATen, no-ops removed, which the manager also does to the model's
    graph first), i.e. as the graph stands when our passes run, before Inductor's own rewrites."""
    from torch._inductor.pattern_matcher import fwd_only
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    # the args' own mode (a match's retrace, symbolic shapes), else a fresh static one: never the
    # ambient compile's, whose shape env would get symbols (and guards) no input has
    mode = next((a.fake_mode for a in args if isinstance(a, FakeTensor)), None) or FakeTensorMode()
    args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) else a
            for a in args]
    with V.set_fake_mode(mode), mode:
        return fwd_only(fn, args, **kw)


class SearchTraces:
    """The search function's traces by argument structure. `register_replacement` matches loosely
    first, then re-traces the search function on each match's (symbolic) argument shapes to
    check its constants: one trace per match (~0.1 s), of the same few shapes at every layer. A
    trace is kept by (search function, traced function's name, the arguments' shapes and strides
    as expressions, dtypes, scalar values), and each use gets its own copy of the graph (Inductor
    renames its placeholders). Replacement graphs are always traced afresh: they enter the
    model's graph with their fake values, which must be the compile's own."""

    def __init__(self):
        self.graphs: dict = {}
        self.hits = 0

    def get(self, search, fn, args, **kw) -> torch.fx.GraphModule:
        key = (search, fn.__name__, _structure(args))
        gm = self.graphs.get(key)
        if gm is None:
            gm = self.graphs[key] = trace(fn, args, **kw)
        else:
            self.hits += 1
        return torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))


def _structure(a):
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(map(str, a.shape)), tuple(map(str, a.stride())), a.dtype, a.device.type,
                a.requires_grad)
    if isinstance(a, (list, tuple)):
        return (type(a).__name__,) + tuple(_structure(x) for x in a)
    return (type(a).__name__, str(a) if isinstance(a, torch.SymInt) else repr(a))


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


# ---- direct graph edits (passes whose matches have readers outside them) ----------------------

def add_node(graph: torch.fx.Graph, target, *args, **kwargs) -> torch.fx.Node:
    """A call_function node with its fake value, computed in the fake mode of the graph's values."""
    from torch._guards import detect_fake_mode
    node = graph.call_function(target, args, kwargs)
    args_v, kwargs_v = torch.fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
    with detect_fake_mode([n.meta["val"] for n in graph.find_nodes(op="placeholder")]):
        node.meta["val"] = target(*args_v, **kwargs_v)
    return node


def calls_of(graph: torch.fx.Graph, op) -> list[torch.fx.Node]:
    """The graph's functional calls of the mutating op `op` (auto_functionalized, v1 or v2)."""
    return [n for af in _AF for n in graph.find_nodes(op="call_function", target=af) if n.args[0] is op]


def output_of(node: torch.fx.Node) -> torch.fx.Node | None:
    """The single getitem(node, 1) of an auto_functionalized node with one output, or None."""
    users = list(node.users)
    if len(users) == 1 and users[0].target is operator.getitem and users[0].args[1] == 1:
        return users[0]
    return None


def token_count(node: torch.fx.Node) -> bool:
    """sym_size(t, 0): a value's token count, which sizes the buffers of the ops reading it."""
    return node.target is aten.sym_size.int and node.args[1] == 0


def producer_read_only_by(value: torch.fx.Node, reader: torch.fx.Node, op) -> torch.fx.Node | None:
    """The auto_functionalized `op` whose output `value` is, where `reader` is its only reader
    besides token counts; else None."""
    if value.target is not operator.getitem or any(u is not reader and not token_count(u) for u in value.users):
        return None
    af = value.args[0]
    return af if af.target in _AF and af.args[0] is op and output_of(af) is value else None


def erase_producer(graph: torch.fx.Graph, value: torch.fx.Node, rows: torch.fx.Node) -> None:
    """Erase `value` (an op's output whose reader is gone) and its op; its token counts read
    `rows` instead, a value of the same token count made before them."""
    for count in [u for u in value.users if token_count(u)]:
        count.replace_input_with(value, rows)
    producer = value.args[0]
    graph.erase_node(value)
    graph.erase_node(producer)


# ---- CSE of pure ops -----------------------------------------------------------------------

_ALLOCATORS = (aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided)


def _pure(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    t = node.target
    if t is operator.getitem:
        return True
    if not isinstance(t, torch._ops.OpOverload):
        return False
    if t._schema.is_mutable or torch.Tag.nondeterministic_seeded in t.tags:
        return False
    if t.overloadpacket in _ALLOCATORS:           # fresh buffers stay distinct
        return False
    return t.namespace in ("aten", "prims")


_VIEWS = {aten.slice.Tensor, aten.select.int, aten.reshape.default, aten.view.default,
          aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default,
          aten.as_strided.default, aten.t.default, aten.transpose.int}
_AF = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)


def _view_of_mutated(node: torch.fx.Node) -> bool:
    """A view whose base is a value a mutating op produced (an auto_functionalized output)."""
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[0], torch.fx.Node) and node.args[0].target in _AF)


def dedupe_replayed_views(graph: torch.fx.Graph) -> int:
    """Functionalization replays every view of a mutated buffer from its base, once per use
    (`o[..., -16:]` twice for the two halves of RoPE); merge those copies so the model's own
    patterns, which take the view once, match."""
    return cse(graph, lambda n: n.target in _VIEWS and _view_of_mutated(n))


def cse(graph: torch.fx.Graph, keep=None) -> int:
    """Merge pure ATen/prims nodes with the same target and arguments (the model quantizes the
    same activation once per GEMM reading it); returns the number of nodes removed."""
    seen: dict = {}
    removed = 0
    for n in list(graph.nodes):
        if not _pure(n) or (keep is not None and not keep(n)):
            continue
        try:
            key = (n.target, _freeze(n.args), _freeze(n.kwargs))
            hash(key)
        except TypeError:
            continue
        prev = seen.get(key)
        if prev is None:
            seen[key] = n
            continue
        n.replace_all_uses_with(prev)
        graph.erase_node(n)
        removed += 1
    return removed


def _freeze(a):
    if isinstance(a, (list, tuple)):
        return (type(a).__name__,) + tuple(_freeze(x) for x in a)
    if isinstance(a, dict):
        return ("dict",) + tuple((k, _freeze(v)) for k, v in sorted(a.items()))
    if isinstance(a, torch.fx.Node):
        return ("node", id(a))
    if isinstance(a, float):
        return ("float", a, str(a))        # 0.0 and -0.0 differ
    if isinstance(a, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return (type(a).__name__, str(a))
    return (type(a).__name__, a)
