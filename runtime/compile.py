"""Compile the plain-PyTorch model: segments, one trace each, passes, caches, dumps.

DESIGN.md §5: only the token dimension is dynamic, the runtime compiles once, and a recompile
while serving is an error. What this module does:

* Segments. With decoder SWA bounded replay on (the default) the forward is two compiled graphs
  with two layers between and after them (Flash numbering; derived from the topology for any
  config: `boundary` = the last kv source, `last` = the last backbone layer):

      _EarlyLayers   embedding + layers [0, boundary)           compiled
      layer boundary                                              eager
      _LateLayers    layers (boundary, last)                      compiled
      layer last, final collapse + norm                           eager

  With it off, `_Backbone` (the whole `Transformer.forward`) is one graph. NOTE: bounded
  replay itself (running layers boundary+1..last on the last W rows of a finishing prompt only)
  is NOT implemented yet: today the split only decides the graph boundaries, every layer runs on
  every row, and the split forward equals the unsplit one.

* One trace per segment. `torch.compile(fullgraph=True, dynamic=False)` with dim 0 of every
  token-shaped input marked dynamic (and `backed_size_oblivious`, so a 1-token step needs no
  0/1 specialization); every other size is static. Dynamo guards are dropped
  (`guard_filter_fn`), so a call never re-evaluates or recompiles; after warm-up every call
  runs under `torch.compiler.set_stance("fail_on_recompile")`. Each compiled segment gets a
  code object of its own, so two configurations never share a Dynamo cache entry; engines
  with the same `compile_key` (same config, dtype, device, capacities, compile settings) share
  the traced segments (the graphs read weights and caches from the module they are called
  with).

* Backend. The segment's Dynamo graph is split per layer (`passes/split.py`); each distinct
  layer piece goes through Inductor once, with the v41 passes installed
  (`passes/manager.py`); identical pieces (same role) reuse that compiled callable. Inductor's
  own caches (FX graph, AOTAutograd, C++/Triton kernels) live under the compile cache
  directory, so a second process finds them.

* Cache directory (`python -m v41.prebuild`): `<compile_cache_dir>/<key>/` where key hashes
  the config, the model/pass/op source files, the split points, the warm-up (capture) sizes,
  torch/triton/aiter versions and the device arch; `TORCHINDUCTOR_CACHE_DIR` and
  `TRITON_CACHE_DIR` point inside it. A file lock serializes builders; `READY` marks a
  complete build. Serving reports a cold or a warm start.

* Dumps (`dump_dir`): computation graph of each segment, the split, each pass's graph before
  and after (`post_grad.<i>.<pass>.{before,after}.py`) and match counts per piece, the Inductor
  output code of each piece, and depyf's decompiled Dynamo bytecode when depyf is installed
  (`depyf.prepare_debug`; never the interactive `depyf.debug`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import platform
import threading
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

log = logging.getLogger("v41.compile")

REPO = Path(__file__).resolve().parent.parent
# the source files whose code is traced or shapes the compiled graphs (hashed into the key)
TRACED_SOURCES = ("v41/model.py", "v41/attention.py", "v41/moe.py", "v41/layers.py", "v41/quant.py",
                  "v41/engram/device.py", "runtime/compile.py", "runtime/model_runner.py")
SEGMENTS = ("_Backbone", "_EarlyLayers", "_LateLayers")
# EngineArgs fields that cannot change a compiled graph (every other field is in the key: opt-out,
# so a new engine setting is keyed until someone decides otherwise). The model is keyed by its
# config, the device by its arch, the compile settings by CompileConfig.
NOT_KEYED = {"model", "device", "seed", "load_format", "max_prefill_chunk", "speculative_method",
             "enforce_eager", "compilation_level", "decoder_swa_bounded_replay", "compile_cache_dir",
             "capture_sizes", "dump_dir", "extra"}


@dataclass(frozen=True)
class CompileConfig:
    """How the runner's forward is compiled. `level` 0 = eager, 3 = compiled."""
    level: int = 3
    split: bool = True                     # decoder SWA bounded replay: _EarlyLayers/_LateLayers
    backend: Any = "inductor"              # inductor | post_grad_eager | aot_eager | eager | a callable
    passes: bool = True                    # the v41 passes (inductor, post_grad_eager)
    fused_lowering: str = "auto"           # BackendSelection policy: auto | op | inline
    drop_guards: bool = True               # False: keep Dynamo guards (tests count recompiles)
    dump_dir: str | None = None
    cache_dir: str | None = None           # root of the keyed compile cache directories
    capture_sizes: tuple = ()              # token counts warmed up (later: CUDA-graph capture)

    @classmethod
    def from_engine_args(cls, args, max_tokens: int) -> "CompileConfig | None":
        """None when the engine runs the eager model."""
        if args.enforce_eager or args.compilation_level == 0:
            return None
        sizes = parse_sizes(args.capture_sizes, max_tokens)
        return cls(level=args.compilation_level, split=args.decoder_swa_bounded_replay,
                   dump_dir=args.dump_dir, cache_dir=args.compile_cache_dir or default_cache_root(),
                   capture_sizes=sizes, fused_lowering=os.environ.get("V41_FUSED_LOWERING", "auto"))


