"""Native DeepSeek-V4.1 checkpoint: schema, parameter counts, a deterministic random-weight
writer, a header-first checker, the loader and the post-load processing (spec/model.md §5).

    python -m v41.loader write toy /tmp/v41-toy [--seed N]   # random weights of a preset
    python -m v41.loader check /tmp/v41-toy                   # header check only, prints a summary

Names carry no `model.` prefix: `embed.*`, `layers.L.*`, `mtp.M.*`, `norm.*`, `head.*`
(v41 has no vision tower, so no `vision.*` / `aligner.*` / `image_*`). Quantized linears are
`<name>.weight` + `<name>.scale`: FP8 E4M3 with an E8M0 scale per 32x32 block, or routed-expert
FP4 E2M1 packed two per byte (`I8` on disk) with an E8M0 scale per 1x32 group along the input.

Loading checks every shard header against the schema before any tensor data is read, then
reads, then runs the post-load processing exactly once (§5.4): `attn.wo_a` is dequantized to
BF16 (its scale dropped), `head` / `markov_head.head` / `confidence_head.proj` become FP32;
nothing else changes dtype. Engram tables (`*.engram.embed.*`) stay on the host.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import inspect
import json
import math
import os
import shutil
import struct
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from v41.config import TOY_TOKENIZER_DIR, V41Config, Role, load_config, preset, PRESETS

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_SHARD_BYTES = 4 << 30
COMPLETE_MARKER = ".complete"

PARTS = ("routed_experts", "engram_tables", "dspark", "other")
KINDS = ("bf16", "f32", "fp8", "e8m0", "fp4")

_KIND_DTYPE = {"bf16": torch.bfloat16, "f32": torch.float32, "fp8": torch.float8_e4m3fn,
               "e8m0": torch.float8_e8m0fnu, "fp4": torch.int8}
# safetensors header dtype strings
_ST_DTYPE = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3",
             torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8"}
_ST_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1,
                "F8_E8M0": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "I8": 1, "U8": 1, "I16": 2,
                "U16": 2, "I32": 4, "U32": 4, "I64": 8, "U64": 8, "BOOL": 1, "C64": 8}


class CheckpointError(ValueError):
    """A checkpoint that does not match the schema of its config. `problems` lists every finding;
    each names the tensor or shard concerned. Raised before any tensor data is read."""

    def __init__(self, problems, where: str = ""):
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        head = f"checkpoint {where}: " if where else "checkpoint: "
        shown = self.problems[:20]
        more = f"\n  ... and {len(self.problems) - 20} more" if len(self.problems) > 20 else ""
        if len(shown) == 1:
            msg = head + shown[0]
        else:
            msg = head + f"{len(self.problems)} problems:\n  - " + "\n  - ".join(shown) + more
        super().__init__(msg)


# ---- schema -----------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple
    kind: str                   # bf16 | f32 | fp8 | e8m0 | fp4
    part: str                   # routed_experts | engram_tables | dspark | other
    group: tuple | None = None  # quantized weight / scale: the block one scale covers (rows, cols)
    logical: tuple | None = None  # quantized weight / scale: the unpacked weight shape [out, in]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _dtype_size(self.dtype)

    @property
    def params(self) -> int:
        """Counted parameters (spec §5.3): scales count 0, packed FP4 bytes count 2."""
        if self.kind == "e8m0":
            return 0
        return self.numel * (2 if self.kind == "fp4" else 1)

    @property
    def st_dtype(self) -> str:
        return _ST_DTYPE[self.dtype]


def _dtype_size(dt: torch.dtype) -> int:
    return torch.empty((), dtype=dt, device="meta").element_size()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def checkpoint_schema(cfg: V41Config) -> dict[str, TensorSpec]:
    """Every tensor of the native checkpoint of `cfg` (spec §5.2), in a fixed order:
    embed, backbone layers, draft stages, final norm, head."""
    S: dict[str, TensorSpec] = {}
    D, hc, V = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
    H, hd, ql = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    mix = hc * (hc + 2)

    def plain(name, kind, shape, part):
        S[name] = TensorSpec(_KIND_DTYPE[kind], tuple(int(s) for s in shape), kind, part)

    def fp8(prefix, n, k, part, group=(32, 32), weight_part=None):
        gr, gc = group
        S[prefix + ".weight"] = TensorSpec(torch.float8_e4m3fn, (n, k), "fp8", weight_part or part,
                                           group, (n, k))
        S[prefix + ".scale"] = TensorSpec(torch.float8_e8m0fnu, (_cdiv(n, gr), _cdiv(k, gc)), "e8m0",
                                          weight_part or part, group, (n, k))

    def fp4(prefix, n, k, part):
        if k % 2:
            raise ValueError(f"{prefix}: FP4 input width {k} is odd")
        S[prefix + ".weight"] = TensorSpec(torch.int8, (n, k // 2), "fp4", part, (1, 32), (n, k))
        S[prefix + ".scale"] = TensorSpec(torch.float8_e8m0fnu, (n, _cdiv(k, 32)), "e8m0", part,
                                          (1, 32), (n, k))

    plain("embed.weight", "bf16", (V, D), "other")
    topo = cfg.topology
    n_back = cfg.num_hidden_layers
    engram_rows = dict(zip(cfg.engram_layer_ids, cfg.engram_num_embeddings))
    for spec in topo.layers:
        draft = spec.draft
        idx = spec.layer - n_back if draft else spec.layer
        p = f"mtp.{idx}." if draft else f"layers.{idx}."
        part = "dspark" if draft else "other"
        # Engram sits before the block (spec §3.0)
        if not draft and spec.layer in engram_rows:
            rows = engram_rows[spec.layer]
            fp8(p + "engram.embed", rows, cfg.engram_head_dim, "engram_tables", group=(1, 32))
            fp8(p + "engram.wkv", (hc + 1) * D, cfg.engram_width, part)
            plain(p + "engram.k_weight", "bf16", (hc, D), part)
            plain(p + "engram.q_weight", "bf16", (hc, D), part)
        # mHC
        for s in ("attn", "ffn"):
            plain(p + f"hc_{s}_fn", "f32", (mix, hc * D), part)
            plain(p + f"hc_{s}_base", "f32", (mix,), part)
            plain(p + f"hc_{s}_scale", "f32", (3,), part)
        plain(p + "attn_norm.weight", "bf16", (D,), part)
        # attention
        a = p + "attn."
        plain(a + "attn_sink", "f32", (H,), part)
        plain(a + "q_norm.weight", "bf16", (ql,), part)
        plain(a + "kv_norm.weight", "bf16", (hd,), part)
        fp8(a + "wq_a", ql, D, part)
        fp8(a + "wq_b", H * hd, ql, part)
        fp8(a + "wkv", hd, D, part)
        fp8(a + "wo_a", cfg.o_groups * cfg.o_lora_rank, cfg.o_group_in, part)
        fp8(a + "wo_b", D, cfg.o_groups * cfg.o_lora_rank, part)
        # compare role values, not members: under `python -m v41.config` the enum class exists twice
        role = Role(spec.role.value)
        if role is Role.FULL:
            plain(a + "compressor.wkv.weight", "bf16", (hd, D), part)
            if spec.ratio == 2:
                plain(a + "compressor.wgate.weight", "bf16", (hd, D), part)
            plain(a + "compressor.norm.weight", "bf16", (hd,), part)
            plain(a + "indexer.wk.weight", "bf16", (cfg.index_head_dim, hd), part)
            plain(a + "indexer.k_norm.weight", "bf16", (cfg.index_head_dim,), part)
        if role in (Role.FULL, Role.REINDEX):
            fp8(a + "indexer.wq_b", cfg.index_n_heads * cfg.index_head_dim, ql, part)
            plain(a + "indexer.weights_proj.weight", "bf16", (cfg.index_n_heads, D), part)
        # MoE
        plain(p + "ffn_norm.weight", "bf16", (D,), part)
        f = p + "ffn."
        n_exp = cfg.dspark_n_routed_experts if draft else cfg.n_routed_experts
        I = cfg.moe_intermediate_size
        plain(f + "gate.weight", "bf16", (n_exp, D), part)
        plain(f + "gate.bias", "f32", (n_exp,), part)
        plain(f + "gate.bias_vl", "f32", (n_exp,), part)
        epart = "dspark" if draft else "routed_experts"
        for e in range(n_exp):
            fp4(f + f"experts.{e}.w1", I, D, epart)
            fp4(f + f"experts.{e}.w3", I, D, epart)
            fp4(f + f"experts.{e}.w2", D, I, epart)
        fp8(f + "shared_experts.w1", I, D, part)
        fp8(f + "shared_experts.w3", I, D, part)
        fp8(f + "shared_experts.w2", D, I, part)
        # DSpark extras
        if draft and idx == 0:
            fp8(p + "main_proj", D, len(cfg.dspark_target_layer_ids) * D, part)
            plain(p + "main_norm.weight", "bf16", (D,), part)
        if draft and idx == cfg.num_nextn_predict_layers - 1:
            r = cfg.dspark_markov_rank
            plain(p + "norm.weight", "bf16", (D,), part)
            plain(p + "markov_head.embed.weight", "bf16", (V, r), part)
            plain(p + "markov_head.head.weight", "bf16", (V, r), part)
            plain(p + "confidence_head.proj.weight", "bf16", (1, D + r), part)
    plain("norm.weight", "bf16", (D,), "other")
    plain("head.weight", "bf16", (V, D), "other")
    return S


def is_host_table(name: str) -> bool:
    """Engram tables stay on the host (memory, not the accelerator)."""
    return ".engram.embed." in name


def count_params(cfg: V41Config) -> dict:
    """Parameters per part, counted from tensors built on the meta device (spec §5.3 rule:
    `.scale` tensors are not counted; a packed FP4 byte counts 2 parameters)."""
    out = {"routed_experts": 0, "engram_tables": 0, "dspark": 0, "vision": 0, "other": 0}
    for spec in checkpoint_schema(cfg).values():
        if spec.kind == "e8m0":
            continue
        t = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
        out[spec.part] += t.numel() * (2 if spec.kind == "fp4" else 1)
    out["total"] = sum(out[k] for k in ("routed_experts", "engram_tables", "dspark", "vision", "other"))
    return out


def schema_totals(cfg: V41Config, schema: dict | None = None) -> dict:
    """Tensor count and bytes on disk per part (spec §5.3 "bytes on disk")."""
    schema = schema if schema is not None else checkpoint_schema(cfg)
    b = {p: 0 for p in PARTS}
    n = {p: 0 for p in PARTS}
    for spec in schema.values():
        b[spec.part] += spec.nbytes
        n[spec.part] += 1
    return {"tensors": len(schema), "bytes": sum(b.values()), "bytes_per_part": b,
            "tensors_per_part": n}


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


# ---- writer -----------------------------------------------------------------------------

def shard_plan(schema: dict, shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[list[str]]:
    """Tensor names per shard: everything but the Engram tables packed greedily in schema order,
    then each layer's Engram table (weight + scale) in a shard of its own at the end (§5.1)."""
    shards, cur, cur_b = [], [], 0
    tables: dict[str, list[str]] = {}
    for name, spec in schema.items():
        if is_host_table(name):
            tables.setdefault(name.split(".engram.")[0], []).append(name)
            continue
        if cur and cur_b + spec.nbytes > shard_bytes:
            shards.append(cur)
            cur, cur_b = [], 0
        cur.append(name)
        cur_b += spec.nbytes
    if cur:
        shards.append(cur)
    shards.extend(tables.values())
    return shards


