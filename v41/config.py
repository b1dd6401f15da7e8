"""V41Config: one object for an HF `config.json` (root + `text_config`), the presets, the layer
topology and the admission checks that refuse a bad configuration before any weight is read.

    python -m v41.config flash            # the topology table (spec/model.md §1.2)
    python -m v41.config toy --json       # topology, Engram layout and parameter counts
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from v41.topology import Topology, build_topology


class ConfigError(ValueError):
    """A configuration that v41 refuses; the message starts with the offending field."""

    def __init__(self, fld: str, msg: str):
        super().__init__(f"{fld}: {msg}")
        self.field = fld


NATIVE_QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic",
                       "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}


@dataclass
class V41Config:
    # root
    architectures: list = field(default_factory=lambda: ["DeepseekV41ForCausalLM"])
    model_type: str = "deepseek_v41"
    dtype: str = "bfloat16"
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    image_token_id: int = 129264
    quantization_config: dict = field(default_factory=lambda: dict(NATIVE_QUANTIZATION))
    # text_config
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    hidden_act: str = "silu"
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-20
    attention_bias: bool = False
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict = field(default_factory=lambda: {
        "rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
        "beta_fast": 32, "beta_slow": 1})
    sliding_window: int = 128
    compress_ratios: list = field(default_factory=lambda: [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0])
    kv_source_layer_ids: list = field(default_factory=lambda: [2, 8, 14, 20])
    index_source_layer_ids: list = field(default_factory=lambda: [2, 8, 14, 20, 24, 28, 32, 36])
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    n_routed_experts: int = 384
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2304
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    first_k_dense_replace: int = 0
    num_hash_layers: int = 0
    tie_word_embeddings: bool = False
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: list = field(default_factory=lambda: [1, 14])
    engram_num_embeddings: list = field(default_factory=lambda: [384006168, 384016682])
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16000000
    engram_compressed_vocab_size: int = 99092
    engram_pad_token_id: int = 2
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: list = field(default_factory=lambda: [37, 38, 39])
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    # v41 runtime defaults carried with a preset (not HF fields)
    kv_cache_block_size: int = 128
    name: str = "custom"

    # ---- derived -----------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def n_draft(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def o_group_in(self) -> int:
        """Input width of one `wo_a` group: the heads of the group side by side."""
        return self.num_attention_heads * self.head_dim // self.o_groups

    @property
    def engram_width(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads * self.engram_head_dim

    @property
    def topology(self) -> "Topology":
        return build_topology(self)

    def to_hf_dict(self) -> dict:
        """The HF `config.json` layout: root fields plus `text_config`."""
        d = dataclasses.asdict(self)
        root = {k: d.pop(k) for k in _ROOT_FIELDS}
        d.pop("kv_cache_block_size"), d.pop("name")
        d["model_type"] = "deepseek_v41_text"
        root["text_config"] = d
        root["v41"] = {"kv_cache_block_size": self.kv_cache_block_size, "name": self.name}
        return root


_ROOT_FIELDS = ("architectures", "model_type", "dtype", "bos_token_id", "eos_token_id",
                "pad_token_id", "image_token_id", "quantization_config")
# the reference's inference/config.json names for the same fields
_REF_ALIASES = {"engram_pad_id": "engram_pad_token_id"}


def from_hf_dict(d: dict) -> V41Config:
    """Build a config from an HF `config.json` dict. Unknown text fields are refused by name."""
    d = json.loads(json.dumps(d))  # deep copy
    text = d.pop("text_config", None)
    if text is None:
        raise ConfigError("text_config", "missing (expected an HF config with model_type deepseek_v41)")
    extras = d.pop("v41", {}) or {}
    d.pop("vision_config", None)  # no vision tower yet: vision fields are not read
    known = {f.name for f in dataclasses.fields(V41Config)}
    kw = {}
    for k, v in d.items():
        if k in _ROOT_FIELDS:
            kw[k] = v
    if kw.get("model_type", "deepseek_v41") != "deepseek_v41":
        raise ConfigError("model_type", f"{kw['model_type']!r} is not 'deepseek_v41'")
    text.pop("model_type", None)
    for k, v in text.items():
        k = _REF_ALIASES.get(k, k)
        if k in ("vision_config",):
            continue
        if k not in known or k in _ROOT_FIELDS or k in ("name", "kv_cache_block_size"):
            raise ConfigError(f"text_config.{k}", "unknown field")
        kw[k] = v
    for k, v in extras.items():
        if k not in ("kv_cache_block_size", "name"):
            raise ConfigError(f"v41.{k}", "unknown field")
        kw[k] = v
    cfg = V41Config(**kw)
    validate(cfg)
    return cfg


# ---- validation -------------------------------------------------------------------------

def _mult(cfg, name, value, k):
    if value % k:
        raise ConfigError(name, f"{value} is not a multiple of {k}")


def validate(cfg: V41Config) -> None:
    """Every rule of spec/model.md §1.1 "ATOM validators" plus v41's width rules (§8.3)."""
    if cfg.architectures != ["DeepseekV41ForCausalLM"]:
        raise ConfigError("architectures", f"{cfg.architectures} is not ['DeepseekV41ForCausalLM']")
    q = dict(cfg.quantization_config or {})
    if q != NATIVE_QUANTIZATION:
        raise ConfigError("quantization_config", f"{q} is not the native block {NATIVE_QUANTIZATION}")
    n, nd = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    if n < 1:
        raise ConfigError("num_hidden_layers", "must be positive")
    rs = cfg.compress_ratios
    if len(rs) != n + nd:
        raise ConfigError("compress_ratios", f"has {len(rs)} entries; need num_hidden_layers + "
                          f"num_nextn_predict_layers = {n + nd}")
    for i, r in enumerate(rs):
        if r not in (0, 1, 2):
            raise ConfigError("compress_ratios", f"layer {i} has ratio {r}; only 0, 1, 2 exist")
        if i >= n and r != 0:
            raise ConfigError("compress_ratios", f"draft layer {i} has ratio {r}; draft ratios must be 0")
    kv, idx = list(cfg.kv_source_layer_ids), list(cfg.index_source_layer_ids)
    for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", idx)):
        if not ids:
            raise ConfigError(name, "is empty")
        if ids != sorted(set(ids)):
            raise ConfigError(name, f"{ids} must be strictly increasing")
        for i in ids:
            if not 0 <= i < n:
                raise ConfigError(name, f"layer {i} is not a backbone layer")
            if rs[i] == 0:
                raise ConfigError(name, f"layer {i} has ratio 0; a source must compress")
    missing = sorted(set(kv) - set(idx))
    if missing:
        raise ConfigError("index_source_layer_ids", f"must contain every kv source; missing {missing}")
    owner = None
    for i in range(n):
        if rs[i] == 0:
            continue
        if i in kv:
            owner = i
        if owner is None:
            raise ConfigError("kv_source_layer_ids", f"layer {i} (ratio {rs[i]}) has no preceding kv owner")
        if rs[owner] != rs[i]:
            raise ConfigError("compress_ratios", f"layer {i} has ratio {rs[i]} but its kv owner "
                              f"{owner} has ratio {rs[owner]}")
        if not any(owner <= j <= i for j in idx):
            raise ConfigError("index_source_layer_ids", f"layer {i} has no index source at or after "
                              f"its kv owner {owner}")
    if cfg.candidate_source_layer_id not in idx:
        raise ConfigError("candidate_source_layer_id",
                          f"{cfg.candidate_source_layer_id} is not an index source")
    cb = cfg.candidate_block_size
    if cb < 1 or cb & (cb - 1):
        raise ConfigError("candidate_block_size", f"{cb} is not a power of two")
    if cfg.candidate_topk_blocks * cb < cfg.index_topk:
        raise ConfigError("candidate_topk_blocks", f"candidate_topk_blocks*candidate_block_size = "
                          f"{cfg.candidate_topk_blocks * cb} < index_topk = {cfg.index_topk}")
    rd = cfg.qk_rope_head_dim
    if rd <= 0 or rd % 2:
        raise ConfigError("qk_rope_head_dim", f"{rd} must be positive and even")
    if rd > min(cfg.head_dim, cfg.index_head_dim):
        raise ConfigError("qk_rope_head_dim", f"{rd} exceeds min(head_dim, index_head_dim) = "
                          f"{min(cfg.head_dim, cfg.index_head_dim)}")
    if cfg.num_attention_heads % cfg.o_groups:
        raise ConfigError("o_groups", f"num_attention_heads {cfg.num_attention_heads} is not "
                          f"divisible by o_groups {cfg.o_groups}")
    if cfg.num_key_value_heads != 1:
        raise ConfigError("num_key_value_heads", f"{cfg.num_key_value_heads}; V4.1 has one latent KV head")
    if cfg.n_shared_experts != 1:
        raise ConfigError("n_shared_experts", f"{cfg.n_shared_experts}; V4.1 has exactly one")
    if cfg.num_hash_layers:
        raise ConfigError("num_hash_layers", "V4.1 has no hash-routed layers")
    if cfg.first_k_dense_replace:
        raise ConfigError("first_k_dense_replace", "V4.1 has MoE in every layer")
    if cfg.scoring_func != "sqrtsoftplus":
        raise ConfigError("scoring_func", f"{cfg.scoring_func!r}; only 'sqrtsoftplus'")
    if cfg.hidden_act != "silu":
        raise ConfigError("hidden_act", f"{cfg.hidden_act!r}; only 'silu'")
    if cfg.tie_word_embeddings:
        raise ConfigError("tie_word_embeddings", "V4.1 has separate embed and head")
    for name in ("hidden_size", "q_lora_rank", "o_lora_rank", "head_dim", "index_head_dim",
                 "moe_intermediate_size", "engram_head_dim"):
        _mult(cfg, name, getattr(cfg, name), 32)
    _mult(cfg, "head_dim", cfg.head_dim, 16)
    _mult(cfg, "o_groups", cfg.o_group_in, 32)
    if not 1 <= cfg.num_experts_per_tok <= cfg.n_routed_experts:
        raise ConfigError("num_experts_per_tok", f"{cfg.num_experts_per_tok} not in 1..n_routed_experts")
    if not 1 <= cfg.dspark_num_experts_per_tok <= cfg.dspark_n_routed_experts:
        raise ConfigError("dspark_num_experts_per_tok", "not in 1..dspark_n_routed_experts")
    if len(cfg.engram_layer_ids) != len(cfg.engram_num_embeddings):
        raise ConfigError("engram_num_embeddings", f"{len(cfg.engram_num_embeddings)} entries for "
                          f"{len(cfg.engram_layer_ids)} engram_layer_ids")
    for i in cfg.engram_layer_ids:
        if not 0 <= i < n:
            raise ConfigError("engram_layer_ids", f"layer {i} is not a backbone layer")
    if cfg.engram_layer_ids and any(i >= max(kv) + 1 for i in cfg.engram_layer_ids):
        raise ConfigError("engram_layer_ids", "an Engram layer after the last kv source would be "
                          "skipped by decoder bounded replay")
    if cfg.engram_max_ngram_size < 2:
        raise ConfigError("engram_max_ngram_size", "must be at least 2")
    if nd:
        taps = cfg.dspark_target_layer_ids
        if any(not 0 <= t < n for t in taps):
            raise ConfigError("dspark_target_layer_ids", f"{taps} must be backbone layers")
    if cfg.sliding_window < 1:
        raise ConfigError("sliding_window", "must be positive")
    validate_page(cfg, cfg.kv_cache_block_size, "kv_cache_block_size")