def parse_sizes(spec, max_tokens: int) -> tuple:
    """"1,2,4" -> (1, 2, 4); default: 1, 2, 4, 8 and the step budget."""
    if spec is None or spec == "":
        sizes = [s for s in (1, 2, 4, 8) if s < max_tokens] + [max_tokens]
    elif isinstance(spec, str):
        sizes = [int(s) for s in spec.split(",") if s.strip()]
    else:
        sizes = [int(s) for s in spec]
    bad = [s for s in sizes if not 1 <= s <= max_tokens]
    if bad:
        raise ValueError(f"capture_sizes: {bad} not in [1, max_num_batched_tokens = {max_tokens}]")
    return tuple(sorted(set(sizes)))


def default_cache_root() -> str:
    return os.environ.get("V41_COMPILE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "v41", "compile")


# ---- segments ------------------------------------------------------------------------------

@dataclass(frozen=True)
class SplitPoints:
    """Layers of each part of the forward (any topology): early [0, boundary), the boundary
    layer (eager), late (boundary, last), the last layer (eager)."""
    boundary: int
    last: int

    @classmethod
    def of(cls, cfg) -> "SplitPoints":
        topo = cfg.topology
        return cls(topo.boundary, topo.n_backbone - 1)

    @property
    def early(self) -> range:
        return range(0, self.boundary)

    @property
    def late(self) -> range:
        return range(self.boundary + 1, self.last)

    @property
    def eager(self) -> tuple:
        return tuple(sorted({self.boundary, self.last}))


def embed(model, batch):
    """The head of `Transformer.forward`: residual streams and the first collapse weights."""
    X = model.embed[batch.input_ids].unsqueeze(1).expand(-1, model.hc, -1).contiguous()
    pre = torch.zeros(X.shape[0], model.hc, dtype=_acc(model.dtype), device=X.device)
    pre[:, 0] = 1
    return X, pre


def final(model, X, pre):
    """The tail of `Transformer.forward`: the last collapse and norm."""
    from v41.model import collapse
    return model.norm(collapse(X, pre))


def _acc(dtype):
    from v41.layers import acc_dtype
    return acc_dtype(dtype)


class _Backbone(nn.Module):
    """The whole forward, one graph (bounded replay off)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch, cache):
        return self.model(batch, cache)


class _EarlyLayers(nn.Module):
    """Embedding and the encoder below the boundary layer (0..19 in Flash)."""

    def __init__(self, model, layers: range):
        super().__init__()
        self.embed, self.hc, self.dtype = model.embed, model.hc, model.dtype
        self.layers = nn.ModuleList(model.layers[i] for i in layers)

    def forward(self, batch, cache, sel):
        X, pre = embed(self, batch)
        for block in self.layers:
            X, pre = block(X, pre, batch, cache, sel)
        return X, pre


class _LateLayers(nn.Module):
    """The decoder between the boundary and the last layer (21..38 in Flash)."""

    def __init__(self, model, layers: range):
        super().__init__()
        self.layers = nn.ModuleList(model.layers[i] for i in layers)

    def forward(self, X, pre, batch, cache, sel):
        for block in self.layers:
            X, pre = block(X, pre, batch, cache, sel)
        return X, pre


def split_forward(model, batch, cache, early: Callable, late: Callable | None, points: SplitPoints):
    """The forward as segments: `early`/`late` are the (compiled or eager) segment callables."""
    sel: dict = {}
    X, pre = early(batch, cache, sel)
    X, pre = model.layers[points.boundary](X, pre, batch, cache, sel)
    if late is not None:
        X, pre = late(X, pre, batch, cache, sel)
    if points.last != points.boundary:
        X, pre = model.layers[points.last](X, pre, batch, cache, sel)
    return final(model, X, pre)


# ---- dynamic dims --------------------------------------------------------------------------

def token_tensors(batch, *extra) -> list:
    """Every tensor whose dim 0 is the token count: the batch's per-token fields, the Engram
    rows, and `extra` (X, pre, sel values)."""
    out = [batch.input_ids, batch.positions, batch.batch_ids, batch.win_idx, batch.ring_dest,
           batch.tail_src, batch.tail_dst]
    out += list(batch.owner_dest.values()) + list(batch.engram_rows.values())
    if getattr(batch, "image_dest", None) is not None:
        out.append(batch.image_dest)
    for e in extra:
        if isinstance(e, dict):
            out += [v for v in e.values() if isinstance(v, torch.Tensor)]
        elif isinstance(e, torch.Tensor):
            out.append(e)
    return out


def mark_tokens(batch, *extra) -> None:
    for t in token_tensors(batch, *extra):
        torch._dynamo.maybe_mark_dynamic(t, 0)


def _drop_all_guards(entries):
    return [False] * len(entries)


def _fresh_function(fn, tag: str):
    """`fn` with a code object of its own: Dynamo keeps its cache on the code object, so this
    compiled segment never sees another's cache entries (which, guards dropped, it would run)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}__{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


# ---- the piecewise backend -----------------------------------------------------------------

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

    def __init__(self, segment: str, ccfg: CompileConfig, pass_manager=None):
        self.segment, self.ccfg, self.pass_manager = segment, ccfg, pass_manager
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
        from passes.split import VIEWS, split_by_layer
        self.graphs += 1
        if p := self.dump_path("computation_graph.py"):
            p.write_text(gm.print_readable(print_output=False, include_stride=True))
        split_gm, pieces = split_by_layer(gm)
        log.info("%s: Dynamo graph of %d nodes, %d pieces", self.segment, len(gm.graph.nodes),
                 sum(v != VIEWS for v in pieces.values()))
        if p := self.dump_path("split_graph.py"):
            p.write_text(split_gm.print_readable(print_output=False))
        # each piece's inputs carry Dynamo's example values (split_module copies node meta onto
        # the placeholders); without them, propagate fake values through the split module
        todo = [(n.target, self._piece_inputs(getattr(split_gm, n.target)))
                for n in split_gm.graph.nodes if n.op == "call_module" and pieces[n.target] != VIEWS]
        if all(args is not None for _, args in todo):
            for target, args in todo:
                sub = getattr(split_gm, target)
                split_gm.__dict__[target] = self.compile_piece(sub, args, target, pieces[target])
                self.installed.append((split_gm, target, sub))
        else:
            self._compile_by_propagation(gm, split_gm, pieces)
        return split_gm

    @staticmethod
    def _piece_inputs(sub: torch.fx.GraphModule):
        args = []
        for ph in sub.graph.find_nodes(op="placeholder"):
            if "example_value" not in ph.meta:
                return None
            args.append(ph.meta["example_value"])
        return args

    def _compile_by_propagation(self, gm, split_gm, pieces) -> None:
        from passes.split import VIEWS
        fake_args = [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]
        # Dynamo's own fake mode (the tracing context holds a fresh one for the backend; AOT
        # re-fakes these inputs into it)
        fake_mode = next((a.fake_mode for a in fake_args if hasattr(a, "fake_mode")), None)
        backend = self

        class Compiler(torch.fx.Interpreter):
            def call_module(self, target, args, kwargs):
                sub = self.fetch_attr(target)
                out = super().call_module(target, args, kwargs)
                if pieces[target] != VIEWS:
                    self.module.__dict__[target] = backend.compile_piece(sub, args, target, pieces[target])
                    backend.installed.append((self.module, target, sub))
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


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name).strip("_")


