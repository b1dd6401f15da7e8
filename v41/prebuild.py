"""Prebuild the compile cache, so serving starts warm:

    python -m v41.prebuild --model toy --dtype float32 --device cpu
    python -m v41.prebuild --model flash-slice --capture-sizes 1,2,4,8,16,32,64 --json

Builds the engine the way `python -m v41.serve --no-enforce-eager` does (same flags, same code
path): every compiled segment is traced and compiled once, every capture size is run under
`fail_on_recompile`, and the keyed directory `<compile-cache-dir>/<key>/` gets its READY marker
(runtime/compile/cache.py: the key hashes the config, the runtime settings that shape the graphs, the
model/pass/op sources, the split points, the capture sizes, torch/triton/aiter versions and the
device arch; a file lock serializes concurrent builders). A later `serve` with the same settings
finds it and reports a warm start. Prints the directory, cold or warm, and the seconds.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from runtime.cli import exit_on_refusal
from runtime.engine_args import EngineArgs
from runtime.geometry import AdmissionError


def build_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m v41.prebuild",
                                 description="compile every segment into the keyed compile cache")
    names = EngineArgs.add_cli_args(ap)
    ap.set_defaults(enforce_eager=False)            # prebuild compiles: --no-enforce-eager / -O3
    ap.add_argument("--json", action="store_true", help="one JSON line: the compile report")
    return ap, names


def main(argv=None) -> int:
    ap, _ = build_parser()
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    with exit_on_refusal() as refused:
        eargs = EngineArgs.from_cli_args(a)
        if eargs.enforce_eager:
            raise AdmissionError("prebuild compiles the model: drop --enforce-eager / --compilation-level 0")
        eargs.admit()
        from runtime.engine import LLMEngine
        engine = LLMEngine(eargs)
    if refused:
        return refused.status
    rep = engine.compile_report
    if a.json:
        print(json.dumps(rep, default=str))
    else:
        print(f"{rep['start']} start in {rep['seconds']:.1f}s: {', '.join(rep['segments'])} "
              f"(capture sizes {rep['capture_sizes']}) -> {rep['cache_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