def _toy_tokenizer_files() -> list[Path]:
    return [TOY_TOKENIZER_DIR / f for f in ("tokenizer.json", "tokenizer_config.json")]


def write_checkpoint(cfg: V41Config, out_dir, seed: int = 0, shard_bytes: int = DEFAULT_SHARD_BYTES,
                     progress: bool = True) -> Path:
    """Write a random-weight native checkpoint of `cfg`: config.json, safetensors shards,
    model.safetensors.index.json (and the toy tokenizer for the toy preset). Deterministic: the
    same (cfg, seed, shard_bytes) gives identical bytes."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    schema = checkpoint_schema(cfg)
    plan = shard_plan(schema, shard_bytes)
    n = len(plan)
    files = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for stale in out.glob("model-*-of-*.safetensors"):
        if stale.name not in files:
            stale.unlink()
    (out / COMPLETE_MARKER).unlink(missing_ok=True)
    total = sum(s.nbytes for s in schema.values())
    weight_map = {}
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
              desc=f"write {cfg.name} checkpoint") as bar:
        for fname, names in zip(files, plan):
            tensors = {}
            for name, t in iter_tensor_values(cfg, names, schema, seed):
                tensors[name] = t
                weight_map[name] = fname
                bar.update(schema[name].nbytes)
            save_file(tensors, str(out / fname), metadata={"format": "pt"})
            del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    if cfg.name == "toy":
        for f in _toy_tokenizer_files():
            if f.exists():
                shutil.copyfile(f, out / f.name)
            else:
                warnings.warn(f"toy tokenizer file {f} not found; not copied")
    return out


# ---- header check -----------------------------------------------------------------------

def read_safetensors_header(path) -> tuple[dict, int, int]:
    """Parse a safetensors header without touching tensor data: (header, data_start, file_size).
    Raises CheckpointError naming the shard on a missing file or a corrupted header."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"shard {path.name}: file missing")
    size = path.stat().st_size
    if size < 8:
        raise CheckpointError(f"shard {path.name}: {size} bytes, too short for a safetensors header")
    with open(path, "rb") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        if hlen > size - 8:
            raise CheckpointError(f"shard {path.name}: header length {hlen} runs past the end of the "
                                  f"file ({size} bytes; truncated or corrupted)")
        raw = f.read(hlen)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"shard {path.name}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"shard {path.name}: header is not a JSON object")
    return header, 8 + hlen, size