@contextlib.contextmanager
def _dump_context(pass_manager, directory: Path | None):
    """Route the pass manager's before/after dumps and Inductor's output code to `directory`."""
    if directory is None:
        yield
        return
    from torch._inductor.graph import GraphLowering
    prev_hook = GraphLowering.save_output_code
    n = [0]

    def save(code: str):
        name = "output_code.py" if n[0] == 0 else f"output_code.{n[0]}.py"
        (directory / name).write_text(code)
        n[0] += 1

    GraphLowering.save_output_code = save
    prev_dir = pass_manager.set_dump_dir(directory) if pass_manager is not None else None
    try:
        yield
    finally:
        GraphLowering.save_output_code = prev_hook
        if pass_manager is not None:
            pass_manager.set_dump_dir(prev_dir)


# ---- keys and cache directories -----------------------------------------------------------

def _file_hash(paths) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(Path(p).relative_to(REPO)).encode())
        h.update(Path(p).read_bytes())
    return h.hexdigest()


def source_hashes() -> dict:
    """Content hashes of what the compiled graphs are made from: traced model code, pass files,
    op files (schemas, fake and reference impls, kernels)."""
    return {
        "model": _file_hash(REPO / f for f in TRACED_SOURCES),
        "passes": _file_hash((REPO / "passes").glob("*.py")),
        "ops": _file_hash((REPO / "custom_ops").rglob("*.py")),
    }


