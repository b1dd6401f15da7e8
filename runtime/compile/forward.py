"""The compiled forward: CompiledForward (the segments compiled once each, then called in order,
same call and result as `Transformer.forward`), TraceCache (traced segments shared on request),
and compile_runner, which installs it on a runner (traced and warmed on the runner's padding
batches) inside the keyed cache directory."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from runtime.compile.backend import PiecewiseBackend, compile_segment
from runtime.compile.cache import CacheDir, key_factors
from runtime.compile.config import CompileConfig
from runtime.compile.debug import _depyf
from runtime.compile.draft import compile_draft
from runtime.compile.piece_graphs import PieceGraphs
from runtime.compile.segments import (SplitPoints, _Backbone, _EarlyLayers, _LateLayers, _Layer, _QueryLayer,
                                      call_context, mark_queries, mark_tokens, split_forward)
from runtime.replay import DecoderRows
from v41.attention import QueryRows
from v41.keyed_dir import default_cache_root

log = logging.getLogger("v41.compile")


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("v41_trace_cache", default=None)


class TraceCache:
    """Traced segments shared by the compiled forwards that opt in: a forward with the key
    (compile_runner: the compile key) and the static signature of an earlier one reuses its
    compiled segment functions, backends and pass manager instead of tracing again (the graphs
    read weights and caches from the module they are called with). An engine traces its own
    segments unless given one: pass it to compile_runner, or make it the active one around code
    that builds engines (`with traces.active(): ...`; tests share one through a fixture)."""

    def __init__(self):
        self._entries: dict[str, dict] = {}
        self._lock = threading.Lock()

    def get(self, key: str, signature: str) -> dict | None:
        with self._lock:
            entry = self._entries.get(key)
        return entry if entry is not None and entry["signature"] == signature else None

    def put(self, key: str, entry: dict) -> None:
        with self._lock:
            self._entries[key] = entry

    def mark_warm(self, key: str) -> None:
        with self._lock:
            if key in self._entries:
                self._entries[key]["warm"] = True

    def __len__(self) -> int:
        return len(self._entries)

    @contextlib.contextmanager
    def active(self):
        """Within the block, compile_runner calls given no TraceCache use this one."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    @staticmethod
    def current() -> "TraceCache | None":
        return _ACTIVE.get()


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

    def __init__(self, model, cache, ccfg: CompileConfig, share_key: str | None = None, pass_manager=None,
                 traces: TraceCache | None = None):
        """`traces`, `share_key`: forwards with the same key (and weights/cache shapes) in one
        TraceCache share the traced segments. `pass_manager`: a PassManager to use instead of the
        default one."""
        from passes.manager import PassManager
        self.model, self.ccfg = model, ccfg
        self.points = SplitPoints.of(model.cfg)
        self.warm = False
        self.queries_traced = False
        self.pass_manager = pass_manager
        if pass_manager is None and ccfg.backend in ("inductor", "post_grad_eager") and ccfg.passes:
            self.pass_manager = PassManager(model.cfg, model.dtype, lowering=ccfg.fused_lowering)
        if ccfg.split:
            pts = self.points
            self.segments = {"_EarlyLayers": _EarlyLayers(model, pts.early)}
            if len(pts.late):
                self.segments["_LateLayers"] = _LateLayers(model, pts.late)
            for i in pts.single:
                self.segments[f"_Layer{i}"] = _Layer(model, i)
            if not ccfg.splitting_ops:     # TR_HYBRID's captures run no query row: its last layer stays eager
                self.segments[pts.query_segment] = _QueryLayer(model, pts.last)
        else:
            self.segments = {"_Backbone": _Backbone(model)}
        self.backends: dict[str, Any] = {}
        self.pieces: dict = {}                   # compiled pieces by piece key, shared by the segments' backends
        self.raw: dict[str, Callable] = {}       # the segment functions Dynamo caches on
        # TR_HYBRID: the token pieces' graphs, bound to this model's weights and this cache, so
        # such a forward never shares its trace
        self.piece_graphs = PieceGraphs() if ccfg.splitting_ops else None
        sig = static_signature(model, cache)
        if traces is None or self.piece_graphs is not None:
            share_key = None
        shared = traces.get(share_key, sig) if share_key is not None else None
        if shared is not None:
            self.fns, self.backends, self.pass_manager = shared["fns"], shared["backends"], shared["passes"]
            self.raw = shared["raw"]
            self.warm = shared["warm"]
            self.shared = True
        else:
            self.fns = {name: self._compile(name, seg) for name, seg in self.segments.items()}
            self.shared = False
            if share_key is not None:
                traces.put(share_key, {"signature": sig, "fns": self.fns, "backends": self.backends,
                                       "passes": self.pass_manager, "raw": self.raw, "warm": False})
        self._traces, self._share_key = traces, share_key

    def _compile(self, name: str, seg: nn.Module):
        # a layer role compiled once for every segment: the backends share one piece dict
        fn, self.raw[name], self.backends[name] = compile_segment(
            name, type(seg).forward, f"{name}_{id(self):x}", self.ccfg, self.pass_manager, self.piece_graphs,
            self.pieces)
        return fn

    # -- calling --
    def _call(self, name: str, *args):
        seg = self.segments[name]
        return self.fns[name](seg, *args)

    def _layers(self, name: str, X, pre, b, c, sel):
        """A segment of layers (_LateLayers, _Layer<i>), its token-shaped inputs marked dynamic
        while tracing."""
        if not self.warm:
            mark_tokens(b, X, pre, sel)
        return self._call(name, X, pre, b, c, sel)

    def _query_layer(self, i: int, X, pre, b, c, sel, queries):
        """_QueryLayer<i> (i: the last layer), its decoder rows and query rows marked dynamic while tracing."""
        if not self.warm:
            mark_tokens(b, X, pre, sel)
            mark_queries(queries)
            self.queries_traced = True
        return self._call(self.points.query_segment, X, pre, b, c, sel, queries)

    def __call__(self, batch, cache):
        with call_context(self.warm):
            if not self.warm:
                mark_tokens(batch)
            if "_Backbone" in self.segments:
                return self._call("_Backbone", batch, cache)
            late = functools.partial(self._layers, "_LateLayers") if "_LateLayers" in self.segments else None
            query = self._query_layer if self.points.query_segment in self.fns else None
            return split_forward(self.model, batch, cache, lambda b, c, s: self._call("_EarlyLayers", b, c, s),
                                 late, self.points, lambda i, *a: self._layers(f"_Layer{i}", *a), query)

    def trace_query_layer(self, runner, rows: int) -> None:
        """Trace _QueryLayer<last> (before `finish_warmup`): a padding step of `rows` rows with a
        decoder plan over all of them and its first rows // 2 as query rows (two distinct counts,
        so the trace keeps them two symbols). Without the segment (TR_HYBRID) or under 3 rows it
        traces nothing (`finish_warmup`)."""
        if self.points.query_segment not in self.segments or rows < 3:
            return
        b = runner.padding_batch(rows)
        q = torch.arange(rows // 2, device=b.positions.device)
        b.decoder = DecoderRows(torch.arange(rows, device=q.device), b,
                                QueryRows(q, b.positions[q], b.batch_ids[q], b.win_idx[q], b.block_table))
        self(b, runner.cache)

    def finish_warmup(self) -> None:
        """From now on a recompile is an error. A _QueryLayer not traced by then (a forward warmed
        without `trace_query_layer`) is dropped: the last layer of a decoder plan runs eagerly."""
        if not self.warm and not self.queries_traced:
            for d in (self.segments, self.fns, self.raw, self.backends):
                d.pop(self.points.query_segment, None)
        self.warm = True
        if self._share_key is not None:
            self._traces.mark_warm(self._share_key)

    def stats(self) -> dict:
        out = {}
        for name, be in self.backends.items():
            if isinstance(be, PiecewiseBackend):
                out[name] = be.summary()
        if self.pass_manager is not None:
            out["matches"] = self.pass_manager.totals()
        return out


def compile_runner(runner, args, ccfg: CompileConfig, traces: TraceCache | None = None) -> dict:
    """Compile `runner`'s forward (or reuse a prebuilt cache), warm every capture size and switch
    to fail_on_recompile. `traces`: share traced segments there (default: the active TraceCache,
    if any). Returns a report: cold/warm start, seconds, cache directory, stats."""
    if traces is None:
        traces = TraceCache.current()
    t0 = time.perf_counter()
    factors = key_factors(runner.cfg, args, ccfg, runner.device)
    cdir = CacheDir(ccfg.cache_dir or default_cache_root("compile"), factors)
    cdir.activate()
    was_ready = cdir.ready
    with cdir.lock():
        was_ready = was_ready or cdir.ready
        fwd = CompiledForward(runner.model, runner.cache, ccfg, share_key=cdir.key, traces=traces)
        runner.use_forward(fwd, static_shapes=True)
        sizes = ccfg.capture_sizes or (runner.max_tokens,)
        depyf_ctx = _depyf(ccfg.dump_dir) if ccfg.dump_dir and not fwd.warm else contextlib.nullcontext()
        with torch.inference_mode():
            if not fwd.warm:
                with depyf_ctx:
                    fwd(runner.padding_batch(max(sizes)), runner.cache)     # the one trace
                    fwd.trace_query_layer(runner, max(sizes))
                fwd.finish_warmup()
            for s in sizes:
                fwd(runner.padding_batch(s), runner.cache)
        draft = None
        if getattr(runner, "spec", None) is not None:      # DSpark: the draft's blocks too
            draft = compile_draft(runner.spec, ccfg, fwd.pass_manager, args.decode_sizes(), sizes)
        seconds = time.perf_counter() - t0
        report = {"start": "warm" if was_ready else "cold", "seconds": round(seconds, 2),
                  "cache_dir": str(cdir.path), "key": cdir.key, "capture_sizes": list(sizes),
                  "shared_trace": fwd.shared, "segments": list(fwd.segments), "stats": fwd.stats(),
                  **({"draft": draft} if draft is not None else {})}
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

