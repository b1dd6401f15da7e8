"""Write the examples of the `pydoc_next_word` lm-eval tasks (tasks/pydoc_next_word.jsonl).

    .venv/bin/python benchmarks/lm_eval/make_task.py

Source: the held-out slice of the toy's training corpus, `pydoc_data.topics` from CPython's
standard library (PSF License 2.0), as tools/train_toy.py defines it: the topics joined in key
order, tokenized with the toy tokenizer, the last `--holdout` fraction of the tokens. The trained
toy never saw these tokens. The text depends on the Python version that ships the topics, so the
JSONL is committed and records that version; the tasks read only the JSONL.

An example is a prose paragraph of the slice cut just before one of its words: `context` is the
text up to that word (at most --max-context-chars, cut at a word start), `target` the word
(letters only, after a space, so the continuation starts with " word"). Three words a paragraph,
at fixed fractions of it: deterministic, no sampling. The topics repeat text verbatim, so an
example whose last words and target also occur in the training slice is dropped (as are repeats).
"""
from __future__ import annotations

import argparse
import json
import platform
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

OUT = Path(__file__).resolve().parent / "tasks" / "pydoc_next_word.jsonl"
WORD = re.compile(r"(?<= )[A-Za-z]+(?=[\s,.;:)])")
FRACTIONS = (0.3, 0.6, 0.9)  # where in a paragraph the target words sit


def corpus_split(holdout: float) -> tuple[str, str]:
    """(training text, held-out text) as tools/train_toy.py splits the tokens."""
    from tools.train_toy import corpus_tokens, split_tokens
    from v41.config import TOY_TOKENIZER_DIR
    from v41.tokenizer import Tokenizer
    tok = Tokenizer(TOY_TOKENIZER_DIR)
    return tuple(tok.decode(part.tolist()) for part in split_tokens(corpus_tokens(), holdout))


def is_prose(paragraph: str, min_words: int) -> bool:
    """A paragraph of running text: not a table, code block (indented) or bullet list."""
    return not re.match(r"[\s+|*>]", paragraph) and len(paragraph.split()) >= min_words


def examples(text: str, train: str, max_context_chars: int, min_words: int, seen_chars: int) -> list[dict]:
    out, seen = [], set()
    for k, p in enumerate(text.split("\n\n")):
        if not is_prose(p, min_words):
            continue
        words = list(WORD.finditer(p))
        taken = set()
        for f in FRACTIONS:
            at = next((m for m in words if m.start() >= f * len(p) and m.start() not in taken), None)
            if at is None:
                continue
            taken.add(at.start())
            context = p[: at.start() - 1]
            if len(context) > max_context_chars:
                cut = len(context) - max_context_chars
                context = context[cut + re.search(r"\s\S", context[cut:]).start() + 1:]
            # the topics repeat text verbatim: drop a repeat, and an example whose last words
            # (seen_chars of context, then the target) the training slice holds
            if (context, at.group()) not in seen and f"{context[-seen_chars:]} {at.group()}" not in train:
                seen.add((context, at.group()))
                out.append({"id": f"p{k}w{at.start()}", "context": context, "target": at.group()})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/lm_eval/make_task.py", description=__doc__.split("\n")[0])
    ap.add_argument("--holdout", type=float, default=0.05, help="train_toy's held-out fraction")
    ap.add_argument("--max-context-chars", type=int, default=320)
    ap.add_argument("--min-words", type=int, default=20, help="shortest paragraph used")
    ap.add_argument("--seen-chars", type=int, default=40,
                    help="context characters before the target that, found with it in the training slice, drop it")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    train, held = corpus_split(a.holdout)
    rows = examples(held, train, a.max_context_chars, a.min_words, a.seen_chars)
    source = {"source": f"pydoc_data.topics, Python {platform.python_version()} (PSF License 2.0)",
              "holdout": a.holdout}
    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps({**r, **source}, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} examples to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
