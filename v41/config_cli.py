"""`python -m v41.config MODEL [--json]`: the topology table, or (--json) topology, Engram layout
and parameter counts. Lives apart from v41.config because the counts come from the checkpoint
schema (v41.loader), which imports v41.config; v41/config.py's `__main__` runs `main` here."""
from __future__ import annotations

import argparse
import json
import sys

import v41.config as config
from v41.config import ConfigError, V41Config, load_config
from v41.topology import topology_table
from v41.engram.hashing import EngramLayout
from v41.loader import count_params


def summary(cfg: V41Config) -> dict:
    lay = EngramLayout(cfg)
    engram = {str(l): {"rows": lay.rows[i], "primes": lay.primes[i], "multipliers": lay.multipliers[i]}
              for i, l in enumerate(cfg.engram_layer_ids)}
    return {"topology": [s.as_json() for s in cfg.topology.layers], "engram": engram,
            "params": count_params(cfg)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v41.config", description=config.__doc__.split("\n")[0])
    ap.add_argument("model", help="preset name (flash, flash-slice, toy) or a directory with config.json")
    ap.add_argument("--json", action="store_true", help="print topology, Engram layout and parameter counts")
    a = ap.parse_args(argv)
    try:
        cfg = load_config(a.model)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary(cfg), indent=1) if a.json else topology_table(cfg))
    return 0
