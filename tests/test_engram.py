"""Engram host half: prime layout, multipliers, n-gram hash ids, normalization map, toy tokenizer."""
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from v41 import config
from v41.config import V41Config, preset
from v41.engram.hashing import DEAD, EngramLayout, hash_ids, table_rows
from v41.engram.tokens import compress, normalize_text, synthetic_token_map, token_map_from_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "v41" / "assets" / "make_toy_tokenizer.py"
CORPUS = Path(__file__).resolve().parents[2] / "shared"   # ../shared beside the checkout


# ---- layout -------------------------------------------------------------------------------

def test_flash_layout():
    lay = EngramLayout(preset("flash"))
    assert lay.rows == [384006168, 384016682] == preset("flash").engram_num_embeddings
    flat = lay.primes[0] + lay.primes[1]
    assert len(flat) == 48 and flat[:3] == [16000057, 16000079, 16000081] and flat[-1] == 16000889
    assert flat == sorted(flat)  # the 48 consecutive primes above 16,000,000
    assert lay.multipliers[0] == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert lay.multipliers[1] == [67716810739261, 51510806800915, 30921347202721, 82619226485591]
    assert lay.offsets[0][:3] == [0, 16000057, 16000057 + 16000079]
    json.dumps([lay.primes, lay.offsets, lay.rows, lay.multipliers])  # plain ints


def test_toy_layout():
    cfg = preset("toy")
    assert cfg.engram_n_heads == 2 and cfg.engram_vocab_size == 64
    lay = EngramLayout(cfg)
    assert lay.primes == [[67, 71, 73, 79, 83, 89], [97, 101, 103, 107, 109, 113]]
    assert lay.rows == [462, 630] == table_rows(cfg) == cfg.engram_num_embeddings


# ---- hash ids -----------------------------------------------------------------------------

def _small_layout(pad_id=1):
    # max_ngram 3, 2 heads, vocab 10: primes order 2 -> 11, 13; order 3 -> 17, 19;
    # offsets 0, 11, 24, 41; multipliers overridden to 3, 5, 7.
    cfg = V41Config(engram_layer_ids=[1], engram_max_ngram_size=3, engram_n_heads=2,
                    engram_vocab_size=10, engram_compressed_vocab_size=16)
    lay = EngramLayout(cfg, pad_id=pad_id)
    assert lay.primes == [[11, 13, 17, 19]] and lay.offsets == [[0, 11, 24, 41]]
    lay.multipliers = [[3, 5, 7]]
    return lay


def test_hash_ids_by_hand():
    # c = [4, 6, DEAD, 2, 9], pad = 1, m = (3, 5, 7); ids = r2%11+0, r2%13+11, r3%17+24, r3%19+41
    # p0: tok (4, pad, pad)  prod (12, 5, 7)   r2 = 12^5 = 9   r3 = 9^7 = 14  -> 9, 20, 38, 55
    # p1: tok (6, 4, pad)    prod (18, 20, 7)  r2 = 18^20 = 6  r3 = 6^7 = 1   -> 6, 17, 25, 42
    # p2: DEAD -> all pad    prod (3, 5, 7)    r2 = 3^5 = 6    r3 = 6^7 = 1   -> 6, 17, 25, 42
    # p3: tok (2, pad, pad)  (look-back hits the DEAD: blocked)
    #                        prod (6, 5, 7)    r2 = 6^5 = 3    r3 = 3^7 = 4   -> 3, 14, 28, 45
    # p4: tok (9, 2, pad)    prod (27, 10, 7)  r2 = 27^10 = 17 r3 = 17^7 = 22 -> 6, 15, 29, 44
    lay = _small_layout()
    got = hash_ids([4, 6, DEAD, 2, 9], lay, 0)
    assert got.dtype == torch.int64 and got.shape == (5, 4)
    assert got.tolist() == [[9, 20, 38, 55], [6, 17, 25, 42], [6, 17, 25, 42],
                            [3, 14, 28, 45], [6, 15, 29, 44]]


def _wrap(x):
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


def _reference(c, lay, i):
    """Pure-Python big-int version of spec §3.2, int64 products wrapped mod 2^64 (signed)."""
    n, m, out = lay.max_ngram, lay.multipliers[i], []
    for p in range(len(c)):
        toks, blocked = [], False
        for k in range(n):
            blocked = blocked or p - k < 0 or c[p - k] == DEAD
            toks.append(lay.pad_id if blocked else c[p - k])
        prods = [_wrap(t * mk) for t, mk in zip(toks, m)]
        rolling, row = prods[0], []
        for o in range(2, n + 1):
            rolling ^= prods[o - 1]  # Python ^ on negatives = two's complement, like int64
            js = range((o - 2) * lay.n_heads, (o - 1) * lay.n_heads)
            row += [rolling % lay.primes[i][j] + lay.offsets[i][j] for j in js]  # floor mod
        out.append(row)
    return out


