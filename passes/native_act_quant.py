"""The A8 quant of a native FP8 GEMM moved into the kernel that makes its input.

With native weights (custom_ops.gemm.native_weights) every FP8 projection is a `v41::fp8_linear`
of its input in the activation dtype, and that op quantizes the input (E4M3 codes and UE8M0
scales per 32) in a kernel of its own before the GEMM wherever the GEMV cannot quantize inside
(custom_ops/triton/fp8_gemm.py `quantizes_inside`: at one token Flash's wq_b, wo_a and shared
w1/w3; every projection at more). This pass gives the quant to the input's producer and makes
the GEMM a `v41::fp8_block_gemm` on the codes:

- an RMSNorm (`v41::rms_norm`, after rms_norm_quant) becomes `v41::rms_norm_act_quant`, which
  writes the codes beside the norm; the norm's other readers (router, compressor, ...) keep its
  output. Flash: wq_a + wkv, wq_b, shared w1 + w3. Where the norm's input is mHC's collapse of
  the residual streams, read by the norm alone (the attention and FFN inputs), the collapse
  joins it: `v41::hc_collapse_rms_norm_act_quant`.
- an input made by pointwise ATen ops (the inverse RoPE before native wo_a, SwiGLU before shared
  w2) gets the quant as ATen ops (the reference's `custom_ops.gemm.act_quant_codes`), which Inductor
  generates in the producer's own kernel.
- a W8A8 GEMM whose output only native GEMMs read (wo_a's, read by wo_b) becomes
  `v41::fp8_block_gemm_act_quant`, which quantizes its output tiles in the epilogue.

Inputs made by other ops (a piece input: Engram) keep fp8_linear.
f32 shown, RMSNorm:

    before:
        af = auto_functionalized(v41.rms_norm, x=x, w=w, eps=1e-20, out=empty([s0, 64]))
        y = af[1]
        lin = auto_functionalized_v2(v41.fp8_linear, x=view(y, [-1, 64]), w=W, ws=Ws, groups=1,
                                     _out_base_index=0, _all_bases=[empty([s0, 128])])
        z = lin[1]
    after:
        af = auto_functionalized(v41.rms_norm_act_quant, x=x, w=w, eps=1e-20, out=empty([s0, 64]),
                                 q=empty([s0, 64], float8_e4m3fn), s=empty([s0, 2], float32))
        y = af[1]; q = af[2]; s = af[3]
        lin = auto_functionalized_v2(v41.fp8_block_gemm, xq=view(q, [-1, 64]), xs=view(s, [-1, 2]),
                                     w=W, ws=Ws, groups=1, _out_base_index=0,
                                     _all_bases=[empty([s0, 128])])
        z = lin[1]

and pointwise, SwiGLU:

    before:
        h = mul(silu(g), u)
        lin = auto_functionalized_v2(v41.fp8_linear, x=view(h, [-1, 32]), w=W, ...)
    after:
        v = view(view(h, [-1, 32]), [s0, 1, 32]); amax = amax(abs(v), [-1], True) ... round ...
        lin = auto_functionalized_v2(v41.fp8_block_gemm, xq=convert(q, float8_e4m3fn), xs=s, w=W, ...)

fp8_linear's definition is fp8_act_quant then fp8_block_gemm, so the arithmetic is unchanged. A
GEMM may read a norm's output through views; the codes take the same final view and the scales
its last dim / 32 (the views keep the norm's rows whole). The model's graph holds its own
mutating ops as auto_functionalized_v2 and our passes' as v1; the rewrite keeps each form. It
edits nodes directly (a pattern cannot leave the norm's other readers outside it), giving each
new node the fake value the compile's fake mode computes for it.
"""
from __future__ import annotations

import operator

import torch

from custom_ops.gemm import act_quant_codes
from passes.base import V41Pass, add_node, calls_of, erase_producer, output_of, producer_read_only_by, trace

aten = torch.ops.aten
AF = torch.ops.higher_order.auto_functionalized
AF2 = torch.ops.higher_order.auto_functionalized_v2
FP8_GROUP = 32
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


