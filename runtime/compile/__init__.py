"""Compile the plain-PyTorch model: segments, one trace each, passes, caches, dumps.

DESIGN.md §5: only the token dimension is dynamic, the runtime compiles once, and a recompile
while serving is an error. What this module does:

* Segments. With decoder SWA bounded replay on (the default) the forward is two compiled graphs
  with two layers between and after them (Flash numbering; derived from the topology for any
  config: `boundary` = the last kv source, `last` = the last backbone layer):

      _EarlyLayers   embedding + layers [0, boundary)           compiled
      layer boundary               _Layer<boundary>             compiled
      _LateLayers    layers (boundary, last)                      compiled
      layer last     _QueryLayer<last> with a decoder plan, else _Layer<last>    compiled
      final collapse + norm                                       eager

  With it off, `_Backbone` (the whole `Transformer.forward`) is one graph. The rows change
  between the segments: `Transformer.enter_decoder` (eager) gathers each request's tail rows
  after the boundary layer's compression (runtime/replay.py plans them), the boundary layer then
  runs on those rows as any layer does, and the last layer runs its query, attention and FFN on
  the sampled rows alone (`_QueryLayer<last>`: two dynamic dims, the decoder's rows and the
  query rows, traced by `CompiledForward.trace_query_layer`; TR_HYBRID, whose captures run no
  query row, and a step with none run that layer eagerly). A step without a decoder plan
  (decode and DSpark verify steps, the ones FULL graphs replay) changes no rows, so it runs both
  layers as one-layer segments `_Layer<i>` (their pieces are the same compiled callables as the
  other layers of their role).

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

The package, one concern per module (like vLLM's `compilation/`): `config` (CompileConfig,
parse_sizes), `segments` (SplitPoints, the segment modules, split_forward, the token-shaped
tensors and their dynamic dim), `backend` (PiecewiseBackend, piece keys, post_grad_eager),
`cache` (key factors, compile_key, the keyed cache directory), `forward` (CompiledForward,
TraceCache, compile_runner), `draft` (the DSpark draft's blocks as one more segment), `piece_graphs` (TR_HYBRID: each token piece's CUDA graphs per token
bucket, the pieces cut at passes/split.py's SPLITTING_OPS) and `debug` (dump routing, depyf).
Import the names from here.
"""
from __future__ import annotations

from runtime.compile.backend import PiecewiseBackend, PieceStats, piece_key, post_grad_eager
from runtime.compile.cache import (NOT_KEYED, REPO, TRACED_SOURCES, CacheDir, compile_key, device_arch,
                                   key_factors, source_hashes)
from runtime.compile.config import CompileConfig, parse_sizes
from runtime.compile.debug import _depyf
from runtime.compile.draft import compile_draft
from runtime.compile.forward import CompiledForward, TraceCache, compile_runner, static_signature
from runtime.compile.segments import (SEGMENTS, SplitPoints, _Backbone, _EarlyLayers, _LateLayers, _Layer, mark_tokens,
                                      split_forward, token_tensors)

__all__ = ["NOT_KEYED", "REPO", "SEGMENTS", "TRACED_SOURCES", "CacheDir", "CompileConfig", "CompiledForward",
           "PieceStats", "PiecewiseBackend", "SplitPoints", "TraceCache", "compile_draft", "compile_key", "compile_runner", "device_arch",
           "key_factors", "mark_tokens", "parse_sizes",
           "piece_key", "post_grad_eager", "source_hashes", "split_forward", "static_signature",
           "token_tensors"]
