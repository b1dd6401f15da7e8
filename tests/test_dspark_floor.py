"""benchmarks/dspark_floor.py: the bytes a plain decode step and a DSpark step read by the
schema (floor.py's rule), checked on the toy's config, and its JSON."""
import pytest

from benchmarks import dspark_floor as D
from v41.config import load_config
from v41.loader.schema import checkpoint_schema


@pytest.fixture(scope="module")
def cfg():
    return load_config("toy")


@pytest.mark.parametrize("fmt", ["native", "dequant"])
def test_rows_reach_experts_and_embedding_rows(cfg, fmt):
    """More rows read more of the routed experts (min(E, k·rows) of E) and embedding rows, and
    nothing else; the draft reads the mtp.* tensors and the shared head, the target the rest."""
    sizes = D.resident_bytes(cfg, fmt)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    routed = sum(b for n, b in sizes.items() if n.startswith("layers.") and ".ffn.experts." in n)
    emb_row = sizes["embed.weight"] // cfg.vocab_size
    one, every = D.forward_bytes(cfg, sizes, 1, False), D.forward_bytes(cfg, sizes, e, False)
    assert every - one == pytest.approx(routed * (1 - min(e, k) / e) + emb_row * (e - 1), abs=len(sizes))
    draft = D.forward_bytes(cfg, sizes, e, True)
    mtp = sum(b for n, b in sizes.items() if n.startswith("mtp."))
    assert sizes["head.weight"] < draft <= mtp + sizes["head.weight"] + emb_row * e
    assert one + mtp < sum(sizes.values())          # the target's forward never reads the draft


def test_formats(cfg):
    """dequant holds FP8/FP4 weights as bf16 without scales, native as stored; the LM and
    Markov heads are BF16 in both, the draft's confidence head FP32."""
    schema = checkpoint_schema(cfg)
    native, dequant = D.resident_bytes(cfg, "native"), D.resident_bytes(cfg, "dequant")
    w = next(n for n, s in schema.items() if s.kind == "fp4")
    assert dequant[w] == 4 * native[w]                  # two E2M1 values a byte -> two bf16
    assert not any(schema[n].kind == "e8m0" for n in dequant)
    assert native["head.weight"] == dequant["head.weight"] == 2 * schema["head.weight"].numel
    f32 = next(n for n in schema if n.endswith("confidence_head.proj.weight"))
    assert native[f32] == dequant[f32] == 4 * schema[f32].numel


def test_json(tmp_path):
    out = tmp_path / "floor.json"
    res = D.main(["--presets", "toy", "--out", str(out)])
    assert [r["weight_format"] for r in res["results"]] == ["native", "dequant"]
    for r in res["results"]:
        assert r["verify_bytes"] > r["plain_bytes"] > 0 and r["draft_bytes"] > 0
        assert r["bound"] == pytest.approx(3.51 * r["plain_bytes"] / (r["verify_bytes"] + r["draft_bytes"]), abs=1e-3)
    assert out.exists()
