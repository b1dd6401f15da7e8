"""Batched sampling on the logits' device, for every request of a step at once.

Per row, in vLLM's order: logit_bias and the min_tokens mask, the penalties (repetition on the
prompt and output tokens, then frequency and presence on the output tokens), then either greedy
(argmax) or temperature, top-k, min_p and top-p, and a draw. The draw inverts the row's CDF (in
vocab order, float64) at one uniform from an integer hash of (the request's seed, its number of
generated tokens), computed on the device: a request's tokens depend on nothing else, so a
seeded request gives the same tokens alone or in any batch and after a preemption; the hash is
exact integer arithmetic, the same on every device. Filters keep ties (top-k keeps every token
equal to the k-th, top-p every token as likely as one it keeps), so no sort order decides a
token. The chosen ids come back in one device-to-host copy."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from runtime.sequence import Sequence

# Below this a temperature is greedy (vLLM's rule): logits / 1e-50 overflow to inf and softmax
# turns them into NaN.
GREEDY_BELOW = 1e-5

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), in int64 without overflow (16-bit halves), so the
    result is exact and the same on every device."""
    lo = (x & 0xFFFF) * c
    hi = (((x >> 16) * c) & 0xFFFF) << 16
    return (lo + hi) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective avalanche mix of 32-bit values held in int64 (murmur3's finalizer)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def uniforms(seed_lo: torch.Tensor, seed_hi: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """One float64 uniform in (0, 1) per row (53 bits, exact) from the 32-bit seed halves and
    the row's step."""
    h1 = mix32(seed_hi ^ mix32(seed_lo ^ mix32((step * _GOLDEN + 7) & _M32)))
    h2 = mix32(h1 ^ 0x68E31DA4)
    return ((h1 << 21) + (h2 >> 11)).to(torch.float64).add(0.5).mul(2.0 ** -53)


@dataclass
class SamplingTensors:
    """A batch's sampling parameters as per-row tensors on the device, built with one host-to-
    device copy of floats and one of integers. The flags say which stages any row needs."""
    FLOATS = ("temperature", "top_p", "min_p", "presence", "frequency", "repetition")
    vocab: int
    rows: int
    temperature: torch.Tensor        # [B] (1 on greedy rows)
    top_k: torch.Tensor              # [B] (vocab when off)
    top_p: torch.Tensor
    min_p: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    seed_lo: torch.Tensor            # [R] per random row
    seed_hi: torch.Tensor
    step: torch.Tensor
    random_rows: torch.Tensor        # [R] rows that draw (the others are greedy)
    bias_at: torch.Tensor            # flat row * vocab + token
    bias: torch.Tensor
    banned_at: torch.Tensor          # flat indices masked by min_tokens
    output_at: torch.Tensor          # flat indices of output tokens (penalty rows), repeated
    prompt_at: torch.Tensor          # flat indices of prompt tokens (repetition rows)
    num_random: int
    top_k_max: int                   # the largest top-k in use; 0: no row uses top-k
    use_top_p: bool
    top_p_sorts_all: bool            # a top-p row without top-k: top-p sorts the whole vocab
    use_min_p: bool
    use_output_penalty: bool
    use_repetition: bool

    @classmethod
    def build(cls, seqs: list[Sequence], vocab: int, device, dtype=torch.float32,
              eos_token_id: int | None = None, table: "SamplingTable | None" = None,
              slots: np.ndarray | None = None, steady: bool = False) -> "SamplingTensors":
        """`table` with each request's STATE `slots`: the per-request parameters come from the
        engine's SamplingTable (rows written once per request) instead of a pass over every
        request's params. `steady`: the requests of the last build in its rows, each one token
        on (a steady decode step, runtime.scheduler), so neither they nor the table are read.
        Raises ValueError naming the field when a request's data does not fit this vocab."""
        B = len(seqs)
        if table is None:
            table, slots = SamplingTable(B), np.arange(B)
        pin = torch.device(device).type == "cuda"
        key = (vocab, str(device), dtype, eos_token_id, slots.tobytes())
        last = table.last if table.last is not None and table.last[0] == key else None
        changed = not (steady and last is not None) and table.update(seqs, slots)
        if not changed and last is not None:
            # the same requests in the same rows as the last build: only the draws' steps moved
            _, prev, rand_list, prompt_len, step = last
            step = step + 1 if steady else np.fromiter([len(seqs[j].token_ids) for j in rand_list], np.int64,
                                                        len(rand_list)) - prompt_len
            table.last = (key, prev, rand_list, prompt_len, step)
            return dataclasses.replace(prev, step=_to(torch.from_numpy(step), device, pin))
        greedy = table.greedy[slots]
        fl = table.floats[:, slots]
        rand = np.flatnonzero(~greedy)
        k = table.top_k[slots]
        top_k = np.where(~greedy & (k > 0) & (k < vocab), k, vocab)
        n_out = np.fromiter([len(s.token_ids) for s in seqs], np.int64, B) - table.prompt_len[slots]
        bias_at, bias, banned, out_at, prompt_at = [], [], [], [], []
        # logit_bias, min_tokens and penalties: a pass over only the requests that use them
        for i in np.flatnonzero(table.special[slots]).tolist():
            s = seqs[i]
            p = s.params
            if p.logit_bias:
                bad = [t for t in p.logit_bias if t >= vocab]
                if bad:
                    raise ValueError(f"logit_bias: token ids {bad[:5]} out of range [0, {vocab})")
                bias_at += [i * vocab + t for t in p.logit_bias]
                bias += p.logit_bias.values()
            if n_out[i] < p.min_tokens:
                stops = list(p.stop_token_ids) + ([eos_token_id] if eos_token_id is not None and not p.ignore_eos else [])
                banned += [i * vocab + t for t in stops if 0 <= t < vocab]
            if p.penalized:
                ids = np.asarray(s.token_ids, np.int64)
                out_at.append(ids[s.num_prompt_tokens:] + i * vocab)
                if p.repetition_penalty != 1:
                    prompt_at.append(ids[:s.num_prompt_tokens] + i * vocab)
        R = len(rand)
        cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)  # noqa: E731
        ints = {"top_k": top_k, "random_rows": rand, "seed_lo": table.seed_lo[slots[rand]],
                "seed_hi": table.seed_hi[slots[rand]], "step": n_out[rand],
                "bias_at": np.array(bias_at, np.int64), "banned_at": np.array(banned, np.int64),
                "output_at": cat(out_at), "prompt_at": cat(prompt_at)}
        i_dev = _to(torch.from_numpy(np.concatenate(list(ints.values()))), device, pin)
        f_dev = _to(torch.from_numpy(np.concatenate([fl.reshape(-1), np.array(bias, np.float64)])).to(dtype),
                    device, pin)
        cuts = np.cumsum([0] + [len(a) for a in ints.values()]).tolist()
        views = {k: i_dev[cuts[j]:cuts[j + 1]] for j, k in enumerate(ints)}
        views.update({k: f_dev[j * B:(j + 1) * B] for j, k in enumerate(cls.FLOATS)})
        k_rand = top_k[rand]
        k_used = k_rand[k_rand < vocab]
        p_rand = fl[1, rand] < 1
        st = cls(vocab=vocab, rows=B, bias=f_dev[6 * B:], num_random=R,
                 top_k_max=int(k_used.max()) if k_used.size else 0,
                 use_top_p=bool(p_rand.any()), top_p_sorts_all=bool((p_rand & (k_rand >= vocab)).any()),
                 use_min_p=bool((fl[2, rand] > 0).any()),
                 use_output_penalty=bool(fl[3:5].any()), use_repetition=bool(prompt_at), **views)
        # reusable while the rows stay these requests' (logit_bias, min_tokens and penalties
        # depend on more than the step: never reused)
        special = bool(table.special[slots].any())
        table.last = None if special else (key, st, rand.tolist(), table.prompt_len[slots[rand]], n_out[rand])
        return st


