"""The pass manager: one `CustomGraphPass` installed as Inductor's `joint_custom_pre_pass`,
running the v41 passes in a fixed order on every compiled piece.

Where: first thing on the graph AOT traced (functional ATen after Inductor's decompositions),
before any of Inductor's own rewrites, because those differ by torch version and device and
would break patterns traced on the CPU: torch 2.11 folds the bf16 round trip `f32 -> bf16 ->
f32` where a sublayer's output meets the next norm, and on CUDA its post-grad passes turn
softmax into an online softmax (both seen on the H200 with the passes after post-grad: most
mHC and RMSNorm patterns stopped matching). Inductor then runs its joint-graph and post-grad
passes (reinplacing included) on the fused graph. The manager removes no-ops first, as Inductor
does right after it and as the traced patterns have them removed.

Its `uuid()` hashes the files the passes are made of (every `passes/*.py` and `custom_ops/**.py`:
patterns, replacements, op schemas and reference impls), the model config the patterns are
traced for, the activation dtype, the lowering policy and the op backends registered now, so
Inductor's FX graph cache never returns a graph built by other passes.

Order (each pass's docstring shows its graph before and after):

    0 inv_rope_wo_a    inverse RoPE of the attention output + the grouped wo_a projection
    1 rope_qat         RoPE, and RoPE + the FP8 QAT round trip of the window KV row
    2 mhc              mHC mix (projection, gates, Sinkhorn), collapse, expand
    3 moe_route        router scores + top-k selection + weights
    4 engram_gate      Engram gate after the wkv GEMM
    5 rms_norm_quant   (after a CSE of the pure ops left) RMSNorm, and RMSNorm + the FP8 act
                       quant of the GEMM reading it
    6 norm_rope        RMSNorm + RoPE + FP8 QAT of the window KV row in one op
    7 native_act_quant (native weights) a GEMM's A8 quant moved into the kernel making its
                       input (RMSNorm, with mHC's collapse before it; pointwise ATen ops; the
                       GEMM before it)
    8 moe_overlap      the routed experts on a second stream beside the shared expert, up to a
                       join before their sum
    9 backend_select   keep each fused op (its dispatch runs the selected Triton/AITER/reference
                       impl) or lower it back to its reference composition for Inductor

The CSE runs late on purpose: a pattern's inner nodes must have no users outside it, and
merging (say) the three identical cos-table gathers of a layer would give them some.

With a dump directory set (`set_dump_dir`), each pass writes the graph before and after it as
`post_grad.<i>.<pass>.{before,after}.py`; match counts are kept per compiled piece.
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from v41.keyed_dir import hash_files

PASSES_DIR = Path(__file__).resolve().parent
OPS_DIR = PASSES_DIR.parent / "custom_ops"


def _files() -> list[str]:
    return sorted(str(p) for p in list(PASSES_DIR.glob("*.py")) + list(OPS_DIR.rglob("*.py")))


def files_hash() -> str:
    return hash_files(_files(), root=PASSES_DIR.parent).hexdigest()


def graph_code(graph: torch.fx.Graph) -> str:
    return graph.python_code(root_module="self").src


class PassManager(CustomGraphPass):
    def __init__(self, cfg, dtype: torch.dtype, lowering: str = "auto", only: tuple | None = None):
        """`lowering`: the backend_select policy (auto | op | inline, see passes/backend_select.py).
        `only`: names of the passes to run (tests); default all."""
        from passes import build_passes
        self.cfg, self.dtype, self.lowering = cfg, dtype, lowering
        self.passes = build_passes(cfg, dtype, lowering, only)
        self.counts: dict[str, Counter] = defaultdict(Counter)   # piece -> pass -> matches
        self.calls = 0
        self._dump_dir: Path | None = None
        self._label = "graph"

    # -- dumps --
    def set_dump_dir(self, directory):
        prev, self._dump_dir = self._dump_dir, (Path(directory) if directory else None)
        if directory:
            self._label = Path(directory).name
        return prev

    def _dump(self, i: int, name: str, stage: str, graph):
        if self._dump_dir is not None:
            self._dump_dir.mkdir(parents=True, exist_ok=True)
            (self._dump_dir / f"post_grad.{i}.{name}.{stage}.py").write_text(graph_code(graph))

    # -- CustomGraphPass --
    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._inductor.fx_passes.post_grad import remove_noop_ops
        self.calls += 1
        remove_noop_ops(graph)
        label = self._label if self._dump_dir is not None else f"graph{self.calls}"
        for i, p in enumerate(self.passes):
            self._dump(i, p.name, "before", graph)
            n = p(graph)
            self.counts[label][p.name] += n
            self._dump(i, p.name, "after", graph)
        graph.lint()
        if self._dump_dir is not None:
            (self._dump_dir / "match_counts.json").write_text(json.dumps(dict(self.counts[label]), indent=1))

    def uuid(self) -> str:
        from custom_ops import registry
        sel = registry.selected()
        payload = {"files": files_hash(), "config": self.cfg.to_hf_dict(), "dtype": str(self.dtype),
                   "lowering": self.lowering, "passes": [p.name for p in self.passes],
                   "backends": {k: sel[k] for k in sorted(sel)}}
        return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()

    # -- reporting --
    def totals(self) -> dict:
        out: Counter = Counter()
        for c in self.counts.values():
            out.update(c)
        return {p.name: out[p.name] for p in self.passes}

    def write_counts(self, path) -> None:
        Path(path).write_text(json.dumps({"total": self.totals(),
                                          "per_graph": {k: dict(v) for k, v in self.counts.items()}},
                                         indent=1))
