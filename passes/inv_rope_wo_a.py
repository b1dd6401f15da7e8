"""Inverse RoPE of the attention output + the grouped `wo_a` projection -> `v41::inv_rope_wo_a`.

The end of `Attention.forward` (the attention output is the `out` buffer `sparse_attn` wrote, so
functionalization replays each view of it per use: the pass first merges those copies): the attention output's rotary dims are rotated back to the
query position (`Rope.forward(..., inverse=True)`: the conjugate), heads are grouped and each
group goes through its own low-rank matrix (`einsum("tgi,goi->tgo")`). f32 shown:

    before:
        cos = index(cos_table, [pos]); sin = neg(index(sin_table, [pos]))
        head = slice(o, 2, 0, -16); tail = slice(o, 2, -16, END)
        a = slice(tail, 2, 0, END, 2); b = slice(tail, 2, 1, END, 2)
        rot = cat([unsqueeze(a*cos - b*sin, -1), unsqueeze(a*sin + b*cos, -1)], -1)
        o2 = cat([head, view(rot, [s0, 4, 16])], -1)
        z = view(permute(bmm(view(permute(view(o2, [s0, 2, -1])), [2, s0, 128]),
                                view(permute(wo_a), [2, 128, 32])), ...), [s0, 2, 32])
        q = clone(z) ... (wo_b's FP8 quant reads z as [s0, 2, 32] groups)
    after:
        af = auto_functionalized(v41.inv_rope_wo_a, o=o, cos=cos_table, sin=sin_table,
                                 positions=pos, wo_a=wo_a, out=empty([s0, 64]))
        z = view(af[1], [s0, 2, 32])
        q = clone(z) ...
"""
from __future__ import annotations

import torch

from passes.base import PatternPass, call, dedupe_replayed_views, ns, rand
from v41.layers import Rope


class InvRopeWoA(PatternPass):
    name = "inv_rope_wo_a"
    ops = ("inv_rope_wo_a",)

    def register(self, pm):
        cfg, dt = self.cfg, self.dtype
        rot, G = cfg.qk_rope_head_dim, cfg.o_groups

        # the pattern ends at the einsum: Inductor folds the model's `.flatten(1)` into the
        # reshape of the GEMM reading it (wo_b's FP8 quant), so the match leaves it out
        def search(o, cos, sin, pos, wo_a):
            T = o.shape[0]
            x = Rope.forward(ns(cos=cos, sin=sin, rot_dim=rot), o, pos, True).view(T, G, -1)
            return torch.einsum("tgi,goi->tgo", x, wo_a)

        def replace(o, cos, sin, pos, wo_a):
            T, g, r = o.shape[0], wo_a.shape[0], wo_a.shape[1]
            out = o.new_empty((T, g * r))
            return call("inv_rope_wo_a", o, cos, sin, pos, wo_a, out)[0].view(T, g, r)

        H, d, R = 6, 2 * rot + 8, 40
        ex = [rand(10, H, d, dtype=dt), rand(64, rot // 2), rand(64, rot // 2),
              torch.randint(0, 64, (10,)), rand(G, R, H * d // G, dtype=dt)]
        self.add(pm, search, replace, ex)

    def before(self, graph):
        dedupe_replayed_views(graph)     # o is sparse_attn's output buffer


def make(cfg, dtype, lowering="auto"):
    return InvRopeWoA(cfg, dtype, lowering)