def _version(mod: str) -> str | None:
    try:
        m = __import__(mod)
        return getattr(m, "__version__", "unknown")
    except Exception:  # noqa: BLE001  (absent or broken: not part of this build)
        return None


def device_arch(device) -> str:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        arch = getattr(props, "gcnArchName", None) or "sm_%d%d" % (props.major, props.minor)
        return f"cuda:{arch}"
    return f"{device.type}:{platform.machine()}"


def key_factors(cfg, args, ccfg: CompileConfig, device) -> dict:
    """Everything a compiled graph depends on, as plain JSON values. Changing any one of them
    gives a new cache directory (tests/test_compile.py checks each)."""
    points = SplitPoints.of(cfg)
    return {
        "config": cfg.to_hf_dict(),
        "runtime": {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
                    if f.name not in NOT_KEYED},
        "compile": {"level": ccfg.level, "backend": str(ccfg.backend), "passes": ccfg.passes,
                    "fused_lowering": ccfg.fused_lowering},
        "split": ({"segments": ["_EarlyLayers", "_LateLayers"], "early": [0, points.boundary],
                   "late": [points.boundary + 1, points.last], "eager": list(points.eager)}
                  if ccfg.split else {"segments": ["_Backbone"]}),
        "capture_sizes": list(ccfg.capture_sizes),
        "sources": source_hashes(),
        "versions": {"torch": torch.__version__, "triton": _version("triton"), "aiter": _version("aiter"),
                     "python": platform.python_version()},
        "device": device_arch(device),
    }


def compile_key(factors: dict) -> str:
    return hashlib.sha256(json.dumps(factors, sort_keys=True, default=str).encode()).hexdigest()[:16]


class CacheDir:
    """`<root>/<key>/` with a lock and a READY marker; Inductor and Triton caches inside."""

    def __init__(self, root: str, factors: dict):
        self.factors, self.key = factors, compile_key(factors)
        self.path = Path(root) / self.key
        self.ready_file = self.path / "READY"

    @property
    def ready(self) -> bool:
        return self.ready_file.exists()

    def activate(self) -> None:
        """Point Inductor's and Triton's caches into this directory (before any compile)."""
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "factors.json").write_text(json.dumps(self.factors, indent=1, sort_keys=True, default=str))
        ind = str(self.path / "inductor")
        if os.environ.get("TORCHINDUCTOR_CACHE_DIR") != ind:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = ind
            os.environ["TRITON_CACHE_DIR"] = str(self.path / "triton")
            try:      # in-memory caches keyed by the old directory
                from torch._inductor.utils import clear_caches
                clear_caches()
            except Exception as e:  # noqa: BLE001  (absent in some torch versions: nothing to clear)
                log.debug("inductor clear_caches unavailable: %s", e)

    def lock(self):
        from filelock import FileLock
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.path) + ".lock")

    def mark_ready(self, info: dict) -> None:
        tmp = self.ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=1, default=str))
        tmp.replace(self.ready_file)


# ---- the compiled forward ------------------------------------------------------------------

_SHARED: dict[str, dict] = {}        # compile_key -> {segment name: compiled function}
_SHARED_LOCK = threading.Lock()


def static_signature(model, cache) -> str:
    """Shapes, strides and dtypes of every tensor the graphs read besides the per-step batch:
    weights (module tensor attributes) and cache planes. Segments traced for one signature are
    only shared with a model of the same signature."""
    h = hashlib.sha256()
    for name, m in model.named_modules():
        for k, v in sorted(vars(m).items()):
            if isinstance(v, torch.Tensor):
                h.update(f"{name}.{k}:{tuple(v.shape)}:{v.stride()}:{v.dtype}:{v.device.type}".encode())
            elif isinstance(v, (int, float, str, bool)) and not k.startswith("_"):
                h.update(f"{name}.{k}={v!r}".encode())
    for k, v in sorted(vars(cache).items()):
        if isinstance(v, torch.Tensor):
            h.update(f"cache.{k}:{tuple(v.shape)}:{v.dtype}".encode())
    for o, planes in sorted(cache.owners.items()):
        for k, v in sorted(vars(planes).items()):
            h.update(f"owner{o}.{k}:{tuple(v.shape) if isinstance(v, torch.Tensor) else v}".encode())
    return h.hexdigest()


