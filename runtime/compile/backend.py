"""The Dynamo backend of one segment: its graph split per layer (passes/split.py), each distinct
layer piece compiled once (Inductor with the v41 passes, or Inductor's graph pipeline without code
generation, `post_grad_eager`), identical pieces reusing it by their structural key. With
splitting ops (TR_HYBRID) the pieces of those ops stay eager FX modules, and every compiled token
piece is installed behind a PieceGraph of its own (runtime/compile/piece_graphs.py)."""
from __future__ import annotations

import contextlib
import hashlib
import logging
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from runtime.compile.config import CompileConfig
from runtime.compile.debug import _dump_context
from runtime.cuda_graph import piece_boundary

log = logging.getLogger("v41.compile")


def _node_key(n, ids):
    def norm(a):
        if isinstance(a, torch.fx.Node):
            return ("node", ids[a])
        if isinstance(a, (list, tuple)):
            return (type(a).__name__, tuple(norm(x) for x in a))
        if isinstance(a, dict):
            return ("dict", tuple((k, norm(v)) for k, v in a.items()))
        if isinstance(a, torch.Tensor):
            return ("tensor", id(a))
        return repr(a)
    if n.op == "placeholder":
        target = "input"           # by position: names carry the layer (X_7, X_9, ...)
    elif isinstance(n.target, str):
        target = n.target
    else:
        target = f"{getattr(n.target, '__module__', '')}.{getattr(n.target, '__qualname__', repr(n.target))}" \
            f"#{id(n.target)}"
    return (n.op, target, norm(n.args), norm(n.kwargs))


def _arg_meta(a):
    if isinstance(a, torch.Tensor):
        return ("T", tuple(str(s) for s in a.shape), tuple(str(s) for s in a.stride()), str(a.dtype),
                str(a.device))
    if isinstance(a, torch.SymInt):
        return ("S", str(a))
    return ("C", repr(a))


def piece_key(gm: torch.fx.GraphModule, args) -> str:
    """Structural identity of a piece: its graph with nodes numbered, constants by value (get_attr
    tensors by identity) and its inputs' metadata (symbolic sizes by expression)."""
    ids = {n: i for i, n in enumerate(gm.graph.nodes)}
    nodes = [_node_key(n, ids) for n in gm.graph.nodes]
    consts = [(n.target, id(getattr(gm, n.target, None))) for n in gm.graph.nodes if n.op == "get_attr"]
    return hashlib.sha256(repr((nodes, consts, [_arg_meta(a) for a in args])).encode()).hexdigest()


@dataclass
class PieceStats:
    name: str
    key: str
    reused: bool
    seconds: float


class PiecewiseBackend:
    """The Dynamo backend of one segment (see the module docstring)."""

    def __init__(self, segment: str, ccfg: CompileConfig, pass_manager=None, piece_graphs=None):
        """`piece_graphs`: a PieceGraphs (TR_HYBRID) that gets each token piece's call site."""
        self.segment, self.ccfg, self.pass_manager = segment, ccfg, pass_manager
        self.piece_graphs = piece_graphs
        self.compiled: dict[str, Callable] = {}
        self.stats: list[PieceStats] = []
        self.graphs = 0
        self.installed: list[tuple] = []     # (split module, target, Dynamo piece): piece_check.py

    def dump_path(self, *parts) -> Path | None:
        if not self.ccfg.dump_dir:
            return None
        p = Path(self.ccfg.dump_dir, self.segment, *parts)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from passes.split import split_by_layer
        self.graphs += 1
        if p := self.dump_path("computation_graph.py"):
            p.write_text(gm.print_readable(print_output=False, include_stride=True))
        split_gm, pieces = split_by_layer(gm, self.ccfg.splitting_ops)
        log.info("%s: Dynamo graph of %d nodes, %d pieces", self.segment, len(gm.graph.nodes),
                 sum(map(_compiled, pieces.values())))
        if p := self.dump_path("split_graph.py"):
            p.write_text(split_gm.print_readable(print_output=False))
        # each piece's inputs carry Dynamo's example values (split_module copies node meta onto
        # the placeholders); without them, propagate fake values through the split module
        todo = [(n.target, self._piece_inputs(getattr(split_gm, n.target)))
                for n in split_gm.graph.nodes if n.op == "call_module" and _compiled(pieces[n.target])]
        if all(args is not None for _, args in todo):
            for target, args in todo:
                self.install(split_gm, target, args, pieces[target])
        else:
            self._compile_by_propagation(gm, split_gm, pieces)
        return split_gm

    def summary(self) -> dict:
        """Dynamo graphs, pieces, how many compiled and reused, compile seconds."""
        return {"graphs": self.graphs, "pieces": len(self.stats), "compiled": sum(not s.reused for s in self.stats),
                "reused": sum(s.reused for s in self.stats), "seconds": round(sum(s.seconds for s in self.stats), 2)}

    def install(self, split_gm, target: str, args, name: str) -> None:
        """The compiled piece in place of its submodule (behind a PieceGraph with TR_HYBRID)."""
        sub = getattr(split_gm, target)
        fn = self.compile_piece(sub, args, target, name)
        fn = _boundary(fn)
        if self.piece_graphs is not None:
            fn = self.piece_graphs.add(fn, args, f"{self.segment}.{target}.{name}")
        split_gm.__dict__[target] = fn
        self.installed.append((split_gm, target, sub))

    @staticmethod
    def _piece_inputs(sub: torch.fx.GraphModule):
        args = []
        for ph in sub.graph.find_nodes(op="placeholder"):
            if "example_value" not in ph.meta:
                return None
            args.append(ph.meta["example_value"])
        return args

    def _compile_by_propagation(self, gm, split_gm, pieces) -> None:
        fake_args = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
        # Dynamo's own fake mode (the tracing context holds a fresh one for the backend; AOT
        # re-fakes these inputs into it)
        fake_mode = next((a.fake_mode for a in fake_args if hasattr(a, "fake_mode")), None)
        backend = self

        class Compiler(torch.fx.Interpreter):
            def call_module(self, target, args, kwargs):
                out = super().call_module(target, args, kwargs)
                if _compiled(pieces[target]):
                    backend.install(self.module, target, args, pieces[target])
                return out

        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            Compiler(split_gm).run(*fake_args)

    def compile_piece(self, gm, args, target: str, name: str):
        t0 = time.perf_counter()
        key = piece_key(gm, args)
        if key in self.compiled:
            self.stats.append(PieceStats(name, key[:12], True, time.perf_counter() - t0))
            return self.compiled[key]
        label = f"{target}.{_slug(name)}"
        log.info("%s: compiling %s (%d nodes)", self.segment, label, len(gm.graph.nodes))
        single = _make_tuple_output(gm)
        if self.ccfg.backend == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager
            fn = aot_eager(gm, list(args))
        elif self.ccfg.backend == "post_grad_eager":
            fn = post_grad_eager(gm, list(args), self.pass_manager)
        else:
            fn = self._inductor(gm, list(args), label)
        if single:
            inner = fn

            def fn(*a):
                return inner(*a)[0]
        self.compiled[key] = fn
        self.stats.append(PieceStats(name, key[:12], False, time.perf_counter() - t0))
        log.info("%s: compiled %s in %.1fs (%d distinct so far)", self.segment, label,
                 self.stats[-1].seconds, len(self.compiled))     # progress of a long compile
        return fn

    def _inductor(self, gm, args, label: str):
        from torch._inductor.compile_fx import compile_fx
        patches: dict = {}
        if self.pass_manager is not None:
            patches["joint_custom_pre_pass"] = self.pass_manager
        dump = self.dump_path(label, "x")
        nocache = contextlib.nullcontext()
        if dump is not None:      # a cache hit would skip the passes and the code generation
            nocache = torch.compiler.config.patch(force_disable_caches=True)
            (dump.parent / "piece_graph.py").write_text(gm.print_readable(print_output=False))
        with nocache, _dump_context(self.pass_manager, dump.parent if dump else None):
            return compile_fx(gm, args, config_patches=patches)


