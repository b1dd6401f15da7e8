"""Engram n-gram hash ids for the oracle, written from spec/model.md §3.2 on their own (not from
v41.engram.hashing), so the parity tests see a bug in the runtime's hashing. Plain Python
integers, one position at a time: clarity over speed.

    lay = EngramLayout(cfg, pad_id=int(token_map[cfg.engram_pad_token_id]))
    ids = hash_ids(compressed, lay, i)      # i: index of the layer in cfg.engram_layer_ids
"""
from __future__ import annotations

import numpy as np
import torch

DEAD = -1          # compressed id of an image-span token


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    d = 2
    while d * d <= n:
        if n % d == 0:
            return False
        d += 1
    return True


def int64(x: int) -> int:
    """x wrapped to a signed 64-bit integer (the spec's hash arithmetic is int64)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


class EngramLayout:
    """Per Engram layer i (in cfg.engram_layer_ids order):

    primes[i]       bucket sizes, (order, head) order: for each order o = 2..max_ngram restart at
                    engram_vocab_size - 1 and give each head the next prime not used yet (by any
                    layer or order)
    offsets[i]      exclusive cumsum of primes[i]
    rows[i]         sum of primes[i] (= engram_num_embeddings[i])
    multipliers[i]  default_rng(10007 * layer_id).integers(0, bound, max_ngram) * 2 + 1 with
                    bound = floor(floor((2^63 - 1) / compressed_vocab) / 2)
    pad_id          the compressed pad id, token_map[engram_pad_token_id] (only hash_ids needs it)
    """

    def __init__(self, cfg, pad_id: int | None = None):
        self.max_ngram = cfg.engram_max_ngram_size
        self.n_heads = cfg.engram_n_heads
        self.pad_id = pad_id
        self.primes, self.offsets, self.rows, self.multipliers = [], [], [], []
        used = set()
        for layer_id in cfg.engram_layer_ids:
            primes = []
            for _order in range(2, self.max_ngram + 1):
                cur = cfg.engram_vocab_size - 1
                for _head in range(self.n_heads):
                    cur += 1
                    while not is_prime(cur) or cur in used:
                        cur += 1
                    used.add(cur)
                    primes.append(cur)
            offsets, total = [], 0
            for p in primes:
                offsets.append(total)
                total += p
            bound = ((2 ** 63 - 1) // cfg.engram_compressed_vocab_size) // 2
            draws = np.random.default_rng(10007 * layer_id).integers(0, bound, size=self.max_ngram, dtype=np.int64)
            self.primes.append(primes)
            self.offsets.append(offsets)
            self.rows.append(total)
            self.multipliers.append([int(d) * 2 + 1 for d in draws])


def _ints(x) -> list[int]:
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.reshape(-1).tolist()]
    return [int(v) for v in np.asarray(x).reshape(-1).tolist()]


def hash_ids(compressed, layout: EngramLayout, i: int, start: int = 0, history=None) -> torch.Tensor:
    """Hash ids [S, (max_ngram - 1) * n_heads] (int64, (order, head) order) of Engram layer i for
    the compressed ids at absolute positions start .. start + S - 1. `history` holds the
    compressed ids just before `start`, oldest first: at least min(start, max_ngram - 1) of them."""
    if layout.pad_id is None:
        raise ValueError("hash_ids needs the layout's pad_id")
    c, hist = _ints(compressed), _ints(history)
    n = layout.max_ngram
    if len(hist) < min(start, n - 1):
        raise ValueError(f"history has {len(hist)} ids, position {start} needs {min(start, n - 1)}")

    def at(q):                      # the compressed id at absolute position q >= 0
        return c[q - start] if q >= start else hist[len(hist) - (start - q)]

    m, primes, offsets = layout.multipliers[i], layout.primes[i], layout.offsets[i]
    out = []
    for p in range(start, start + len(c)):
        # look-back k = 0..n-1: pad before the sequence and from the first DEAD on
        toks, blocked = [], False
        for k in range(n):
            if p - k < 0 or at(p - k) == DEAD:
                blocked = True
            toks.append(layout.pad_id if blocked else at(p - k))
        prods = [int64(t * m[k]) for k, t in enumerate(toks)]
        rolling, row = prods[0], []
        for o in range(2, n + 1):
            rolling = int64(rolling ^ prods[o - 1])
            for h in range(layout.n_heads):
                j = (o - 2) * layout.n_heads + h
                row.append(rolling % primes[j] + offsets[j])
        out.append(row)
    return torch.tensor(out, dtype=torch.int64).reshape(len(c), (n - 1) * layout.n_heads)
