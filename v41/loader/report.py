"""The startup memory report of loaded weights: bytes by storage format (FP8 and FP4 codes,
their E8M0 scales, BF16, FP32) and the Engram tables' bytes, mapped from disk or resident."""
from __future__ import annotations

import torch

from v41.loader.schema import is_host_table

FORMATS = ("bf16", "f32", "fp8", "fp4", "e8m0")
_FORMAT = {torch.bfloat16: "bf16", torch.float32: "f32", torch.float8_e4m3fn: "fp8",
           torch.int8: "fp4", torch.float8_e8m0fnu: "e8m0"}    # int8: packed FP4 E2M1 pairs


def memory_report(weights) -> dict:
    """Bytes of `weights` (a v41.loader.Weights): `formats` (every tensor but the Engram tables,
    by storage format; a dtype outside FORMATS under its torch name), `engram` ({'mapped',
    'resident'}: table rows + scales; mapped ones are read from the shard on demand and hold no
    RAM of their own), `weights_bytes` (the sum of `formats`, on `device`) and `device`."""
    formats = dict.fromkeys(FORMATS, 0)
    engram = {"mapped": 0, "resident": 0}
    mapped = {n for w in weights.mapped for n in (w, w[: -len("weight")] + "scale")}
    for name, t in weights.items():
        if is_host_table(name):
            engram["mapped" if name in mapped else "resident"] += t.nbytes
            continue
        key = _FORMAT.get(t.dtype, str(t.dtype).removeprefix("torch."))
        formats[key] = formats.get(key, 0) + t.nbytes
    return {"formats": formats, "weights_bytes": sum(formats.values()), "engram": engram,
            "device": str(weights.device)}


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):,.2f} {unit}"
    return f"{n} B"


def format_memory_report(rep: dict) -> str:
    """One log line of a memory_report."""
    fmts = ", ".join(f"{k} {_size(v)}" for k, v in rep["formats"].items() if v)
    e = rep["engram"]
    return (f"weights on {rep['device']}: {_size(rep['weights_bytes'])} ({fmts}); Engram tables: "
            f"{_size(e['mapped'])} mapped from disk, {_size(e['resident'])} resident on the host")
