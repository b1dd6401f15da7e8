"""Loading: the `Weights` mapping and its post-load processing (spec/model.md §5.4), a checkpoint
directory read after its header check, the writer's values built in memory (`load_format='dummy'`),
and the cache of preset checkpoints written once on first use (a keyed directory)."""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from v41.config import V41Config, load_config, preset, PRESETS
from v41.keyed_dir import KeyedDir, default_cache_root, hash_files
from v41.loader.io import (COMPLETE_MARKER, DEFAULT_SHARD_BYTES, INDEX_FILE, SINGLE_FILE, _toy_tokenizer_files,
                           check_checkpoint, shard_plan, write_checkpoint)
from v41.loader.engram_map import ENGRAM_MAP_BYTES, ENGRAM_MODES, map_engram_table
from v41.loader.report import format_memory_report, memory_report
from v41.loader.schema import CheckpointError, checkpoint_schema, is_host_table
from v41.loader.synthetic import _CHUNK_ELEMS, _FP8_CODE_STD, _WRITER_FUNCS, dummy_tensors

log = logging.getLogger("v41.loader")


# ---- weights + post-load processing -----------------------------------------------------

def fp32_copy_names(schema) -> list[str]:
    """The BF16 tensors §5.4 copies to FP32: DSpark's confidence head. The LM head and the
    Markov head stay BF16: their FP32 products are exact from BF16 (custom_ops/head.py)."""
    return [n for n in schema if n.startswith("mtp.") and n.endswith("confidence_head.proj.weight")]


WO_A_FORMATS = ("bf16", "fp8")     # §5.4's BF16 copy, or kept FP8 for the native weight format


def wo_a_names(schema) -> list[str]:
    return [n for n in schema if n.endswith("attn.wo_a.weight")]


class Weights(Mapping):
    """The checkpoint tensors by name (a read-only mapping) plus where they came from.
    `postprocess()` runs the §5.4 post-load processing; it runs exactly once."""

    def __init__(self, cfg: V41Config, tensors: dict, source: str, device="cpu", seed: int | None = None,
                 mapped: dict | None = None):
        self.cfg = cfg
        self.tensors = tensors
        self.source = source          # a checkpoint directory or "dummy"
        # table weight name -> MappedEngramTable; `tensors` holds zero-copy views of them
        self.mapped = dict(mapped or {})
        self.device = torch.device(device)
        self.seed = seed
        self.processed = False
        self.postprocessed: list[str] = []

    def __getitem__(self, name):
        return self.tensors[name]

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)

    def __repr__(self):
        return (f"Weights({self.cfg.name}, {len(self)} tensors, source={self.source}, "
                f"device={self.device}, processed={self.processed})")

    @property
    def host_tables(self) -> dict:
        return {n: t for n, t in self.tensors.items() if is_host_table(n)}

    def postprocess(self, wo_a: str = "bf16") -> "Weights":
        """§5.4: `attn.wo_a.weight` FP8 x E8M0 (32x32) -> BF16 and `.scale` dropped (`wo_a="fp8"`
        keeps both, for the native weight format's W8A8 grouped GEMM);
        `mtp.*.confidence_head.proj` -> an FP32 copy. Everything else keeps its native dtype (no
        re-quantization; the LM and Markov heads stay BF16 and multiply in FP32 all the same). A
        second call raises."""
        if self.processed:
            raise RuntimeError("post-load processing already ran on these weights (it runs exactly once)")
        if wo_a not in WO_A_FORMATS:
            raise ValueError(f"wo_a {wo_a!r}: expected one of {', '.join(WO_A_FORMATS)}")
        from v41.quant import dequant_fp8_block
        T = self.tensors
        done = []
        for name in wo_a_names(T) if wo_a == "bf16" else []:
            sname = name[: -len(".weight")] + ".scale"
            w, s = T[name], T.pop(sname)
            if w.dtype != torch.float8_e4m3fn:
                raise RuntimeError(f"{name}: expected float8_e4m3fn before post-load processing, got {w.dtype}")
            T[name] = dequant_fp8_block(w, s, torch.bfloat16)
            done.append(name)
        for name in fp32_copy_names(T):
            T[name] = T[name].float()
            done.append(name)
        for name, t in T.items():
            if ".hc_" in "." + name.rsplit(".", 1)[-1] and t.dtype != torch.float32:
                raise RuntimeError(f"{name}: mHC tensors must stay FP32, got {t.dtype}")
        self.postprocessed = done
        self.processed = True
        return self


def postprocess(weights: Weights, wo_a: str = "bf16") -> Weights:
    return weights.postprocess(wo_a)