def _read_index(root: Path) -> dict[str, str]:
    idx = root / INDEX_FILE
    if not idx.exists():
        if (root / SINGLE_FILE).exists():
            header, _, _ = read_safetensors_header(root / SINGLE_FILE)
            return {k: SINGLE_FILE for k in header if k != "__metadata__"}
        raise CheckpointError(f"{INDEX_FILE}: missing (and no {SINGLE_FILE})", str(root))
    try:
        d = json.loads(idx.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{INDEX_FILE}: not valid JSON ({e})", str(root)) from None
    wm = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise CheckpointError(f"{INDEX_FILE}: no weight_map of tensor name -> shard file", str(root))
    for shard in set(wm.values()):
        if Path(shard).name != shard:
            raise CheckpointError(f"{INDEX_FILE}: shard name {shard!r} is not a plain file name",
                                  str(root))
    return wm


@dataclass
class CheckReport:
    root: Path
    shards: dict          # shard file -> list of tensor names (in header data order)
    tensors: int
    bytes: int
    bytes_per_part: dict
    params: dict

    def summary(self) -> str:
        lines = [f"{self.root}: OK — {len(self.shards)} shards, {self.tensors} tensors, "
                 f"{self.bytes:,} bytes ({self.bytes / 2**20:.2f} MiB)"]
        for p in PARTS:
            lines.append(f"  {p:15s} {self.params.get(p, 0):>20,} params {self.bytes_per_part[p]:>20,} B")
        lines.append(f"  {'total':15s} {self.params['total']:>20,} params {self.bytes:>20,} B")
        return "\n".join(lines)


def check_checkpoint(path, cfg: V41Config | None = None, schema: dict | None = None) -> CheckReport:
    """Check the index and every shard header against the schema of `cfg` (from the directory's
    config.json when not given). Reads headers only. Raises CheckpointError listing every problem."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory")
    if cfg is None:
        cfg = load_config(root)
    schema = schema if schema is not None else checkpoint_schema(cfg)
    wm = _read_index(root)
    problems: list[str] = []
    for name in schema:
        if name not in wm:
            problems.append(f"tensor {name}: missing (not in {INDEX_FILE})")
    for name in wm:
        if name not in schema:
            problems.append(f"tensor {name}: unexpected (not in the {cfg.name} schema)")
    by_shard: dict[str, list[str]] = {}
    for name, shard in wm.items():
        by_shard.setdefault(shard, []).append(name)
    seen: dict[str, str] = {}
    shards: dict[str, list[str]] = {}
    for shard in sorted(by_shard):
        listed = set(by_shard[shard])
        spath = root / shard
        if not spath.is_file():
            problems.append(f"shard {shard}: listed in {INDEX_FILE} but missing "
                            f"(tensors {sorted(listed)[:3]}{' ...' if len(listed) > 3 else ''})")
            continue
        try:
            header, data_start, size = read_safetensors_header(spath)
        except CheckpointError as e:
            problems.extend(e.problems)
            continue
        header.pop("__metadata__", None)
        ranges = []
        for name, ent in header.items():
            if name in seen:
                problems.append(f"tensor {name}: present in shard {seen[name]} and shard {shard}")
                continue
            seen[name] = shard
            if name not in listed:
                if name in wm:
                    problems.append(f"tensor {name}: found in shard {shard} but the index maps it to "
                                    f"{wm[name]}")
                else:
                    problems.append(f"tensor {name}: unexpected, in shard {shard} (not in the index)"
                                    + ("" if name in schema else f" nor in the {cfg.name} schema"))
                continue
            if not isinstance(ent, dict) or not {"dtype", "shape", "data_offsets"} <= set(ent):
                problems.append(f"tensor {name}: malformed header entry in shard {shard}")
                continue
            dt, shape, offs = ent["dtype"], ent["shape"], ent["data_offsets"]
            if (not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape)
                    or not isinstance(offs, list) or len(offs) != 2
                    or not all(isinstance(o, int) for o in offs) or dt not in _ST_ITEMSIZE):
                problems.append(f"tensor {name}: malformed header entry in shard {shard} "
                                f"(dtype {dt!r}, shape {shape!r}, data_offsets {offs!r})")
                continue
            spec = schema.get(name)
            bad = False
            if spec is not None:
                if dt != spec.st_dtype:
                    problems.append(f"tensor {name}: dtype {dt} in shard {shard}, expected {spec.st_dtype}")
                    bad = True
                if tuple(shape) != spec.shape:
                    problems.append(f"tensor {name}: shape {list(shape)} in shard {shard}, expected "
                                    f"{list(spec.shape)}")
                    bad = True
            b, e = offs
            need = math.prod(shape) * _ST_ITEMSIZE[dt]
            if not 0 <= b <= e or e - b != need:
                problems.append(f"tensor {name}: data_offsets {offs} in shard {shard} do not hold "
                                f"{need} bytes")
                bad = True
            elif data_start + e > size:
                problems.append(f"tensor {name}: data [{b}, {e}) runs past the end of shard {shard} "
                                f"({size - data_start} data bytes; file truncated?)")
                bad = True
            if not bad:
                ranges.append((b, e, name))
        for name in sorted(listed - set(header)):
            problems.append(f"tensor {name}: missing from shard {shard} (the index lists it there)")
        ranges.sort()
        for (b0, e0, n0), (b1, e1, n1) in zip(ranges, ranges[1:]):
            if b1 < e0:
                problems.append(f"tensor {n1}: data overlaps tensor {n0} in shard {shard}")
        shards[shard] = [r[2] for r in ranges]
    if problems:
        raise CheckpointError(problems, str(root))
    sizes = {p: 0 for p in PARTS}
    for spec in schema.values():
        sizes[spec.part] += spec.nbytes
    params = count_params(cfg)
    return CheckReport(root, shards, len(schema), sum(sizes.values()), sizes, params)


# ---- weights + post-load processing -----------------------------------------------------

def fp32_copy_names(schema) -> list[str]:
    return [n for n in schema if n == "head.weight" or
            (n.startswith("mtp.") and n.endswith(("markov_head.head.weight", "confidence_head.proj.weight")))]


def wo_a_names(schema) -> list[str]:
    return [n for n in schema if n.endswith("attn.wo_a.weight")]


class Weights(Mapping):
    """The checkpoint tensors by name (a read-only mapping) plus where they came from.
    `postprocess()` runs the §5.4 post-load processing; it runs exactly once."""

    def __init__(self, cfg: V41Config, tensors: dict, source: str, device="cpu", seed: int | None = None):
        self.cfg = cfg
        self.tensors = tensors
        self.source = source          # a checkpoint directory or "dummy"
        self.device = torch.device(device)
        self.seed = seed
        self.processed = False
        self.postprocessed: list[str] = []

    def __getitem__(self, name):
        return self.tensors[name]

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)

    def __repr__(self):
        return (f"Weights({self.cfg.name}, {len(self)} tensors, source={self.source}, "
                f"device={self.device}, processed={self.processed})")

    @property
    def host_tables(self) -> dict:
        return {n: t for n, t in self.tensors.items() if is_host_table(n)}

    def postprocess(self) -> "Weights":
        """§5.4: `attn.wo_a.weight` FP8 x E8M0 (32x32) -> BF16 and `.scale` dropped; `head`,
        `mtp.*.markov_head.head`, `mtp.*.confidence_head.proj` -> FP32 copies. Everything else
        keeps its native dtype (no re-quantization). A second call raises."""
        if self.processed:
            raise RuntimeError("post-load processing already ran on these weights (it runs exactly once)")
        from v41.quant import dequant_fp8_block
        T = self.tensors
        done = []
        for name in wo_a_names(T):
            sname = name[: -len(".weight")] + ".scale"
            w, s = T[name], T.pop(sname)
            if w.dtype != torch.float8_e4m3fn:
                raise RuntimeError(f"{name}: expected float8_e4m3fn before post-load processing, got {w.dtype}")
            T[name] = dequant_fp8_block(w, s, torch.bfloat16)
            done.append(name)
        for name in fp32_copy_names(T):
            T[name] = T[name].float()
            done.append(name)
        for name, t in T.items():
            if ".hc_" in "." + name.rsplit(".", 1)[-1] and t.dtype != torch.float32:
                raise RuntimeError(f"{name}: mHC tensors must stay FP32, got {t.dtype}")
        self.postprocessed = done
        self.processed = True
        return self


def postprocess(weights: Weights) -> Weights:
    return weights.postprocess()


def load_checkpoint(path, cfg: V41Config | None = None, device="cpu", progress: bool = True,
                    process: bool = True) -> Weights:
    """Load a native checkpoint directory: header check of every shard first (CheckpointError,
    nothing read), then the tensors (Engram tables on the CPU, the rest on `device`), then the
    post-load processing (once)."""
    root = Path(path)
    if cfg is None:
        cfg = load_config(root)
    schema = checkpoint_schema(cfg)
    report = check_checkpoint(root, cfg, schema)
    device = torch.device(device)
    tensors: dict[str, torch.Tensor] = {}
    with tqdm(total=report.bytes, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
              desc=f"load {root.name}") as bar:
        for shard, names in report.shards.items():
            with safe_open(str(root / shard), framework="pt", device="cpu") as f:
                for name in names:
                    t = f.get_tensor(name)
                    spec = schema[name]
                    if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                        raise CheckpointError(f"tensor {name}: read {t.dtype} {list(t.shape)}, expected "
                                              f"{spec.dtype} {list(spec.shape)}", str(root))
                    if not is_host_table(name) and device.type != "cpu":
                        t = t.to(device)
                    tensors[name] = t
                    bar.update(spec.nbytes)
    w = Weights(cfg, {n: tensors[n] for n in schema}, str(root), device)
    return w.postprocess() if process else w


def dummy_weights(cfg: V41Config, device="cpu", seed: int = 0, progress: bool = True,
                  process: bool = True) -> Weights:
    """The writer's tensors built in memory (CPU generators, then moved to `device`), no files."""
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
    w = Weights(cfg, tensors, "dummy", device, seed)
    return w.postprocess() if process else w


def _is_checkpoint_dir(p: Path) -> bool:
    return p.is_dir() and ((p / INDEX_FILE).exists() or (p / SINGLE_FILE).exists())


def load_weights(model_or_dir, cfg: V41Config | None = None, device="cpu", load_format: str = "auto",
                 seed: int = 0, progress: bool = True) -> Weights:
    """`model_or_dir`: a checkpoint directory or a preset name. `load_format`:
    'safetensors' reads the directory; 'dummy' builds the writer's random tensors in memory
    (same values as `write_checkpoint(cfg, ..., seed)`); 'auto' = safetensors for a checkpoint
    directory; for the `toy` preset its checkpoint, written once into the cache on first use
    and then read like any other; dummy for the other presets (too large to write)."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format {load_format!r}: expected 'auto', 'safetensors' or 'dummy'")
    if load_format == "auto":
        p = Path(model_or_dir)
        if _is_checkpoint_dir(p):
            load_format = "safetensors"
        elif model_or_dir == "toy":
            model_or_dir, load_format = ensure_preset_checkpoint("toy", seed=seed), "safetensors"
        elif isinstance(model_or_dir, str) and model_or_dir in PRESETS:
            load_format = "dummy"
        else:
            raise CheckpointError(f"{model_or_dir!r} is neither a checkpoint directory nor a preset")
    if load_format == "dummy":
        cfg = cfg if cfg is not None else load_config(model_or_dir)
        return dummy_weights(cfg, device, seed, progress)
    return load_checkpoint(model_or_dir, cfg, device, progress)


# ---- cached preset checkpoints ----------------------------------------------------------

def checkpoint_key(cfg: V41Config, seed: int = 0) -> str:
    """Short hash of what determines the written bytes: config, schema, writer source and (toy)
    tokenizer files."""
    h = hashlib.blake2b(digest_size=6)
    h.update(json.dumps(cfg.to_hf_dict(), sort_keys=True).encode())
    for name, s in checkpoint_schema(cfg).items():
        h.update(f"{name}|{s.st_dtype}|{s.shape}|{s.group}|{s.logical}\n".encode())
    for fn in _WRITER_FUNCS + (write_checkpoint, shard_plan):
        h.update(inspect.getsource(fn).encode())
    h.update(f"{_FP8_CODE_STD}|{_CHUNK_ELEMS}|{DEFAULT_SHARD_BYTES}|{seed}".encode())
    if cfg.name == "toy":
        for f in _toy_tokenizer_files():
            h.update(f.read_bytes() if f.exists() else b"-")
    return h.hexdigest()


def default_cache_root() -> Path:
    env = os.environ.get("V41_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "v41" / "checkpoints"


def ensure_preset_checkpoint(name: str, root=None, seed: int = 0, progress: bool = False) -> Path:
    """The random-weight checkpoint of a preset, written on first use into
    `<root>/<name>-s<seed>-<hash>` (root: `$V41_CACHE` or ~/.cache/v41/checkpoints) under an
    fcntl lock so concurrent processes do not race; `.complete` is written last."""
    cfg = preset(name)
    root = Path(root) if root is not None else default_cache_root()
    d = root / f"{name}-s{seed}-{checkpoint_key(cfg, seed)}"
    if (d / COMPLETE_MARKER).exists():
        return d
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{d.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if (d / COMPLETE_MARKER).exists():
                return d
            if d.exists():
                shutil.rmtree(d)
            for stale in root.glob(f".{d.name}.tmp-*"):    # left by a writer that died
                shutil.rmtree(stale, ignore_errors=True)
            tmp = root / f".{d.name}.tmp-{os.getpid()}"
            write_checkpoint(cfg, tmp, seed=seed, progress=progress)
            tmp.rename(d)
            (d / COMPLETE_MARKER).write_text(json.dumps({"preset": name, "seed": seed}) + "\n")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return d


# ---- CLI --------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m v41.loader", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write a random-weight checkpoint of a preset")
    w.add_argument("preset", choices=sorted(PRESETS))
    w.add_argument("out_dir")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES)
    w.add_argument("--no-progress", action="store_true")
    c = sub.add_parser("check", help="check every shard header against the schema (reads no tensor data)")
    c.add_argument("dir")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "write":
            cfg = preset(a.preset)
            out = write_checkpoint(cfg, a.out_dir, seed=a.seed, shard_bytes=a.shard_bytes,
                                   progress=not a.no_progress)
            print(check_checkpoint(out, cfg).summary())
        else:
            print(check_checkpoint(a.dir).summary())
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
