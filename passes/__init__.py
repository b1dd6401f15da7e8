"""FX passes on the graph AOT traces (passes/manager.py says where and in which order) and the
layer split of a segment's Dynamo graph (passes/split.py)."""
from __future__ import annotations

PASS_NAMES = ("inv_rope_wo_a", "rope_qat", "mhc", "moe_route", "engram_gate", "rms_norm_quant",
              "norm_rope", "native_act_quant", "moe_overlap", "backend_select")


def build_passes(cfg, dtype, lowering: str = "auto", only=None) -> list:
    """The passes for a model config and activation dtype, in manager order."""
    import importlib
    names = [n for n in PASS_NAMES if only is None or n in only]
    out = []
    for name in names:
        mod = importlib.import_module(f"passes.{name}")
        out.append(mod.make(cfg, dtype, lowering=lowering))
    return out
