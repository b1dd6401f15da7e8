"""DeepSeek-V4.1 as plain PyTorch over a flat token batch (spec §3).

The forward takes the tokens of many requests at once, each with its own positions; a `Batch`
carries the step's metadata (batch id per token, block tables, ring and page destinations) and
a `Cache` the PAGE and STATE planes. Nothing loops over requests: Q/KV and output projections
run over all tokens, and the ops that need request boundaries take all of them in one call.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from custom_ops.gemm import check_native, native_weights
from v41 import quant
from v41.attention import Attention
from v41.config import V41Config
from v41.engram.device import Engram
from v41.layers import RMSNorm, Rope, acc_dtype, f32_linear
from v41.mhc import MHC, collapse, expand
from v41.moe import MoE

log = logging.getLogger("v41.model")


def tap(X: torch.Tensor) -> torch.Tensor:
    """A DSpark tap: the mean over the residual streams X [T, hc, D], in the accumulation
    dtype, cast once (the target records it at the input of each `dspark_target_layer_ids`)."""
    return X.to(acc_dtype(X.dtype)).mean(1).to(X.dtype)


class Block(nn.Module):
    def __init__(self, cfg: V41Config, spec, w: dict, rope: Rope):
        super().__init__()
        eps = cfg.rms_norm_eps
        mk = lambda s: MHC(w[f"hc_{s}_fn"], w[f"hc_{s}_base"], w[f"hc_{s}_scale"], cfg.hc_mult,  # noqa: E731
                           cfg.hc_sinkhorn_iters, cfg.hc_eps, eps)
        self.layer = spec.layer
        self.mix_attn, self.mix_ffn = mk("attn"), mk("ffn")
        self.attn_norm, self.ffn_norm = RMSNorm(w["attn_norm"], eps), RMSNorm(w["ffn_norm"], eps)
        self.attn = Attention(cfg, spec, {k[5:]: v for k, v in w.items() if k.startswith("attn.")}, rope)
        self.ffn = MoE({k[4:]: v for k, v in w.items() if k.startswith("ffn.")},
                       cfg.num_experts_per_tok if spec.layer < cfg.num_hidden_layers else
                       cfg.dspark_num_experts_per_tok, cfg.routed_scaling_factor, cfg.swiglu_limit)
        self.engram = Engram(w, cfg.hc_mult, eps) if "engram.wkv" in w else None
        self.tap_out = None        # DSpark: [rows, D] buffer this layer's input tap goes to (record_taps)

    def forward(self, X, pre, batch, cache, sel, queries=None):
        """The block on every row, or (`queries`, v41.attention.QueryRows) every row's window KV
        and the rest on the query rows alone: the output has their rows."""
        if self.tap_out is not None:
            self.tap_out.narrow(0, 0, X.shape[0]).copy_(tap(X))
        if self.engram is not None:
            X = self.engram(X, batch.engram_rows[self.layer])
        x = self.attn_norm(collapse(X, pre))
        if queries is not None:
            if not len(queries.rows):      # no row samples this step: the window KV is all it leaves
                self.attn.keep_window(cache.ring[self.layer], self.attn.window_kv(x, batch.positions), batch, cache)
                return X[:0], pre[:0]
            X = X[queries.rows]
        pa, post, comb = self.mix_attn(X)
        X = expand(self.attn(x, batch, cache, sel, queries), X, post, comb)
        pf, post, comb = self.mix_ffn(X)
        X = expand(self.ffn(self.ffn_norm(collapse(X, pa))), X, post, comb)
        return X, pf

    def compress(self, X, pre, batch, cache) -> None:
        """This layer's compression alone (a FULL owner's global rows and index keys): under
        decoder bounded replay the boundary layer compresses every row, the rest runs on the tail."""
        self.attn.compress(self.attn_norm(collapse(X, pre)), batch, cache)


class Transformer(nn.Module):
    def __init__(self, cfg: V41Config, weights: dict, dtype=torch.bfloat16, device=None, max_pos=None,
                 native: bool | None = None):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.native = native_weights(device, dtype) if native is None else native
        w = prepare_weights(cfg, weights, dtype, device, self.native)
        max_pos = max_pos or cfg.max_position_embeddings
        window = Rope(cfg.qk_rope_head_dim, cfg.rope_theta, None, max_pos, device)
        compressed = Rope(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling, max_pos, device)
        topo = cfg.topology
        self.layers = nn.ModuleList(
            Block(cfg, s, w[f"layers.{s.layer}"], compressed if s.ratio else window) for s in topo.backbone)
        self.embed_weight = w["embed.weight"]
        self.norm = RMSNorm(w["norm.weight"], cfg.rms_norm_eps)
        self.head = w["head.weight"]
        self.hc = cfg.hc_mult

    def record_taps(self, out: torch.Tensor | None) -> None:
        """DSpark: from now on each forward writes the tap of the j-th tapped layer's input rows
        (all rows, or the decoder's under bounded replay) into out[j] ([n_taps, rows, D]); None
        stops it. A buffer, not a return value: the compiled pieces and CUDA graphs write it in
        place like the cache."""
        for j, layer in enumerate(self.cfg.topology.dspark_taps):
            self.layers[layer].tap_out = None if out is None else out[j]

    def forward(self, batch, cache):
        """Hidden state after the final collapse and norm, [T, D]: of every token, or under
        decoder bounded replay (`batch.decoder`) of the rows the step samples."""
        X, pre = self.embed(batch)
        sel: dict = {}
        queries, last, boundary = None, len(self.layers) - 1, self.cfg.topology.boundary
        for i, block in enumerate(self.layers):
            if i == boundary and batch.decoder is not None:
                X, pre, batch, sel, queries = self.enter_decoder(X, pre, batch, cache, sel)
                if not X.shape[0]:
                    break
            X, pre = block(X, pre, batch, cache, sel, queries if i == last else None)
        return self.final(X, pre)

    def enter_decoder(self, X, pre, batch, cache, sel):
        """Decoder bounded replay (batch.decoder: runtime.replay.DecoderRows): the boundary layer
        compresses every row (the global KV all later rows read), then the decoder goes on with
        its own rows. Returns the decoder's X, pre, batch, selections and last-layer queries."""
        dec = batch.decoder
        self.layers[self.cfg.topology.boundary].compress(X, pre, batch, cache)
        r = dec.rows
        return X[r], pre[r], dec.batch, {k: v[r] for k, v in sel.items()}, dec.queries

    # the head and the tail of the forward, also run by the compiled segments (runtime/compile/)
    def embed(self, batch):
        """The residual streams of the batch's tokens (hc copies of each embedding) and the first
        collapse weights (all on stream 0): (X [T, hc, D], pre [T, hc])."""
        X = self.embed_weight[batch.input_ids].unsqueeze(1).expand(-1, self.hc, -1).contiguous()
        pre = torch.zeros(X.shape[0], self.hc, dtype=acc_dtype(self.dtype), device=X.device)
        pre[:, 0] = 1
        return X, pre

    def final(self, X, pre):
        """The last collapse and the final norm: [T, D]."""
        return self.norm(collapse(X, pre))

    def logits(self, h):
        return f32_linear(h, self.head)


# ---- weights ----------------------------------------------------------------------------

def prepare_weights(cfg: V41Config, weights: dict, dtype, device, native: bool | None = None) -> dict:
    """Native checkpoint tensors (after post-load processing) -> compute tensors: global ones by
    name, layer ones grouped under `layers.L` with the prefix and the `.weight` suffix stripped.
    FP8/FP4 weights stay native (quant.BlockScaled: codes and E8M0 scales) where the op registry
    runs native GEMMs (custom_ops.gemm.native_weights: CUDA with the Triton impls; `native`
    overrides), else they are dequantized once here; activation quantization stays in the
    forward. Tensors the spec keeps in FP32 (mHC, sink, router, ratio-2 compressor, Engram's
    q/k weights, whose product is formed in FP32) take the accumulation dtype."""
    acc = acc_dtype(dtype)
    native = native_weights(device, dtype) if native is None else native
    out: dict = {}
    for name, t in weights.items():
        if name.endswith(".scale") or ".engram.embed." in name or name.startswith("mtp."):
            continue
        if t.dtype in (torch.float8_e4m3fn, torch.int8):      # FP8 block / packed FP4 expert
            scale_name = name[: -len("weight")] + "scale"
            t = quant.BlockScaled(t, weights[scale_name])
            if native:
                check_native(scale_name, t)
            t = t.to(device) if native else t.dequant(dtype)
        if not name.startswith("layers."):
            out[name] = t.to(device=device, dtype=dtype)
            continue
        _, idx, rest = name.split(".", 2)
        rest = rest.removesuffix(".weight")
        f32 = rest.startswith(("hc_", "attn.attn_sink", "ffn.gate", "engram.q_weight", "engram.k_weight")) \
            or (rest.startswith("attn.compressor.w") and cfg.compress_ratios[int(idx)] == 2)
        if not isinstance(t, quant.BlockScaled):
            t = t.to(device=device, dtype=acc if f32 else dtype)
        out.setdefault(f"layers.{idx}", {})[rest] = t
    for layer in out.values():
        if isinstance(layer, dict):
            _stack_experts(layer)
    log.info("weights on %s: %s", device, ", ".join(
        f"{fmt} {n / 2**20:.1f} MiB" for fmt, n in weight_bytes(out).items()))
    return out


def _stack_experts(layer: dict) -> None:
    n = sum(1 for k in layer if k.startswith("ffn.experts.") and k.endswith(".w1"))
    for p in ("w1", "w3", "w2"):
        ws = [layer.pop(f"ffn.experts.{e}.{p}") for e in range(n)]
        layer[f"ffn.experts.{p}"] = quant.BlockScaled.stack(ws) if ws and \
            isinstance(ws[0], quant.BlockScaled) else torch.stack(ws)


def weight_bytes(prepared: dict) -> dict[str, int]:
    """Bytes of the prepared weights by storage format (fp8, fp4 and their e8m0 scales; the
    plain tensors by dtype): the startup memory report."""
    out: dict[str, int] = {}

    def add(key, n):
        out[key] = out.get(key, 0) + n

    for t in prepared.values():
        for v in (t.values() if isinstance(t, dict) else (t,)):
            if isinstance(v, quant.BlockScaled):
                add(v.fmt, v.q.nbytes)
                add("e8m0", v.scale.nbytes)
            else:
                add(str(v.dtype).removeprefix("torch."), v.nbytes)
    return out
