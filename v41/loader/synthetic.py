"""Deterministic random checkpoint values: each tensor from its own generator seeded by (seed,
name), so values depend on neither tensor order nor threading. The writer (v41.loader.io) and
`load_format='dummy'` (v41.loader.load) share them; `_WRITER_FUNCS` are hashed into the cache key
of the written checkpoints."""
from __future__ import annotations

import hashlib
import math
import os

import torch
from tqdm import tqdm

from v41.config import V41Config
from v41.loader.schema import TensorSpec, _cdiv, checkpoint_schema, is_host_table

# ---- deterministic random values --------------------------------------------------------

_FP8_CODE_STD = 8.0             # FP8 codes have std in [8, 16) x 2^-d inside a block
_FP4_CODE_RMS = math.sqrt(sum(v * v for v in (0, .5, 1, 1.5, 2, 3, 4, 6)) / 8)  # uniform nibbles
_CHUNK_ELEMS = 1 << 24


def tensor_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed per (seed, tensor name): values do not depend on tensor order."""
    h = hashlib.blake2b(f"{int(seed)}\x00{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def _gen(seed: int, name: str) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(tensor_seed(seed, name))
    return g


def _weight_sigma(cfg: V41Config, wname: str, logical: tuple) -> float:
    """Target std of a quantized weight's dequantized values."""
    if ".engram.embed." in wname:
        return 1.0                      # table rows O(1)
    return 1.0 / math.sqrt(logical[1])  # 1/sqrt(fan_in)


def _fp8_exponent0(sigma: float) -> int:
    return math.floor(math.log2(sigma / _FP8_CODE_STD))


def _scale_deltas(seed: int, scale_name: str, shape: tuple) -> torch.Tensor:
    """Per-block exponent offsets d in {-1, 0, 1} of an FP8 weight's scale, drawn from the scale
    tensor's own generator (the weight's codes compensate, so every block has std sigma)."""
    return torch.randint(-1, 2, shape, generator=_gen(seed, scale_name), dtype=torch.int16)


def _fp4_exponents(seed: int, scale_name: str, shape: tuple, sigma: float) -> torch.Tensor:
    """E8M0 exponents of an FP4 expert scale. The codes are uniform nibbles (RMS `_FP4_CODE_RMS`),
    so the std is set by the scales alone: each group gets exponent a or a+1, a+1 with the
    probability that makes the mean square exactly sigma^2."""
    m = (sigma / _FP4_CODE_RMS) ** 2
    a = math.floor(math.log2(m) / 2)
    p = (m / 4.0 ** a - 1.0) / 3.0
    up = torch.rand(shape, generator=_gen(seed, scale_name)) < p
    return up.to(torch.int16) + a


