"""Engram bucket layout and n-gram hash ids (spec/model.md §3.2). Host-side: numpy and torch only.

    lay = EngramLayout(cfg, pad_id=int(token_map[cfg.engram_pad_token_id]))
    ids = hash_ids(compressed, lay, i)      # i = position of the layer in cfg.engram_layer_ids

`compressed` holds *compressed* token ids (the normalization map already applied, `tokens.DEAD`
for image tokens). Ids index one layer's concatenated table of `lay.rows[i]` rows.
"""
from __future__ import annotations

import numpy as np
import torch

DEAD = -1  # compressed id of an image token: blocks every n-gram that reaches it


def _is_prime(n: int) -> bool:
    # deterministic Miller-Rabin: these bases are exact for every n < 3.3e24
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    for p in bases:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


class EngramLayout:
    """Per Engram layer i (cfg.engram_layer_ids order), plain-int lists so they JSON-serialize:

    primes[i]      (max_ngram-1)*n_heads bucket sizes in (order, head) order
    offsets[i]     exclusive cumsum of primes[i]: where each (order, head) bucket starts
    rows[i]        sum(primes[i]) = the table's row count (= engram_num_embeddings[i])
    multipliers[i] max_ngram odd int64 multipliers, one per look-back k = 0..max_ngram-1

    pad_id is the *compressed* pad id, token_map[cfg.engram_pad_token_id]; deriving it is the
    caller's job because the layout does not know the token map. Only hash_ids needs it.
    """

    def __init__(self, cfg, pad_id: int | None = None):
        self.layer_ids = list(cfg.engram_layer_ids)
        self.max_ngram = cfg.engram_max_ngram_size
        self.n_heads = cfg.engram_n_heads
        self.pad_id = pad_id
        # Primes come from one global pool: every order restarts the search at vocab-1 but skips
        # primes already taken, so the layers end up with consecutive primes above the vocab.
        used: set[int] = set()
        self.primes = []
        for _ in self.layer_ids:
            ps = []
            for _order in range(2, self.max_ngram + 1):
                cur = cfg.engram_vocab_size - 1
                for _head in range(self.n_heads):
                    cur += 1
                    while cur in used or not _is_prime(cur):
                        cur += 1
                    used.add(cur)
                    ps.append(cur)
            self.primes.append(ps)
        self.offsets = [[0] + np.cumsum(ps[:-1]).tolist() for ps in self.primes]
        self.rows = [sum(ps) for ps in self.primes]
        # bound keeps token * multiplier inside int64 for every compressed id
        bound = ((2**63 - 1) // cfg.engram_compressed_vocab_size) // 2
        self.multipliers = [
            (np.random.default_rng(10007 * l).integers(0, bound, size=self.max_ngram, dtype=np.int64)
             * 2 + 1).tolist()
            for l in self.layer_ids]


def table_rows(cfg) -> list[int]:
    """Rows of each Engram layer's table (what `engram_num_embeddings` must hold)."""
    return EngramLayout(cfg).rows


def _as_long(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.int64).reshape(-1)


def hash_ids(compressed, layout: EngramLayout, i: int, start: int = 0, history=None) -> torch.Tensor:
    """Hash ids [S, (max_ngram-1)*n_heads] (int64, (order, head) order) of Engram layer i.

    compressed: [S] compressed ids at absolute positions start..start+S-1.
    history:    the compressed ids just before `start` (oldest first); at least
                min(start, max_ngram-1) of them. Lets a chunk hash exactly like the full sequence.
    """
    if layout.pad_id is None:
        raise ValueError("EngramLayout.pad_id is unset; pass pad_id=token_map[cfg.engram_pad_token_id]")
    n, H = layout.max_ngram, layout.n_heads
    c = _as_long(compressed)
    S = c.numel()
    h = min(start, n - 1)
    hist = _as_long([] if history is None else history)
    if hist.numel() < h:
        raise ValueError(f"history has {hist.numel()} ids; position {start} needs the last {h}")
    # Positions before 0 act like DEAD: both make the look-back (and every longer one) pad.
    ext = torch.cat([torch.full((n - 1 - h,), DEAD, dtype=torch.int64), hist[hist.numel() - h:], c])
    lookback = torch.stack([ext[n - 1 - k: n - 1 - k + S] for k in range(n)], 1)  # c[p - k]
    return hash_lookback(lookback, layout, i)


def hash_lookback(lookback, layout: EngramLayout, i: int):
    """Hash ids [rows, (max_ngram-1)*n_heads] of Engram layer i from look-back rows:
    lookback[t, k] = compressed id at position p_t - k, DEAD where that position is an image
    token or lies before the sequence (LayerHashes' arithmetic, for one layer). numpy in, numpy
    out; a tensor in gives a tensor out."""
    as_tensor = isinstance(lookback, torch.Tensor)
    look = lookback.numpy() if as_tensor else np.asarray(lookback, dtype=np.int64)
    out = LayerHashes(layout, [i]).ids(look)[:, :, 0]             # [n-1, H, rows]
    out = np.ascontiguousarray(out.reshape(-1, len(look)).T)      # (order, head) columns
    return torch.from_numpy(out) if as_tensor else out


class LayerHashes:
    """The hash ids of several Engram layers at once (the runtime's batched path writes them into
    a step's host mirrors). The arrays are tiny ([rows, n]), so a step pays per numpy call: the
    look-back order is the outer axis (the rolling xor is then a few whole-plane xors) and all
    layers share each call."""

    def __init__(self, layout: EngramLayout, layers, names=()):
        """`layers`: the Engram layers' indices (0, 1, ...: layout.multipliers' rows); `names`:
        each one's host mirror, for __call__."""
        L, n, H = list(layers), layout.max_ngram, layout.n_heads
        planes = lambda v: np.array([v[i] for i in L], np.int64).reshape(len(L), n - 1, H).transpose(1, 2, 0)  # noqa: E731
        self.mult = np.array([layout.multipliers[i] for i in L], np.int64).T[:, :, None]     # [n, layers, 1]
        self.primes, self.offsets = planes(layout.primes)[..., None], planes(layout.offsets)[..., None]  # [n-1, H, layers, 1]
        self.pad_id, self.names = np.int64(layout.pad_id), list(names)

    def ids(self, look: np.ndarray) -> np.ndarray:
        """[n-1, H, layers, rows] hash ids of the rows look[t, k] (compressed id at p_t - k)."""
        if (look < 0).any():                                # once blocked, every longer look-back pads
            look = np.where(np.maximum.accumulate(look < 0, axis=1), self.pad_id, look)
        prods = np.ascontiguousarray(look.T)[:, None, :] * self.mult     # [n, layers, R], wrapping mod 2**64
        for k in range(1, len(prods)):                      # the rolling xor (accumulate is slower here)
            np.bitwise_xor(prods[k], prods[k - 1], out=prods[k])
        # np.mod is floor-mod like torch and the reference: non-negative for a positive prime
        out = np.mod(prods[1:, None], self.primes)          # [n-1, H, layers, R]
        out += self.offsets
        return out

    def __call__(self, look: np.ndarray, host: dict) -> None:
        """Each layer's ids of the rows look[t, k] into host[name], (order, head) columns."""
        out, R = self.ids(look), len(look)
        for i, name in enumerate(self.names):
            host[name][:R] = out[:, :, i].reshape(-1, R).T
