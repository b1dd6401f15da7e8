"""Generate text offline:

    python -m v41.generate --prompt "The window ring" --max-tokens 32
    python -m v41.generate --prompts-file prompts.jsonl --json

Engine flags: the same as `python -m v41.serve` (`EngineArgs.add_cli_args`), but for `--seed`,
which seeds sampling here; a preset's random weights take `--weight-seed`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from runtime.cli import exit_on_refusal
from runtime.engine_args import EngineArgs
from runtime.sequence import SamplingParams


def build_parser() -> tuple[argparse.ArgumentParser, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m v41.generate", description="offline generation")
    g = ap.add_argument_group("generation")
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    g.add_argument("--prompts-file", help="JSON lines, each with a 'prompt'")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", dest="sampling_seed", type=int, default=None,
                   help="sampling seed (a preset's random weights: --weight-seed)")
    g.add_argument("--json", action="store_true", help="one JSON line per request")
    names = EngineArgs.add_cli_args(ap, exclude=("--seed",))
    return ap, names


def main(argv=None) -> int:
    ap, _ = build_parser()
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    prompts = list(a.prompt)
    if a.prompts_file:
        with open(a.prompts_file) as f:
            prompts += [json.loads(line)["prompt"] for line in f if line.strip()]
    if not prompts:
        ap.error("give --prompt or --prompts-file")
    with exit_on_refusal() as refused:
        params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k,
                                top_p=a.top_p, seed=a.sampling_seed)
        eargs = EngineArgs.from_cli_args(a)
        from v41.llm import LLM
        llm = LLM(**{f.name: getattr(eargs, f.name) for f in dataclasses.fields(eargs)})
    if refused:
        return refused.status
    for out in llm.generate(prompts, params, use_tqdm=not a.json):
        if a.json:
            print(json.dumps(out.as_json()))
        else:
            print(f"--- {out.prompt!r}\n{out.text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