class CompiledForward:
    """`runner.forward` when compiled: same call and result as `Transformer.forward`."""

    def __init__(self, model, cache, ccfg: CompileConfig, share_key: str | None = None, pass_manager=None):
        """`share_key`: engines with the same key (and weights/cache shapes) share the traced
        segments. `pass_manager`: a PassManager to use instead of the default one."""
        from passes.manager import PassManager
        self.model, self.ccfg = model, ccfg
        self.points = SplitPoints.of(model.cfg)
        self.warm = False
        self.pass_manager = pass_manager
        if pass_manager is None and ccfg.backend in ("inductor", "post_grad_eager") and ccfg.passes:
            self.pass_manager = PassManager(model.cfg, model.dtype, lowering=ccfg.fused_lowering)
        if ccfg.split:
            pts = self.points
            self.segments = {"_EarlyLayers": _EarlyLayers(model, pts.early)}
            if len(pts.late):
                self.segments["_LateLayers"] = _LateLayers(model, pts.late)
        else:
            self.segments = {"_Backbone": _Backbone(model)}
        self.backends: dict[str, Any] = {}
        self.raw: dict[str, Callable] = {}       # the segment functions Dynamo caches on
        sig = static_signature(model, cache)
        shared = None
        if share_key is not None:
            with _SHARED_LOCK:
                shared = _SHARED.get(share_key)
                if shared is not None and shared["signature"] != sig:
                    shared = None
        if shared is not None:
            self.fns, self.backends, self.pass_manager = shared["fns"], shared["backends"], shared["passes"]
            self.raw = shared["raw"]
            self.warm = shared["warm"]
            self.shared = True
        else:
            self.fns = {name: self._compile(name, seg) for name, seg in self.segments.items()}
            self.shared = False
            if share_key is not None:
                with _SHARED_LOCK:
                    _SHARED[share_key] = {"signature": sig, "fns": self.fns, "backends": self.backends,
                                          "passes": self.pass_manager, "raw": self.raw, "warm": False}
        self._share_key = share_key

    def _compile(self, name: str, seg: nn.Module):
        ccfg = self.ccfg
        if callable(ccfg.backend) and not isinstance(ccfg.backend, str):
            backend = ccfg.backend
        elif ccfg.backend == "eager":
            backend = "eager"
        else:
            backend = PiecewiseBackend(name, ccfg, self.pass_manager)
        self.backends[name] = backend
        fn = _fresh_function(type(seg).forward, f"{name}_{id(self):x}")
        self.raw[name] = fn
        options = {"guard_filter_fn": _drop_all_guards} if ccfg.drop_guards else None
        return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False, options=options)

    # -- calling --
    def _call(self, name: str, *args):
        seg = self.segments[name]
        return self.fns[name](seg, *args)

    def __call__(self, batch, cache):
        ctx = (torch.compiler.set_stance("fail_on_recompile") if self.warm
               else torch.fx.experimental._config.patch(backed_size_oblivious=True))
        with ctx:
            if not self.warm:
                mark_tokens(batch)
            if "_Backbone" in self.segments:
                return self._call("_Backbone", batch, cache)
            late = None
            if "_LateLayers" in self.segments:
                def late(X, pre, b, c, sel):
                    if not self.warm:
                        mark_tokens(b, X, pre, sel)
                    return self._call("_LateLayers", X, pre, b, c, sel)
            return split_forward(self.model, batch, cache, lambda b, c, s: self._call("_EarlyLayers", b, c, s),
                                 late, self.points)

    def finish_warmup(self) -> None:
        """From now on a recompile is an error."""
        self.warm = True
        if self._share_key is not None:
            with _SHARED_LOCK:
                if self._share_key in _SHARED:
                    _SHARED[self._share_key]["warm"] = True

    def stats(self) -> dict:
        out = {}
        for name, be in self.backends.items():
            if isinstance(be, PiecewiseBackend):
                out[name] = {"graphs": be.graphs, "pieces": len(be.stats),
                             "compiled": sum(not s.reused for s in be.stats),
                             "reused": sum(s.reused for s in be.stats),
                             "seconds": round(sum(s.seconds for s in be.stats), 2)}
        if self.pass_manager is not None:
            out["matches"] = self.pass_manager.totals()
        return out