def _random_seq(rng, n, vocab):
    return [DEAD if rng.random() < 0.1 else rng.randrange(vocab) for _ in range(n)]


def test_hash_ids_wraparound():
    rng = random.Random(0)
    lay = EngramLayout(preset("flash"), pad_id=2)
    # odd multipliers near 2^63: every product overflows int64, rolling goes negative
    lay.multipliers[1] = [rng.randrange(1 << 62, 1 << 63) | 1 for _ in range(4)]
    c = _random_seq(rng, 200, 99092)
    got = hash_ids(torch.tensor(c), lay, 1).tolist()
    assert got == _reference(c, lay, 1)
    assert all(0 <= x - lay.offsets[1][j] < lay.primes[1][j] for row in got for j, x in enumerate(row))


def test_hash_ids_flash_multipliers():
    rng = random.Random(1)
    lay = EngramLayout(preset("flash"), pad_id=2)
    c = _random_seq(rng, 100, 99092)
    for i in (0, 1):
        assert hash_ids(np.array(c), lay, i).tolist() == _reference(c, lay, i)


def test_hash_ids_chunked():
    rng = random.Random(2)
    lay = EngramLayout(preset("toy"), pad_id=2)
    c = torch.tensor(_random_seq(rng, 80, config.TOY_COMPRESSED_VOCAB))
    for i in (0, 1):
        full = hash_ids(c, lay, i)
        for _ in range(10):
            cuts = sorted(rng.sample(range(1, len(c)), rng.randrange(1, 6)))
            parts = [hash_ids(c[a:b], lay, i, start=a, history=c[max(0, a - 3):a])
                     for a, b in zip([0] + cuts, cuts + [len(c)])]
            assert torch.equal(torch.cat(parts), full)
    # a longer history is fine (its last 3 ids count); too short is refused
    assert torch.equal(hash_ids(c[10:], lay, 0, start=10, history=c[:10]), hash_ids(c, lay, 0)[10:])
    with pytest.raises(ValueError):
        hash_ids(c[10:], lay, 0, start=10, history=c[8:10])
    with pytest.raises(ValueError):
        hash_ids(c, EngramLayout(preset("toy")), 0)  # no pad_id


def test_hash_ids_match_oracle():
    """The runtime's hashing equals the oracle's own (tests/reference/engram_hashing.py, written
    from the spec): layout, multipliers and hash ids of every toy Engram layer, exactly, on random
    streams of DEAD and real ids (shorter than the n-gram too), resumed mid-stream from a
    history holding DEAD and pad ids. The oracle used to import this code, so the parity tests
    could not see a hashing bug."""
    from tests.reference import engram_hashing as ref
    cfg, rng = preset("toy"), random.Random(3)
    pad = 2
    lay, ora = EngramLayout(cfg, pad_id=pad), ref.EngramLayout(cfg, pad_id=pad)
    assert (lay.primes, lay.offsets, lay.rows, lay.multipliers) == \
        (ora.primes, ora.offsets, ora.rows, ora.multipliers)
    assert len(cfg.engram_layer_ids) == 2
    for i in range(len(cfg.engram_layer_ids)):
        for n in (1, 2, 3, 4, 5, 17, 64):
            c = _random_seq(rng, n, config.TOY_COMPRESSED_VOCAB)
            assert torch.equal(hash_ids(torch.tensor(c), lay, i), ref.hash_ids(c, ora, i)), (i, n)
            start = rng.randrange(1, 40)
            hist = [rng.choice([DEAD, pad, rng.randrange(config.TOY_COMPRESSED_VOCAB)])
                    for _ in range(min(start, 3) + rng.randrange(2))]
            got = hash_ids(torch.tensor(c), lay, i, start=start, history=torch.tensor(hist))
            assert torch.equal(got, ref.hash_ids(c, ora, i, start=start, history=hist)), (i, n, start, hist)
        dead_hist = ref.hash_ids([5, 6], ora, i, start=3, history=[DEAD] * 3)
        assert torch.equal(hash_ids(torch.tensor([5, 6]), lay, i, start=3, history=[DEAD] * 3), dead_hist)

def test_compress_marks_dead():
    tm = synthetic_token_map(10, 4)
    assert tm.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert compress([5, 9, 3], tm, dead=[False, True, False]).tolist() == [1, DEAD, 3]