class NativeActQuant(V41Pass):
    name = "native_act_quant"

    def __call__(self, graph: torch.fx.Graph) -> int:
        matched = 0
        for norm in calls_of(graph, torch.ops.v41.rms_norm.default):
            y = output_of(norm)
            gemms = [(v, r) for v, r in _readers(y) if _is_linear(r)]
            if gemms and _fresh(norm.kwargs["out"]):
                q, s = self._quantizing_norm(graph, norm, y)
                for view, gemm in gemms:
                    self._gemm_on_codes(graph, gemm, view, q, s)
                matched += len(gemms)
        for gemm in calls_of(graph, torch.ops.v41.fp8_linear.default):
            if _is_linear(gemm) and _pointwise(_base(gemm.kwargs["x"])):
                self._inline_quant(graph, gemm)
                matched += 1
        for producer in calls_of(graph, torch.ops.v41.fp8_block_gemm.default):
            z = output_of(producer)
            readers = _readers(z)
            if producer.target is AF2 and readers and all(_is_linear(r) for _, r in readers) and \
                    len(producer.kwargs["_all_bases"]) == 1 and _fresh(producer.kwargs["_all_bases"][0]):
                q, s = self._quantizing_gemm(graph, producer, z)
                for view, gemm in readers:
                    self._gemm_on_codes(graph, gemm, view, q, s)
                matched += len(readers)
        if matched:
            graph.eliminate_dead_code()         # the replaced GEMMs, their outputs' views and getitems
        return matched

    def _quantizing_norm(self, graph, norm, y):
        """Replace the norm (and the collapse it alone reads) with the op writing the same output
        and the codes: the (codes, scales) nodes."""
        with graph.inserting_before(norm):
            q, s = _code_buffers(graph, norm.kwargs["out"])
            collapse = producer_read_only_by(norm.kwargs["x"], norm, torch.ops.v41.hc_collapse.default)
            if collapse is None:
                af = add_node(graph, AF, torch.ops.v41.rms_norm_act_quant.default, **norm.kwargs, q=q, s=s)
            else:
                kw = {k: v for k, v in norm.kwargs.items() if k != "x"}
                af = add_node(graph, AF, torch.ops.v41.hc_collapse_rms_norm_act_quant.default, X=collapse.kwargs["X"],
                              mix=collapse.kwargs["mix"], **kw, q=q, s=s)
            y2, q, s = (add_node(graph, operator.getitem, af, i) for i in (1, 2, 3))
        y.replace_all_uses_with(y2)
        x = norm.kwargs["x"]
        graph.erase_node(y)
        graph.erase_node(norm)
        if collapse is not None:
            erase_producer(graph, x, collapse.kwargs["X"])     # X [T, hc, D]: the same T
        return q, s

    def _quantizing_gemm(self, graph, gemm, z):
        """Replace a W8A8 GEMM whose output z only native GEMMs read with
        `fp8_block_gemm_act_quant`: the (codes, scales) nodes."""
        kw = {k: gemm.kwargs[k] for k in ("xq", "xs", "w", "ws", "groups")}
        with graph.inserting_before(gemm):
            q, s = _code_buffers(graph, gemm.kwargs["_all_bases"][0])
            af = add_node(graph, AF, torch.ops.v41.fp8_block_gemm_act_quant.default, **kw, dtype=z.meta["val"].dtype,
                          q=q, s=s)
            q, s = (add_node(graph, operator.getitem, af, i) for i in (1, 2))
        return q, s

    def _inline_quant(self, graph, gemm):
        """Replace fp8_linear(x) with the act quant's ATen ops on x and fp8_block_gemm."""
        x = gemm.kwargs["x"]
        traced = trace(act_quant_codes, [x.meta["val"]]).graph
        with graph.inserting_before(gemm):
            q, s = graph.graph_copy(traced, {next(iter(traced.find_nodes(op="placeholder"))): x})
        self._replace(graph, gemm, q, s)

    def _gemm_on_codes(self, graph, gemm, view, q, s):
        """Replace fp8_linear(view(y)) with fp8_block_gemm on the same view of the codes."""
        rows = list(view.args[1][:-1]) if view is not None else list(q.meta["val"].shape[:-1])
        K = (view if view is not None else q).meta["val"].shape[-1]
        with graph.inserting_before(gemm):
            xq = add_node(graph, aten.view.default, q, [*rows, K])
            xs = add_node(graph, aten.view.default, s, [*rows, K // FP8_GROUP])
        self._replace(graph, gemm, xq, xs)

    def _replace(self, graph, gemm, xq, xs):
        kw = {k: v for k, v in gemm.kwargs.items() if k != "x"}
        with graph.inserting_before(gemm):
            new = add_node(graph, AF2, torch.ops.v41.fp8_block_gemm.default, xq=xq, xs=xs, **kw)
        gemm.replace_all_uses_with(new)
        graph.erase_node(gemm)


def _code_buffers(graph, out):
    """Fresh E4M3 codes and FP32 scales for an op's output buffer `out` (`_fresh`): its sizes,
    the last one over 32 for the scales."""
    sizes, device = list(out.args[0]), out.kwargs["device"]
    q = add_node(graph, aten.empty.memory_format, sizes, dtype=torch.float8_e4m3fn, device=device, pin_memory=False)
    s = add_node(graph, aten.empty.memory_format, sizes[:-1] + [sizes[-1] // FP8_GROUP], dtype=torch.float32,
                 device=device, pin_memory=False)
    return q, s


def _fresh(buffer) -> bool:
    """An op's output buffer made by `empty` here: its sizes give the codes' and scales'."""
    return buffer.op == "call_function" and buffer.target is aten.empty.memory_format


def _is_linear(node) -> bool:
    """An fp8_linear call in the form the model's graph holds (its out buffer among the bases)."""
    return node.target is AF2 and node.args[0] is torch.ops.v41.fp8_linear.default


def _base(node):
    """The node a chain of views starts from."""
    while node.op == "call_function" and node.target in VIEWS:
        node = node.args[0]
    return node


def _pointwise(node) -> bool:
    """Made by an ATen op Inductor generates a kernel around: pointwise, or a cat of such."""
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and \
        node.target.namespace == "aten" and (torch.Tag.pointwise in node.target.tags or
                                             node.target is aten.cat.default)


def _readers(y) -> list:
    """(last view or None, reader) for every reader of y, directly or through a chain of views
    that keep y's rows whole (a view splitting them counts as a reader, which no GEMM is)."""
    if y is None:
        return []
    D = y.meta["val"].shape[-1]
    out, todo = [], [(y, None)]
    while todo:
        node, view = todo.pop()
        for u in node.users:
            last = u.meta["val"].shape[-1] if u.target in VIEWS and u.args[0] is node else None
            if isinstance(last, int) and last > 0 and last % D == 0:
                todo.append((u, u))
            else:
                out.append((view, u))
    return out


def make(cfg, dtype, lowering="auto"):
    return NativeActQuant(cfg, dtype, lowering)
