"""RoPE, and RoPE + the FP8 QAT round trip of the window KV row -> `v41::rope`,
`v41::rope_fp8_qat`.

`Rope.forward` rotates the last rot dims (interleaved pairs) by the FP32 table rows of each
token's position; the window KV row is then fake-quantized to FP8 (`quant.fp8_qat`, groups of
32) before attention reads it and the ring keeps it. Query, index query and the compressor's
main row and index key use the rotation alone. f32 shown:

    before:
        cos = view(index(cos_table, [pos]), [s0, 8]); sin = view(index(sin_table, [pos]), ...)
        head = slice(x, 1, 0, -16); tail = slice(x, 1, -16, END)
        a = slice(tail, 1, 0, END, 2); b = slice(tail, 1, 1, END, 2)
        r = cat([head, view(cat([unsqueeze(a*cos - b*sin, -1), unsqueeze(a*sin + b*cos, -1)],
                                   -1), [s0, 16])], -1)
        v = view(r, [s0, 2, 32]); amax(abs(v)) ... view.dtype, rshift ... round ... copysign
        kv = view(mul_s, [s0, 64])
    after:
        af = auto_functionalized(v41.rope_fp8_qat, x=x, cos=cos_table, sin=sin_table,
                                 positions=pos, inverse=False, out=empty([s0, 64]))
        kv = af[1]

and `rope(x)` alone -> `auto_functionalized(v41.rope, ..., inverse=False, out=...)[1]` for 2-d
and 3-d x. The ring write (`scatter_rows`) stays after attention: a query's window reads the
ring rows this step overwrites. The inverse rotation is `inv_rope_wo_a`'s (which runs first).
"""
from __future__ import annotations

import torch

from passes.base import PatternPass, call, ns, rand
from v41 import quant
from v41.layers import Rope

FP8_GROUP = 32


class RopeQAT(PatternPass):
    name = "rope_qat"
    ops = ("rope", "rope_fp8_qat")

    def register(self, pm):
        rot, dt = self.cfg.qk_rope_head_dim, self.dtype

        def rope(x, cos, sin, pos):
            return Rope.forward(ns(cos=cos, sin=sin, rot_dim=rot), x, pos, False)

        def rope_qat(x, cos, sin, pos):
            return quant.fp8_qat(rope(x, cos, sin, pos), FP8_GROUP)

        def rope_qat_fused(x, cos, sin, pos):
            return call("rope_fp8_qat", x, cos, sin, pos, False, torch.empty_like(x))[0]

        def rope_fused(x, cos, sin, pos):
            return call("rope", x, cos, sin, pos, False, torch.empty_like(x))[0]

        tables = [rand(64, rot // 2), rand(64, rot // 2), torch.randint(0, 64, (10,))]
        d = 2 * rot + 32
        self.add(pm, rope_qat, rope_qat_fused, [rand(10, d, dtype=dt)] + tables)
        for shape in ((10, d), (10, 3, d)):
            self.add(pm, rope, rope_fused, [rand(*shape, dtype=dt)] + tables)


def make(cfg, dtype, lowering="auto"):
    return RopeQAT(cfg, dtype, lowering)
