"""Backend selection for the fused v41 ops: keep the op, or lower it back to its reference.

Every fused op the passes before this one emit has a torch reference impl (the definition) and,
per device, maybe faster impls (Triton on CUDA, AITER on ROCm) that `custom_ops.registry` picks at
run time (priority aiter > triton > reference, or `V41_OP_BACKEND`). This pass decides, per op
node and from the node's device only (never from the token count), whether the compiled graph
calls the op or Inductor generates its reference composition itself. Policy (`lowering`):

  auto    keep the op where a non-reference impl is selected for its device; where only the
          reference exists, keep it on the CPU (it is the eager model's own arithmetic, so the
          compiled model stays bitwise equal to the eager one: tests/test_compiled_invariance.py)
          and inline it on an accelerator (Inductor's generated kernel beats the reference's
          eager ops there)
  op      keep every op
  inline  inline every op (Inductor fuses the composition with its neighbours; vLLM found its
          RMSNorm+quant kernel faster than a custom one on NVIDIA; not bitwise equal to eager)

    before (inline):
        af = auto_functionalized(v41.rms_norm, x=x, w=w, eps=1e-20, out=empty([s0, 64]))
        y = af[1]
    after:
        pow = pow(x, 2); mean = mean(pow, [-1], True); ...; mul_1 = mul(w, mul)
        y = mul_1                           # the reference impl, functionalized

    before / after (auto on CUDA with a Triton impl registered, or on CPU): unchanged; Inductor
    calls the op and its dispatch runs the selected impl.

The irregular ops (sparse attention, index top-k, scatters, compressor, experts, Engram gather)
are always kept: their reference impls are not traceable to fixed shapes. So are the native
GEMMs and the ops native_act_quant makes (their codes feed those GEMMs, which only native
weights on a device with their Triton impls run).
"""
from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch._inductor.pattern_matcher import CallFunctionVarArgs, PatternMatcherPass, register_graph_pattern

from passes.base import V41Pass

FUSED_OPS = ("rms_norm", "rms_norm_fp8", "rope", "rope_fp8_qat", "rms_norm_rope_fp8_qat", "inv_rope_wo_a", "mhc_mix",
             "hc_collapse", "hc_expand", "moe_route", "engram_gate")


def _device(node: torch.fx.Node) -> torch.device | None:
    for a in pytree.tree_leaves((node.args, node.kwargs)):
        v = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
        if isinstance(v, torch.Tensor):
            return v.device
    return None


def functional_reference(op: torch._ops.OpOverload):
    """auto_functionalized(op, **kw) as plain ops: the registered reference impl writing into
    fresh buffers, functionalized so the buffers disappear."""
    from custom_ops import registry
    ref = registry._reference_fns[f"{op.namespace}::{op._schema.name.split('::')[-1]}"]
    mutable = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]

    def decomp(spec, *flat):
        kwargs = pytree.tree_unflatten(list(flat), spec)
        outs = {n: torch.empty_like(kwargs[n]) for n in mutable}
        ref(**{**kwargs, **outs})
        return (None, *[outs[n] for n in mutable])

    return decomp


class BackendSelect(V41Pass):
    name = "backend_select"

    def __init__(self, cfg, dtype, lowering="auto"):
        super().__init__(cfg, dtype, lowering)
        if lowering not in ("auto", "op", "inline"):
            raise ValueError(f"fused op lowering {lowering!r}: expected auto, op or inline")
        self.decisions: dict[str, str] = {}     # "op@device" -> "kept (triton)" / "inlined"

    def choose(self, name: str, device: torch.device | None) -> tuple[bool, str]:
        """(keep the op?, its backend on that device)."""
        from custom_ops import registry
        backend = registry.selected().get(f"v41::{name}", {}).get(device.type if device else "cpu", "reference")
        if self.lowering == "op":
            return True, backend
        if self.lowering == "inline":
            return False, backend
        return backend != "reference" or device is None or device.type == "cpu", backend

    def __call__(self, graph: torch.fx.Graph) -> int:
        pm = PatternMatcherPass(pass_name="v41.backend_select")
        fused = {getattr(torch.ops.v41, n).default: n for n in FUSED_OPS if hasattr(torch.ops.v41, n)}
        seen = [0]

        @register_graph_pattern(CallFunctionVarArgs(torch.ops.higher_order.auto_functionalized),
                                pass_dict=pm, extra_check=lambda m: m.output_node().args[0] in fused)
        def _(match, *args, **kwargs):
            node = match.output_node()
            name = fused[node.args[0]]
            keep, backend = self.choose(name, _device(node))
            seen[0] += 1
            dev = getattr(_device(node), "type", "?")
            self.decisions[f"{name}@{dev}"] = f"kept ({backend})" if keep else "inlined"
            if keep:
                return
            kw = {k: v for k, v in node.kwargs.items()}
            flat, spec = pytree.tree_flatten(kw)
            decomp = functional_reference(node.args[0])

            def fn(*flat_args):
                return decomp(spec, *flat_args)

            match.replace_by_example(torch.func.functionalize(fn, remove="mutations"), flat)

        pm.apply(graph)
        return seen[0]


def make(cfg, dtype, lowering="auto"):
    return BackendSelect(cfg, dtype, lowering)
