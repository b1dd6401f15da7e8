"""Engram tables mapped from the checkpoint shards (v41/loader/engram_map.py, issue 16 item 2):
mapped rows byte-equal the resident ones and are views of the file, gathers equal indexing and
the gather op, a shard that is not the schema's is refused naming the tensor, the stager's
prefetch is used only for the ids it gathered, and an engine on mapped tables generates the
resident engine's greedy tokens (float64), also through the stager at the runner's call site."""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open as st_safe_open
from safetensors.torch import save_file

import custom_ops  # noqa: F401  (registers torch.ops.v41)
import v41.loader as L
import v41.loader.load
from tests import harness as H
from v41 import quant
from v41.config import preset
from v41.loader.engram_map import EngramStager, engram_stager, engram_tables, map_engram_table
from v41.loader.report import memory_report

ops = torch.ops.v41
TABLE = "layers.1.engram.embed.weight"
SCALE = "layers.1.engram.embed.scale"


@pytest.fixture(scope="module")
def toy():
    return preset("toy")


@pytest.fixture(scope="module")
def ckpt(toy, tmp_path_factory):
    return L.write_checkpoint(toy, tmp_path_factory.mktemp("engram") / "toy", seed=0, progress=False)


@pytest.fixture(scope="module")
def resident(toy, ckpt):
    return L.load_checkpoint(ckpt, toy, progress=False, engram="resident")


@pytest.fixture(scope="module")
def mapped(toy, ckpt):
    return L.load_checkpoint(ckpt, toy, progress=False, engram="mapped")


def _shard(d: Path, name: str) -> Path:
    return d / json.loads((d / L.INDEX_FILE).read_text())["weight_map"][name]


def _decode(w: torch.Tensor, s: torch.Tensor, ids) -> torch.Tensor:
    """Reference rows: FP8 value x its 32-block's E8M0 scale, by plain indexing (float64)."""
    ids = torch.as_tensor(ids)
    v = w[ids].to(torch.float64).unflatten(-1, (-1, 32))
    return (v * quant.e8m0_decode(s[ids], torch.float64)[..., None]).flatten(-2)


def test_mapped_rows_byte_equal_and_views_of_the_file(toy, resident, mapped):
    assert set(mapped.mapped) == {f"layers.{l}.engram.embed.weight" for l in toy.engram_layer_ids}
    assert not resident.mapped
    for name in resident.host_tables:
        a, b = resident[name], mapped[name]
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    for name, table in mapped.mapped.items():
        assert isinstance(table.codes, np.memmap) and table.codes._mmap is not None
        # the tensor is the mapping itself, at the tensor's offset in its shard: no copy in RAM
        assert mapped[name].data_ptr() == table.codes.ctypes.data
        raw = table.path.read_bytes()
        off = table.codes.offset
        assert raw[off: off + table.codes.nbytes] == mapped[name].view(torch.uint8).numpy().tobytes()
    for name in mapped:                                          # everything else is read as before
        if name not in resident.host_tables:
            assert torch.equal(mapped[name], resident[name]), name