def _boundary(fn):
    """The piece, announced first to a FULL graph chain being captured (a possible cut point)."""
    def piece(*args):
        piece_boundary()
        return fn(*args)
    return piece


def _drop_all_guards(entries):
    return [False] * len(entries)


def _fresh_function(fn, tag: str):
    """`fn` with a code object of its own: Dynamo keeps its cache on the code object, so this
    compiled segment never sees another's cache entries (which, guards dropped, it would run)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}__{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def compile_segment(name: str, forward, tag: str, ccfg: CompileConfig, pass_manager=None, piece_graphs=None,
                    pieces: dict | None = None) -> tuple:
    """torch.compile of a segment's `forward` under a code object of its own (`tag`): one graph,
    guards dropped unless `ccfg` keeps them, the backend `ccfg` names (a callable, "eager", else
    a PiecewiseBackend for segment `name`; `pieces`: the dict of compiled pieces it shares).
    Returns (compiled function, the function Dynamo caches on, backend)."""
    if callable(ccfg.backend) and not isinstance(ccfg.backend, str):
        backend = ccfg.backend
    elif ccfg.backend == "eager":
        backend = "eager"
    else:
        backend = PiecewiseBackend(name, ccfg, pass_manager, piece_graphs)
        if pieces is not None:
            backend.compiled = pieces
    raw = _fresh_function(forward, tag)
    options = {"guard_filter_fn": _drop_all_guards} if ccfg.drop_guards else None
    return torch.compile(raw, backend=backend, fullgraph=True, dynamic=False, options=options), raw, backend


def post_grad_eager(gm: torch.fx.GraphModule, args, pass_manager=None):
    """Inductor's graph pipeline without its code generation (tests, pass debugging): AOT with
    Inductor's decompositions, its joint-graph passes with `pass_manager` as the custom pre pass,
    its post-grad passes (so also reinplacing and the decomposition of functionalized
    mutations), then the resulting ATen graph runs as a plain FX module (called as a module, so
    its forward hooks run: tests record a piece's inputs with one). No C++/Triton build."""
    from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func
    from torch._inductor import config as inductor_config
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.fx_passes.post_grad import post_grad_passes, view_to_reshape
    from torch._inductor.virtualized import V

    def fw(g, example_inputs):
        mode = torch._guards.detect_fake_mode(example_inputs)
        with V.set_fake_mode(mode):
            with inductor_config.patch(joint_custom_pre_pass=pass_manager):
                joint_graph_passes(g)
            view_to_reshape(g)
            post_grad_passes(g, is_inference=True)
        g.recompile()
        return make_boxed_func(g)

    return aot_module_simplified(gm, args, fw_compiler=fw, decompositions=select_decomp_table(),
                                 keep_inference_input_mutations=True)


def _make_tuple_output(gm: torch.fx.GraphModule) -> bool:
    """Make a piece return a tuple (what AOT wants); True when it returned one value."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if isinstance(out.args[0], (tuple, list)):
        return False
    out.args = ((out.args[0],),)
    gm.recompile()
    return True


def _compiled(name: str) -> bool:
    """Pieces that are compiled: not the hoisted views, not a run of splitting ops."""
    from passes.split import VIEWS, is_eager
    return name != VIEWS and not is_eager(name)


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name).strip("_")