def _chunked(shape: tuple, dtype: torch.dtype, fill, row_multiple: int = 1) -> torch.Tensor:
    """Allocate `shape` and fill it in row chunks (`fill(r0, r1) -> tensor [r1-r0, ...]`), so large
    tensors never need a full-size FP32 temporary. The chunking depends only on the shape."""
    out = torch.empty(shape, dtype=dtype)
    if len(shape) == 0 or out.numel() == 0:
        if len(shape) == 0:
            out.copy_(fill(0, 1).reshape(()))
        return out
    rows = shape[0]
    per_row = max(1, out.numel() // rows)
    step = max(row_multiple, (_CHUNK_ELEMS // per_row) // row_multiple * row_multiple)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        out[r0:r1] = fill(r0, r1)
    return out


def _randn(g, shape, std=1.0, mean=0.0, dtype=torch.bfloat16) -> torch.Tensor:
    def fill(r0, r1):
        x = torch.randn((r1 - r0,) + tuple(shape[1:]), generator=g)
        if std != 1.0:
            x.mul_(std)
        if mean != 0.0:
            x.add_(mean)
        return x
    return _chunked(tuple(shape), dtype, fill)


def _gen_fp8_weight(cfg, name, spec, seed) -> torch.Tensor:
    n, k = spec.shape
    gr, gc = spec.group
    sname = name[: -len(".weight")] + ".scale"
    nb, kb = _cdiv(n, gr), _cdiv(k, gc)
    sigma = _weight_sigma(cfg, name, spec.logical)
    e0 = _fp8_exponent0(sigma)
    d = _scale_deltas(seed, sname, (nb, kb)).float()
    code_std = (sigma / 2.0 ** e0) * torch.pow(2.0, -d)        # [nb, kb]
    if k % gc:
        code_std = code_std.repeat_interleave(gc, 1)[:, :k]     # per-column
        gc_eff = 1
    else:
        gc_eff = gc
    g = _gen(seed, name)

    def fill(r0, r1):
        x = torch.randn((r1 - r0, k), generator=g)
        cs = code_std[r0 // gr: _cdiv(r1, gr)].repeat_interleave(gr, 0)[: r1 - r0]   # [rows, k/gc_eff]
        x.view(r1 - r0, -1, gc_eff).mul_(cs.unsqueeze(-1))
        return x.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)

    return _chunked((n, k), torch.float8_e4m3fn, fill, row_multiple=gr)


def _gen_scale(cfg, name, spec, seed) -> torch.Tensor:
    wname = name[: -len(".scale")] + ".weight"
    sigma = _weight_sigma(cfg, wname, spec.logical)
    if ".ffn.experts." in name:                               # FP4 routed expert
        codes = _fp4_exponents(seed, name, spec.shape, sigma) + 127
    else:                                                     # FP8 block / Engram row
        codes = _scale_deltas(seed, name, spec.shape) + (127 + _fp8_exponent0(sigma))
    if codes.min() < 1 or codes.max() > 254:
        raise ValueError(f"{name}: scale exponent out of E8M0 range")
    return codes.to(torch.uint8).view(torch.float8_e8m0fnu)


def _gen_fp4_weight(cfg, name, spec, seed) -> torch.Tensor:
    g = _gen(seed, name)
    # uniform random bytes = two uniform E2M1 codes (all 16 codes are finite numbers)
    return _chunked(spec.shape, torch.int8,
                    lambda r0, r1: torch.randint(-128, 128, (r1 - r0,) + spec.shape[1:],
                                                 generator=g, dtype=torch.int8))


def _gen_plain(cfg, name, spec, seed) -> torch.Tensor:
    g = _gen(seed, name)
    shape, dt = spec.shape, spec.dtype
    D, hc = cfg.hidden_size, cfg.hc_mult
    last = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):                       # every RMSNorm weight: near 1
        return _randn(g, shape, 0.05, 1.0, dt)
    if name.endswith(("engram.q_weight", "engram.k_weight")):
        return _randn(g, shape, 0.1, 1.0, dt)
    if name == "embed.weight" or name.endswith("markov_head.embed.weight"):
        return _randn(g, shape, 1.0, 0.0, dt)              # rows O(1)
    if last.startswith("hc_") and last.endswith("_fn"):
        # mix logits m = fn . x / rms(x) have std 0.5 whatever the width
        return _randn(g, shape, 0.5 / math.sqrt(hc * D), 0.0, dt)
    if last.startswith("hc_") and last.endswith("_base"):
        b = torch.randn(shape, generator=g) * 0.1
        b[:hc] += math.log(1.0 / (hc - 1))                 # pre = sigmoid(.) ~ 1/hc: sum ~ 1
        # post: 2*sigmoid(~0) ~ 1; comb: diagonal preference, softmax rows + Sinkhorn
        b[2 * hc:].view(hc, hc).diagonal().add_(2.0)
        return b.to(dt)
    if last.startswith("hc_") and last.endswith("_scale"):
        return _randn(g, shape, 0.1, 1.0, dt)
    if last == "attn_sink":
        return _randn(g, shape, 0.1, 0.0, dt)
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return _randn(g, shape, 0.01, 0.0, dt)
    if len(shape) == 2:                                    # linear weights: 1/sqrt(fan_in)
        return _randn(g, shape, 1.0 / math.sqrt(shape[1]), 0.0, dt)
    return _randn(g, shape, 0.1, 0.0, dt)


def tensor_values(cfg: V41Config, name: str, spec: TensorSpec | None = None, seed: int = 0) -> torch.Tensor:
    """The deterministic random value of one checkpoint tensor, on the CPU, in its native dtype.
    Depends only on (cfg widths, seed, name): the writer and `load_format='dummy'` share it."""
    if spec is None:
        spec = checkpoint_schema(cfg)[name]
    if spec.kind == "fp8":
        t = _gen_fp8_weight(cfg, name, spec, seed)
    elif spec.kind == "e8m0":
        t = _gen_scale(cfg, name, spec, seed)
    elif spec.kind == "fp4":
        t = _gen_fp4_weight(cfg, name, spec, seed)
    else:
        t = _gen_plain(cfg, name, spec, seed)
    assert t.dtype == spec.dtype and tuple(t.shape) == spec.shape, name
    return t


def iter_tensor_values(cfg: V41Config, names, schema: dict, seed: int = 0, workers: int | None = None):
    """(name, tensor_values(...)) for `names`, in order, generated by a few threads at once (each
    tensor has its own generator, so the values do not depend on the threading)."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor
    names = list(names)
    workers = workers or min(8, os.cpu_count() or 1)
    if workers <= 1 or len(names) < 2:
        for n in names:
            yield n, tensor_values(cfg, n, schema[n], seed)
        return
    with ThreadPoolExecutor(workers) as ex:
        window: deque = deque()
        it = iter(names)
        for n in it:
            window.append((n, ex.submit(tensor_values, cfg, n, schema[n], seed)))
            if len(window) >= 2 * workers:
                break
        while window:
            n, fut = window.popleft()
            nxt = next(it, None)
            if nxt is not None:
                window.append((nxt, ex.submit(tensor_values, cfg, nxt, schema[nxt], seed)))
            yield n, fut.result()


_WRITER_FUNCS = (tensor_seed, _gen, _weight_sigma, _fp8_exponent0, _scale_deltas, _fp4_exponents, _chunked, _randn,
                 _gen_fp8_weight, _gen_scale, _gen_fp4_weight, _gen_plain, tensor_values)


def dummy_tensors(cfg: V41Config, device="cpu", seed: int = 0, progress: bool = True) -> dict:
    """Every checkpoint tensor of `cfg`, as the writer would write it, built in memory (CPU
    generators, then moved to `device`; Engram tables stay on the CPU), in schema order."""
    device = torch.device(device)
    schema = checkpoint_schema(cfg)
    tensors = {}
    total = sum(s.nbytes for s in schema.values())
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
              desc=f"dummy {cfg.name} weights") as bar:
        for name, t in iter_tensor_values(cfg, schema, schema, seed):
            spec = schema[name]
            if not is_host_table(name) and device.type != "cpu":
                t = t.to(device)
            tensors[name] = t
            bar.update(spec.nbytes)
    return tensors
