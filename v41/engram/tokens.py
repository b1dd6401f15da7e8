"""Engram token normalization map (spec/model.md §3.2). Host-side: no Triton.

Every token id gets a *compressed* id: tokens whose decoded text normalizes to the same key share
one. The hash ids (`hashing.hash_ids`) are computed on compressed ids, so the map must match the
reference exactly or every hash changes (Flash: 129,280 ids -> 99,092 compressed).
"""
from __future__ import annotations

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, normalizers

from v41.engram.hashing import DEAD

_SENTINEL = "\ue000"  # private use: keeps a lone space alive through Strip
# Built from the tokenizers library's own normalizers rather than unicodedata: the reference
# uses them, and they differ from Python in corners that change the map (StripAccents drops
# every combining mark, Mn/Mc/Me; Strip uses Rust's whitespace set; Rust's Unicode tables).
_NORMALIZER = normalizers.Sequence([
    normalizers.NFKC(),
    normalizers.NFD(),
    normalizers.StripAccents(),
    normalizers.Lowercase(),
    normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
    normalizers.Replace(Regex(r"^ $"), _SENTINEL),
    normalizers.Strip(),
    normalizers.Replace(_SENTINEL, " "),
])


def normalize_text(s: str) -> str:
    """NFKC, NFD, strip accents, lowercase, collapse whitespace, strip (a lone space survives);
    an empty result falls back to the original text."""
    return _NORMALIZER.normalize_str(s) or s


def token_map_from_tokenizer(tok: Tokenizer) -> tuple[np.ndarray, int]:
    """(token_map int64 [vocab incl. added tokens], compressed vocab size)."""
    keys: dict[str, int] = {}
    out = np.empty(tok.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    for i in range(len(out)):
        text = tok.decode([i], skip_special_tokens=False)
        # a partial UTF-8 sequence decodes to U+FFFD: key it by its raw token string instead,
        # so distinct byte pieces stay distinct
        key = tok.id_to_token(i) if "\ufffd" in text else normalize_text(text)
        out[i] = keys.setdefault(key, len(keys))
    return out, len(keys)


def synthetic_token_map(vocab: int, compressed: int) -> np.ndarray:
    """token_map[i] = i mod compressed: for presets run without their real tokenizer."""
    return np.arange(vocab, dtype=np.int64) % compressed


def compress(ids, token_map, dead=None) -> torch.Tensor:
    """Compressed ids of token ids; positions where `dead` (bool mask, e.g. image tokens) is set
    become DEAD."""
    ids = torch.as_tensor(ids, dtype=torch.int64)
    c = torch.as_tensor(token_map, dtype=torch.int64)[ids]
    return c if dead is None else torch.where(torch.as_tensor(dead, dtype=torch.bool), DEAD, c)
