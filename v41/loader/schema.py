"""The native checkpoint's schema (spec/model.md §5.2-5.3): every tensor of a config with its dtype,
shape, quantization group and part, and the counts built on it (parameters per part, tensors and
bytes on disk)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from v41.config import V41Config
from v41.topology import Role

PARTS = ("routed_experts", "engram_tables", "dspark", "other")
KINDS = ("bf16", "f32", "fp8", "e8m0", "fp4")

_KIND_DTYPE = {"bf16": torch.bfloat16, "f32": torch.float32, "fp8": torch.float8_e4m3fn,
               "e8m0": torch.float8_e8m0fnu, "fp4": torch.int8}
# safetensors header dtype strings
_ST_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
             torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8"}


class CheckpointError(ValueError):
    """A checkpoint that does not match the schema of its config. `problems` lists every finding;
    each names the tensor or shard concerned. Raised before any tensor data is read."""

    def __init__(self, problems, where: str = ""):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        head = f"checkpoint {where}: " if where else "checkpoint: "
        shown = self.problems[:20]
        more = f"\n  ... and {len(self.problems) - 20} more" if len(self.problems) > 20 else ""
        if len(shown) == 1:
            msg = head + shown[0]
        else:
            msg = head + f"{len(self.problems)} problems:\n  - " + "\n  - ".join(shown) + more
        super().__init__(msg)


# ---- schema -----------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple
    kind: str                   # bf16 | f32 | fp8 | e8m0 | fp4
    part: str                   # routed_experts | engram_tables | dspark | other
    group: tuple | None = None  # quantized weight / scale: the block one scale covers (rows, cols)
    logical: tuple | None = None  # quantized weight / scale: the unpacked weight shape [out, in]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _dtype_size(self.dtype)

    @property
    def params(self) -> int:
        """Counted parameters (spec §5.3): scales count 0, packed FP4 bytes count 2."""
        if self.kind == "e8m0":
            return 0
        return self.numel * (2 if self.kind == "fp4" else 1)

    @property
    def st_dtype(self) -> str:
        return _ST_DTYPE[self.dtype]


def _dtype_size(dt: torch.dtype) -> int:
    return torch.empty((), dtype=dt, device="meta").element_size()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def checkpoint_schema(cfg: V41Config) -> dict[str, TensorSpec]:
    """Every tensor of the native checkpoint of `cfg` (spec §5.2), in a fixed order:
    embed, backbone layers, draft stages, final norm, head."""
    S: dict[str, TensorSpec] = {}
    D, hc, V = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
    H, hd, ql = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    mix = hc * (hc + 2)

    def plain(name, kind, shape, part):
        S[name] = TensorSpec(_KIND_DTYPE[kind], tuple(int(s) for s in shape), kind, part)

    def fp8(prefix, n, k, part, group=(32, 32), weight_part=None):
        gr, gc = group
        S[prefix + ".weight"] = TensorSpec(torch.float8_e4m3fn, (n, k), "fp8", weight_part or part,
                                           group, (n, k))
        S[prefix + ".scale"] = TensorSpec(torch.float8_e8m0fnu, (_cdiv(n, gr), _cdiv(k, gc)), "e8m0",
                                          weight_part or part, group, (n, k))

    def fp4(prefix, n, k, part):
        if k % 2:
            raise ValueError(f"{prefix}: FP4 input width {k} is odd")
        S[prefix + ".weight"] = TensorSpec(torch.int8, (n, k // 2), "fp4", part, (1, 32), (n, k))
        S[prefix + ".scale"] = TensorSpec(torch.float8_e8m0fnu, (n, _cdiv(k, 32)), "e8m0", part,
                                          (1, 32), (n, k))

    plain("embed.weight", "bf16", (V, D), "other")
    topo = cfg.topology
    n_back = cfg.num_hidden_layers
    engram_rows = dict(zip(cfg.engram_layer_ids, cfg.engram_num_embeddings))
    for spec in topo.layers:
        draft = spec.draft
        idx = spec.layer - n_back if draft else spec.layer
        p = f"mtp.{idx}." if draft else f"layers.{idx}."
        part = "dspark" if draft else "other"
        # Engram sits before the block (spec §3.0)
        if not draft and spec.layer in engram_rows:
            rows = engram_rows[spec.layer]
            fp8(p + "engram.embed", rows, cfg.engram_head_dim, "engram_tables", group=(1, 32))
            fp8(p + "engram.wkv", (hc + 1) * D, cfg.engram_width, part)
            plain(p + "engram.k_weight", "bf16", (hc, D), part)
            plain(p + "engram.q_weight", "bf16", (hc, D), part)
        # mHC
        for s in ("attn", "ffn"):
            plain(p + f"hc_{s}_fn", "f32", (mix, hc * D), part)
            plain(p + f"hc_{s}_base", "f32", (mix,), part)
            plain(p + f"hc_{s}_scale", "f32", (3,), part)
        plain(p + "attn_norm.weight", "bf16", (D,), part)
        # attention
        a = p + "attn."
        plain(a + "attn_sink", "f32", (H,), part)
        plain(a + "q_norm.weight", "bf16", (ql,), part)
        plain(a + "kv_norm.weight", "bf16", (hd,), part)
        fp8(a + "wq_a", ql, D, part)
        fp8(a + "wq_b", H * hd, ql, part)
        fp8(a + "wkv", hd, D, part)
        fp8(a + "wo_a", cfg.o_groups * cfg.o_lora_rank, cfg.o_group_in, part)
        fp8(a + "wo_b", D, cfg.o_groups * cfg.o_lora_rank, part)
        # compare role values, not members: under `python -m v41.config` the enum class exists twice
        role = Role(spec.role.value)
        if role is Role.FULL:
            plain(a + "compressor.wkv.weight", "bf16", (hd, D), part)
            if spec.ratio == 2:
                plain(a + "compressor.wgate.weight", "bf16", (hd, D), part)
            plain(a + "compressor.norm.weight", "bf16", (hd,), part)
            plain(a + "indexer.wk.weight", "bf16", (cfg.index_head_dim, hd), part)
            plain(a + "indexer.k_norm.weight", "bf16", (cfg.index_head_dim,), part)
        if role in (Role.FULL, Role.REINDEX):
            fp8(a + "indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, ql, part)
            plain(a + "indexer.weights_proj.weight", "bf16", (cfg.index_n_heads, D), part)
        # MoE
        plain(p + "ffn_norm.weight", "bf16", (D,), part)
        f = p + "ffn."
        n_exp = cfg.dspark_n_routed_experts if draft else cfg.n_routed_experts
        I = cfg.moe_intermediate_size
        plain(f + "gate.weight", "bf16", (n_exp, D), part)
        plain(f + "gate.bias", "f32", (n_exp,), part)
        plain(f + "gate.bias_vl", "f32", (n_exp,), part)
        epart = "dspark" if draft else "routed_experts"
        for e in range(n_exp):
            fp4(f + f"experts.{e}.w1", I, D, epart)
            fp4(f + f"experts.{e}.w3", I, D, epart)
            fp4(f + f"experts.{e}.w2", D, I, epart)
        fp8(f + "shared_experts.w1", I, D, part)
        fp8(f + "shared_experts.w3", I, D, part)
        fp8(f + "shared_experts.w2", D, I, part)
        # DSpark extras
        if draft and idx == 0:
            fp8(p + "main_proj", D, len(cfg.dspark_target_layer_ids) * D, part)
            plain(p + "main_norm.weight", "bf16", (D,), part)
        if draft and idx == cfg.num_nextn_predict_layers - 1:
            r = cfg.dspark_markov_rank
            plain(p + "norm.weight", "bf16", (D,), part)
            plain(p + "markov_head.embed.weight", "bf16", (V, r), part)
            plain(p + "markov_head.head.weight", "bf16", (V, r), part)
            plain(p + "confidence_head.proj.weight", "bf16", (1, D + r), part)
    plain("norm.weight", "bf16", (D,), "other")
    plain("head.weight", "bf16", (V, D), "other")
    return S


def is_host_table(name: str) -> bool:
    """Engram tables stay on the host (memory, not the accelerator)."""
    return ".engram.embed." in name


def count_params(cfg: V41Config) -> dict:
    """Parameters per part, counted from tensors built on the meta device (spec §5.3 rule:
    `.scale` tensors are not counted; a packed FP4 byte counts 2 parameters)."""
    out = {"routed_experts": 0, "engram_tables": 0, "dspark": 0, "vision": 0, "other": 0}
    for spec in checkpoint_schema(cfg).values():
        if spec.kind == "e8m0":
            continue
        t = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
        out[spec.part] += t.numel() * (2 if spec.kind == "fp4" else 1)
    out["total"] = sum(out[k] for k in ("routed_experts", "engram_tables", "dspark", "vision", "other"))
    return out


def schema_totals(cfg: V41Config, schema: dict | None = None) -> dict:
    """Tensor count and bytes on disk per part (spec §5.3 "bytes on disk")."""
    schema = schema if schema is not None else checkpoint_schema(cfg)
    b = {p: 0 for p in PARTS}
    n = {p: 0 for p in PARTS}
    for spec in schema.values():
        b[spec.part] += spec.nbytes
        n[spec.part] += 1
    return {"tensors": len(schema), "bytes": sum(b.values()), "bytes_per_part": b,
            "tensors_per_part": n}
