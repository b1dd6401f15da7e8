"""The independent reference oracle: a plain full-sequence forward of spec/model.md §3 for one
request, written from the spec. v41's paged runtime is compared against it (float64, 1e-6).

It takes a `V41Config` and a weights mapping (names of spec §5.2, as `v41.loader` produces them)
and imports no v41 model code (only `v41.config` and `v41.topology`; its Engram hashing is its own).

Precision contract. `dtype` is the activation dtype: every point where the spec rounds to BF16
becomes a cast to `dtype`; every FP32 point computes in `acc` (float64 when dtype is float64,
else float32). With dtype=bfloat16 the oracle follows REF's rounding points (index scores stay
in acc, see `index_scores`). Quantizers (tests/reference/quant.py) are exact in any dtype.

    o = Oracle(cfg, weights)                    # float64, REF's FP4 index plane
    logits = o.forward(ids)                     # [S, vocab], acc
    o.last.taps, o.last.selections, o.last.stats
    d = o.draft(ids)                            # DSpark draft block after ids
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from v41.config import V41Config
from v41.topology import Role

from . import quant as Q
from .engram_hashing import DEAD, EngramLayout, hash_ids

NEG_INF = float("-inf")


# ---- §2.2 RMSNorm, §2.3 RoPE/YaRN ------------------------------------------------------------

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, acc: torch.dtype) -> torch.Tensor:
    """w ⊙ (x · rsqrt(mean(x²) + eps)) in acc, cast once to x.dtype."""
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (w.to(acc) * y).to(x.dtype)


def yarn_range(rope_dim: int, base: float, orig: int, beta_fast: float, beta_slow: float) -> tuple[int, int]:
    """(low, high) of the YaRN ramp, REF `find_correction_range`."""
    def cd(n):
        return rope_dim * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(base))
    return max(math.floor(cd(beta_fast)), 0), min(math.ceil(cd(beta_slow)), rope_dim - 1)


def rope_freqs(cfg: V41Config, ratio: int) -> torch.Tensor:
    """FP32 inverse frequencies [r/2] of a layer: ratio 0 → rope_theta, no YaRN; ratio > 0 →
    compress_rope_theta with YaRN (no mscale). Built exactly as REF, all in FP32."""
    r = cfg.qk_rope_head_dim
    base = float(cfg.rope_theta if ratio == 0 else cfg.compress_rope_theta)
    f = 1.0 / (base ** (torch.arange(0, r, 2, dtype=torch.float32) / r))
    sc = cfg.rope_scaling or {}
    orig = int(sc.get("original_max_position_embeddings", 0) or 0)
    if ratio > 0 and sc.get("rope_type", sc.get("type")) == "yarn" and orig > 0:
        low, high = yarn_range(r, base, orig, sc["beta_fast"], sc["beta_slow"])
        if low == high:
            high += 0.001
        ramp = ((torch.arange(r // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        f = f / sc["factor"] * (1 - smooth) + f * smooth
    return f


def rope_table(freqs: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) FP32 [N, r/2]: angles = outer(fp32 positions, freqs) rounded once in FP32,
    then FP32 torch.polar (spec §2.3: the table is FP32 even in a float64 oracle)."""
    ang = torch.outer(positions.to(torch.float32), freqs)
    cis = torch.polar(torch.ones_like(ang), ang)
    return cis.real.contiguous(), cis.imag.contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, acc: torch.dtype,
               inverse: bool = False) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of the LAST r dims by e^{±iθ}; computed in acc,
    written back in x.dtype. cos/sin broadcast against x[..., r/2]."""
    r = 2 * cos.shape[-1]
    xr = x[..., -r:].to(acc).unflatten(-1, (r // 2, 2))
    x0, x1 = xr[..., 0], xr[..., 1]
    c, s = cos.to(acc), sin.to(acc)
    if inverse:
        s = -s
    y = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return torch.cat((x[..., :-r], y.to(x.dtype)), dim=-1)


# ---- §3.1 mHC ---------------------------------------------------------------------------------

def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """C = softmax_row(logits) + eps; C /= colsum + eps; then (iters-1) × (row, col) passes.
    logits [..., hc, hc] with C[i][j] row-major; returns the comb matrix."""
    c = torch.softmax(logits, dim=-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


# ---- §3.3 (g)(h) selection, (i) sparse attention ----------------------------------------------

def stable_desc_order(score: torch.Tensor) -> torch.Tensor:
    """Indices by descending score; exact ties keep the smaller index first."""
    return torch.sort(score, dim=-1, descending=True, stable=True).indices


def candidate_blocks(score: torch.Tensor, vis: torch.Tensor, block: int, keep: int) -> torch.Tensor:
    """§3.3(g) level 1: block score = max over `block` consecutive rows (pad -inf); the block of
    the newest visible row forced +inf; keep the top `keep` blocks with score > -inf (ties:
    smaller block first). Returns the boolean row mask [S, R]."""
    S, R = score.shape
    nb = -(-R // block)
    if nb == 0:
        return torch.zeros(S, 0, dtype=torch.bool)
    score = score.masked_fill(torch.arange(R)[None, :] >= vis[:, None], NEG_INF)
    bs = F.pad(score, (0, nb * block - R), value=NEG_INF).view(S, nb, block).amax(-1)
    has = vis > 0
    newest = (vis - 1).clamp(min=0) // block
    bs[has, newest[has]] = float("inf")
    order = stable_desc_order(bs)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(nb).expand(S, nb))
    kept = (rank < keep) & (bs > NEG_INF)
    return kept.repeat_interleave(block, dim=1)[:, :R]


def topk_rows(score: torch.Tensor, vis: torch.Tensor, topk: int) -> torch.Tensor:
    """§3.3(h): per query the top k = min(topk, visible) rows by score (ties: smaller row first),
    sorted ascending, -1 padded to width min(topk, R). Only visible rows (j < vis) are eligible;
    a visible row scored -inf (outside candidates) would still fill a slot if fewer than k rows
    are finite (REF's positional -1 rule; it cannot happen when candidate_topk_blocks ·
    candidate_block_size leaves at least index_topk rows, as in toy and Flash)."""
    S, R = score.shape
    K = min(topk, R)
    visible = torch.arange(R)[None, :] < vis[:, None]
    # invisible rows tie at -inf with visible -inf rows and sort after them (larger index)
    order = stable_desc_order(score.masked_fill(~visible, NEG_INF))[:, :K]
    k = torch.clamp(vis, max=topk)
    sel = torch.where(torch.arange(K)[None, :] < k[:, None], order, torch.full_like(order, R))
    sel = torch.sort(sel, dim=-1).values
    return torch.where(sel == R, torch.full_like(sel, -1), sel)


def sparse_attn_sink(q: torch.Tensor, pool: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                     scale: float, acc: torch.dtype, block: int = 64) -> torch.Tensor:
    """§3.3(i): o_h = Σ exp(s_i) kv_i / (exp(sink_h) + Σ exp(s_i)), s_i = scale·q_h·kv_i, K = V.
    q [S, H, d]; pool [N, d] rows; idx [S, L] into pool in attention order, -1 skipped.
    Online softmax over blocks of 64 indices (running max seeded -1e30), unnormalized
    probabilities cast to q.dtype before P·V, running sum from the uncast values, sink added
    after the last block, division last; a query with no valid index outputs 0."""
    S, H, d = q.shape
    valid = idx >= 0
    kv = pool[idx.clamp(min=0)].to(acc)                              # [S, L, d]
    s = torch.einsum("shd,sld->shl", q.to(acc), kv) * scale
    s = s.masked_fill(~valid[:, None, :], NEG_INF)
    m = torch.full((S, H), -1e30, dtype=acc)
    num = torch.zeros(S, H, d, dtype=acc)
    den = torch.zeros(S, H, dtype=acc)
    for b0 in range(0, idx.shape[1], block):
        sb = s[..., b0:b0 + block]
        m_new = torch.maximum(m, sb.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(sb - m_new[..., None])
        num = num * alpha[..., None] + torch.einsum("shl,sld->shd", p.to(q.dtype).to(acc), kv[:, b0:b0 + block])
        den = den * alpha + p.sum(-1)
        m = m_new
    den = den + torch.exp(sink.to(acc)[None, :] - m)
    o = num / den[..., None]
    o = torch.where(valid.any(-1)[:, None, None], o, torch.zeros_like(o))
    return o.to(q.dtype)


# ---- forward record ---------------------------------------------------------------------------

@dataclass
class ForwardState:
    """What one `forward` saw, kept on `Oracle.last` (rows are local: row t = position start+t)."""
    start: int
    positions: torch.Tensor
    taps: list = field(default_factory=list)          # [S, D] per dspark tap layer, dtype
    selections: dict = field(default_factory=dict)    # scoring layer → [S, K] owner rows, -1 pad
    candidates: dict = field(default_factory=dict)    # producer layer → bool [S, R]
    main_rows: dict = field(default_factory=dict)     # kv owner → [R, head_dim] (FP4-QAT'd)
    index_rows: dict = field(default_factory=dict)    # kv owner → [R, index_head_dim]
    window_kv: dict = field(default_factory=dict)     # layer → [S, head_dim] (FP8-QAT'd)
    window_lo: dict = field(default_factory=dict)     # layer → [S] first window position
    hidden: torch.Tensor | None = None                # final collapsed stream [S, D]
    stats: dict = field(default_factory=dict)
    cached: tuple | None = None                       # (hit, ForwardState of a cold run)


@dataclass
class DraftResult:
    logits: torch.Tensor        # [block, vocab] acc: head(norm(hd)) + Markov bias
    tokens: torch.Tensor        # [block] greedy drafted tokens (positions anchor_pos+2 ..)
    confidence: torch.Tensor    # [block] sigmoid(confidence_head.proj([hd; markov_embed]))
    positions: torch.Tensor     # [block] positions of the draft rows (anchor_pos+1 ..)
    context: torch.Tensor       # positions of the context rows attended


def replay_window(first_row: int, from_layer: int = 0) -> Callable:
    """A `window_start` hook for SWA bounded replay: in layers >= from_layer a query at position
    p >= first_row reads no window row below `first_row` ([max(first_row, p-W+1), p]); earlier
    queries keep their full window (a replaying runtime does not compute them at all).
    Decoder replay = (tail start, cfg.topology.boundary); encoder replay = (replay start, 0)."""
    def hook(layer: int, positions: torch.Tensor) -> torch.Tensor | None:
        if layer < from_layer:
            return None
        return torch.where(positions >= first_row, first_row, 0)
    return hook


class Oracle:
    def __init__(self, cfg: V41Config, weights, dtype: torch.dtype = torch.float64,
                 index_plane: str = "fp4", token_map=None):
        if index_plane not in ("fp4", "fp8"):
            raise ValueError(f"index_plane {index_plane!r}: 'fp4' (REF) or 'fp8' (runtime plane)")
        if dtype not in (torch.float64, torch.float32, torch.bfloat16):
            raise ValueError(f"dtype {dtype}: float64, float32 or bfloat16")
        self.cfg = cfg
        self.topo = cfg.topology
        self.raw = weights
        self.dtype = dtype
        self.acc = torch.float64 if dtype == torch.float64 else torch.float32
        self.index_plane = index_plane
        self.eps = cfg.rms_norm_eps
        self._w: dict[str, torch.Tensor] = {}
        for name in weights:
            if not name.endswith(".scale") and ".engram.embed." not in name:
                self.W(name)          # dequantize everything once
        if token_map is None:
            token_map = np.arange(cfg.vocab_size, dtype=np.int64) % cfg.engram_compressed_vocab_size
        self.token_map = torch.as_tensor(np.asarray(token_map), dtype=torch.int64)
        self.engram = EngramLayout(cfg, pad_id=int(self.token_map[cfg.engram_pad_token_id]))
        self.freqs = {0: rope_freqs(cfg, 0), 1: rope_freqs(cfg, 1)}   # window / compressed layers
        self.last: ForwardState | None = None

    # ---- weights (§2.5, §4) ----
    def W(self, name: str) -> torch.Tensor:
        """A weight in acc: FP8 E4M3 × E8M0 32×32 blocks, packed FP4 × E8M0 1×32, or as stored."""
        if name not in self._w:
            w = self.raw[name]
            sname = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None
            if sname is not None and sname in self.raw:
                if w.dtype == torch.float8_e4m3fn:
                    w = Q.dequant_fp8_block(w, self.raw[sname], self.acc)
                else:
                    w = Q.dequant_fp4_packed(w, self.raw[sname], self.acc)
            self._w[name] = w.to(self.acc)
        return self._w[name]

    # linear flavours: FP8/FP4 weights with FP8 act quant, BF16, FP32
    def qlinear(self, x, name):
        """x → FP8 per-32 (ue8m0) QAT → GEMM in acc → dtype (FP8-block and FP4 W4A8 linears)."""
        return (Q.fp8_qat(x, 32).to(self.acc) @ self.W(name + ".weight").T).to(self.dtype)

    def blinear(self, x, name):
        """BF16 linear: no act quant, GEMM in acc, output dtype."""
        return (x.to(self.acc) @ self.W(name + ".weight").T).to(self.dtype)

    def flinear(self, x, name):
        """FP32 linear: input cast to acc, output acc."""
        return x.to(self.acc) @ self.W(name + ".weight").T

    def norm(self, x, name):
        return rms_norm(x, self.W(name), self.eps, self.acc)

    def rope(self, ratio: int, positions: torch.Tensor):
        return rope_table(self.freqs[1 if ratio else 0], positions)

    def greedy_after(self, prompt, continuation, **kw) -> list[int]:
        """The argmax token after prompt + continuation[:i] for each i < len(continuation), from
        one forward over prompt + continuation[:-1] (`kw`: forward's). The oracle is causal
        (tests/test_oracle.py test_causality), so this equals `continuation` exactly when greedy
        decoding after `prompt`, one forward per token, gives `continuation`."""
        ids = torch.as_tensor([*prompt, *continuation[:-1]], dtype=torch.int64)
        return self.forward(ids, **kw)[len(prompt) - 1:].argmax(-1).tolist()

    # ---- §3.0 top level ----
    def forward(self, token_ids, start: int = 0, window_start: Callable | None = None,
                engram_history=None, cached: tuple | None = None) -> torch.Tensor:
        """Logits [S, vocab] (acc) of tokens at positions start..start+S-1. The request has no
        context before `start` (start > 0 only moves positions; it must be a multiple of
        2·candidate_block_size so row groups and candidate blocks align).
        window_start(layer, positions) -> LongTensor | None: a floor on the first window
        position per query (bounded replay); the window is [max(floor, p-W+1, start), p].
        engram_history: compressed ids before `start` (default: DEAD = pad n-grams).
        cached: (hit, state of an earlier untruncated forward over the same prefix): owner rows
        of groups ending below `hit` are taken from it, as a runtime resuming a prefix hit reads
        them from the prefix cache instead of recomputing them (encoder replay)."""
        cfg, dt, acc = self.cfg, self.dtype, self.acc
        ids = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1)
        S = ids.numel()
        align = 2 * cfg.candidate_block_size
        if start % align:
            raise ValueError(f"start {start} must be a multiple of {align}")
        pos = start + torch.arange(S)
        st = ForwardState(start, pos, cached=cached)
        st.stats = {"seq_len": S, "window": cfg.sliding_window, "window_dropped": S > cfg.sliding_window,
                    "layers": {}}
        hashes = self.engram_hashes(ids, start, engram_history)
        X = self.W("embed.weight")[ids].to(dt)[:, None, :].expand(S, cfg.hc_mult, -1).contiguous()
        pre = F.one_hot(torch.zeros(S, dtype=torch.int64), cfg.hc_mult).to(acc)
        for spec in self.topo.backbone:
            l = spec.layer
            if l in self.topo.engram_layers:
                X = self.engram_layer(l, X, hashes[l])
            if l in self.topo.dspark_taps:
                st.taps.append(X.to(acc).mean(1).to(dt))
            attn = lambda x, spec=spec: self.attention(spec, x, st, window_start)
            X, pre = self.block(f"layers.{l}", X, pre, attn, cfg.n_routed_experts, cfg.num_experts_per_tok)
        y = self.collapse(X, pre)
        st.hidden = y
        self.last = st
        return self.flinear(self.norm(y, "norm.weight"), "head")

    # ---- §3.1 mHC ----
    def hc_mixes(self, X, prefix):
        """(pre [S,hc], post [S,hc], comb [S,hc,hc]) in acc from the stream X [S, hc, D]."""
        hc = self.cfg.hc_mult
        fn, base, scale = self.W(prefix + "_fn"), self.W(prefix + "_base"), self.W(prefix + "_scale")
        xf = X.reshape(X.shape[0], -1).to(self.acc)
        m = (xf @ fn.T) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + self.cfg.hc_eps
        post = 2 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
        logits = (m[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc)
        comb = sinkhorn(logits, self.cfg.hc_sinkhorn_iters, self.cfg.hc_eps)
        return pre, post, comb

    def collapse(self, X, mix):
        """Σ_k mix[k]·X[k] in acc, cast dtype."""
        return (mix[..., None] * X.to(self.acc)).sum(-2).to(self.dtype)

    def expand(self, out, X, post, comb):
        """X'[j] = post[j]·out + Σ_i C[i][j]·X[i] in acc, cast dtype."""
        new = post[..., None] * out.to(self.acc)[:, None, :] + torch.einsum("sij,sid->sjd", comb, X.to(self.acc))
        return new.to(self.dtype)

    def block(self, prefix, X, pre_in, attn, n_experts, topk):
        """Single-pass delayed pre-mix: attention uses pre_in, the FFN uses attention's pre,
        the FFN's pre goes to the next block."""
        pA, postA, cA = self.hc_mixes(X, prefix + ".hc_attn")
        a = attn(self.norm(self.collapse(X, pre_in), prefix + ".attn_norm.weight"))
        X = self.expand(a, X, postA, cA)
        pF, postF, cF = self.hc_mixes(X, prefix + ".hc_ffn")
        f = self.moe(prefix + ".ffn", self.norm(self.collapse(X, pA), prefix + ".ffn_norm.weight"), n_experts, topk)
        return self.expand(f, X, postF, cF), pF

    # ---- §3.2 Engram ----
    def engram_hashes(self, ids, start, history):
        out = {}
        if not self.topo.engram_layers:
            return out
        c = self.token_map[ids]
        n_hist = min(start, self.cfg.engram_max_ngram_size - 1)
        if history is None:
            history = [DEAD] * n_hist
        for i, l in enumerate(self.topo.engram_layers):
            out[l] = hash_ids(c, self.engram, i, start=start, history=history)
        return out

    def engram_rows(self, prefix, hids):
        """Table rows of the hash ids [.., n, head_dim] in acc: FP8 × E8M0 per 32 (a trainer
        overrides it to read rows of a float table instead)."""
        table, tscale = self.raw[prefix + ".embed.weight"], self.raw[prefix + ".embed.scale"]
        return Q.dequant_fp8_rows(table[hids], tscale[hids], self.acc)

    def engram_layer(self, l, X, hids):
        cfg, acc = self.cfg, self.acc
        p = f"layers.{l}.engram"
        S, hc, D = X.shape
        e = self.engram_rows(p, hids).to(self.dtype).reshape(S, -1)
        kv = self.qlinear(e, p + ".wkv")                                   # [S, (hc+1)·D]
        key = kv[:, :hc * D].reshape(S, hc, D).to(acc)
        value = kv[:, hc * D:(hc + 1) * D].to(acc)
        wqk = self.W(p + ".q_weight") * self.W(p + ".k_weight")            # [hc, D]
        xa = X.to(acc)
        dot = ((xa * wqk * key).sum(-1)
               * torch.rsqrt(xa.square().mean(-1) + self.eps)
               * torch.rsqrt(key.square().mean(-1) + self.eps) / math.sqrt(D))
        mag = torch.sqrt(dot.abs().clamp(min=1e-6))
        gate = torch.sigmoid(torch.where(dot >= 0, mag, -mag))              # ±0 counts as positive
        return (xa + gate[..., None] * value[:, None, :]).to(self.dtype)

    # ---- §3.3 attention ----
    def query(self, prefix, x, cos, sin):
        """(a): qr = q_norm(wq_a(x)); q = RoPE(wq_b(qr)) [S, H, head_dim]."""
        cfg = self.cfg
        qr = self.norm(self.qlinear(x, prefix + ".wq_a"), prefix + ".q_norm.weight")
        q = self.qlinear(qr, prefix + ".wq_b").view(-1, cfg.num_attention_heads, cfg.head_dim)
        return qr, apply_rope(q, cos[:, None], sin[:, None], self.acc)

    def window_kv(self, prefix, x, cos, sin):
        """(b): FP8 QAT (group 32, all dims) of RoPE(kv_norm(wkv(x)))."""
        kv = self.norm(self.qlinear(x, prefix + ".wkv"), prefix + ".kv_norm.weight")
        return Q.fp8_qat(apply_rope(kv, cos, sin, self.acc), 32)

    def output(self, prefix, o, cos, sin):
        """(j): inverse RoPE at the query position, grouped wo_a (BF16), wo_b (FP8)."""
        cfg = self.cfg
        o = apply_rope(o, cos[:, None], sin[:, None], self.acc, inverse=True)
        G = cfg.o_groups
        o = o.reshape(o.shape[0], G, -1)
        wa = self.W(prefix + ".wo_a.weight").view(G, cfg.o_lora_rank, -1)
        z = torch.einsum("sgi,goi->sgo", o.to(self.acc), wa).to(self.dtype).reshape(o.shape[0], -1)
        return self.qlinear(z, prefix + ".wo_b")

    def attention(self, spec, x, st: ForwardState, window_start):
        cfg, l = self.cfg, spec.layer
        p = f"layers.{l}.attn"
        S = x.shape[0]
        cos, sin = self.rope(spec.ratio, st.positions)
        qr, q = self.query(p, x, cos, sin)
        kv = self.window_kv(p, x, cos, sin)
        st.window_kv[l] = kv
        sel, main = None, None
        if spec.role is Role.FULL:
            self.compress(spec, x, st)
        if spec.role in (Role.FULL, Role.REINDEX):
            sel = self.index_select(spec, x, qr, cos, sin, st)
            st.selections[l] = sel
        elif spec.role is Role.REUSE:
            sel = st.selections[spec.topk_owner]
        if spec.ratio > 0:
            main = st.main_rows[spec.kv_owner]
        lo = self.window_lo(l, st, window_start)
        st.window_lo[l] = lo
        idx = attention_indices(st.positions - st.start, lo - st.start, sel, S)
        pool = kv if main is None else torch.cat((kv, main), dim=0)
        o = sparse_attn_sink(q, pool, idx, self.W(p + ".attn_sink"), cfg.head_dim ** -0.5, self.acc)
        return self.output(p, o, cos, sin)

    def window_lo(self, layer, st, window_start):
        pos = st.positions
        lo = torch.clamp(pos - self.cfg.sliding_window + 1, min=st.start)
        if window_start is not None:
            floor = window_start(layer, pos)
            if floor is not None:
                lo = torch.minimum(torch.maximum(lo, torch.as_tensor(floor, dtype=torch.int64)), pos)
        return lo

    def compress(self, spec, x, st: ForwardState):
        """(c) compressor, (d) index keys, (e) main rows of a FULL owner; row j stands for local
        positions {r·j .. r·j+r-1} and is RoPE'd at position start + r·j."""
        cfg, acc, l, r = self.cfg, self.acc, spec.layer, spec.ratio
        c = f"layers.{l}.attn.compressor"
        n = x.shape[0] // r
        if r == 2:
            v = self.flinear(x, c + ".wkv")[: 2 * n].view(n, 2, cfg.head_dim)
            g = self.flinear(x, c + ".wgate")[: 2 * n].view(n, 2, cfg.head_dim)
            latent = (v * torch.softmax(g, dim=1)).sum(1).to(self.dtype)
        elif r == 1:
            latent = self.blinear(x, c + ".wkv")
        else:
            raise ValueError(f"layer {l}: compress ratio {r}")
        latent = self.norm(latent, c + ".norm.weight")
        cos, sin = self.rope(r, st.start + r * torch.arange(n))
        ix = f"layers.{l}.attn.indexer"
        k = self.norm(self.blinear(latent, ix + ".wk"), ix + ".k_norm.weight")
        st.index_rows[l] = Q.fp4_qat_ue8m0(apply_rope(k, cos, sin, acc), 32)
        st.main_rows[l] = Q.fp4_qat_e4m3(apply_rope(latent, cos, sin, acc), 16)
        if st.cached is not None:  # encoder replay: groups below the hit come from the cache
            hit, cold = st.cached
            keep = min(hit // r, n)
            st.index_rows[l][:keep] = cold.index_rows[l][:keep]
            st.main_rows[l][:keep] = cold.main_rows[l][:keep]

    def index_scores(self, spec, x, qr, cos, sin, st):
        """(f): score[t, j] = Σ_h relu(qI[t,h]·k_j)·wI[t,h] in acc over the kv owner's index
        rows; -inf where j >= (t+1)//ratio (t local)."""
        cfg, acc = self.cfg, self.acc
        ix = f"layers.{spec.layer}.attn.indexer"
        nI, dI = cfg.index_n_heads, cfg.index_head_dim
        qI = self.qlinear(qr, ix + ".wq_b").view(-1, nI, dI)
        qI = apply_rope(qI, cos[:, None], sin[:, None], acc)
        kI = st.index_rows[spec.kv_owner]
        if self.index_plane == "fp8":
            # the FP8 plane's scorer quantizes the query itself, per (token, head), straight
            # from the rotated query; the stored FP4-rounded key is re-rounded per row
            qI, kI = Q.fp8_qat(qI, dI), Q.fp8_qat(kI, dI)
        else:
            qI = Q.fp4_qat_ue8m0(qI, 32)  # the published model: FP4 on both sides
        wI = self.blinear(x, ix + ".weights_proj").to(acc) * (dI ** -0.5 * nI ** -0.5)
        # exact dots rounded once to acc: FP8/FP4 values with power-of-two scales sum exactly
        # in float64, so the score is the same whatever order a GEMM would add them in
        logits = torch.einsum("shd,rd->shr", qI.to(torch.float64), kI.to(torch.float64)).to(acc).relu()
        score = (logits * wI[:, :, None]).sum(1)
        vis = (st.positions - st.start + 1) // spec.ratio
        score = score.masked_fill(torch.arange(kI.shape[0])[None, :] >= vis[:, None], NEG_INF)
        return score, vis

    def index_select(self, spec, x, qr, cos, sin, st):
        """(f)-(h) for FULL and REINDEX layers; returns [S, K] ascending owner rows, -1 pad."""
        cfg = self.cfg
        score, vis = self.index_scores(spec, x, qr, cos, sin, st)
        stats = {"visible_max": int(vis.max()), "topk_dropped": int((vis > cfg.index_topk).sum())}
        if spec.role is Role.REINDEX and spec.candidate_owner is not None:
            cand = st.candidates[spec.candidate_owner]
            score = score.masked_fill(~cand, NEG_INF)
            finite = (score > NEG_INF).sum(1)
            stats["reindex_underfull"] = int((finite < torch.clamp(vis, max=cfg.index_topk)).sum())
        if spec.produces_candidates:
            cb = cfg.candidate_block_size
            st.candidates[spec.layer] = candidate_blocks(score, vis, cb, cfg.candidate_topk_blocks)
            stats["candidate_blocks_dropped"] = int(((vis + cb - 1) // cb > cfg.candidate_topk_blocks).sum())
        sel = topk_rows(score, vis, cfg.index_topk)
        st.stats["layers"][spec.layer] = stats
        return sel

    # ---- §3.4 MoE ----
    def moe(self, prefix, x, n_experts, topk):
        cfg, acc = self.cfg, self.acc
        s = torch.sqrt(F.softplus(self.flinear(x, prefix + ".gate")))     # sqrtsoftplus, [S, E]
        sel = stable_desc_order(s + self.W(prefix + ".gate.bias"))[:, :topk]
        w = s.gather(1, sel)
        w = w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
        y = torch.zeros(x.shape[0], cfg.hidden_size, dtype=acc)
        for e in range(n_experts):
            rows, slot = (sel == e).nonzero(as_tuple=True)
            if rows.numel():
                y[rows] += self.expert(f"{prefix}.experts.{e}", x[rows], w[rows, slot]).to(acc)
        y += self.expert(prefix + ".shared_experts", x, None).to(acc)
        return y.to(self.dtype)

    def expert(self, prefix, x, route_w):
        """Clamped SwiGLU; the routing weight multiplies silu(g)·u in acc before w2's act quant."""
        lim, acc = self.cfg.swiglu_limit, self.acc
        g = self.qlinear(x, prefix + ".w1").to(acc)
        u = self.qlinear(x, prefix + ".w3").to(acc)
        h = F.silu(torch.clamp(g, max=lim)) * torch.clamp(u, -lim, lim)
        if route_w is not None:
            h = route_w[:, None] * h
        return self.qlinear(h.to(self.dtype), prefix + ".w2")

    # ---- §3.6 DSpark draft ----
    def draft(self, token_ids=None, taps=None, anchor_pos: int | None = None, anchor_token: int | None = None,
              start: int = 0, context_start: int | None = None) -> DraftResult:
        """The draft block after the target has processed positions ..anchor_pos.
        taps: the target's tap rows [S, D] ×3 for positions start..start+S-1 (default: run
        `forward(token_ids)` and use its taps). anchor_pos: the last processed target position
        P (default start+S-1). anchor_token: the token sampled at P (default the greedy argmax of
        the target logits at P). Draft rows sit at P+1..P+block: [anchor, noise × (block-1)];
        every row attends to the stage's context rows at positions (P-W, P] (∩ >= context_start,
        the first row the runtime wrote draft context for) and to all block rows."""
        cfg, dt, acc = self.cfg, self.dtype, self.acc
        logits = None
        if taps is None:
            logits = self.forward(token_ids, start=start)
            taps, start = self.last.taps, self.last.start
        S = taps[0].shape[0]
        P = start + S - 1 if anchor_pos is None else int(anchor_pos)
        if not start <= P < start + S:
            raise ValueError(f"anchor_pos {P} outside the tapped rows {start}..{start + S - 1}")
        if anchor_token is None:
            if logits is None:
                raise ValueError("anchor_token is needed when taps are given")
            anchor_token = int(logits[P - start].argmax())
        T, W, hc = cfg.dspark_block_size, cfg.sliding_window, cfg.hc_mult
        lo = max(P - W + 1, start, context_start if context_start is not None else start)
        ctx_pos = torch.arange(lo, P + 1)
        main_hidden = torch.cat([t[ctx_pos - start] for t in taps], dim=-1)
        main_x = self.norm(self.qlinear(main_hidden, "mtp.0.main_proj"), "mtp.0.main_norm.weight")
        pos = P + 1 + torch.arange(T)
        toks = torch.full((T,), cfg.dspark_noise_token_id, dtype=torch.int64)
        toks[0] = anchor_token
        X = self.W("embed.weight")[toks].to(dt)[:, None, :].expand(T, hc, -1).contiguous()
        pre = F.one_hot(torch.zeros(T, dtype=torch.int64), hc).to(acc)
        ctx_cos, ctx_sin = self.rope(0, ctx_pos)
        cos, sin = self.rope(0, pos)
        C = ctx_pos.numel()
        idx = torch.arange(C + T)[None, :].expand(T, -1)       # context ascending, then the block
        for s in range(cfg.n_draft):
            p = f"mtp.{s}"
            ctx_kv = self.window_kv(p + ".attn", main_x, ctx_cos, ctx_sin)

            def attn(x, p=p, ctx_kv=ctx_kv):
                qr, q = self.query(p + ".attn", x, cos, sin)
                kv = self.window_kv(p + ".attn", x, cos, sin)
                o = sparse_attn_sink(q, torch.cat((ctx_kv, kv)), idx, self.W(p + ".attn.attn_sink"),
                                     cfg.head_dim ** -0.5, acc)
                return self.output(p + ".attn", o, cos, sin)
            X, pre = self.block(p, X, pre, attn, cfg.dspark_n_routed_experts, cfg.dspark_num_experts_per_tok)
        hd = self.collapse(X, pre)
        last = f"mtp.{cfg.n_draft - 1}"
        base = self.flinear(self.norm(hd, last + ".norm.weight"), "head")
        emb, mhead = self.W(last + ".markov_head.embed.weight"), self.W(last + ".markov_head.head.weight")
        out_logits, out_tok, embeds = [], [], []
        tok = anchor_token
        for i in range(T):
            e = emb[tok].to(dt)                                    # W1[x_{i}] (BF16 table)
            lg = base[i] + e.to(acc) @ mhead.T
            tok = int(lg.argmax())
            out_logits.append(lg), out_tok.append(tok), embeds.append(e)
        conf_in = torch.cat((hd, torch.stack(embeds)), dim=-1)
        conf = torch.sigmoid(self.flinear(conf_in, last + ".confidence_head.proj")).squeeze(-1)
        return DraftResult(torch.stack(out_logits), torch.tensor(out_tok), conf, pos, ctx_pos)


def attention_indices(t: torch.Tensor, lo: torch.Tensor, sel: torch.Tensor | None, S: int) -> torch.Tensor:
    """[S, L] indices into cat(window rows [S], owner main rows): the window rows lo..t
    ascending (local), then the selected owner rows ascending (offset S); -1 padded. The two
    sets may overlap in time (no exclusion)."""
    wc = t - lo + 1
    Lw = int(wc.max()) if t.numel() else 0
    Lm = 0 if sel is None else sel.shape[1]
    j = torch.arange(Lw + Lm)[None, :]
    idx = torch.where(j < wc[:, None], lo[:, None] + j, torch.full_like(j, -1).expand(t.numel(), -1))
    if Lm:
        k = (sel >= 0).sum(1)
        jm = j - wc[:, None]
        in_main = (jm >= 0) & (jm < k[:, None])
        main = S + sel.gather(1, jm.clamp(0, Lm - 1))
        idx = torch.where(in_main, main, idx)
    return idx