def load_checkpoint(path, cfg: V41Config | None = None, device="cpu", progress: bool = True,
                    process: bool = True, engram: str = "auto", wo_a: str = "bf16") -> Weights:
    """Load a native checkpoint directory: header check of every shard first (CheckpointError,
    nothing read), then the tensors (Engram tables on the CPU, the rest on `device`), then the
    post-load processing (once). `engram`: 'mapped' maps every Engram table from its shard
    (v41.loader.engram_map), 'resident' reads them, 'auto' maps a table (rows + scales) of at
    least ENGRAM_MAP_BYTES and reads smaller ones."""
    if engram not in ENGRAM_MODES:
        raise ValueError(f"engram {engram!r}: expected one of {', '.join(ENGRAM_MODES)}")
    root = Path(path)
    if cfg is None:
        cfg = load_config(root)
    schema = checkpoint_schema(cfg)
    report = check_checkpoint(root, cfg, schema)
    device = torch.device(device)
    mapped = {}
    for name in schema:
        if is_host_table(name) and name.endswith(".weight"):
            size = schema[name].nbytes + schema[name[: -len("weight")] + "scale"].nbytes
            if engram == "mapped" or (engram == "auto" and size >= ENGRAM_MAP_BYTES):
                shard = next(s for s, names in report.shards.items() if name in names)
                mapped[name] = map_engram_table(root / shard, name, schema)
    tensors: dict[str, torch.Tensor] = {}
    for name, table in mapped.items():
        tensors[name], tensors[name[: -len("weight")] + "scale"] = table.tensors()
    with tqdm(total=report.bytes - sum(t.nbytes for t in mapped.values()), unit="B", unit_scale=True,
              unit_divisor=1024, disable=not progress, desc=f"load {root.name}") as bar:
        for shard, names in report.shards.items():
            names = [n for n in names if n not in tensors]
            if not names:
                continue
            with safe_open(str(root / shard), framework="pt", device="cpu") as f:
                for name in names:
                    t = f.get_tensor(name)
                    spec = schema[name]
                    if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                        raise CheckpointError(f"tensor {name}: read {t.dtype} {list(t.shape)}, expected "
                                              f"{spec.dtype} {list(spec.shape)}", str(root))
                    if not is_host_table(name) and device.type != "cpu":
                        t = t.to(device)
                    tensors[name] = t
                    bar.update(spec.nbytes)
    w = Weights(cfg, {n: tensors[n] for n in schema}, str(root), device, mapped=mapped)
    return w.postprocess(wo_a) if process else w


def dummy_weights(cfg: V41Config, device="cpu", seed: int = 0, progress: bool = True,
                  process: bool = True, wo_a: str = "bf16") -> Weights:
    """The writer's tensors built in memory (CPU generators, then moved to `device`), no files."""
    device = torch.device(device)
    w = Weights(cfg, dummy_tensors(cfg, device, seed, progress), "dummy", device, seed)
    return w.postprocess(wo_a) if process else w


def _is_checkpoint_dir(p: Path) -> bool:
    return p.is_dir() and ((p / INDEX_FILE).exists() or (p / SINGLE_FILE).exists())


def load_weights(model_or_dir, cfg: V41Config | None = None, device="cpu", load_format: str = "auto",
                 seed: int = 0, progress: bool = True, engram: str = "auto", wo_a: str = "bf16") -> Weights:
    """`model_or_dir`: a checkpoint directory or a preset name. `load_format`:
    'safetensors' reads the directory; 'dummy' builds the writer's random tensors in memory
    (same values as `write_checkpoint(cfg, ..., seed)`); 'auto' = safetensors for a checkpoint
    directory; for the `toy` preset its checkpoint, written once into the cache on first use
    and then read like any other; dummy for the other presets (too large to write). `engram`:
    see load_checkpoint (the dummy format has no files: its tables are resident). `wo_a`: see
    Weights.postprocess. Logs the memory report (v41.loader.report)."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format {load_format!r}: expected 'auto', 'safetensors' or 'dummy'")
    if load_format == "auto":
        p = Path(model_or_dir)
        if _is_checkpoint_dir(p):
            load_format = "safetensors"
        elif model_or_dir == "toy":
            model_or_dir, load_format = ensure_preset_checkpoint("toy", seed=seed), "safetensors"
        elif isinstance(model_or_dir, str) and model_or_dir in PRESETS:
            load_format = "dummy"
        else:
            raise CheckpointError(f"{model_or_dir!r} is neither a checkpoint directory nor a preset")
    if load_format == "dummy":
        cfg = cfg if cfg is not None else load_config(model_or_dir)
        w = dummy_weights(cfg, device, seed, progress, wo_a=wo_a)
    else:
        w = load_checkpoint(model_or_dir, cfg, device, progress, engram=engram, wo_a=wo_a)
    log.info("%s", format_memory_report(memory_report(w)))
    return w


# ---- cached preset checkpoints ----------------------------------------------------------

def checkpoint_key(cfg: V41Config, seed: int = 0) -> str:
    """Short hash of what determines the written bytes: config, schema, writer source and (toy)
    tokenizer files."""
    h = hashlib.blake2b(digest_size=6)
    h.update(json.dumps(cfg.to_hf_dict(), sort_keys=True).encode())
    for name, s in checkpoint_schema(cfg).items():
        h.update(f"{name}|{s.st_dtype}|{s.shape}|{s.group}|{s.logical}\n".encode())
    for fn in _WRITER_FUNCS + (write_checkpoint, shard_plan):
        h.update(inspect.getsource(fn).encode())
    h.update(f"{_FP8_CODE_STD}|{_CHUNK_ELEMS}|{DEFAULT_SHARD_BYTES}|{seed}".encode())
    if cfg.name == "toy":
        hash_files(_toy_tokenizer_files(), hasher=h, missing=b"-")
    return h.hexdigest()


def ensure_preset_checkpoint(name: str, root=None, seed: int = 0, progress: bool = False) -> Path:
    """The random-weight checkpoint of a preset, written on first use into
    `<root>/<name>-s<seed>-<hash>` (root: `$V41_CACHE` or ~/.cache/v41/checkpoints), a keyed
    directory (v41/keyed_dir.py): written once under its lock into a temporary directory renamed
    into place, so concurrent processes do not race; `.complete` is written last."""
    cfg = preset(name)
    root = Path(root) if root is not None else default_cache_root("checkpoints")
    d = KeyedDir(root, f"{name}-s{seed}-{checkpoint_key(cfg, seed)}", marker=COMPLETE_MARKER)
    return d.build(lambda tmp: write_checkpoint(cfg, tmp, seed=seed, progress=progress),
                   {"preset": name, "seed": seed})
