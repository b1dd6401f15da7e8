"""Greedy generation through the reference oracle (the full forward is recomputed per token).

    python -m tests.reference.generate --prompt "Once upon a time" --max-tokens 16

Uses the toy preset's random-weight checkpoint (`v41.loader.ensure_preset_checkpoint`) and the
toy tokenizer (v41/assets/toy/tokenizer.json). The Engram token map is the tokenizer's
normalization map (spec §3.2), as the runtime uses it.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from tokenizers import Tokenizer

from v41.config import TOY_TOKENIZER_DIR, preset
from v41.engram.tokens import synthetic_token_map, token_map_from_tokenizer
from v41.loader import ensure_preset_checkpoint, load_checkpoint

from .oracle import Oracle

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.reference.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float64")
    ap.add_argument("--index-plane", choices=("fp4", "fp8"), default="fp4")
    ap.add_argument("--seed", type=int, default=0, help="checkpoint seed")
    ap.add_argument("--bos", action="store_true", help="prepend the BOS token")
    ap.add_argument("--synthetic-token-map", action="store_true",
                    help="Engram token map i mod engram_compressed_vocab_size instead of the tokenizer's")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (the oracle is many tiny ops: 1 is fastest)")
    ap.add_argument("--verbose", "-v", action="store_true", help="print ids and timing to stderr")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    cfg = preset("toy")
    tok = Tokenizer.from_file(str(TOY_TOKENIZER_DIR / "tokenizer.json"))
    if a.synthetic_token_map:
        token_map = synthetic_token_map(cfg.vocab_size, cfg.engram_compressed_vocab_size)
    else:
        token_map, n = token_map_from_tokenizer(tok)
        if n != cfg.engram_compressed_vocab_size or len(token_map) != cfg.vocab_size:
            print(f"error: toy tokenizer map has {n} compressed ids / {len(token_map)} tokens; the toy "
                  f"config expects {cfg.engram_compressed_vocab_size} / {cfg.vocab_size}", file=sys.stderr)
            return 2
    weights = load_checkpoint(ensure_preset_checkpoint("toy", seed=a.seed), cfg, progress=False)
    oracle = Oracle(cfg, weights, dtype=DTYPES[a.dtype], index_plane=a.index_plane, token_map=token_map)

    ids = ([cfg.bos_token_id] if a.bos else []) + tok.encode(a.prompt).ids
    if not ids:
        print("error: empty prompt", file=sys.stderr)
        return 2
    n_prompt = len(ids)
    t0 = time.time()
    for _ in range(a.max_tokens):
        nxt = int(oracle.forward(torch.tensor(ids))[-1].argmax())
        ids.append(nxt)
        if nxt == cfg.eos_token_id:
            break
    out = ids[n_prompt:]
    if a.verbose:
        print(f"prompt ids {ids[:n_prompt]}\ngenerated ids {out}\n{len(out)} tokens in "
              f"{time.time() - t0:.2f}s", file=sys.stderr)
    print(a.prompt + tok.decode(out, skip_special_tokens=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
