"""Engram tables mapped from the checkpoint shards (spec/model.md §5.5). Each table's FP8 rows and
E8M0 scales are opened at their safetensors offsets with a read-only mmap, so only the rows a
step gathers are ever read: Flash's two tables are 94 GiB each. The rows of a step's hash ids
are decoded on the host into a staging buffer (pinned on CUDA) and copied to the device with one
non-blocking copy per layer; `EngramStager.prefetch` gathers the next step's rows on a
background thread when its ids are known early.

A mapped table is refused by name before it serves when its shard is not the one the schema
describes: a missing tensor, another dtype or shape, data offsets that do not hold the tensor,
or data past the end of the file (a truncated shard, which would otherwise fault at a gather).
"""
from __future__ import annotations

import math
import mmap
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from v41 import quant
from v41.loader.io import _ST_ITEMSIZE, read_safetensors_header
from v41.loader.schema import CheckpointError, TensorSpec

# load_checkpoint(engram="auto") maps a table (rows + scales) of at least this many bytes and
# reads smaller ones. Below it, a resident table costs little RAM and reads in well under a
# second, and the gather op decodes small tables once whole; Flash's tables are ~370x larger.
ENGRAM_MAP_BYTES = 256 << 20
ENGRAM_MODES = ("auto", "mapped", "resident")

_CODES = torch.arange(256, dtype=torch.uint8)
_FP8_VALUES = _CODES.view(torch.float8_e4m3fn).to(torch.float32).numpy()   # E4M3 code -> value
_E8M0_VALUES = quant.e8m0_decode(_CODES, torch.float32).numpy()            # E8M0 code -> 2^(c-127)


def _entry(header: dict, name: str, spec: TensorSpec, shard: str, data_start: int, size: int) -> int:
    """The absolute file offset of `name`'s data after checking its header entry against `spec`."""
    ent = header.get(name)
    if not isinstance(ent, dict) or not {"dtype", "shape", "data_offsets"} <= set(ent):
        raise CheckpointError(f"tensor {name}: not in shard {shard}" if ent is None
                              else f"tensor {name}: malformed header entry in shard {shard}")
    dt, shape, offs = ent["dtype"], ent["shape"], ent["data_offsets"]
    if dt != spec.st_dtype:
        raise CheckpointError(f"tensor {name}: dtype {dt} in shard {shard}, expected {spec.st_dtype}")
    if not isinstance(shape, list) or tuple(shape) != spec.shape:
        raise CheckpointError(f"tensor {name}: shape {shape} in shard {shard}, expected {list(spec.shape)}")
    need = math.prod(spec.shape) * _ST_ITEMSIZE[dt]
    if (not isinstance(offs, list) or len(offs) != 2 or not all(isinstance(o, int) for o in offs)
            or not 0 <= offs[0] <= offs[1] or offs[1] - offs[0] != need):
        raise CheckpointError(f"tensor {name}: data_offsets {offs} in shard {shard} do not hold {need} bytes")
    if data_start + offs[1] > size:
        raise CheckpointError(f"tensor {name}: data [{offs[0]}, {offs[1]}) runs past the end of shard "
                              f"{shard} ({size - data_start} data bytes; file truncated?)")
    return data_start + offs[0]


def _map(path: Path, offset: int, shape: tuple) -> np.memmap:
    m = np.memmap(path, dtype=np.uint8, mode="r", offset=offset, shape=shape)
    # hash ids are spread uniformly over the table: read-ahead would only pull unused pages
    m._mmap.madvise(mmap.MADV_RANDOM)
    return m


