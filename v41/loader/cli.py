"""Native DeepSeek-V4.1 checkpoint: schema, parameter counts, a deterministic random-weight
writer, a header-first checker and the weights' placement on GPUs, from the command line
(`python -m v41.loader write|check|placement`; v41/loader/__main__.py runs `main`)."""
from __future__ import annotations

import argparse
import sys

from v41.config import preset, PRESETS
from v41.loader.io import DEFAULT_SHARD_BYTES, check_checkpoint, write_checkpoint
from v41.loader.placement import RULES, format_placement, placement
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
    p = sub.add_parser("placement", help="bytes of weights per GPU (meta device; Engram tables on the host)")
    p.add_argument("preset", choices=sorted(PRESETS))
    p.add_argument("--gpus", default="4,8", help="GPU counts, comma-separated (default 4,8)")
    p.add_argument("--rule", choices=RULES, default="dp-attention",
                   help="dense weights replicated (dp-attention) or tensor-parallel slices (tp)")
    p.add_argument("--processed", action="store_true",
                   help="bytes after the post-load processing (wo_a BF16, the draft's confidence head FP32)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "write":
            cfg = preset(a.preset)
            out = write_checkpoint(cfg, a.out_dir, seed=a.seed, shard_bytes=a.shard_bytes,
                                   progress=not a.no_progress)
            print(check_checkpoint(out, cfg).summary())
        elif a.cmd == "placement":
            try:
                counts = [int(g) for g in a.gpus.split(",")]
            except ValueError:
                raise ValueError(f"--gpus {a.gpus!r}: expected comma-separated integers") from None
            print("\n\n".join(format_placement(placement(preset(a.preset), g, a.rule, a.processed))
                              for g in counts))
        else:
            print(check_checkpoint(a.dir).summary())
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

