"""Checkpoint files: the shard plan and the random-weight writer, the safetensors header reader,
the index, and the header-first check of a checkpoint directory against the schema (spec/model.md
§5.1-5.2). Reads headers only; tensor data is read by v41.loader.load."""
from __future__ import annotations

import json
import math
import shutil
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file
from tqdm import tqdm

from v41.config import TOY_TOKENIZER_DIR, V41Config, load_config
from v41.loader.schema import PARTS, CheckpointError, checkpoint_schema, count_params, is_host_table
from v41.loader.synthetic import iter_tensor_values

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_SHARD_BYTES = 4 << 30
COMPLETE_MARKER = ".complete"
_ST_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
                "F8_E8M0": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "I8": 1, "U8": 1, "I16": 2,
                "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8, "BOOL": 1, "C64": 8}


# ---- writer -----------------------------------------------------------------------------

def shard_plan(schema: dict, shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[list[str]]:
    """Tensor names per shard: everything but the Engram tables packed greedily in schema order,
    then each layer's Engram table (weight + scale) in a shard of its own at the end (§5.1)."""
    shards, cur, cur_b = [], [], 0
    tables: dict[str, list[str]] = {}
    for name, spec in schema.items():
        if is_host_table(name):
            tables.setdefault(name.split(".engram.")[0], []).append(name)
            continue
        if cur and cur_b + spec.nbytes > shard_bytes:
            shards.append(cur)
            cur, cur_b = [], 0
        cur.append(name)
        cur_b += spec.nbytes
    if cur:
        shards.append(cur)
    shards.extend(tables.values())
    return shards


def _toy_tokenizer_files() -> list[Path]:
    return [TOY_TOKENIZER_DIR / f for f in ("tokenizer.json", "tokenizer_config.json")]


def write_checkpoint(cfg: V41Config, out_dir, seed: int = 0, shard_bytes: int = DEFAULT_SHARD_BYTES,
                     progress: bool = True) -> Path:
    """Write a random-weight native checkpoint of `cfg`: config.json, safetensors shards,
    model.safetensors.index.json (and the toy tokenizer for the toy preset). Deterministic: the
    same (cfg, seed, shard_bytes) gives identical bytes."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    schema = checkpoint_schema(cfg)
    plan = shard_plan(schema, shard_bytes)
    n = len(plan)
    files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for stale in out.glob("model-*-of-*.safetensors"):
        if stale.name not in files:
            stale.unlink()
    (out / COMPLETE_MARKER).unlink(missing_ok=True)
    total = sum(s.nbytes for s in schema.values())
    weight_map = {}
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
              desc=f"write {cfg.name} checkpoint") as bar:
        for fname, names in zip(files, plan):
            tensors = {}
            for name, t in iter_tensor_values(cfg, names, schema, seed):
                tensors[name] = t
                weight_map[name] = fname
                bar.update(schema[name].nbytes)
            save_file(tensors, str(out / fname), metadata={"format": "pt"})
            del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    if cfg.name == "toy":
        for f in _toy_tokenizer_files():
            if f.exists():
                shutil.copyfile(f, out / f.name)
            else:
                warnings.warn(f"toy tokenizer file {f} not found; not copied")
    return out


# ---- header check -----------------------------------------------------------------------

def read_safetensors_header(path) -> tuple[dict, int, int]:
    """Parse a safetensors header without touching tensor data: (header, data_start, file_size).
    Raises CheckpointError naming the shard on a missing file or a corrupted header."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"shard {path.name}: file missing")
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"shard {path.name}: {size} bytes, too short for a safetensors header")
    with open(path, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        if hlen > size - 8:
            raise CheckpointError(f"shard {path.name}: header length {hlen} runs past the end of the "
                                  f"file ({size} bytes; truncated or corrupted)")
        raw = f.read(hlen)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"shard {path.name}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"shard {path.name}: header is not a JSON object")
    return header, 8 + hlen, size


def _read_index(root: Path) -> dict[str, str]:
    idx = root / INDEX_FILE
    if not idx.exists():
        if (root / SINGLE_FILE).exists():
            header, _, _ = read_safetensors_header(root / SINGLE_FILE)
            return {k: SINGLE_FILE for k in header if k != "__metadata__"}
        raise CheckpointError(f"{INDEX_FILE}: missing (and no {SINGLE_FILE})", str(root))
    try:
        d = json.loads(idx.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{INDEX_FILE}: not valid JSON ({e})", str(root)) from None
    wm = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"{INDEX_FILE}: no weight_map of tensor name -> shard file", str(root))
    for shard in set(wm.values()):
        if Path(shard).name != shard:
            raise CheckpointError(f"{INDEX_FILE}: shard name {shard!r} is not a plain file name",
                                  str(root))
    return wm


@dataclass
class CheckReport:
    root: Path
    shards: dict          # shard file -> list of tensor names (in header data order)
    tensors: int
    bytes: int
    bytes_per_part: dict
    params: dict

    def summary(self) -> str:
        lines = [f"{self.root}: OK — {len(self.shards)} shards, {self.tensors} tensors, "
                 f"{self.bytes:,} bytes ({self.bytes / 2**20:.2f} MiB)"]
        for p in PARTS:
            lines.append(f"  {p:15s} {self.params.get(p, 0):>20,} params {self.bytes_per_part[p]:>20,} B")
        lines.append(f"  {'total':15s} {self.params['total']:>20,} params {self.bytes:>20,} B")
        return "\n".join(lines)


def check_checkpoint(path, cfg: V41Config | None = None, schema: dict | None = None) -> CheckReport:
    """Check the index and every shard header against the schema of `cfg` (from the directory's
    config.json when not given). Reads headers only. Raises CheckpointError listing every problem."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory")
    if cfg is None:
        cfg = load_config(root)
    schema = schema if schema is not None else checkpoint_schema(cfg)
    wm = _read_index(root)
    problems: list[str] = []
    for name in schema:
        if name not in wm:
            problems.append(f"tensor {name}: missing (not in {INDEX_FILE})")
    for name in wm:
        if name not in schema:
            problems.append(f"tensor {name}: unexpected (not in the {cfg.name} schema)")
    by_shard: dict[str, list[str]] = {}
    for name, shard in wm.items():
        by_shard.setdefault(shard, []).append(name)
    seen: dict[str, str] = {}
    shards: dict[str, list[str]] = {}
    for shard in sorted(by_shard):
        listed = set(by_shard[shard])
        spath = root / shard
        if not spath.is_file():
            problems.append(f"shard {shard}: listed in {INDEX_FILE} but missing "
                            f"(tensors {sorted(listed)[:3]}{' ...' if len(listed) > 3 else ''})")
            continue
        try:
            header, data_start, size = read_safetensors_header(spath)
        except CheckpointError as e:
            problems.extend(e.problems)
            continue
        header.pop("__metadata__", None)
        ranges = []
        for name, ent in header.items():
            if name in seen:
                problems.append(f"tensor {name}: present in shard {seen[name]} and shard {shard}")
                continue
            seen[name] = shard
            if name not in listed:
                if name in wm:
                    problems.append(f"tensor {name}: found in shard {shard} but the index maps it to "
                                    f"{wm[name]}")
                else:
                    problems.append(f"tensor {name}: unexpected, in shard {shard} (not in the index)"
                                    + ("" if name in schema else f" nor in the {cfg.name} schema"))
                continue
            if not isinstance(ent, dict) or not {"dtype", "shape", "data_offsets"} <= set(ent):
                problems.append(f"tensor {name}: malformed header entry in shard {shard}")
                continue
            dt, shape, offs = ent["dtype"], ent["shape"], ent["data_offsets"]
            if (not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape)
                    or not isinstance(offs, list) or len(offs) != 2
                    or not all(isinstance(o, int) for o in offs) or dt not in _ST_ITEMSIZE):
                problems.append(f"tensor {name}: malformed header entry in shard {shard} "
                                f"(dtype {dt!r}, shape {shape!r}, data_offsets {offs!r})")
                continue
            spec = schema.get(name)
            bad = False
            if spec is not None:
                if dt != spec.st_dtype:
                    problems.append(f"tensor {name}: dtype {dt} in shard {shard}, expected {spec.st_dtype}")
                    bad = True
                if tuple(shape) != spec.shape:
                    problems.append(f"tensor {name}: shape {list(shape)} in shard {shard}, expected "
                                    f"{list(spec.shape)}")
                    bad = True
            b, e = offs
            need = math.prod(shape) * _ST_ITEMSIZE[dt]
            if not 0 <= b <= e or e - b != need:
                problems.append(f"tensor {name}: data_offsets {offs} in shard {shard} do not hold "
                                f"{need} bytes")
                bad = True
            elif data_start + e > size:
                problems.append(f"tensor {name}: data [{b}, {e}) runs past the end of shard {shard} "
                                f"({size - data_start} data bytes; file truncated?)")
                bad = True
            if not bad:
                ranges.append((b, e, name))
        for name in sorted(listed - set(header)):
            problems.append(f"tensor {name}: missing from shard {shard} (the index lists it there)")
        ranges.sort()
        for (b0, e0, n0), (b1, e1, n1) in zip(ranges, ranges[1:]):
            if b1 < e0:
                problems.append(f"tensor {n1}: data overlaps tensor {n0} in shard {shard}")
        shards[shard] = [r[2] for r in ranges]
    if problems:
        raise CheckpointError(problems, str(root))
    sizes = {p: 0 for p in PARTS}
    for spec in schema.values():
        sizes[spec.part] += spec.nbytes
    params = count_params(cfg)
    return CheckReport(root, shards, len(schema), sum(sizes.values()), sizes, params)
