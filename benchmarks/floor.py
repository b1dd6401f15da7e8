"""The floor of an engine step (issue 16's `floor_ms`): the bytes the step must read at the copy
rate, or its weight GEMMs' FLOPs at the measured tensor-core peak, whichever is larger.

Bytes: every device tensor of the model once (weights and their scales), except what a step
touches only in part: of each MoE layer's routed experts the ones `requests x top_k` tokens can
reach (min(E, k·n) of E: exact for one token, the worst case above), of the embedding (and the
DSpark draft's Markov embedding) the rows looked up, of the RoPE tables nothing worth counting;
plus the KV pages and slot state the requests hold (at 1,024-token contexts the sparse attention
and the indexer read all of it).
FLOPs: 2 x the weight elements each token multiplies (the routed experts k of E, the LM head
once per sampled row: a request's last in decode and prefill, every row in a DSpark verify step
or draft), at the FP8 peak for FP8/FP4 weights and the bf16 peak for the rest (FP32
weights too: a lower bound of their time, so the floor stays a floor); attention's own FLOPs
are left out.
"""
from __future__ import annotations

import math

import torch

COPY_RATE = 4.24e12                  # bytes/s, the H200 copy rate issue 16 names
# measured in native-gemm-h200.json (torch._scaled_mm FP8 and cuBLAS bf16 on 8192^3)
PEAK_TFLOPS = {"fp8": 1261.4, "bf16": 746.0}


def _tensors(model) -> dict[int, tuple[str, torch.Tensor]]:
    """Every tensor the model's modules hold, by storage address, with its owner's name."""
    out: dict[int, tuple[str, torch.Tensor]] = {}
    for mname, m in model.named_modules():
        for attr, v in vars(m).items():
            items = v.items() if attr in ("_parameters", "_buffers") else [(attr, v)]
            for name, t in items:
                if isinstance(t, torch.Tensor) and t.numel():
                    out.setdefault(t.untyped_storage().data_ptr(), (f"{mname}.{name}", t))
    return out


def weight_bytes(model) -> int:
    """Bytes of every tensor the model holds (weights, scales, RoPE tables)."""
    return sum(t.nbytes for _, t in _tensors(model).values())


def _elements(t: torch.Tensor) -> int:
    return t.numel() * (2 if t.dtype == torch.int8 else 1)     # int8: packed FP4 pairs


def step_floor(model, kind: str, requests: int, tokens_each: int, state_bytes: int) -> dict:
    """{'bytes', 'flops', 'bytes_ms', 'flops_ms', 'floor_ms'} of one decode step (one token per request), prefill step
    (`tokens_each` per request) or verify step (`tokens_each` per request, each row sampled: a
    DSpark verify forward, or the draft's) of `model` (a v41.model.Transformer, or a
    v41.dspark.DSpark: its blocks, heads and the target's shared embedding and head);
    `state_bytes`: the KV pages and slot state the requests hold."""
    from v41.moe import MoE
    if kind not in ("decode", "prefill", "verify"):
        raise ValueError(f"step_floor: kind {kind!r} is not 'decode', 'prefill' or 'verify'")
    tokens = requests * (1 if kind == "decode" else tokens_each)
    sampled = tokens if kind == "verify" else requests
    partial: dict[int, float] = {}        # storage -> fraction of it a step reads
    per_token: dict[int, float] = {}      # storage -> fraction of it each token multiplies
    for m in model.modules():
        if isinstance(m, MoE):
            e, k = m.gate.shape[0], m.top_k
            for t in (m.w1, m.w3, m.w2, *((m.s1, m.s3, m.s2) if m.native else ())):
                partial[t.untyped_storage().data_ptr()] = min(e, k * tokens) / e
                per_token[t.untyped_storage().data_ptr()] = k / e
    emb, head = model.embed_weight, model.head
    lookups = {t.untyped_storage().data_ptr(): t for t in (emb, getattr(model, "markov_embed", None)) if t is not None}
    for ptr, table in lookups.items():            # the embedding, and the DSpark draft's Markov embedding
        partial[ptr] = min(1.0, tokens / table.shape[0])
    nbytes, flops, flops_s = float(state_bytes), 0.0, 0.0
    for ptr, (name, t) in _tensors(model).items():
        if name.endswith((".cos", ".sin")):
            continue                      # RoPE tables: a row per position
        nbytes += t.nbytes * partial.get(ptr, 1.0)
        if t.dim() < 2 or t.dtype == torch.uint8 or ptr in lookups:
            continue                      # norms, sinks, biases, E8M0 scales, the lookup tables
        rows = sampled if ptr == head.untyped_storage().data_ptr() else tokens * per_token.get(ptr, 1.0)
        peak = PEAK_TFLOPS["fp8" if t.dtype in (torch.float8_e4m3fn, torch.int8) else "bf16"]
        flops += 2 * _elements(t) * rows
        flops_s += 2 * _elements(t) * rows / (peak * 1e12)
    floor = max(nbytes / COPY_RATE, flops_s) * 1e3
    return {"bytes": int(nbytes), "flops": int(flops), "flops_ms": round(flops_s * 1e3, 4),
            "bytes_ms": round(nbytes / COPY_RATE * 1e3, 4), "floor_ms": round(floor, 4)}


def held_state_bytes(geo, requests: int, tokens_each: int) -> int:
    """Bytes of the KV pages and slot state `requests` requests of `tokens_each` tokens hold."""
    return requests * (math.ceil(tokens_each / geo.page_tokens) * geo.bytes_per_page + geo.bytes_per_state)
