"""Train the toy tokenizer once (DESIGN.md §6): byte-level BPE, vocab exactly 1024, trained on
the project's own text (/work/shared: DESIGN.md, spec/*.md, seeds/*), read at training time.

    .venv/bin/python v41/assets/make_toy_tokenizer.py [--corpus /work/shared] [--out v41/assets/toy]

The output is committed and frozen: the toy checkpoint, TOY_COMPRESSED_VOCAB and the Engram
hashes depend on it. tokenizer_config.json records the corpus hash so a test can tell "the
script changed" (fail) from "the docs moved on since" (skip).
"""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 1024
BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜pad｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
# ids 0..4: the trainer places its special tokens first
HEAD = [BOS, EOS, PAD, USER, ASSISTANT]
# ids 1022, 1023 (toy dspark_noise_token_id, image_token_id): added after training
TAIL = ["<｜dspark_noise｜>", "<｜image｜>"]

# DeepSeek style: bos, a system prompt verbatim, user turns after <｜User｜>, assistant turns
# closed by eos; <｜Assistant｜> opens the reply when add_generation_prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)


def corpus_files(root: Path) -> list[Path]:
    files = [root / "DESIGN.md", *sorted((root / "spec").glob("*.md")), *sorted((root / "seeds").glob("*"))]
    return [f for f in files if f.is_file()]


def corpus_sha256(root: Path) -> str:
    h = hashlib.sha256()
    for f in corpus_files(root):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def train(root: Path) -> Tokenizer:
    texts = [f.read_text(encoding="utf-8") for f in corpus_files(root)]
    if not texts:
        raise SystemExit(f"no corpus under {root}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - len(TAIL), special_tokens=HEAD, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != VOCAB - len(TAIL):
        raise SystemExit(f"trained vocab {tok.get_vocab_size()} != {VOCAB - len(TAIL)}: corpus too small")
    tok.add_special_tokens(TAIL)
    ids = [tok.token_to_id(t) for t in HEAD + TAIL]
    assert ids == [0, 1, 2, 3, 4, VOCAB - 2, VOCAB - 1], ids
    return tok


def tokenizer_config(root: Path) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "add_bos_token": False,  # the chat template writes bos itself
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,  # toy max_position_embeddings
        "chat_template": CHAT_TEMPLATE,
        "v41_corpus_sha256": corpus_sha256(root),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=Path(__file__).resolve().parents[3] / "shared")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "toy")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    train(a.corpus).save(str(a.out / "tokenizer.json"), pretty=True)
    (a.out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(a.corpus), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {a.out}/tokenizer.json, tokenizer_config.json")


if __name__ == "__main__":
    main()
