"""Generate text offline:

    python -m v41.generate --prompt "The window ring" --max-tokens 32
    python -m v41.generate --prompts-file prompts.jsonl --json
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

from runtime.geometry import AdmissionError
from runtime.sequence import SamplingParams
from v41.config import ConfigError


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v41.generate", description="offline generation")
    ap.add_argument("--model", default="toy", help="preset name or model directory (default: toy)")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    ap.add_argument("--prompts-file", help="JSON lines, each with a 'prompt'")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None, help="sampling seed")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--index-cache-dtype", default="fp8", help="fp8 (default) or fp4")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                    help="run the eager model (default: on; --no-enforce-eager compiles)")
    ap.add_argument("--compilation-level", "--level", type=int, choices=(0, 3), default=3)
    ap.add_argument("--decoder-swa-bounded-replay", action=argparse.BooleanOptionalAction, default=True,
                    help="compiled graphs _EarlyLayers/_LateLayers (off: one _Backbone)")
    ap.add_argument("--compile-cache-dir", default=None)
    ap.add_argument("--dump-dir", default=None, help="graphs, pass dumps, output code, depyf")
    ap.add_argument("--json", action="store_true", help="one JSON line per request")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    prompts = list(a.prompt)
    if a.prompts_file:
        with open(a.prompts_file) as f:
            prompts += [json.loads(line)["prompt"] for line in f if line.strip()]
    if not prompts:
        ap.error("give --prompt or --prompts-file")
    try:
        params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k,
                                top_p=a.top_p, seed=a.seed)
        from v41.llm import LLM
        llm = LLM(a.model, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                  index_cache_dtype=a.index_cache_dtype, block_size=a.block_size, dtype=a.dtype,
                  device=a.device, load_format=a.load_format, enforce_eager=a.enforce_eager,
                  compilation_level=a.compilation_level, decoder_swa_bounded_replay=a.decoder_swa_bounded_replay,
                  compile_cache_dir=a.compile_cache_dir, dump_dir=a.dump_dir)
    except (ConfigError, AdmissionError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for out in llm.generate(prompts, params, use_tqdm=not a.json):
        if a.json:
            print(json.dumps(out.as_json()))
        else:
            print(f"--- {out.prompt!r}\n{out.text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