def validate_page(cfg: V41Config, page: int, name: str = "block_size") -> None:
    """PAGE = the hash block: even, a multiple of every ratio, at least window - 1."""
    if page <= 0 or page % 2:
        raise ConfigError(name, f"{page}: the cache block size must be even")
    for r in set(cfg.compress_ratios) - {0}:
        if page % r:
            raise ConfigError(name, f"{page} is not a multiple of compress ratio {r}")
    if page < cfg.sliding_window - 1:
        raise ConfigError(name, f"{page} is shorter than sliding_window - 1 = {cfg.sliding_window - 1}")


def validate_parallelism(cfg: V41Config, tp: int = 1, ep: int = 1) -> None:
    for name, v in (("num_attention_heads", cfg.num_attention_heads), ("index_n_heads", cfg.index_n_heads),
                    ("o_groups", cfg.o_groups), ("moe_intermediate_size", cfg.moe_intermediate_size)):
        if v % tp:
            raise ConfigError("tensor_parallel_size", f"{name} = {v} is not divisible by TP {tp}")
    if cfg.n_routed_experts % ep:
        raise ConfigError("expert_parallel_size", f"n_routed_experts = {cfg.n_routed_experts} is not "
                          f"divisible by EP {ep}")


# ---- presets ----------------------------------------------------------------------------

