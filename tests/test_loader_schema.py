"""v41.loader.schema: the Flash checkpoint's tensors, parameter counts and bytes (spec/model.md
§5.2-5.3) on the meta device, and the config CLI that prints them."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import v41.loader as L
from v41.config import preset

# ---- flash: schema and totals on the meta device ----------------------------------------

FLASH_PARAMS = {"routed_experts": 543_581_798_400, "engram_tables": 196_613_849_600,
                "other": 8_299_036_784, "dspark": 14_225_362_530, "vision": 0}
FLASH_BYTES = {"routed_experts": 288_777_830_400, "engram_tables": 202_758_032_400,
               "other": 9_846_748_608, "dspark": 7_932_874_632}


@pytest.fixture(scope="module")
def flash():
    cfg = preset("flash")
    return cfg, L.checkpoint_schema(cfg)


def test_flash_param_counts(flash):
    cfg, _ = flash
    p = L.count_params(cfg)
    for k, v in FLASH_PARAMS.items():
        assert p[k] == v, k
    assert p["total"] == sum(FLASH_PARAMS.values()) == 762_720_047_314
    # = spec §5.3 total 763,205,315,794 minus the vision tower we do not have
    assert p["total"] + 485_268_480 == 763_205_315_794
    assert p["dspark"] - 3 * 128 * 3 * 5120 * 2304 == 14_225_362_530 - 13_589_544_960


def test_flash_tensor_count_and_bytes(flash):
    cfg, schema = flash
    t = L.schema_totals(cfg, schema)
    assert t["tensors"] == 95_819
    assert t["bytes"] == 509_315_486_040
    assert t["bytes_per_part"] == FLASH_BYTES


def test_flash_schema_entries(flash):
    _, S = flash

    def chk(name, dtype, shape):
        assert S[name].dtype == dtype and S[name].shape == tuple(shape), (name, S[name])

    f8, e8, bf, f32, i8 = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.bfloat16, torch.float32,
                           torch.int8)
    chk("embed.weight", bf, [129280, 5120])
    chk("head.weight", bf, [129280, 5120])
    chk("layers.0.hc_attn_fn", f32, [24, 20480])
    chk("layers.0.hc_ffn_base", f32, [24])
    chk("layers.0.hc_ffn_scale", f32, [3])
    chk("layers.0.attn.attn_sink", f32, [64])
    chk("layers.5.attn.wq_a.scale", e8, [40, 160])
    chk("layers.5.attn.wq_b.weight", f8, [32768, 1280])
    chk("layers.5.attn.wq_b.scale", e8, [1024, 40])
    chk("layers.5.attn.wo_a.weight", f8, [8192, 4096])
    chk("layers.5.attn.wo_a.scale", e8, [256, 128])
    chk("layers.5.attn.wo_b.scale", e8, [160, 256])
    chk("layers.5.ffn.experts.383.w1.weight", i8, [2304, 2560])
    chk("layers.5.ffn.experts.383.w1.scale", e8, [2304, 160])
    chk("layers.5.ffn.experts.0.w2.weight", i8, [5120, 1152])
    chk("layers.5.ffn.experts.0.w2.scale", e8, [5120, 72])
    chk("layers.5.ffn.shared_experts.w2.scale", e8, [160, 72])
    chk("layers.5.ffn.gate.bias_vl", f32, [384])
    chk("layers.20.attn.compressor.wkv.weight", bf, [512, 5120])
    chk("layers.20.attn.indexer.wk.weight", bf, [128, 512])
    chk("layers.24.attn.indexer.wq_b.scale", e8, [128, 40])
    chk("layers.24.attn.indexer.weights_proj.weight", bf, [32, 5120])
    chk("layers.1.engram.embed.weight", f8, [384006168, 256])
    chk("layers.1.engram.embed.scale", e8, [384006168, 8])
    chk("layers.14.engram.embed.weight", f8, [384016682, 256])
    chk("layers.14.engram.wkv.scale", e8, [800, 192])
    chk("layers.14.engram.q_weight", bf, [4, 5120])
    chk("mtp.0.main_proj.weight", f8, [5120, 15360])
    chk("mtp.0.main_proj.scale", e8, [160, 480])
    chk("mtp.1.ffn.gate.weight", bf, [128, 5120])
    chk("mtp.2.markov_head.head.weight", bf, [129280, 256])
    chk("mtp.2.confidence_head.proj.weight", bf, [1, 5376])

    def count(suffix):
        return sum(n.endswith(suffix) for n in S)

    assert count("compressor.wkv.weight") == 4 and count("compressor.wgate.weight") == 3
    assert count("indexer.wq_b.weight") == 8 and count("indexer.wk.weight") == 4
    assert count("engram.wkv.weight") == 2
    assert {n for n in S if n.endswith("compressor.wgate.weight")} == {
        f"layers.{i}.attn.compressor.wgate.weight" for i in (2, 8, 14)}
    assert "mtp.99.ffn.experts.128.w1.weight" not in S and "mtp.2.ffn.experts.128.w1.weight" not in S
    assert "mtp.2.ffn.experts.127.w1.weight" in S and "layers.39.ffn.experts.384.w1.weight" not in S
    assert not any(n.startswith(("model.", "vision.", "aligner.", "image_")) for n in S)
    assert not any("mtp." in n and ("compressor" in n or "indexer" in n) for n in S)
    assert all((n.endswith(".scale") and s.kind == "e8m0") or s.kind != "e8m0" for n, s in S.items())
    # every quantized weight has its scale right after it
    names = list(S)
    for i, n in enumerate(names):
        if S[n].kind in ("fp8", "fp4"):
            assert names[i + 1] == n[: -len(".weight")] + ".scale"


def test_config_cli_counts():
    """`python -m v41.config flash --json` (v41.config run as __main__) reports the same counts."""
    out = subprocess.run([sys.executable, "-m", "v41.config", "flash", "--json"], capture_output=True,
                         text=True, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)["params"]
    assert {k: p[k] for k in FLASH_PARAMS} == FLASH_PARAMS