def padding_batch(runner, tokens: int):
    """A step of `tokens` padding rows and no request: reads and writes nothing (DESIGN §5
    "Padding is inert"); used to trace and warm the compiled segments."""
    from runtime.model_runner import Batch
    if not 1 <= tokens <= runner.max_tokens:
        raise ValueError(f"padding batch of {tokens} rows: capacity is {runner.max_tokens}")
    pad = {"input_ids": 0, "positions": 0}
    v = {}
    for k in ("input_ids", "positions", "batch_ids", "win_idx", "ring_dest", "tail_src", "tail_dst",
              "dest1", "dest2"):
        v[k] = runner.buf[k][:tokens].fill_(pad.get(k, -1))
    bt = runner.block_table_rows(1)
    bt.fill_(0)
    rows = {l: b[:tokens].zero_() for l, b in runner.engram_buf.items()}
    image = runner.image_rows([], runner.buf["image_dest"][:tokens].fill_(-1))
    return Batch(v["input_ids"], v["positions"], v["batch_ids"], bt, v["win_idx"], v["ring_dest"],
                 {1: v["dest1"], 2: v["dest2"]}, v["tail_src"], v["tail_dst"], rows, image)


def compile_runner(runner, args, ccfg: CompileConfig) -> dict:
    """Compile `runner`'s forward (or reuse a prebuilt cache), warm every capture size and switch
    to fail_on_recompile. Returns a report: cold/warm start, seconds, cache directory, stats."""
    t0 = time.perf_counter()
    factors = key_factors(runner.cfg, args, ccfg, runner.device)
    cdir = CacheDir(ccfg.cache_dir or default_cache_root(), factors)
    cdir.activate()
    was_ready = cdir.ready
    with cdir.lock():
        was_ready = was_ready or cdir.ready
        runner.static_shapes = True
        fwd = CompiledForward(runner.model, runner.cache, ccfg, share_key=cdir.key)
        runner.forward = fwd
        sizes = ccfg.capture_sizes or (runner.max_tokens,)
        depyf_ctx = _depyf(ccfg.dump_dir) if ccfg.dump_dir and not fwd.warm else contextlib.nullcontext()
        with torch.inference_mode():
            if not fwd.warm:
                with depyf_ctx:
                    fwd(padding_batch(runner, max(sizes)), runner.cache)     # the one trace
                fwd.finish_warmup()
            for s in sizes:
                fwd(padding_batch(runner, s), runner.cache)
        seconds = time.perf_counter() - t0
        report = {"start": "warm" if was_ready else "cold", "seconds": round(seconds, 2),
                  "cache_dir": str(cdir.path), "key": cdir.key, "capture_sizes": list(sizes),
                  "shared_trace": fwd.shared, "segments": list(fwd.segments), "stats": fwd.stats()}
        if not cdir.ready:
            cdir.mark_ready({"built_seconds": round(seconds, 2), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                             "segments": list(fwd.segments), "stats": report["stats"]})
    if ccfg.dump_dir:
        Path(ccfg.dump_dir).mkdir(parents=True, exist_ok=True)
        Path(ccfg.dump_dir, "compile_report.json").write_text(json.dumps(report, indent=1, default=str))
        if fwd.pass_manager is not None:
            fwd.pass_manager.write_counts(Path(ccfg.dump_dir, "match_counts.json"))
    log.info("compile: %s start in %.1fs (%s, segments %s, cache %s)", report["start"], seconds,
             "trace shared" if fwd.shared else "traced", ", ".join(fwd.segments), cdir.path)
    return report


@contextlib.contextmanager
def _depyf(dump_dir: str):
    """depyf's dump of the Dynamo-transformed bytecode (decompiled), when depyf is installed."""
    try:
        import depyf
    except ImportError:
        yield
        return
    path = Path(dump_dir, "depyf")
    path.mkdir(parents=True, exist_ok=True)
    try:
        ctx = depyf.prepare_debug(str(path))
        ctx.__enter__()
    except Exception as e:  # noqa: BLE001  (depyf lags torch; a dump must not break a compile)
        log.warning("depyf unavailable for this torch: %s", e)
        yield
        return
    try:
        yield
    finally:
        try:
            ctx.__exit__(None, None, None)
        except Exception as e:  # noqa: BLE001
            log.warning("depyf dump incomplete: %s", e)