def _flash() -> V41Config:
    return V41Config(name="flash")


def _flash_slice() -> V41Config:
    # Flash widths and topology; 16 routed experts and small Engram tables so it fits one H200.
    from v41.engram.hashing import table_rows
    cfg = V41Config(name="flash-slice", n_routed_experts=16, dspark_n_routed_experts=16,
                    engram_vocab_size=1000)
    cfg.engram_num_embeddings = table_rows(cfg)
    return cfg


TOY_TOKENIZER_DIR = Path(__file__).parent / "assets" / "toy"


def _toy() -> V41Config:
    # The Flash 40-layer topology with tiny widths (every quantized width a multiple of 32).
    from v41.engram.hashing import table_rows
    cfg = V41Config(
        name="toy", vocab_size=1024, image_token_id=1023, hidden_size=64, num_attention_heads=4,
        head_dim=64, qk_rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32,
        max_position_embeddings=8192, sliding_window=16, candidate_topk_blocks=4,
        candidate_block_size=4, index_n_heads=2, index_head_dim=32, index_topk=8,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        engram_n_heads=2, engram_head_dim=32, engram_vocab_size=64,
        engram_compressed_vocab_size=TOY_COMPRESSED_VOCAB, dspark_noise_token_id=1022,
        dspark_markov_rank=32, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2,
        kv_cache_block_size=32)
    cfg.engram_num_embeddings = table_rows(cfg)
    return cfg


# size of the toy tokenizer's Engram normalization map (asserted in tests/test_engram.py)
TOY_COMPRESSED_VOCAB = 798

PRESETS = {"flash": _flash, "flash-slice": _flash_slice, "toy": _toy}


def preset(name: str) -> V41Config:
    if name not in PRESETS:
        raise ConfigError("model", f"unknown preset {name!r}; presets are {sorted(PRESETS)}")
    cfg = PRESETS[name]()
    validate(cfg)
    return cfg


def load_config(model: str | os.PathLike) -> V41Config:
    """A preset name or a directory holding an HF `config.json`."""
    if isinstance(model, str) and model in PRESETS:
        return preset(model)
    path = Path(model)
    f = path / "config.json" if path.is_dir() else path
    if not f.exists():
        raise ConfigError("model", f"{model!r} is neither a preset {sorted(PRESETS)} nor a directory "
                          f"with config.json")
    try:
        d = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError("config.json", f"not valid JSON: {e}") from None
    return from_hf_dict(d)


if __name__ == "__main__":
    # the CLI lives in v41.config_cli: its --json prints parameter counts from the checkpoint
    # schema (v41.loader), which imports this module
    from v41.config_cli import main
    sys.exit(main())