class SamplingTable:
    """Each STATE slot's sampling parameters as arrays, so a step gathers its rows with numpy
    by slot. A row is written when a request first samples in that slot (`owner` holds its
    seq_id); a request's params are read once and must not change afterwards."""

    def __init__(self, num_slots: int):
        S = num_slots
        self.owner = np.full(S, -1, np.int64)
        self.floats = np.zeros((6, S), np.float64)        # SamplingTensors.FLOATS order
        self.top_k = np.zeros(S, np.int64)
        self.greedy = np.zeros(S, bool)
        self.seed_lo = np.zeros(S, np.int64)
        self.seed_hi = np.zeros(S, np.int64)
        self.prompt_len = np.zeros(S, np.int64)
        self.special = np.zeros(S, bool)                  # logit_bias, min_tokens or penalties
        self.last = None    # (key, SamplingTensors, random rows, their prompt lengths, steps) of the last build

    def update(self, seqs: list[Sequence], slots: np.ndarray) -> bool:
        """Write the rows of the requests new to their slot; True when there were any."""
        ids = np.fromiter([s.seq_id for s in seqs], np.int64, len(seqs))
        stale = np.flatnonzero(self.owner[slots] != ids).tolist()
        for j in stale:
            s, i = seqs[j], int(slots[j])
            p = s.params
            greedy = p.temperature < GREEDY_BELOW
            self.floats[:, i] = (1.0 if greedy else p.temperature, p.top_p, p.min_p, p.presence_penalty,
                                 p.frequency_penalty, p.repetition_penalty)
            seed = s.sampling_seed % 2 ** 64
            self.seed_lo[i], self.seed_hi[i] = seed & _M32, seed >> 32
            self.top_k[i], self.greedy[i], self.prompt_len[i] = p.top_k, greedy, s.num_prompt_tokens
            self.special[i] = bool(p.logit_bias) or p.min_tokens > 0 or p.penalized
            self.owner[i] = s.seq_id
        if stale:
            self.last = None
        return bool(stale)


