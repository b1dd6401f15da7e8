"""How the runner's forward is compiled: CompileConfig (from the engine settings) and the
capture sizes."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from v41.keyed_dir import default_cache_root


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
    splitting_ops: tuple = ()              # TR_HYBRID: passes/split.py SPLITTING_OPS, pieces run eager

    @classmethod
    def from_engine_args(cls, args, max_tokens: int) -> "CompileConfig | None":
        """None when the engine runs the eager model."""
        if args.enforce_eager or args.compilation_level == 0:
            return None
        from passes.split import SPLITTING_OPS
        sizes = parse_sizes(args.capture_sizes, max_tokens)
        return cls(level=args.compilation_level, split=args.decoder_swa_bounded_replay,
                   dump_dir=args.dump_dir, cache_dir=args.compile_cache_dir or str(default_cache_root("compile")),
                   capture_sizes=sizes, fused_lowering=os.environ.get("V41_FUSED_LOWERING", "auto"),
                   splitting_ops=SPLITTING_OPS if args.graph_mode() == "TR_HYBRID" else ())


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

