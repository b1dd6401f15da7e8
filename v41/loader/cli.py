"""Native DeepSeek-V4.1 checkpoint: schema, parameter counts, a deterministic random-weight
writer and a header-first checker, from the command line (`python -m v41.loader write|check`;
v41/loader/__main__.py runs `main`)."""
from __future__ import annotations

import argparse
import sys

from v41.config import preset, PRESETS
from v41.loader.io import DEFAULT_SHARD_BYTES, check_checkpoint, write_checkpoint
from v41.loader.schema import CheckpointError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v41.loader", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write a random-weight checkpoint of a preset")
    w.add_argument("preset", choices=sorted(PRESETS))
    w.add_argument("out_dir")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES)
    w.add_argument("--no-progress", action="store_true")
    c = sub.add_parser("check", help="check every shard header against the schema (reads no tensor data)")
    c.add_argument("dir")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "write":
            cfg = preset(a.preset)
            out = write_checkpoint(cfg, a.out_dir, seed=a.seed, shard_bytes=a.shard_bytes,
                                   progress=not a.no_progress)
            print(check_checkpoint(out, cfg).summary())
        else:
            print(check_checkpoint(a.dir).summary())
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