def _to(t: torch.Tensor, device, pin: bool) -> torch.Tensor:
    return t.pin_memory().to(device, non_blocking=True) if pin else t.to(device)


def process_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The logits in float (at least float32) with logit_bias, the min_tokens mask and the
    penalties applied (greedy rows take their argmax); the caller's tensor is never modified."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if not (st.bias_at.numel() or st.banned_at.numel()):
        return _penalize(x, st) if st.use_repetition or st.use_output_penalty else x
    # filled in place below: never the caller's tensor, and contiguous so `flat` is a view of it
    x = x.clone(memory_format=torch.contiguous_format) if x is logits else x.contiguous()
    return _penalize(x, st)


def _penalize(x: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    flat = x.reshape(-1)
    if st.bias_at.numel():
        flat.index_put_((st.bias_at,), st.bias.to(x.dtype), accumulate=True)
    if st.banned_at.numel():
        flat[st.banned_at] = float("-inf")
    if st.use_repetition:
        seen = torch.zeros_like(flat, dtype=torch.bool)
        seen[st.prompt_at] = True
        seen[st.output_at] = True
        r = st.repetition.to(x.dtype)[:, None].expand_as(x)
        x = torch.where(seen.view_as(x), torch.where(x > 0, x / r, x * r), x)
    if st.use_output_penalty:
        counts = torch.zeros_like(flat).index_put_((st.output_at,), torch.ones_like(st.output_at, dtype=x.dtype),
                                                   accumulate=True).view_as(x)
        x = x - st.frequency.to(x.dtype)[:, None] * counts - st.presence.to(x.dtype)[:, None] * (counts > 0)
    return x


def filter_logits(x: torch.Tensor, temperature, top_k, top_p, min_p, top_k_max: int, use_top_p: bool,
                  use_min_p: bool, top_p_sorts_all: bool = True) -> torch.Tensor:
    """Logits / temperature with the tokens outside top-k, min_p and top-p at -inf. Per-row
    parameters are [rows] tensors (top_k >= vocab: off, top_p = 1: off). Top-k keeps exactly k
    tokens, ties at the k-th value broken by the lower token id; top-p keeps every token whose
    strictly more likely tokens hold at most top_p of the mass (the most likely always stays).
    `top_k_max` (0: no row uses top-k) and the flags come from the host, so nothing here waits
    on the device; `top_p_sorts_all` False says every top-p row has a top-k, so the top
    `top_k_max` values replace a sort of the whole vocab."""
    x = x / temperature.to(x.dtype)[:, None]          # a new tensor: the masks below fill it in place
    inf = float("-inf")
    V = x.shape[-1]
    k = top_k.clamp(max=V)[:, None]
    if top_k_max or use_top_p:
        sv = x.sort(-1, descending=True).values if use_top_p and top_p_sorts_all else x.topk(min(top_k_max, V), -1).values
    if top_k_max:
        kth = sv.gather(1, (k.clamp(max=sv.shape[1]) - 1))
        tied = x == kth
        above = (x > kth).sum(-1, keepdim=True)
        keep = (x > kth) | (tied & (tied.cumsum(-1, dtype=torch.int32) <= k - above))
        x.masked_fill_(~keep & (k < V), inf)
    if use_min_p:      # p < min_p * p_max  <=>  logit < max logit + log(min_p)
        floor = x.amax(-1, keepdim=True) + torch.log(min_p.to(x.dtype))[:, None]
        x.masked_fill_(x < floor, inf)
    if use_top_p:
        # the kept values, in order: the first k of the sorted values (top-k's multiset), min_p
        pos = torch.arange(sv.shape[1], device=x.device).expand_as(sv)
        sv = sv.masked_fill(pos >= k, inf)
        if use_min_p:
            sv = sv.masked_fill(sv < floor, inf)
        w = torch.exp(sv - sv[:, :1]).double()
        cum = w.cumsum(-1)
        before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], -1)
        first = torch.ones_like(sv, dtype=torch.bool)        # a tie group's mass before it is
        first[:, 1:] = sv[:, 1:] != sv[:, :-1]               # its first member's, in any order
        start = torch.where(first, pos, torch.zeros_like(pos)).cummax(-1).values
        kept = (before.gather(1, start) <= top_p.double()[:, None] * cum[:, -1:]).sum(-1, keepdim=True)
        least = sv.gather(1, kept - 1)
        x.masked_fill_((x < least) & (top_p < 1)[:, None], inf)
    return x


