"""Flash's weight placement (v41/loader/placement.py, issue 16's placement line): on the `flash`
preset's schema, per-GPU bytes for 4 and 8 GPUs add back up to the schema's bytes, the routed
experts split whole and evenly, the Engram tables stay on the host; bad input is named."""
from __future__ import annotations

import pytest

import v41.loader as L
from v41.config import preset
from v41.loader.placement import RULES, placement

# spec/model.md §0/§5.3: text + draft + Engram tensors of the real checkpoint (no vision here)
FLASH_BYTES = 509_315_486_040
FLASH_ENGRAM_BYTES = 202_758_032_400
# the tensors the `tp` rule slices (spec §5.4's per-rank slices), by name ending
TP_SPLIT = ("attn.wq_b.weight", "attn.wq_b.scale", "attn.wo_a.weight", "attn.wo_a.scale",
            "attn.attn_sink", "attn.wo_b.weight", "attn.wo_b.scale", "shared_experts.w1.weight",
            "shared_experts.w1.scale", "shared_experts.w3.weight", "shared_experts.w3.scale",
            "shared_experts.w2.weight", "shared_experts.w2.scale")


@pytest.fixture(scope="module")
def flash():
    cfg = preset("flash")
    return cfg, L.checkpoint_schema(cfg)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("gpus", [4, 8])
def test_flash_placement_adds_up(flash, gpus, rule):
    cfg, schema = flash
    p = placement(cfg, gpus, rule)
    ranks = p["gpus"]
    assert len(ranks) == gpus
    assert p["unique"] == sum(s.nbytes for s in schema.values()) == FLASH_BYTES
    assert p["host"] == L.schema_totals(cfg, schema)["bytes_per_part"]["engram_tables"] == FLASH_ENGRAM_BYTES
    experts = sum(s.nbytes for n, s in schema.items() if ".ffn.experts." in n)
    split = sum(s.nbytes for n, s in schema.items()
                if rule == "tp" and (n.endswith(TP_SPLIT) or n in ("embed.weight", "head.weight")))
    replicated = p["unique"] - p["host"] - experts - split
    for r in ranks:        # even: every GPU holds the same
        assert r == ranks[0]
        assert r["experts"] == (cfg.num_hidden_layers * cfg.n_routed_experts
                                + cfg.num_nextn_predict_layers * cfg.dspark_n_routed_experts) // gpus
        assert r["replicated"] == replicated
        assert r["total"] == r["routed_experts"] + r["split"] + r["replicated"]
    assert sum(r["routed_experts"] for r in ranks) == experts
    assert sum(r["split"] for r in ranks) == split
    # the whole checkpoint: every GPU's share, the replicated tensors once, the host tables
    assert (sum(r["routed_experts"] + r["split"] for r in ranks) + ranks[0]["replicated"] + p["host"]
            == FLASH_BYTES)
    if rule == "tp":
        assert split > 0 and ranks[0]["replicated"] < placement(cfg, gpus, "dp-attention")["gpus"][0]["replicated"]


def test_flash_placement_after_post_load_processing(flash):
    cfg, schema = flash
    raw, done = placement(cfg, 8, "tp"), placement(cfg, 8, "tp", processed=True)
    wo_a = [n for n in schema if n.endswith("attn.wo_a.weight")]
    heads = L.fp32_copy_names(schema)
    # wo_a: FP8 (1 B) + its scale -> BF16 (2 B); heads: BF16 -> FP32
    delta = sum(schema[n].numel - schema[n[:-6] + "scale"].nbytes for n in wo_a) \
        + sum(schema[n].nbytes for n in heads)
    assert done["unique"] - raw["unique"] == delta
    per_gpu = [d["total"] - r["total"] for d, r in zip(done["gpus"], raw["gpus"])]
    assert sum(per_gpu) - 7 * (done["gpus"][0]["replicated"] - raw["gpus"][0]["replicated"]) == delta


def test_bad_input_named(flash):
    cfg, _ = flash
    with pytest.raises(ValueError, match="gpus 5: the 384 routed experts"):
        placement(cfg, 5)
    with pytest.raises(ValueError, match="rule 'pp'"):
        placement(cfg, 4, "pp")
    with pytest.raises(ValueError, match="gpus 0"):
        placement(cfg, 0)


def test_cli(capsys):
    assert L.main(["placement", "flash", "--gpus", "4,8"]) == 0
    out = capsys.readouterr().out
    assert "flash on 4 GPUs" in out and "flash on 8 GPUs" in out and "188.83 GiB on the host" in out
    rows = [ln for ln in out.splitlines() if ln.strip()[:1].isdigit()]
    assert len(rows) == 12
    assert L.main(["placement", "flash", "--gpus", "four"]) == 2
    assert "--gpus 'four'" in capsys.readouterr().err
