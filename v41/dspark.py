"""The DSpark draft (spec §3.6) over a flat batch of requests: three extra blocks `mtp.0..2`
propose `dspark_block_size` (5) tokens after a target step.

Context. Every target row whose position can fall in a later draft window leaves, per draft
stage s, one context key FP8QAT(RoPE_p(kv_norm_s(wkv_s(main_x[p])))) with
main_x = main_norm(main_proj([tap37; tap38; tap39])) (a tap is the mean over the residual
streams at a layer's input). The keys live in a window ring per stage, row slot·W + p mod W,
exactly like a target layer's ring: in the STATE slot they are layers n..n+2 of the ring plane
(`rings` here is that plane's [n_draft, slots·W, head_dim] part). `write_context` fills them.

Draft. For a request whose target has processed positions ..P and sampled `anchor`, the draft
rows sit at P+1..P+5 with tokens [anchor, noise × 4]; each stage is an ordinary Block (mHC,
window attention, MoE with the draft's experts) whose attention reads the stage's ring rows at
positions (P-W, P] at or above the request's context floor, then all five draft rows
(bidirectional). The head reads the collapsed stream; the Markov head adds, row by row, a bias
from the previously proposed token, and the confidence head reads [hd; markov embedding].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

import custom_ops  # noqa: F401  (registers torch.ops.v41)
from v41.config import V41Config
from v41.layers import Linear, RMSNorm, Rope, acc_dtype, f32_linear
from v41.mhc import collapse
from v41.model import Block, prepare_weights, tap  # noqa: F401  (tap: the target records it)

ops = torch.ops.v41


def prepare_draft_weights(cfg: V41Config, weights, dtype, device=None, native: bool | None = None) -> list[dict]:
    """The draft stages' compute tensors, one dict per stage in the layout `prepare_weights`
    gives a backbone layer (the stage `mtp.s` is layer n+s of the topology), plus the extras:
    `main_proj`, `main_norm` (stage 0); `norm`, `markov_head.embed`, `markov_head.head`,
    `confidence_head.proj` (last stage; the confidence head in the accumulation dtype, the Markov
    head, like the LM head, in the activation dtype: its FP32 products are exact from bf16)."""
    n, acc = cfg.num_hidden_layers, acc_dtype(dtype)
    renamed = {}
    for name, t in weights.items():
        if name.startswith("mtp."):
            _, s, rest = name.split(".", 2)
            renamed[f"layers.{n + int(s)}.{rest}"] = t
    stages = prepare_weights(cfg, renamed, dtype, device, native)
    out = []
    for s in range(cfg.n_draft):
        w = stages.get(f"layers.{n + s}")
        if w is None:
            raise KeyError(f"weights: no mtp.{s}.* tensors (the DSpark draft needs all {cfg.n_draft} stages)")
        out.append(w)
    for name in ("main_proj", "main_norm"):
        if name not in out[0]:
            raise KeyError(f"weights: mtp.0.{name}.weight is missing")
    last = out[-1]
    for name in ("norm", "markov_head.embed", "markov_head.head", "confidence_head.proj"):
        if name not in last:
            raise KeyError(f"weights: mtp.{cfg.n_draft - 1}.{name}.weight is missing")
    last["confidence_head.proj"] = last["confidence_head.proj"].to(acc)
    return out


@dataclass
class DraftBatch:
    """The draft rows of a step, B requests × block rows, request-major (the Batch fields a
    window-only Block reads)."""
    input_ids: torch.Tensor       # [B·T] anchor, then noise
    positions: torch.Tensor       # [B·T] P+1 .. P+T
    batch_ids: torch.Tensor       # [B·T]
    win_idx: torch.Tensor         # [B·T, W+T] context ring rows (oldest first, -1 below the floor), then the block
    ring_dest: torch.Tensor       # [B·T] all -1: draft rows never enter a ring
    block_table: torch.Tensor     # [B, 1] unused by window-only layers
    image_dest: None = None
    engram_rows: None = None


@dataclass
class Draft:
    logits: torch.Tensor          # [B, T, vocab] accumulation dtype, Markov bias included
    tokens: torch.Tensor          # [B, T] proposed tokens for positions P+2 .. P+T+1
    confidence: torch.Tensor      # [B, T] sigmoid of the confidence head


class _StageRings:
    """The draft rings seen as a cache: `ring[layer]` for the draft layers n..n+2."""

    def __init__(self, rings: torch.Tensor, first_layer: int):
        self.rings, self.first = rings, first_layer

    @property
    def ring(self):
        return self

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.rings[layer - self.first]


class DSpark(nn.Module):
    def __init__(self, cfg: V41Config, weights, embed_weight: torch.Tensor, head: torch.Tensor,
                 dtype=torch.bfloat16, device=None, max_pos: int | None = None, native: bool | None = None):
        """`weights`: the checkpoint mapping (its `mtp.*` tensors are prepared here);
        `embed_weight`, `head`: the target's (shared, spec §3.6); `native`: FP8/FP4 weights kept
        native, as the target's (`prepare_weights`)."""
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.T, self.W, self.hc = cfg.dspark_block_size, cfg.sliding_window, cfg.hc_mult
        self.noise = cfg.dspark_noise_token_id
        w = prepare_draft_weights(cfg, weights, dtype, device, native)
        self.max_pos = (max_pos or cfg.max_position_embeddings) + self.T
        self.rope = Rope(cfg.qk_rope_head_dim, cfg.rope_theta, None, self.max_pos, device)
        specs = cfg.topology.layers[cfg.topology.n_backbone:]
        self.blocks = nn.ModuleList(Block(cfg, spec, ws, self.rope) for spec, ws in zip(specs, w))
        self.first_layer = specs[0].layer
        eps = cfg.rms_norm_eps
        self.main_proj, self.main_norm = Linear(w[0]["main_proj"], "fp8"), RMSNorm(w[0]["main_norm"], eps)
        last = w[-1]
        self.norm = RMSNorm(last["norm"], eps)
        self.markov_embed, self.markov_head = last["markov_head.embed"], last["markov_head.head"]
        self.confidence_proj = last["confidence_head.proj"]
        self.embed_weight, self.head = embed_weight, head

    # ---- context ------------------------------------------------------------------------
    def context_keys(self, taps, positions: torch.Tensor, check: bool = True) -> list[torch.Tensor]:
        """Each stage's context key of the tapped rows: [T, head_dim] per stage. `check=False`:
        the caller checked the positions (SpecStep.keep_context, on its host copy)."""
        if len(taps) != len(self.cfg.dspark_target_layer_ids):
            raise ValueError(f"taps: {len(taps)} tensors, expected one per layer "
                             f"{self.cfg.dspark_target_layer_ids}")
        if check:
            self.check_positions("positions", positions)
        return self.keys(torch.cat(list(taps), -1), positions)

    def keys(self, taps: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
        """`context_keys` of the concatenated taps [T, n_taps·D] (a compiled engine installs its
        compiled segment here: runtime/compile/draft.py)."""
        main_x = self.main_norm(self.main_proj(taps))
        return [b.attn.window_kv(main_x, positions) for b in self.blocks]

    def write_context(self, taps, positions: torch.Tensor, dest: torch.Tensor, rings: torch.Tensor) -> None:
        """Write the tapped rows' context keys into the stage rings at `dest` (slot·W + p mod W,
        -1: not kept; the target's ring_dest of the same rows)."""
        if dest.shape != positions.shape:
            raise ValueError(f"dest: shape {tuple(dest.shape)}, positions {tuple(positions.shape)}")
        self._check_rings(rings)
        for ring, key in zip(rings, self.context_keys(taps, positions)):
            ops.scatter_rows(ring, key, dest)

    # ---- draft --------------------------------------------------------------------------
    def check_inputs(self, anchors, anchor_pos, slots, floors, n_ring: int) -> None:
        """The draft's inputs [B] (tensors, or host arrays before a graph replays them): shapes,
        slots inside the rings, positions inside the RoPE table. Reads their values."""
        for name, t in (("anchors", anchors), ("anchor_pos", anchor_pos), ("slots", slots), ("floors", floors)):
            if t.ndim != 1 or t.shape != anchors.shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, expected [{anchors.shape[0]}] like anchors")
        if len(anchors):
            if int(slots.min()) < 0 or (int(slots.max()) + 1) * self.W > n_ring:
                raise ValueError(f"slots: outside the {n_ring // self.W} ring slots")
            if int(anchor_pos.min()) < 0:
                raise ValueError("anchor_pos: negative position")
            self.check_positions("anchor_pos", anchor_pos + self.T)     # the last draft row's

    def draft_batch(self, anchors, anchor_pos, slots, floors, n_ring: int, check: bool = True) -> DraftBatch:
        """The draft rows of B requests: anchors, anchor_pos (P), slots and context floors
        (the first position with a context key; positions below it are not read) [B].
        `check=False`: the caller checked them (`check_inputs`; a graph capture cannot read them)."""
        if check:
            self.check_inputs(anchors, anchor_pos, slots, floors, n_ring)
        B, T, W, dev = anchors.shape[0], self.T, self.W, anchors.device
        pos = anchor_pos[:, None] + 1 + torch.arange(T, device=dev)
        q = anchor_pos[:, None] - (W - 1) + torch.arange(W, device=dev)        # oldest first
        ctx = torch.where(q >= floors.clamp(min=0)[:, None], slots[:, None] * W + q % W, -1)
        own = n_ring + torch.arange(B * T, device=dev).view(B, T)
        win = torch.cat([ctx, own], 1).repeat_interleave(T, 0)
        ids = torch.full((B, T), self.noise, dtype=torch.long, device=dev)
        ids[:, 0] = anchors
        bid = torch.arange(B, device=dev).repeat_interleave(T)
        none = torch.full((B * T,), -1, dtype=torch.long, device=dev)
        return DraftBatch(ids.flatten(), pos.flatten(), bid, win, none,
                          torch.zeros(B, 1, dtype=torch.long, device=dev))

    def forward(self, anchors, anchor_pos, slots, floors, rings: torch.Tensor,
                choose: Callable | None = None, check: bool = True) -> Draft:
        """Propose T tokens per request. `choose(logits [B, vocab], i) -> [B]` picks the token
        of draft row i (the next row's Markov input); default greedy (argmax, lowest id on ties).
        `check=False`: inputs checked by the caller (`check_inputs`)."""
        self._check_rings(rings)
        batch = self.draft_batch(anchors, anchor_pos, slots, floors, rings.shape[1], check)
        B, T, acc = anchors.shape[0], self.T, acc_dtype(self.dtype)
        X = self.embed_weight[batch.input_ids].unsqueeze(1).expand(-1, self.hc, -1).contiguous()
        pre = torch.zeros(X.shape[0], self.hc, dtype=acc, device=X.device)
        pre[:, 0] = 1
        X, pre = self.run_blocks(X, pre, batch, _StageRings(rings, self.first_layer))
        hd = collapse(X, pre)
        base = f32_linear(self.norm(hd), self.head).view(B, T, -1)
        # the Markov bias of row i depends on the token row i-1 proposed: T steps over all requests
        tok, logits, tokens, embeds = anchors, [], [], []
        for i in range(T):
            e = self.markov_embed[tok]
            lg = base[:, i] + f32_linear(e, self.markov_head)
            tok = lg.argmax(-1) if choose is None else choose(lg, i)
            logits.append(lg), tokens.append(tok), embeds.append(e)
        conf_in = torch.cat([hd.view(B, T, -1), torch.stack(embeds, 1)], -1).to(acc)
        conf = torch.sigmoid(conf_in @ self.confidence_proj.T).squeeze(-1)
        return Draft(torch.stack(logits, 1), torch.stack(tokens, 1), conf)

    def run_blocks(self, X, pre, batch: DraftBatch, cache) -> tuple:
        """The three stages over the draft rows (a compiled engine installs its compiled
        segment here: runtime/compile/draft.py)."""
        for block in self.blocks:
            X, pre = block(X, pre, batch, cache, {})
        return X, pre

    # ---- checks -------------------------------------------------------------------------
    def _check_rings(self, rings: torch.Tensor) -> None:
        want = (len(self.blocks), self.cfg.head_dim)
        if rings.dim() != 3 or (rings.shape[0], rings.shape[2]) != want or rings.shape[1] % self.W:
            raise ValueError(f"rings: shape {tuple(rings.shape)}, expected [{want[0]}, slots·{self.W}, {want[1]}]")

    def check_positions(self, name: str, pos) -> None:
        if len(pos) and int(pos.max()) >= self.max_pos:
            raise ValueError(f"{name}: position {int(pos.max())} past the draft's RoPE table ({self.max_pos})")