def draw(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the token whose CDF interval (vocab order, float64) holds u x the row's mass
    (DSpark's sampled verify draws its rows with it too: runtime.spec_step)."""
    cdf = torch.exp(x - x.amax(-1, keepdim=True)).cumsum(-1, dtype=torch.float64)
    tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return tok.clamp(max=x.shape[-1] - 1)


def sample_tensors(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The chosen token of every row, on the device."""
    x = process_logits(logits, st)
    if not st.num_random:
        return x.argmax(-1)
    every = st.num_random == st.rows
    sel = (lambda t: t) if every else (lambda t: t.index_select(0, st.random_rows))  # noqa: E731
    xr = filter_logits(sel(x), sel(st.temperature), sel(st.top_k), sel(st.top_p), sel(st.min_p),
                       st.top_k_max, st.use_top_p, st.use_min_p, st.top_p_sorts_all)
    drawn = draw(xr, uniforms(st.seed_lo, st.seed_hi, st.step))
    return drawn if every else x.argmax(-1).index_copy(0, st.random_rows, drawn)


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_id: int | None = None,
           table: SamplingTable | None = None, slots: np.ndarray | None = None, steady: bool = False) -> list[int]:
    """The next token of each request (row i of `logits` is `seqs[i]`'s last position);
    `table`/`slots`/`steady` as SamplingTensors.build."""
    if not seqs:
        return []
    st = SamplingTensors.build(seqs, logits.shape[-1], logits.device,
                               torch.promote_types(logits.dtype, torch.float32), eos_token_id, table, slots, steady)
    return sample_tensors(logits, st).tolist()


def probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """The distribution one row's token is drawn from: temperature, then the top-k, min_p and
    top-p filters (the most likely token always stays)."""
    V = logits.shape[-1]
    dt = torch.promote_types(logits.dtype, torch.float32)
    one = lambda v, d=dt: torch.tensor([v], dtype=d, device=logits.device)  # noqa: E731
    k = top_k if 0 < top_k < V else V
    x = filter_logits(logits.to(dt)[None], one(temperature), one(k, torch.int64), one(top_p), one(min_p),
                      k if k < V else 0, top_p < 1, min_p > 0)
    return torch.softmax(x[0], -1)


def token_logprobs(logits: torch.Tensor, tokens: list[int], num: list[int]) -> list[tuple[float, list]]:
    """Per row: the log-probability of the sampled token and the `num[i]` most likely
    (token id, log-probability) pairs, from the model's distribution (the raw logits, before
    temperature and the top-k/top-p filters), computed from the same logits the token came from."""
    if any(n < 0 for n in num):
        raise ValueError(f"logprobs must be >= 0, got {min(num)}")
    lp = torch.log_softmax(logits.float(), -1)
    k = min(max(num, default=0), lp.shape[-1])
    top = torch.topk(lp, k, -1) if k else None
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device).view(-1, 1)).view(-1).tolist()
    out = []
    for i, n in enumerate(num):
        tops = list(zip(top.indices[i, :n].tolist(), top.values[i, :n].tolist())) if n else []
        out.append((chosen[i], tops))
    return out