def _will_need(m: np.memmap, ids: np.ndarray) -> None:
    """Ask the kernel to read the pages of rows `ids` now, all at once (MADV_WILLNEED, one call
    per run of adjacent pages): a cold gather otherwise faults them in one at a time."""
    row, page = m.shape[1], mmap.PAGESIZE
    pos = m.offset % mmap.ALLOCATIONGRANULARITY + ids * row     # where np.memmap's mmap starts
    pages = np.unique(np.concatenate([pos // page, (pos + row - 1) // page]))
    if not len(pages):
        return
    cut = np.flatnonzero(np.diff(pages) != 1) + 1
    for first, last in zip(pages[np.r_[0, cut]].tolist(), pages[np.r_[cut - 1, len(pages) - 1]].tolist()):
        m._mmap.madvise(mmap.MADV_WILLNEED, first * page, (last - first + 1) * page)


class MappedEngramTable:
    """One Engram layer's table mapped read-only from its shard: `codes` uint8 [rows, dim] (E4M3)
    and `scale_codes` uint8 [rows, dim/32] (E8M0), both np.memmap; never written."""

    def __init__(self, name: str, path: Path, codes: np.memmap, scale_codes: np.memmap):
        self.name, self.path = name, path
        self.codes, self.scale_codes = codes, scale_codes
        self.rows, self.dim = codes.shape

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale_codes.nbytes

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-copy (float8_e4m3fn [rows, dim], float8_e8m0fnu [rows, dim/32]) views of the
        mapping, for code that takes tensors (the gather op, `Weights`). Read-only memory:
        writing through them faults."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            w = torch.from_numpy(self.codes).view(torch.float8_e4m3fn)
            s = torch.from_numpy(self.scale_codes).view(torch.float8_e8m0fnu)
        return w, s

    def gather(self, ids, out: np.ndarray | None = None, will_need: bool = True) -> np.ndarray:
        """Decoded rows float32 [N, dim] of the flat int64 `ids` (E4M3 value x its block's E8M0
        scale, as the gather op computes them), written into `out` when given. Only the rows'
        pages are read; `will_need` asks for all of them first (one madvise per run of pages:
        ~3x faster cold, a syscall cost when they are cached). Ids outside [0, rows) raise."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = len(ids)
        if n and (ids.min() < 0 or ids.max() >= self.rows):
            bad = ids[(ids < 0) | (ids >= self.rows)][0]
            raise IndexError(f"{self.name}: row id {bad} outside [0, {self.rows})")
        if will_need:
            _will_need(self.codes, ids)
            _will_need(self.scale_codes, ids)
        out = np.empty((n, self.dim), np.float32) if out is None else out.reshape(n, self.dim)
        np.take(_FP8_VALUES, self.codes[ids], out=out)
        s = np.take(_E8M0_VALUES, self.scale_codes[ids])
        blocks = out.reshape(n, self.dim // 32, 32)
        np.multiply(blocks, s[..., None], out=blocks)
        return out


def map_engram_table(path, weight_name: str, schema: dict) -> MappedEngramTable:
    """Map the table `weight_name` (`layers.L.engram.embed.weight`) and its `.scale` from the
    shard `path`, after checking both header entries against `schema` (CheckpointError naming
    the tensor and the shard otherwise)."""
    path = Path(path)
    header, data_start, size = read_safetensors_header(path)
    scale_name = weight_name[: -len("weight")] + "scale"
    ws, ss = schema[weight_name], schema[scale_name]
    w_off = _entry(header, weight_name, ws, path.name, data_start, size)
    s_off = _entry(header, scale_name, ss, path.name, data_start, size)
    if ws.shape[1] != 32 * ss.shape[1] or ws.shape[0] != ss.shape[0]:
        raise CheckpointError(f"tensor {scale_name}: shape {list(ss.shape)} does not give one scale per "
                              f"32 values of {weight_name} {list(ws.shape)}")
    return MappedEngramTable(weight_name, path, _map(path, w_off, ws.shape), _map(path, s_off, ss.shape))


class EngramStager:
    """The Engram rows of a step, gathered on the host from mapped tables into a float32 staging
    buffer (pinned on CUDA) and copied to the device rows, one non-blocking copy per layer.

    Two staging slots: a step's copy reads one while `prefetch` fills the other on a background
    thread; `gather` with the prefetched ids then only waits for that thread. A slot is rewritten
    only after the copy that read it has run (a CUDA event per slot)."""

    def __init__(self, tables: dict, max_tokens: int, width: int, device, will_need: bool = True):
        """`tables`: layer -> MappedEngramTable; `width`: decoded floats per token (ids per
        token x the table's dim); `will_need`: see MappedEngramTable.gather."""
        self.tables, self.width, self.device = dict(tables), width, torch.device(device)
        self.will_need = will_need
        cuda = self.device.type == "cuda"
        self._stage = [{l: torch.empty(max_tokens, width, dtype=torch.float32, pin_memory=cuda)
                        for l in self.tables} for _ in range(2)]
        self._copied: list = [None, None]       # CUDA event after the copies out of each slot
        self._slot = 1                          # the slot the last step's copy read
        self._pending: tuple | None = None      # (ids, slot, future) of a prefetch
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engram-prefetch")
        self.prefetch_hits = 0

    def _fill(self, slot: int, ids: dict) -> None:
        ev = self._copied[slot]
        if ev is not None:
            ev.synchronize()
        for l, a in ids.items():
            T = len(a)
            if a.shape[1] * self.tables[l].dim != self.width:
                raise ValueError(f"engram ids of layer {l}: {a.shape[1]} per token give "
                                 f"{a.shape[1] * self.tables[l].dim} floats, staging holds {self.width}")
            self.tables[l].gather(a, self._stage[slot][l][:T].numpy(), self.will_need)

    def _check(self, ids: dict) -> dict:
        if set(ids) != set(self.tables):
            raise ValueError(f"engram ids for layers {sorted(ids)}, tables of {sorted(self.tables)}")
        return {l: np.array(a, dtype=np.int64, copy=True).reshape(len(a), -1) for l, a in ids.items()}

    def prefetch(self, ids: dict) -> Future:
        """Start gathering the rows of `ids` (layer -> int64 [T, n], copied now) into the slot the
        last step's copy did not read; a later `gather` of equal ids uses them."""
        ids = self._check(ids)
        self._drain()
        slot = 1 - self._slot
        fut = self._pool.submit(self._fill, slot, ids)
        self._pending = (ids, slot, fut)
        return fut

    def _drain(self) -> tuple | None:
        p, self._pending = self._pending, None
        if p is not None:
            p[2].result()
        return p

    def gather(self, ids: dict, out: dict) -> None:
        """Decoded rows of `ids` (layer -> int64 [T, n]) into `out` (layer -> device tensor
        [T, width], any float dtype), from a matching prefetch or gathered now."""
        ids = self._check(ids)
        p = self._drain()
        if p is not None and all(np.array_equal(p[0][l], ids[l]) for l in ids):
            slot = p[1]
            self.prefetch_hits += 1
        else:
            slot = 1 - self._slot
            self._fill(slot, ids)
        for l, a in ids.items():
            out[l][: len(a)].copy_(self._stage[slot][l][: len(a)], non_blocking=True)
        if self.device.type == "cuda":
            self._copied[slot] = torch.cuda.Event()
            self._copied[slot].record()
        self._slot = slot

    def close(self) -> None:
        self._drain()
        self._pool.shutdown(wait=True)


def engram_tables(cfg, weights, device) -> dict:
    """Layer -> (table, scale) for the gather op. Resident tables (small: the loader maps large
    ones) move to `device`, where the op reads them with a step's published ids (no per-step
    host work); mapped tables stay host views, read through the EngramStager."""
    mapped = getattr(weights, "mapped", None) or {}
    out = {}
    for l in cfg.engram_layer_ids:
        name = f"layers.{l}.engram.embed."
        w, s = weights[name + "weight"], weights[name + "scale"]
        out[l] = (w, s) if name + "weight" in mapped else (w.to(device), s.to(device))
    return out


def engram_stager(weights, max_tokens: int, device) -> EngramStager | None:
    """The stager of a `Weights` whose Engram tables are mapped (None when they are resident, or
    for a plain name -> tensor mapping)."""
    if not getattr(weights, "mapped", None):
        return None
    cfg = weights.cfg
    tables = {l: weights.mapped[f"layers.{l}.engram.embed.weight"] for l in cfg.engram_layer_ids}
    return EngramStager(tables, max_tokens, cfg.engram_width, device)