def test_gather_equals_indexing_and_the_op(toy, resident, mapped):
    rng = np.random.default_rng(0)
    for l in toy.engram_layer_ids:
        table = mapped.mapped[f"layers.{l}.engram.embed.weight"]
        w, s = resident[f"layers.{l}.engram.embed.weight"], resident[f"layers.{l}.engram.embed.scale"]
        ids = np.concatenate([rng.integers(0, table.rows, 500), [0, table.rows - 1, 7, 7]])
        got = table.gather(ids)
        assert got.dtype == np.float32 and got.shape == (len(ids), table.dim)
        assert torch.equal(torch.from_numpy(got).double(), _decode(w, s, ids))
        # what the runner's op gives from the resident table, bit for bit
        T = 4
        tok = torch.from_numpy(rng.integers(0, table.rows, (T, toy.engram_width // table.dim)))
        ref = torch.full((T, toy.engram_width), float("nan"))
        ops.engram_gather(w, s, tok, ref)
        assert torch.equal(torch.from_numpy(table.gather(tok.numpy())).reshape(T, -1), ref)
        assert table.gather(np.zeros(0, np.int64)).shape == (0, table.dim)
        for bad in (-1, table.rows):
            with pytest.raises(IndexError, match=f"layers.{l}.engram.embed.weight: row id {bad} outside"):
                table.gather([3, bad])


# ---- shards that are not the schema's -----------------------------------------------------

def _rewrite(path: Path, edit):
    with st_safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _truncated(d):
    p = _shard(d, TABLE)
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size - 5)
    return TABLE, "past the end"


def _wrong_dtype(d):
    _rewrite(_shard(d, SCALE), lambda t: t.__setitem__(SCALE, t[SCALE].view(torch.uint8)))
    return SCALE, "dtype U8"


def _wrong_shape(d):
    _rewrite(_shard(d, TABLE), lambda t: t.__setitem__(TABLE, t[TABLE][:-1].clone()))
    return TABLE, "shape"


def _foreign(d):
    # layer 14's shard under layer 1's file name: a shard of another table
    shutil.copyfile(_shard(d, "layers.14.engram.embed.weight"), _shard(d, TABLE))
    return TABLE, "not in shard"


def _bad_offsets(d):
    p = _shard(d, TABLE)
    b = bytearray(p.read_bytes())
    (n,) = struct.unpack("<Q", b[:8])
    h = json.loads(b[8:8 + n])
    h[TABLE]["data_offsets"][1] -= 32
    raw = json.dumps(h, separators=(",", ":")).encode().ljust(n)
    assert len(raw) == n
    p.write_bytes(bytes(b[:8]) + raw + bytes(b[8 + n:]))
    return TABLE, "do not hold"


BAD = {"truncated": _truncated, "wrong_dtype": _wrong_dtype, "wrong_shape": _wrong_shape,
       "foreign": _foreign, "bad_offsets": _bad_offsets}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_table_shard_refused_by_name(kind, toy, ckpt, tmp_path, monkeypatch):
    d = tmp_path / "ckpt"
    shutil.copytree(ckpt, d)
    name, why = BAD[kind](d)
    schema = L.checkpoint_schema(toy)
    # the mapped path's own check (the shard opened directly, no directory check first)
    with pytest.raises(L.CheckpointError) as ei:
        map_engram_table(_shard(d, TABLE), TABLE, schema)
    assert name in str(ei.value) and why in str(ei.value), str(ei.value)
    # and through the loader: refused before anything is mapped or read
    monkeypatch.setattr(v41.loader.load, "safe_open", None)
    monkeypatch.setattr(v41.loader.load, "map_engram_table", None)
    with pytest.raises(L.CheckpointError, match=name.replace(".", r"\.")):
        L.load_checkpoint(d, toy, progress=False, engram="mapped")


def test_auto_threshold_and_mode_names(toy, ckpt, monkeypatch):
    assert not L.load_checkpoint(ckpt, toy, progress=False).mapped          # toy tables are small
    sizes = {n: s.nbytes for n, s in L.checkpoint_schema(toy).items() if L.is_host_table(n)}
    table = {n: sizes[n] + sizes[n[:-6] + "scale"] for n in sizes if n.endswith(".weight")}
    cut = sum(table.values()) // 2                  # between the toy's two table sizes
    monkeypatch.setattr(v41.loader.load, "ENGRAM_MAP_BYTES", cut)
    big = {n for n, b in table.items() if b >= cut}
    assert big and big != set(table)                # the threshold splits them
    assert set(L.load_checkpoint(ckpt, toy, progress=False).mapped) == big
    with pytest.raises(ValueError, match="engram 'disk'"):
        L.load_checkpoint(ckpt, toy, progress=False, engram="disk")


def test_memory_report(toy, resident, mapped, ckpt, caplog):
    schema = L.checkpoint_schema(toy)
    by_kind = {}
    for n, s in schema.items():
        if not L.is_host_table(n):
            by_kind[s.kind] = by_kind.get(s.kind, 0) + s.nbytes
    wo_a = [n for n in schema if n.endswith("attn.wo_a.weight")]
    f32 = L.fp32_copy_names(schema)
    tables = sum(s.nbytes for n, s in schema.items() if L.is_host_table(n))
    for w, kind in ((resident, "resident"), (mapped, "mapped")):
        rep = memory_report(w)
        f = rep["formats"]
        # §5.4 post-load: wo_a FP8 + scale -> BF16, the confidence head BF16 -> FP32
        assert f["fp4"] == by_kind["fp4"]
        assert f["fp8"] == by_kind["fp8"] - sum(schema[n].nbytes for n in wo_a)
        assert f["e8m0"] == by_kind["e8m0"] - sum(schema[n[:-6] + "scale"].nbytes for n in wo_a)
        assert f["bf16"] == (by_kind["bf16"] + sum(2 * schema[n].numel for n in wo_a)
                             - sum(schema[n].nbytes for n in f32))
        assert f["f32"] == by_kind["f32"] + sum(2 * schema[n].nbytes for n in f32)
        assert rep["weights_bytes"] == sum(f.values()) == sum(t.nbytes for n, t in w.items()
                                                              if not L.is_host_table(n))
        assert rep["engram"] == {"mapped": 0, "resident": 0, kind: tables}
    caplog.set_level("INFO", logger="v41.loader")
    L.load_weights(ckpt, toy, progress=False, engram="mapped")
    line = [r.getMessage() for r in caplog.records if r.name == "v41.loader"][-1]
    assert "fp4" in line and "e8m0" in line and f"{tables / 1024:,.2f} KiB mapped from disk" in line


def test_resident_tables_go_to_the_model_device_mapped_ones_stay(toy, resident, mapped):
    """The runner's tables (engram_tables): resident ones where the model runs (the gather op
    reads them there with the published ids; "meta" stands in for a GPU), mapped ones on the host."""
    moved = engram_tables(toy, resident, "meta")
    kept = engram_tables(toy, mapped, "meta")
    assert sorted(moved) == sorted(kept) == sorted(toy.engram_layer_ids)
    assert all(t.device.type == "meta" for pair in moved.values() for t in pair)
    assert all(t.device.type == "cpu" for pair in kept.values() for t in pair)
    for l, (w, sc) in kept.items():
        assert w.data_ptr() == mapped[f"layers.{l}.engram.embed.weight"].data_ptr()     # the mapping itself


# ---- the stager ---------------------------------------------------------------------------

def test_stager_prefetch_and_gather(toy, resident, mapped):
    T, n = 9, toy.engram_width // toy.engram_head_dim
    st = engram_stager(mapped, max_tokens=16, device="cpu")
    assert isinstance(st, EngramStager) and engram_stager(resident, 16, "cpu") is None
    rng = np.random.default_rng(1)

    def ids():
        return {l: rng.integers(0, t.rows, (T, n)) for l, t in st.tables.items()}

    def want(i):
        out = {}
        for l, a in i.items():
            out[l] = torch.full((T, toy.engram_width), float("nan"), dtype=torch.float64)
            ops.engram_gather(resident[f"layers.{l}.engram.embed.weight"],
                              resident[f"layers.{l}.engram.embed.scale"], torch.from_numpy(a), out[l])
        return out

    out = {l: torch.full((16, toy.engram_width), float("nan"), dtype=torch.float64) for l in st.tables}
    a, b, c = ids(), ids(), ids()
    st.gather(a, out)                                   # no prefetch
    assert all(torch.equal(out[l][:T], want(a)[l]) for l in a) and st.prefetch_hits == 0
    assert out[1][T:].isnan().all()                     # rows past T untouched
    st.prefetch(b)
    b_copy = {l: v.copy() for l, v in b.items()}
    for v in b.values():
        v[:] = 0                                        # the prefetch copied the ids when called
    st.gather(b_copy, out)
    assert st.prefetch_hits == 1 and all(torch.equal(out[l][:T], want(b_copy)[l]) for l in b)
    st.prefetch(c)
    st.gather(a, out)                                   # other ids: gathered now, not the prefetch's
    assert st.prefetch_hits == 1 and all(torch.equal(out[l][:T], want(a)[l]) for l in a)
    with pytest.raises(ValueError, match="layers"):
        st.gather({1: a[1]}, out)
    with pytest.raises(ValueError, match="engram ids of layer 1"):
        st.gather({l: v[:, :-1] for l, v in a.items()}, out)
    st.close()


# ---- the engine ---------------------------------------------------------------------------

def test_engine_on_mapped_tables_generates_the_same_tokens(resident, mapped, monkeypatch):
    """Mapped tables: the runner gathers their rows on the host through its EngramStager (the
    published host ids, pinned staging on CUDA) and generates the resident tables' tokens."""
    reqs = H.prompts((9, 23, 40), seed=4)
    want = H.run(resident, reqs, max_tokens=5, dtype="float64")
    gathers = []
    gather = EngramStager.gather
    monkeypatch.setattr(EngramStager, "gather", lambda self, ids, out: gathers.append(1) or gather(self, ids, out))
    assert H.make_engine(resident).runner.engram_stager is None
    assert H.make_engine(mapped).runner.engram_stager is not None
    assert H.run(mapped, reqs, max_tokens=5, dtype="float64") == want
    assert len(gathers) >= 5


def test_bench_dry_run(tmp_path, capsys):
    """benchmarks/engram_mmap_bench.py on a small table: writes, maps, gathers, checks sampled
    rows against the file's bytes, prints; writes no result file and leaves no table."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("engram_mmap_bench", Path(__file__).parents[1]
                                                  / "benchmarks" / "engram_mmap_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "r.json"
    assert bench.main(["--dry-run", "--dir", str(tmp_path / "t"), "--out", str(out)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["table"]["rows"] == 48 * 1024 and res["gather"]["cold"]["steps"] == 5
    assert set(res["rss_mib"]) == {"before_map", "after_map", "after_cold_pass", "after_warm_pass"}
    assert not out.exists() and not list((tmp_path / "t").iterdir())
