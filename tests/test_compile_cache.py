"""Compile keys and the keyed cache directory (runtime/compile/cache.py, v41/keyed_dir.py): every
factor changes the key and nothing else does, the traced sources cover the model, the lock and
READY marker, and a second builder of a key waits and reuses."""
import dataclasses
import json
import os
import threading

import torch

from runtime import compile as C
from runtime.engine import EngineArgs
from tests.compile_helpers import REPO


def test_compile_key_changes_with_each_factor(toy_cfg, monkeypatch):
    args = EngineArgs(model="toy", dtype="float32", device="cpu")
    ccfg = C.CompileConfig(capture_sizes=(1, 8))

    def key(cfg=toy_cfg, a=args, cc=ccfg, dev="cpu"):
        return C.compile_key(C.key_factors(cfg, a, cc, dev))

    base = key()
    assert base == key()
    # settings that cannot change a graph keep the key
    for same in (dataclasses.replace(args, seed=3), dataclasses.replace(args, dump_dir="/tmp/x"),
                 dataclasses.replace(args, max_prefill_chunk=7), dataclasses.replace(args, load_format="dummy")):
        assert key(a=same) == base
    changed = {
        "config": key(cfg=dataclasses.replace(toy_cfg, rms_norm_eps=1e-6)),
        "dtype": key(a=dataclasses.replace(args, dtype="bfloat16")),
        "token budget": key(a=dataclasses.replace(args, max_num_batched_tokens=256)),
        "slots": key(a=dataclasses.replace(args, max_num_seqs=3)),
        "index plane": key(a=dataclasses.replace(args, index_cache_dtype="fp4")),
        "split points": key(cc=dataclasses.replace(ccfg, split=False)),
        "capture sizes": key(cc=dataclasses.replace(ccfg, capture_sizes=(1, 16))),
        "passes": key(cc=dataclasses.replace(ccfg, passes=False)),
        "lowering": key(cc=dataclasses.replace(ccfg, fused_lowering="inline")),
        "device arch": key(dev="meta"),
    }
    hashes = C.source_hashes()
    for part in ("model", "passes", "ops"):
        monkeypatch.setattr(C.cache, "source_hashes", lambda part=part: {**hashes, part: "edited"})
        changed[f"{part} sources"] = key()
    monkeypatch.setattr(C.cache, "source_hashes", lambda: hashes)
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    changed["torch"] = key()
    monkeypatch.undo()
    real = C.cache._version
    for mod in ("triton", "aiter"):
        monkeypatch.setattr(C.cache, "_version", lambda m, mod=mod: "9.9" if m == mod else real(m))
        changed[mod] = key()
    monkeypatch.undo()
    monkeypatch.setattr(C.cache, "device_arch", lambda d: "cuda:sm_90")
    changed["gpu arch"] = key()
    assert base not in changed.values() and len(set(changed.values())) == len(changed), changed


def test_traced_sources_cover_the_model_imports():
    """Every module the model imports (at module level, transitively, within v41) is hashed into
    the key, but the config, which the key holds by value (the topology code it imports is
    hashed)."""
    from tests.test_imports import MODULES, import_graph
    graph, seen, todo = import_graph(), set(), ["v41.model"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += [t for t in graph[m] if t.startswith("v41")]
    files = {str(MODULES[m].relative_to(REPO)) for m in seen if m not in ("v41.config", "v41.engram")}
    assert files <= set(C.TRACED_SOURCES), files - set(C.TRACED_SOURCES)
    assert all((REPO / f).exists() for f in C.TRACED_SOURCES)
    assert {str(p.relative_to(REPO)) for p in (REPO / "runtime" / "compile").glob("*.py")} <= set(C.TRACED_SOURCES)


def test_cache_dir_lock_and_ready_marker(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ["TORCHINDUCTOR_CACHE_DIR"])
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    d = C.CacheDir(str(tmp_path), {"a": 1})
    assert d.path == tmp_path / C.compile_key({"a": 1}) and not d.ready
    d.activate()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(d.path / "inductor")
    assert json.loads((d.path / "factors.json").read_text()) == {"a": 1}
    got = []
    with d.lock():
        t = threading.Thread(target=lambda: got.append(_try_lock(d)))
        t.start()
        t.join()
    assert got == [False] and _try_lock(d)
    d.mark_ready({"built_seconds": 1.0})
    assert C.CacheDir(str(tmp_path), {"a": 1}).ready and not C.CacheDir(str(tmp_path), {"a": 2}).ready


def test_keyed_dir_second_builder_waits_and_reuses(tmp_path):
    """v41/keyed_dir.py, as parallel pytest workers use it: two builders of one key, the second
    arriving while the first writes: one write, the second waits for the lock and returns the
    finished directory; no temporary directory is left."""
    import time
    from v41.keyed_dir import KeyedDir
    calls, writing = [], threading.Event()

    def write(tmp):
        calls.append(tmp)
        writing.set()
        time.sleep(0.3)
        tmp.mkdir()
        (tmp / "x").write_text("1")

    a, b = KeyedDir(tmp_path, "k"), KeyedDir(tmp_path, "k")
    out = []
    t = threading.Thread(target=lambda: out.append(a.build(write, {"by": "a"})))
    t.start()
    assert writing.wait(10) and not b.ready
    out.append(b.build(write))
    t.join()
    assert len(calls) == 1 and out == [a.path, a.path] and (a.path / "x").read_text() == "1"
    assert json.loads(a.marker.read_text()) == {"by": "a"}
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def _try_lock(d):
    try:
        with d.lock(blocking=False):
            return True
    except BlockingIOError:
        return False
