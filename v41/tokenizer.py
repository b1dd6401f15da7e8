"""Tokenizer of a model directory or preset (`tokenizer.json` + `tokenizer_config.json` with a
chat template) and the Engram token normalization map that goes with it."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from v41.config import PRESETS, TOY_TOKENIZER_DIR, V41Config
from v41.engram.tokens import synthetic_token_map, token_map_from_tokenizer


class Tokenizer:
    def __init__(self, directory: Path):
        from tokenizers import Tokenizer as HFTokenizer
        self.tok = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        cfgf = directory / "tokenizer_config.json"
        self.config = json.loads(cfgf.read_text()) if cfgf.exists() else {}
        self.chat_template = self.config.get("chat_template")
        self.bos_token = self.config.get("bos_token")
        self.eos_token = self.config.get("eos_token")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        import jinja2
        env = jinja2.Environment(undefined=jinja2.StrictUndefined)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def tokenizer_dir(model: str, cfg: V41Config) -> Path | None:
    if model in PRESETS:
        return TOY_TOKENIZER_DIR if cfg.name == "toy" else None
    d = Path(model)
    return d if (d / "tokenizer.json").exists() else None


def load_tokenizer(model: str, cfg: V41Config) -> tuple[Tokenizer | None, np.ndarray]:
    """The tokenizer (None when the model ships none: prompts are then token ids) and the Engram
    token map: the tokenizer's normalization map when its size matches the config, otherwise
    the synthetic map i mod compressed vocab."""
    d = tokenizer_dir(model, cfg)
    tok = Tokenizer(d) if d else None
    if tok is not None:
        tmap, size = token_map_from_tokenizer(tok.tok)
        if size == cfg.engram_compressed_vocab_size and len(tmap) >= cfg.vocab_size:
            return tok, tmap[: cfg.vocab_size]
    return tok, synthetic_token_map(cfg.vocab_size, cfg.engram_compressed_vocab_size)
