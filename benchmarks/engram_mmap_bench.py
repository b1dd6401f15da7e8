"""Engram tables mapped from disk on the CPU (issue 16 item 2): process RSS and host gather time per
step on a generated table of several GB.

Writes one Engram table (FP8 E4M3 rows [rows, 256] + E8M0 scales [rows, 8], Flash's row format)
as a safetensors shard under /tmp, drops its pages from the page cache, maps it with
v41.loader.map_engram_table and gathers `--steps` steps of `--tokens` tokens x 24 hash ids (3
n-gram orders x 8 heads; each id uniform within its (order, head) bucket, as the hash's
mod-prime gives) through an EngramStager into float32 rows [tokens, 6144]. Measures RSS
(VmRSS, RssAnon, RssFile of /proc/self/status) before and after mapping and after each pass, and
the gather time per step (time.perf_counter; median, p90): a cold pass (the table's pages not
cached) and a warm pass over the same ids, with MADV_WILLNEED on each step's pages (the
default) and, alternating in the warm pass, without it; then the first fifth of the steps cold
again without it (the table unmapped and its pages dropped first). Sampled rows are checked against bytes read from the
file with os.pread. The table is deleted at the end (--keep keeps it).

    python benchmarks/engram_mmap_bench.py                 # 4 GiB table, writes the result
    python benchmarks/engram_mmap_bench.py --dry-run       # small table, prints only
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from v41.loader.engram_map import EngramStager, map_engram_table  # noqa: E402
from v41.loader.schema import TensorSpec  # noqa: E402

RESULT = REPO / "benchmarks" / "results" / "engram-mmap-cpu.json"
NAME = "layers.1.engram.embed.weight"
SCALE = "layers.1.engram.embed.scale"
DIM, ORDERS, HEADS = 256, 3, 8


def schema(rows: int) -> dict:
    return {NAME: TensorSpec(torch.float8_e4m3fn, (rows, DIM), "fp8", "engram_tables", (1, 32), (rows, DIM)),
            SCALE: TensorSpec(torch.float8_e8m0fnu, (rows, DIM // 32), "e8m0", "engram_tables", (1, 32),
                              (rows, DIM))}


def write_table(path: Path, rows: int, seed: int = 0, chunk_rows: int = 1 << 18) -> None:
    """A safetensors file streamed chunk by chunk (never whole in memory): scales, then rows."""
    s_bytes, w_bytes = rows * DIM // 32, rows * DIM
    header = {"__metadata__": {"format": "pt"},
              SCALE: {"dtype": "F8_E8M0", "shape": [rows, DIM // 32], "data_offsets": [0, s_bytes]},
              NAME: {"dtype": "F8_E4M3", "shape": [rows, DIM], "data_offsets": [s_bytes, s_bytes + w_bytes]}}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for a in range(0, rows, chunk_rows):
            n = min(chunk_rows, rows - a)
            f.write(rng.integers(117, 128, n * DIM // 32, dtype=np.uint8).tobytes())   # 2^-10 .. 1
        for a in range(0, rows, chunk_rows):
            n = min(chunk_rows, rows - a)
            codes = np.frombuffer(rng.bytes(n * DIM), np.uint8) & np.uint8(0xFE)     # no NaN code
            f.write(codes.tobytes())
        f.flush()
        os.fsync(f.fileno())


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def rss_mib() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = round(int(val.split()[0]) / 1024, 1)
    return out


def bucket_ids(rng, rows: int, tokens: int) -> np.ndarray:
    """[tokens, 24] ids: column c uniform in bucket c of 24 equal buckets over the table."""
    size = rows // (ORDERS * HEADS)
    return rng.integers(0, size, (tokens, ORDERS * HEADS)) + np.arange(ORDERS * HEADS) * size


def check_rows(path: Path, table, ids: np.ndarray) -> None:
    """Decoded rows of `ids` from bytes read with os.pread equal the mapped gather's."""
    got = table.gather(ids)
    fd = os.open(path, os.O_RDONLY)
    try:
        for i, r in enumerate(ids.tolist()):
            w = np.frombuffer(os.pread(fd, DIM, table.codes.offset + r * DIM), np.uint8)
            s = np.frombuffer(os.pread(fd, DIM // 32, table.scale_codes.offset + r * DIM // 32), np.uint8)
            vals = torch.from_numpy(w.copy()).view(torch.float8_e4m3fn).float().numpy()
            want = (vals.reshape(-1, 32) * np.exp2(s.astype(np.float64) - 127)[:, None]).reshape(-1)
            if not np.array_equal(got[i], want.astype(np.float32)):
                raise AssertionError(f"row {r}: mapped gather differs from the file's bytes")
    finally:
        os.close(fd)


def timed_pass(stager, batches, out) -> list[float]:
    ms = []
    for ids in batches:
        t0 = time.perf_counter()
        stager.gather({1: ids}, out)
        ms.append((time.perf_counter() - t0) * 1e3)
    return ms


def warm_pair(stagers, batches, out) -> dict:
    """Each batch gathered by both stagers (with and without MADV_WILLNEED), order alternating."""
    ms = {k: [] for k in stagers}
    keys = list(stagers)
    for i, ids in enumerate(batches):
        for k in (keys if i % 2 == 0 else keys[::-1]):
            ms[k] += timed_pass(stagers[k], [ids], out)
    return ms


def stats(ms: list[float]) -> dict:
    a = np.asarray(ms)
    return {"steps": len(a), "median_ms": round(float(np.median(a)), 3),
            "p90_ms": round(float(np.percentile(a, 90)), 3), "min_ms": round(float(a.min()), 3),
            "max_ms": round(float(a.max()), 3)}


def run(rows: int, steps: int, tokens: int, workdir: Path, keep: bool) -> dict:
    path = workdir / "model-00001-of-00001.safetensors"
    t0 = time.perf_counter()
    write_table(path, rows)
    write_s = time.perf_counter() - t0
    try:
        drop_cache(path)
        out = {1: torch.empty(tokens, ORDERS * HEADS * DIM, dtype=torch.float32)}
        rng = np.random.default_rng(1)
        batches = [bucket_ids(rng, rows, tokens) for _ in range(steps)]
        rss = {"before_map": rss_mib()}
        t0 = time.perf_counter()
        table = map_engram_table(path, NAME, schema(rows))
        map_ms = (time.perf_counter() - t0) * 1e3
        width = ORDERS * HEADS * DIM
        stagers = {"will_need": EngramStager({1: table}, tokens, width, "cpu"),
                   "plain": EngramStager({1: table}, tokens, width, "cpu", will_need=False)}
        rss["after_map"] = rss_mib()
        cold = timed_pass(stagers["will_need"], batches, out)
        rss["after_cold_pass"] = rss_mib()
        warm = warm_pair(stagers, batches, out)
        rss["after_warm_pass"] = rss_mib()
        check_rows(path, table, np.concatenate([batches[0][0], batches[-1][-1], [0, rows - 1]]))
        for k in list(stagers):
            stagers.pop(k).close()
        del table
        gc.collect()            # no mapping of the file may remain, or its pages stay cached
        # the same first steps cold again, each row's page faulted in alone
        drop_cache(path)
        plain = EngramStager({1: map_engram_table(path, NAME, schema(rows))}, tokens, width, "cpu",
                             will_need=False)
        cold_plain = timed_pass(plain, batches[: max(1, steps // 5)], out)
        plain.close()
        size = path.stat().st_size
    finally:
        if not keep:
            path.unlink(missing_ok=True)
    touched = steps * tokens * ORDERS * HEADS
    return {
        "benchmark": "engram-mmap", "device": "cpu", "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "date": dt.date.today().isoformat(),
        "versions": {"python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__},
        "table": {"rows": rows, "dim": DIM, "file_bytes": size, "file_gib": round(size / 2**30, 3),
                  "write_s": round(write_s, 1)},
        "ids": {"tokens_per_step": tokens, "ids_per_token": ORDERS * HEADS,
                "rows_per_step": tokens * ORDERS * HEADS, "steps_per_pass": steps,
                "rows_per_pass": touched, "distribution": "uniform within 24 equal buckets"},
        "map_ms": round(map_ms, 2), "rss_mib": rss,
        "gather": {"cold": stats(cold), "warm": stats(warm["will_need"]),
                   "warm_without_will_need": stats(warm["plain"]),
                   "cold_without_will_need": stats(cold_plain)},
        "checked_rows": "sampled rows equal the file's bytes decoded (os.pread)",
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16 * 2**20, help="table rows (default 16 Mi: 4.125 GiB)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--dir", default=None, help="where the table is written (default: a new /tmp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the table file")
    ap.add_argument("--out", default=str(RESULT))
    ap.add_argument("--dry-run", action="store_true", help="a 48k-row table, 5 steps; prints only")
    a = ap.parse_args(argv)
    if a.dry_run:
        a.rows, a.steps, a.tokens = 48 * 1024, 5, 16
    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="v41-engram-bench-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        res = run(a.rows, a.steps, a.tokens, work, a.keep)
    finally:
        if not a.dir and not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(res, indent=2)
    print(text)
    if not a.dry_run:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
