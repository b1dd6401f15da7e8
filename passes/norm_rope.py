"""RMSNorm + RoPE + the FP8 QAT of the window KV row -> `v41::rms_norm_rope_fp8_qat`.

Every attention layer makes its window KV row as kv_norm(wkv(x)), rotated and FP8-quantized
(spec §3.3 b); rope_qat and rms_norm_quant have made those `v41::rope_fp8_qat` and
`v41::rms_norm`, two launches, the second reading back the row the first wrote. Where the norm's
output is read by the rotation alone, one op does both (one program a row: the 512-wide row is
whole in its tile). f32 shown:

    before:
        af = auto_functionalized(v41.rms_norm, x=kv, w=w, eps=1e-20, out=empty([s0, 64]))
        n = af[1]
        af_1 = auto_functionalized(v41.rope_fp8_qat, x=n, cos=cos_table, sin=sin_table,
                                   positions=pos, inverse=False, out=empty([sym_size(n, 0), 64]))
        row = af_1[1]
    after:
        af_2 = auto_functionalized(v41.rms_norm_rope_fp8_qat, x=kv, w=w, eps=1e-20, cos=cos_table,
                                   sin=sin_table, positions=pos, inverse=False,
                                   out=empty([sym_size(kv, 0), 64]))
        row = af_2[1]

The op's reference is rope_fp8_qat(rms_norm(x)): the arithmetic is unchanged.
"""
from __future__ import annotations

import operator

import torch

from passes.base import V41Pass, add_node, calls_of, erase_producer, output_of, producer_read_only_by

AF = torch.ops.higher_order.auto_functionalized


class NormRope(V41Pass):
    name = "norm_rope"

    def __call__(self, graph: torch.fx.Graph) -> int:
        v41 = torch.ops.v41
        matched = 0
        for rope in calls_of(graph, v41.rope_fp8_qat.default):
            old = output_of(rope)
            if old is None:
                continue
            n = rope.kwargs["x"]
            norm = producer_read_only_by(n, rope, v41.rms_norm.default)
            if norm is None:
                continue
            kw = {k: v for k, v in rope.kwargs.items() if k != "x"}
            with graph.inserting_before(rope):
                af = add_node(graph, AF, v41.rms_norm_rope_fp8_qat.default, x=norm.kwargs["x"], w=norm.kwargs["w"],
                              eps=norm.kwargs["eps"], **kw)
                row = add_node(graph, operator.getitem, af, 1)
            old.replace_all_uses_with(row)
            graph.erase_node(old)
            graph.erase_node(rope)
            erase_producer(graph, n, norm.kwargs["x"])
            matched += 1
        if matched:
            graph.eliminate_dead_code()
        return matched


def make(cfg, dtype, lowering="auto"):
    return NormRope(cfg, dtype, lowering)
