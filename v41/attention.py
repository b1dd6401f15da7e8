"""CSA2 attention of one layer over the flat token batch (spec §3.3).

Every layer: query, window KV (FP8 QAT) and sparse attention with sink over its window.
FULL owners also compress their input into global main rows and index keys; FULL and REINDEX
layers score the owner's index rows and publish a top-k that the REUSE layers after them read.
The irregular steps are `torch.ops.v41` ops; the rest is plain PyTorch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import custom_ops  # noqa: F401  (registers torch.ops.v41)
from v41 import quant
from v41.config import V41Config
from v41.topology import LayerSpec, Role
from v41.layers import Linear, RMSNorm, Rope, acc_dtype, fp8_linear, stack_rows
from v41.parallel import tensor_parallel

ops = torch.ops.v41


@dataclass
class QueryRows:
    """Queries on some of a layer's rows (the last layer under decoder bounded replay): every
    row still writes its window KV, only `rows` attend. Fields are per query row, as in Batch."""
    rows: torch.Tensor            # [Q] index into the layer's rows
    positions: torch.Tensor
    batch_ids: torch.Tensor
    win_idx: torch.Tensor         # [Q, W] window rows (ring rows, or ring rows + a KV row)
    block_table: torch.Tensor


class Attention(nn.Module):
    def __init__(self, cfg: V41Config, spec: LayerSpec, w: dict, rope: Rope):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.spec, self.rope = spec, rope
        # this rank's query heads and output groups (all of them without tensor parallelism)
        self.n_heads, self.head_dim = w["wq_b"].shape[0] // cfg.head_dim, cfg.head_dim
        self.o_groups, self.o_rank = self.n_heads * cfg.o_groups // cfg.num_attention_heads, cfg.o_lora_rank
        self.tp = tensor_parallel() if self.n_heads < cfg.num_attention_heads else None
        self.scale = cfg.head_dim ** -0.5
        # the query's down projection and the window KV read the same x: one GEMM, rows wq_a
        # then wkv; `wkv` alone (a view of its rows) serves the steps that need no query
        self.q_rank = w["wq_a"].shape[0]
        self.wq_a_kv = Linear(stack_rows(w["wq_a"], w["wkv"]), "fp8")
        self.wkv = self.wq_a_kv.rows(self.q_rank)
        # a scorer's index query reads the query's latent too: its rows follow the query's
        self.q_width = self.n_heads * self.head_dim
        self.wq_b = Linear(stack_rows(w["wq_b"], w["indexer.wq_b"]) if spec.scores else w["wq_b"], "fp8")
        self.wo_b = Linear(w["wo_b"], "fp8")
        if isinstance(w["wo_a"], quant.BlockScaled):     # native: the groups' A8 x FP8 GEMMs
            self.wo_a, self.wo_a_q, self.wo_a_scale = None, w["wo_a"].q, w["wo_a"].scale
        else:
            self.wo_a = w["wo_a"].view(self.o_groups, cfg.o_lora_rank, cfg.o_group_in)
        self.q_norm, self.kv_norm = RMSNorm(w["q_norm"], eps), RMSNorm(w["kv_norm"], eps)
        self.sink = w["attn_sink"]
        if spec.role is Role.FULL:
            self.ratio = spec.ratio
            if spec.ratio == 2:     # the pooled values and their gates share the input: one GEMM
                self.c_wkv_gate = Linear(stack_rows(w["compressor.wkv"], w["compressor.wgate"]), "f32")
            else:
                self.c_wkv = Linear(w["compressor.wkv"], "bf16")
            self.c_norm = RMSNorm(w["compressor.norm"], eps)
            self.i_wk, self.i_knorm = Linear(w["indexer.wk"], "bf16"), RMSNorm(w["indexer.k_norm"], eps)
        if spec.scores:
            self.i_wproj = Linear(w["indexer.weights_proj"], "bf16")
            self.i_heads, self.i_dim = cfg.index_n_heads, cfg.index_head_dim
            self.i_scale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5
            self.topk, self.n_cand = cfg.index_topk, cfg.candidate_topk_blocks
            self.cand_block = cfg.candidate_block_size

    def forward(self, x, batch, cache, sel: dict, queries: QueryRows | None = None):
        """The attention output of every row, or of the `queries` rows only."""
        l, spec = self.spec.layer, self.spec
        xq, qb = (x, batch) if queries is None else (x[queries.rows], queries)
        qa, kv = self.wq_a_kv(x).split([self.q_rank, self.head_dim], -1)
        qr = self.q_norm(qa if queries is None else qa[queries.rows])
        qs = self.wq_b(qr)       # the query heads, then a scorer's index query
        q = self.rope(qs[:, :self.q_width].view(xq.shape[0], self.n_heads, self.head_dim), qb.positions)
        kv = self.window_key(kv, batch.positions)
        if spec.role is Role.FULL:
            self.compress(x, batch, cache)
        if spec.scores:
            self.select(xq, qs[:, self.q_width:], qb, cache, sel)
        ring = cache.ring[l]
        o = torch.empty_like(q)
        if spec.ratio:
            owner = cache.owner(spec.kv_owner)
            topk = sel["topk", spec.topk_owner]
            if queries is not None and not spec.scores:   # published for every row by its scorer
                topk = topk[queries.rows]
            ops.sparse_attn(q, kv, ring, qb.win_idx, owner.main, topk, qb.block_table, qb.batch_ids,
                            spec.ratio, owner.rows_per_page, self.sink, self.scale, o)
        else:
            ops.sparse_attn(q, kv, ring, qb.win_idx, None, None, qb.block_table, qb.batch_ids, 1, 1,
                            self.sink, self.scale, o)
        # every query of the batch has read its window: only now may the ring move on
        self.keep_window(ring, kv, batch, cache)
        o = self.rope(o, qb.positions, inverse=True).view(xq.shape[0], self.o_groups, -1)
        if self.wo_a is None:
            z = fp8_linear(o.flatten(1), self.wo_a_q, self.wo_a_scale, groups=self.o_groups)
        else:
            z = quant.einsum("tgi,goi->tgo", o, self.wo_a).flatten(1)
        return self.wo_b(z) if self.tp is None else self.tp.all_reduce(self.wo_b(z))

    def window_kv(self, x, positions):
        """The rows' window KV (FP8 QAT): what the layer's ring keeps of them."""
        return self.window_key(self.wkv(x), positions)

    def window_key(self, kv, positions):
        """The window KV of the rows' `wkv` projection."""
        return quant.fp8_qat(self.rope(self.kv_norm(kv), positions))

    def keep_window(self, ring, kv, batch, cache) -> None:
        """Rows into the layer's `ring` (the view its attention read), and into checkpoint
        images at PAGE boundaries (copy mode)."""
        ops.scatter_rows(ring, kv, batch.ring_dest)
        if batch.image_dest is not None:
            ops.scatter_rows(cache.image_ring[self.spec.layer], kv, batch.image_dest)

    def compress(self, x, batch, cache):
        """Owner rows: pooled latent -> main row (RoPE, FP4 E4M3/16 QAT) and index key (k_norm,
        RoPE, FP4/32 QAT), written for the groups this batch completes."""
        owner = cache.owner(self.spec.layer)
        if self.ratio == 2:
            v, g = self.c_wkv_gate(x).chunk(2, -1)
            pooled = torch.empty_like(v)
            ops.compress_pool(v, g, batch.positions, batch.batch_ids, batch.tail_src, batch.tail_dst,
                              owner.tail_v, owner.tail_g, pooled)
            latent = self.c_norm(pooled.to(x.dtype))
        else:
            latent = self.c_norm(self.c_wkv(x))
        # a compressed row stands for its group's first token
        first = (batch.positions - (self.ratio - 1)).clamp(min=0)
        k = quant.fp4_qat(self.rope(self.i_knorm(self.i_wk(latent)), first), 32)
        main = quant.fp4_e4m3_qat(self.rope(latent, first), 16)
        dest = batch.owner_dest[self.ratio]
        ops.scatter_rows(owner.main, main, dest)
        vals, scales = owner.encode_index(k)
        ops.scatter_rows(owner.index, vals, dest)
        ops.scatter_rows(owner.index_scale, scales, dest)

    def select(self, x, qi, batch, cache, sel):
        """Index scoring and top-k from the rows' index queries `qi` (before RoPE); the candidate
        source also publishes its level-1 blocks."""
        spec, T = self.spec, x.shape[0]
        owner = cache.owner(spec.kv_owner)
        qi = self.rope(qi.view(T, self.i_heads, self.i_dim), batch.positions)
        qi = quant.index_query_qat(qi, owner.index_fmt)        # as the scorer reads it
        w = self.i_wproj(x).to(acc_dtype(x.dtype)) * self.i_scale
        topk = torch.empty(T, self.topk, dtype=torch.long, device=x.device)
        produce = spec.produces_candidates
        cand_in = sel.get("cand") if spec.role is Role.REINDEX and spec.candidate_owner is not None else None
        cand_out = torch.empty(T, self.n_cand, dtype=torch.long, device=x.device) if produce else None
        ops.index_topk(qi, w, owner.index, owner.index_scale, batch.block_table, batch.batch_ids,
                       batch.positions, spec.ratio, owner.rows_per_page, owner.index_fmt, cand_in,
                       self.cand_block, topk, cand_out, batch.max_position)
        sel["topk", spec.layer] = topk
        if produce:
            sel["cand"] = cand_out
