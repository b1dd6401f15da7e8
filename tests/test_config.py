"""Config, topology and the admission rules of spec/model.md §1.1."""
import json
import subprocess
import sys

import pytest

from v41.config import ConfigError, from_hf_dict, load_config, preset, validate

# spec/model.md §1.2, layer by layer: (role, ratio, kv owner, top-k owner, candidate owner)
FLASH = {0: ("WINDOW", 0, None, None, None), 1: ("WINDOW", 0, None, None, None)}
for l in range(2, 20):
    owner = 2 + 6 * ((l - 2) // 6)
    FLASH[l] = ("FULL" if l == owner else "REUSE", 2, owner, owner, None)
FLASH[20] = ("FULL", 1, 20, 20, 20)
for l in range(21, 40):
    top = max([20] + [r for r in (24, 28, 32, 36) if r <= l])
    FLASH[l] = ("REINDEX" if l == top and l != 20 else "REUSE", 1, 20, top, 20)
for l in (40, 41, 42):
    FLASH[l] = ("WINDOW", 0, None, None, None)


def test_flash_topology_equals_spec():
    topo = preset("flash").topology
    got = {s.layer: (s.role.value, s.ratio, s.kv_owner, s.topk_owner, s.candidate_owner) for s in topo.layers}
    assert got == FLASH
    assert (topo.boundary, topo.late_layer_start) == (20, 21)
    assert topo.owners == (2, 8, 14, 20) and topo.dspark_taps == (37, 38, 39)
    assert topo.engram_layers == (1, 14)
    assert topo.layers[20].produces_candidates and not topo.layers[24].produces_candidates


def test_toy_keeps_flash_topology():
    flash, toy = preset("flash").topology, preset("toy").topology
    assert [(s.role, s.ratio, s.kv_owner, s.topk_owner) for s in toy.layers] == \
        [(s.role, s.ratio, s.kv_owner, s.topk_owner) for s in flash.layers]
    cfg = preset("toy")
    for w in (cfg.hidden_size, cfg.q_lora_rank, cfg.o_lora_rank, cfg.head_dim, cfg.index_head_dim,
              cfg.moe_intermediate_size, cfg.engram_head_dim, cfg.o_group_in):
        assert w % 32 == 0


def test_cli_table_and_json():
    out = subprocess.run([sys.executable, "-m", "v41.config", "flash"], capture_output=True, text=True, check=True)
    assert "REINDEX" in out.stdout and "boundary: 20" in out.stdout
    out = subprocess.run([sys.executable, "-m", "v41.config", "flash", "--json"], capture_output=True,
                         text=True, check=True)
    d = json.loads(out.stdout)
    assert len(d["topology"]) == 43
    assert d["topology"][24] == {"layer": 24, "role": "REINDEX", "ratio": 1, "kv_owner": 20, "topk_owner": 24,
                                 "candidate_owner": 20}
    assert d["engram"]["1"]["rows"] == 384006168 and d["engram"]["14"]["rows"] == 384016682
    assert d["params"]["routed_experts"] == 543_581_798_400 and d["params"]["vision"] == 0
    bad = subprocess.run([sys.executable, "-m", "v41.config", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "neither a preset" in bad.stderr


def test_hf_round_trip(tmp_path):
    cfg = preset("toy")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    assert load_config(tmp_path) == cfg
    d = cfg.to_hf_dict()
    d["text_config"]["engram_pad_id"] = d["text_config"].pop("engram_pad_token_id")  # reference name
    assert from_hf_dict(d).engram_pad_token_id == cfg.engram_pad_token_id


def _bad(field, **changes):
    d = preset("toy").to_hf_dict()
    for k, v in changes.items():
        (d if k in ("quantization_config", "architectures") else d["text_config"])[k] = v
    with pytest.raises(ConfigError) as e:
        from_hf_dict(d)
    assert e.value.field == field, str(e.value)
    return str(e.value)


R = [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]


@pytest.mark.parametrize("field, changes", [
    ("compress_ratios", {"compress_ratios": R[:-1]}),                                   # length
    ("compress_ratios", {"compress_ratios": R[:5] + [3] + R[6:]}),                      # ratio ∉ {0,1,2}
    ("compress_ratios", {"compress_ratios": R[:41] + [1, 0]}),                          # draft ratio
    ("index_source_layer_ids", {"index_source_layer_ids": [2, 14, 20, 24, 28, 32, 36]}),  # kv ⊄ index
    ("kv_source_layer_ids", {"kv_source_layer_ids": [1, 2, 8, 14, 20]}),                # source with ratio 0
    ("kv_source_layer_ids", {"kv_source_layer_ids": [8, 14, 20], "index_source_layer_ids": [8, 14, 20, 24, 28, 32, 36]}),
    ("compress_ratios", {"compress_ratios": R[:3] + [1] + R[4:]}),                      # owner ratio differs
    ("candidate_source_layer_id", {"candidate_source_layer_id": 21}),
    ("candidate_topk_blocks", {"candidate_topk_blocks": 1}),
    ("candidate_block_size", {"candidate_block_size": 6}),
    ("qk_rope_head_dim", {"qk_rope_head_dim": 15}),
    ("qk_rope_head_dim", {"qk_rope_head_dim": 48}),
    ("o_groups", {"o_groups": 3}),
    ("num_key_value_heads", {"num_key_value_heads": 2}),
    ("n_shared_experts", {"n_shared_experts": 2}),
    ("engram_num_embeddings", {"engram_num_embeddings": [462]}),
    ("hidden_size", {"hidden_size": 80}),
    ("kv_cache_block_size", {}),
    ("quantization_config", {"quantization_config": {"quant_method": "fp8"}}),
    ("architectures", {"architectures": ["LlamaForCausalLM"]}),
    ("text_config.bogus", {"bogus": 1}),
])
def test_validation_rules_name_the_field(field, changes):
    if field == "kv_cache_block_size":
        cfg = preset("toy")
        cfg.kv_cache_block_size = 31
        with pytest.raises(ConfigError, match="even") as e:
            validate(cfg)
        assert e.value.field == field
        return
    _bad(field, **changes)


def test_parallelism_rules():
    from v41.config import validate_parallelism
    cfg = preset("flash")
    validate_parallelism(cfg, tp=4, ep=8)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        validate_parallelism(cfg, tp=3)
    with pytest.raises(ConfigError, match="expert_parallel_size"):
        validate_parallelism(cfg, ep=5)