# ---- normalization ------------------------------------------------------------------------

@pytest.mark.parametrize("text, key", [
    ("Hello", "hello"),
    ("ＡＢＣ", "abc"),              # NFKC: fullwidth
    ("ﬁ", "fi"),                    # NFKC: ligature
    ("²", "2"),                     # NFKC: superscript
    ("Café", "cafe"),               # accent stripped
    ("e\u0301", "e"),               # combining accent
    ("ÅNGSTRÖM", "angstrom"),
    ("  Hi\t\r\n there \n", "hi there"),  # collapse + strip
    (" ", " "),                     # a lone space survives (sentinel)
    ("\n", " "),                    # collapses to a lone space first
    ("\t \n", " "),
    ("  ", " "),
    ("\u0301", "\u0301"),           # empty after stripping -> original text
    ("", ""),
])
def test_normalize_text(text, key):
    assert normalize_text(text) == key


def test_token_map_fffd_fallback():
    # byte-level pieces of a multi-byte char decode to U+FFFD alone: keyed by raw token string,
    # so the two halves of "é" (0xC3 0xA9) stay distinct instead of merging into one "\ufffd" key
    tok = _toy_tokenizer()
    tmap, n = token_map_from_tokenizer(tok)
    a, b = tok.token_to_id("Ã"), tok.token_to_id("©")  # bytes 0xC3, 0xA9
    assert "\ufffd" in tok.decode([a]) and "\ufffd" in tok.decode([b])
    assert tmap[a] != tmap[b]
    # case and a leading space fold together
    assert tmap[tok.token_to_id("A")] == tmap[tok.token_to_id("a")]
    assert tmap[tok.token_to_id("Ġthe")] == tmap[tok.token_to_id("the")]
    assert tmap[:3].tolist() == [0, 1, 2] and tmap.max() == n - 1


# ---- toy tokenizer ------------------------------------------------------------------------

def _toy_tokenizer():
    return Tokenizer.from_file(str(config.TOY_TOKENIZER_DIR / "tokenizer.json"))


def test_toy_tokenizer_vocab_and_specials():
    tok = _toy_tokenizer()
    assert tok.get_vocab_size(with_added_tokens=True) == 1024
    cfg = preset("toy")
    want = {cfg.bos_token_id: "<｜begin▁of▁sentence｜>", cfg.eos_token_id: "<｜end▁of▁sentence｜>",
            cfg.pad_token_id: "<｜pad｜>", cfg.dspark_noise_token_id: "<｜dspark_noise｜>",
            cfg.image_token_id: "<｜image｜>"}
    assert sorted(want) == [0, 1, 2, 1022, 1023]
    for i, s in want.items():
        assert tok.id_to_token(i) == s and tok.token_to_id(s) == i
    for s in ("<｜User｜>", "<｜Assistant｜>"):
        assert tok.encode(s).ids == [tok.token_to_id(s)]
    text = "Hello, World!  x = y[0] + {a: b};\n\tThe quick brown fox, 1234567890 ~`@#$%^&*()"
    assert tok.decode(tok.encode(text).ids) == text


def test_toy_chat_template():
    jinja2 = pytest.importorskip("jinja2")
    tc = json.loads((config.TOY_TOKENIZER_DIR / "tokenizer_config.json").read_text())
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "more"}]
    out = jinja2.Template(tc["chat_template"]).render(
        messages=msgs, add_generation_prompt=True, bos_token=tc["bos_token"], eos_token=tc["eos_token"])
    assert out == ("<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>yo<｜end▁of▁sentence｜>"
                   "<｜User｜>more<｜Assistant｜>")
    assert tc["model_max_length"] > 0 and tc["pad_token"] == "<｜pad｜>"


def test_toy_compressed_vocab():
    tmap, n = token_map_from_tokenizer(_toy_tokenizer())
    assert n == config.TOY_COMPRESSED_VOCAB == preset("toy").engram_compressed_vocab_size
    assert len(tmap) == 1024


def test_toy_tokenizer_is_reproducible(tmp_path):
    if not CORPUS.is_dir():
        pytest.skip("training corpus ../shared not present beside the checkout")
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import make_toy_tokenizer as mk
    finally:
        sys.path.pop(0)
    committed = json.loads((config.TOY_TOKENIZER_DIR / "tokenizer_config.json").read_text())
    if mk.corpus_sha256(CORPUS) != committed["v41_corpus_sha256"]:
        pytest.skip("the docs changed since the toy tokenizer was trained; it stays frozen")
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert json.loads((tmp_path / name).read_text()) == \
            json.loads((config.TOY_TOKENIZER_DIR / name).read_text()), name
