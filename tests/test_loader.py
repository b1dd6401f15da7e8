"""v41.loader on the toy: the random-weight writer, the header-first checker, loading, dummy
weights, the once-only post-load processing (spec/model.md §5.4) and the preset cache. The
schema and counts: test_loader_schema.py."""
from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open as st_safe_open
from safetensors.torch import save_file

import v41.loader as L
import v41.loader.load
from v41.config import preset

# ---- toy: write / load ------------------------------------------------------------------

@pytest.fixture(scope="module")
def toy():
    return preset("toy")


@pytest.fixture(scope="module")
def toy_schema(toy):
    return L.checkpoint_schema(toy)


@pytest.fixture(scope="module")
def toy_ckpt(toy, tmp_path_factory):
    return L.write_checkpoint(toy, tmp_path_factory.mktemp("ckpt") / "toy", seed=0, progress=False)


def _fresh_copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_toy_schema_shapes(toy, toy_schema):
    S, D = toy_schema, toy.hidden_size
    assert S["layers.0.hc_attn_fn"].shape == (24, 4 * D)
    assert S["layers.3.attn.wo_a.weight"].shape == (toy.o_groups * toy.o_lora_rank, toy.o_group_in)
    assert S["layers.3.ffn.experts.7.w2.weight"].shape == (D, toy.moe_intermediate_size // 2)
    assert S["layers.3.ffn.experts.7.w2.scale"].shape == (D, toy.moe_intermediate_size // 32)
    rows = toy.engram_num_embeddings
    assert S["layers.1.engram.embed.weight"].shape == (rows[0], toy.engram_head_dim)
    assert S["layers.14.engram.embed.scale"].shape == (rows[1], toy.engram_head_dim // 32)
    assert S["layers.14.engram.wkv.weight"].shape == (5 * D, toy.engram_width)
    assert S["mtp.0.main_proj.weight"].shape == (D, 3 * D)
    assert S["mtp.2.confidence_head.proj.weight"].shape == (1, D + toy.dspark_markov_rank)
    assert "mtp.1.ffn.experts.3.w1.weight" in S and "mtp.1.ffn.experts.4.w1.weight" not in S


def test_toy_checkpoint_files(toy, toy_ckpt, toy_schema):
    files = sorted(p.name for p in toy_ckpt.iterdir())
    assert "config.json" in files and L.INDEX_FILE in files
    assert "tokenizer.json" in files and "tokenizer_config.json" in files
    idx = json.loads((toy_ckpt / L.INDEX_FILE).read_text())
    assert set(idx["weight_map"]) == set(toy_schema)
    shard_bytes = sum((toy_ckpt / f).stat().st_size for f in set(idx["weight_map"].values()))
    assert idx["metadata"]["total_size"] == sum(s.nbytes for s in toy_schema.values())
    print(f"\ntoy checkpoint: {len(set(idx['weight_map'].values()))} shards, {len(toy_schema)} tensors, "
          f"{shard_bytes / 1e6:.2f} MB of shards")
    assert shard_bytes < 10e6
    # the Engram tables are the last shards, one layer each
    shards = sorted(set(idx["weight_map"].values()))
    for i, layer in enumerate(toy.engram_layer_ids):
        sh = shards[len(shards) - len(toy.engram_layer_ids) + i]
        assert {n for n, s in idx["weight_map"].items() if s == sh} == {
            f"layers.{layer}.engram.embed.weight", f"layers.{layer}.engram.embed.scale"}
    cfg2 = json.loads((toy_ckpt / "config.json").read_text())
    assert cfg2 == json.loads(json.dumps(toy.to_hf_dict()))


def _ref_dequant_fp8_block(w, s):
    """Independent 32x32 block dequant: value * 2^(code - 127)."""
    n, k = w.shape
    e = s.view(torch.uint8).to(torch.float64) - 127
    scale = torch.pow(2.0, e).repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]
    return (w.to(torch.float64) * scale).to(torch.bfloat16)


def test_toy_write_load_roundtrip(toy, toy_ckpt, toy_schema):
    raw = L.load_checkpoint(toy_ckpt, progress=False, process=False)
    assert not raw.processed and list(raw) == list(toy_schema)
    for name, spec in toy_schema.items():
        t = raw[name]
        assert t.dtype == spec.dtype and tuple(t.shape) == spec.shape, name
        assert torch.equal(_bytes(t), _bytes(L.tensor_values(toy, name, spec, 0))), name
    w = L.load_checkpoint(toy_ckpt, progress=False)
    assert w.processed
    changed = set(w.postprocessed)
    wo_a = [n for n in toy_schema if n.endswith("attn.wo_a.weight")]
    assert len(wo_a) == toy.num_hidden_layers + toy.num_nextn_predict_layers
    for n in wo_a:
        s = n[: -len(".weight")] + ".scale"
        assert s not in w
        assert w[n].dtype == torch.bfloat16
        assert torch.equal(w[n], _ref_dequant_fp8_block(raw[n], raw[s])), n
    f32 = ["mtp.2.confidence_head.proj.weight"]             # the LM and Markov heads stay BF16
    for n in f32:
        assert w[n].dtype == torch.float32 and torch.equal(w[n], raw[n].float()), n
    assert changed == set(wo_a) | set(f32)
    for n, t in w.items():
        if n not in changed:
            assert t.dtype == toy_schema[n].dtype and torch.equal(_bytes(t), _bytes(raw[n])), n
    assert len(w) == len(toy_schema) - len(wo_a)
    assert set(w.host_tables) == {f"layers.{l}.engram.embed.{s}" for l in toy.engram_layer_ids
                                  for s in ("weight", "scale")}


def _bytes(t):
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(-1).view(torch.uint8)


def test_writer_deterministic(toy, toy_ckpt, tmp_path, toy_schema):
    again = L.write_checkpoint(toy, tmp_path / "again", seed=0, progress=False)
    a = sorted(p.name for p in toy_ckpt.iterdir())
    assert a == sorted(p.name for p in again.iterdir())
    for f in a:
        assert (toy_ckpt / f).read_bytes() == (again / f).read_bytes(), f
    # values do not depend on order; another seed changes them
    names = list(toy_schema)[::-7]
    for n in names[:20]:
        assert torch.equal(_bytes(L.tensor_values(toy, n, toy_schema[n], 0)),
                           _bytes(L.tensor_values(toy, n, None, 0)))
    n = "layers.3.attn.wq_b.weight"
    assert not torch.equal(_bytes(L.tensor_values(toy, n, seed=0)), _bytes(L.tensor_values(toy, n, seed=1)))


def test_value_scales(toy):
    """The random weights have the intended magnitudes (dequantized std ~ 1/sqrt(fan_in))."""
    from v41.quant import dequant_fp4_expert, dequant_fp8_block
    g = lambda n: L.tensor_values(toy, n)
    w = dequant_fp8_block(g("layers.3.attn.wq_b.weight"), g("layers.3.attn.wq_b.scale"), torch.float32)
    assert abs(w.std().item() * toy.q_lora_rank ** 0.5 - 1) < 0.1
    e = dequant_fp4_expert(g("layers.3.ffn.experts.1.w2.weight"), g("layers.3.ffn.experts.1.w2.scale"),
                           torch.float32)
    assert abs(e.std().item() * toy.moe_intermediate_size ** 0.5 - 1) < 0.2
    s = g("layers.3.attn.wq_b.scale").view(torch.uint8)
    assert len(torch.unique(s)) == 3          # the per-block scales differ
    for n in ("layers.3.attn_norm.weight", "layers.3.attn.q_norm.weight", "norm.weight"):
        assert (g(n).float() - 1).abs().max() < 0.5
    assert g("layers.3.hc_attn_fn").dtype == torch.float32
    assert g("layers.3.hc_attn_fn").std() < 1e-1
    assert g("layers.3.attn.attn_sink").abs().max() < 1


def test_dummy_equals_files(toy, toy_ckpt, monkeypatch):
    a = L.load_weights(toy_ckpt, toy, load_format="safetensors", progress=False)
    b = L.load_weights("toy", None, load_format="dummy", progress=False)
    monkeypatch.setattr(v41.loader.load, "dummy_weights", lambda cfg, *a, **k: L.Weights(cfg, {}, "dummy"))
    c = L.load_weights("flash-slice", progress=False)        # auto: a large preset -> dummy
    monkeypatch.undo()
    d = L.load_weights(toy_ckpt, progress=False)              # auto: a directory -> safetensors
    e = L.load_weights("toy", progress=False)                 # auto: the toy's cached checkpoint
    assert b.source == c.source == "dummy" and d.source == str(toy_ckpt)
    assert e.source == str(L.ensure_preset_checkpoint("toy"))
    for n in a:
        assert torch.equal(_bytes(a[n]), _bytes(e[n])), n
    assert list(a) == list(b) and b.processed and a.processed
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(_bytes(a[n]), _bytes(b[n])), n
    with pytest.raises(ValueError):
        L.load_weights("toy", load_format="pickle")


def test_dummy_device_keeps_host_tables():
    cfg = preset("toy")
    w = L.dummy_weights(cfg, device="meta", progress=False)
    for n, t in w.items():
        assert t.device.type == ("cpu" if L.is_host_table(n) else "meta"), n
    assert w["layers.3.attn.wo_a.weight"].dtype == torch.bfloat16


def test_postprocess_runs_once(toy, toy_ckpt):
    w = L.load_checkpoint(toy_ckpt, progress=False)
    with pytest.raises(RuntimeError, match="exactly once"):
        w.postprocess()
    with pytest.raises(RuntimeError):
        L.postprocess(w)
    raw = L.dummy_weights(toy, progress=False, process=False)
    assert raw["layers.0.attn.wo_a.weight"].dtype == torch.float8_e4m3fn
    L.postprocess(raw)
    assert raw["layers.0.attn.wo_a.weight"].dtype == torch.bfloat16
    with pytest.raises(RuntimeError):
        raw.postprocess()


# ---- header check: corruptions --------------------------------------------------------------

def _shard_of(d: Path, name: str) -> Path:
    return d / json.loads((d / L.INDEX_FILE).read_text())["weight_map"][name]


def _rewrite_shard(path: Path, edit):
    with st_safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _edit_index(d: Path, edit):
    p = d / L.INDEX_FILE
    idx = json.loads(p.read_text())
    edit(idx["weight_map"])
    p.write_text(json.dumps(idx))


VICTIM = "layers.7.attn.wkv.weight"


def _garbage_header(d):
    p = _shard_of(d, VICTIM)
    b = bytearray(p.read_bytes())
    (n,) = struct.unpack("<Q", b[:8])
    b[8:8 + n] = b"{ not json" + b"#" * (n - 10)
    p.write_bytes(bytes(b))
    return p.name


def _header_too_long(d):
    p = _shard_of(d, VICTIM)
    b = bytearray(p.read_bytes())
    b[:8] = struct.pack("<Q", len(b) * 2)
    p.write_bytes(bytes(b))
    return p.name


def _missing_tensor(d):
    _rewrite_shard(_shard_of(d, VICTIM), lambda t: t.pop(VICTIM))
    _edit_index(d, lambda wm: wm.pop(VICTIM))
    return VICTIM


def _missing_from_shard(d):
    _rewrite_shard(_shard_of(d, VICTIM), lambda t: t.pop(VICTIM))
    return VICTIM


def _extra_tensor(d):
    extra = "layers.7.attn.bogus.weight"
    p = _shard_of(d, VICTIM)
    _rewrite_shard(p, lambda t: t.__setitem__(extra, torch.zeros(4, dtype=torch.bfloat16)))
    _edit_index(d, lambda wm: wm.__setitem__(extra, p.name))
    return extra


def _extra_unindexed(d):
    extra = "mtp.0.ffn.experts.99.w1.weight"
    _rewrite_shard(_shard_of(d, VICTIM), lambda t: t.__setitem__(extra, torch.zeros(4, dtype=torch.int8)))
    return extra


def _wrong_dtype(d):
    n = "layers.7.attn_norm.weight"
    _rewrite_shard(_shard_of(d, n), lambda t: t.__setitem__(n, t[n].float()))
    return n


def _wrong_dtype_scale(d):
    n = "layers.7.attn.wkv.scale"
    _rewrite_shard(_shard_of(d, n), lambda t: t.__setitem__(n, t[n].view(torch.uint8)))
    return n


def _wrong_shape(d):
    n = "layers.7.ffn.experts.3.w2.weight"
    _rewrite_shard(_shard_of(d, n), lambda t: t.__setitem__(n, t[n].reshape(-1, 2 * t[n].shape[1]).clone()))
    return n


def _truncated(d):
    p = _shard_of(d, VICTIM)
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size - 1000)
    return "past the end"


def _missing_shard(d):
    p = _shard_of(d, VICTIM)
    p.unlink()
    return p.name


def _missing_index(d):
    (d / L.INDEX_FILE).unlink()
    return L.INDEX_FILE


CORRUPTIONS = {"garbage_header": _garbage_header, "header_too_long": _header_too_long,
               "missing_tensor": _missing_tensor, "missing_from_shard": _missing_from_shard,
               "extra_tensor": _extra_tensor, "extra_unindexed": _extra_unindexed,
               "wrong_dtype": _wrong_dtype, "wrong_dtype_scale": _wrong_dtype_scale,
               "wrong_shape": _wrong_shape, "truncated": _truncated, "missing_shard": _missing_shard,
               "missing_index": _missing_index}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_checkpoint_refused_before_reading(kind, toy, toy_ckpt, tmp_path, monkeypatch):
    d = _fresh_copy(toy_ckpt, tmp_path)
    needle = CORRUPTIONS[kind](d)

    def no_read(*a, **k):
        raise AssertionError("tensor data read before the header check finished")

    monkeypatch.setattr(v41.loader.load, "safe_open", no_read)     # where load_checkpoint looks it up
    with pytest.raises(L.CheckpointError) as ei:
        L.load_checkpoint(d, toy, progress=False)
    assert needle in str(ei.value), str(ei.value)
    assert isinstance(ei.value, ValueError)
    with pytest.raises(L.CheckpointError):
        L.check_checkpoint(d)


def test_check_report_and_cli(toy, toy_ckpt, tmp_path):
    r = L.check_checkpoint(toy_ckpt)
    assert r.tensors == len(L.checkpoint_schema(toy)) and r.params == L.count_params(toy)
    assert "OK" in r.summary()
    out = subprocess.run([sys.executable, "-m", "v41.loader", "check", str(toy_ckpt)],
                         capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr
    d = _fresh_copy(toy_ckpt, tmp_path)
    _missing_shard(d)
    assert L.main(["check", str(d)]) == 2
    assert L.main(["write", "toy", str(tmp_path / "w"), "--seed", "0", "--no-progress"]) == 0
    for f in sorted(p.name for p in toy_ckpt.iterdir()):
        assert (toy_ckpt / f).read_bytes() == (tmp_path / "w" / f).read_bytes(), f


# ---- cached preset checkpoints ----------------------------------------------------------

def test_ensure_preset_checkpoint(tmp_path, toy_ckpt):
    # two processes race for the same cache entry: one writes it under the lock, both return it
    code = ("import sys, v41.loader as L; "
            "print(L.ensure_preset_checkpoint('toy', root=sys.argv[1]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
             for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    paths = {o[0].strip().splitlines()[-1] for o in outs}
    assert len(paths) == 1
    d = Path(paths.pop())
    assert d.parent == tmp_path and d.name.startswith("toy-s0-")
    assert (d / L.COMPLETE_MARKER).exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    marker = (d / L.COMPLETE_MARKER).stat().st_mtime_ns
    assert L.ensure_preset_checkpoint("toy", root=tmp_path) == d
    assert (d / L.COMPLETE_MARKER).stat().st_mtime_ns == marker
    for f in sorted(p.name for p in toy_ckpt.iterdir()):
        assert (toy_ckpt / f).read_bytes() == (d / f).read_bytes(), f
    L.check_checkpoint(d)
    # a different seed is a different directory
    assert L.checkpoint_key(preset("toy"), 1) != L.checkpoint_key(preset("toy"), 0)
