"""Where a checkpoint's weights live on N GPUs, computed from tensors on the meta device (nothing is
allocated): bytes per GPU with the routed experts split whole and evenly across the GPUs (expert
parallel), the Engram tables on the host, and every other tensor either replicated or split.

Two rules, from the runtime guide in the seeds and spec/model.md §5.4:

* `dp-attention` (the guide's primary deployment: data-parallel attention with whole-expert EP):
  each rank runs TP1 attention with its own embeddings and output head, so every tensor but the
  routed experts is replicated. The guide does not say where the shared experts go; they are
  assumed replicated with the attention they follow.
* `tp` (tensor parallel, the reference loader's per-rank slices, §5.4): `attn.wq_b`,
  `attn.wo_a`, `attn.attn_sink`, `embed`, `head` and the shared experts' `w1`/`w3` split along
  their output rows; `attn.wo_b` and the shared `w2` along their input columns; a scale splits
  with its weight. The rest is replicated.

Bytes are the checkpoint's (native formats), and with `processed=True` what the post-load
processing leaves (§5.4: `wo_a` BF16 without its scale, the heads FP32).
"""
from __future__ import annotations

import re

import torch

from v41.config import V41Config
from v41.loader.load import fp32_copy_names, wo_a_names
from v41.loader.schema import TensorSpec, checkpoint_schema, is_host_table

RULES = ("dp-attention", "tp")
# a routed expert's tensor: group 1 its part (layers or mtp), group 2 its expert number
ROUTED_EXPERT = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.(\d+)\.")
_TP_ROWS = re.compile(r"(^(embed|head)\.weight$|\.attn\.(wq_b|wo_a)\.(weight|scale)$|\.attn\.attn_sink$"
                      r"|\.ffn\.shared_experts\.(w1|w3)\.(weight|scale)$)")
_TP_COLS = re.compile(r"(\.attn\.wo_b\.(weight|scale)$|\.ffn\.shared_experts\.w2\.(weight|scale)$)")


def tp_axis(name: str) -> int | None:
    """The axis `name` splits along under the `tp` rule (None: replicated)."""
    if _TP_ROWS.search(name):
        return 0
    if _TP_COLS.search(name):
        return 1
    return None


def _processed(cfg_schema: dict) -> dict:
    """The schema after the §5.4 post-load processing (dtype and presence only)."""
    out = dict(cfg_schema)
    for name in wo_a_names(cfg_schema):
        out.pop(name[: -len("weight")] + "scale")
        s = out[name]
        out[name] = TensorSpec(torch.bfloat16, s.shape, "bf16", s.part)
    for name in fp32_copy_names(cfg_schema):
        s = out[name]
        out[name] = TensorSpec(torch.float32, s.shape, "f32", s.part)
    return out


def placement(cfg: V41Config, gpus: int, rule: str = "dp-attention", processed: bool = False) -> dict:
    """Per-GPU bytes of `cfg`'s weights on `gpus` GPUs under `rule`: {'gpus': [{'routed_experts',
    'experts', 'split', 'replicated', 'total'} per rank], 'host' (the Engram tables), 'unique'
    (every tensor counted once: the checkpoint's bytes, or the loaded ones when `processed`)}."""
    if rule not in RULES:
        raise ValueError(f"rule {rule!r}: expected one of {', '.join(RULES)}")
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus {gpus!r}: expected a positive integer")
    schema = checkpoint_schema(cfg)
    if processed:
        schema = _processed(schema)
    n_exp = {"layers": cfg.n_routed_experts, "mtp": cfg.dspark_n_routed_experts}
    for kind, n in n_exp.items():
        if n % gpus:
            raise ValueError(f"gpus {gpus}: the {n} routed experts of {kind}.* do not split evenly")
    ranks = [dict(routed_experts=0, experts=0, split=0, replicated=0) for _ in range(gpus)]
    host = unique = 0
    for name, spec in schema.items():
        t = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
        unique += t.nbytes
        if is_host_table(name):
            host += t.nbytes
            continue
        m = ROUTED_EXPERT.match(name)
        if m:
            per = n_exp[m.group(1)] // gpus            # whole experts in contiguous blocks
            r = ranks[int(m.group(2)) // per]
            r["routed_experts"] += t.nbytes
            r["experts"] += name.endswith(".w1.weight")
            continue
        axis = tp_axis(name) if rule == "tp" else None
        if axis is None:
            for r in ranks:
                r["replicated"] += t.nbytes
            continue
        if t.shape[axis] % gpus:
            raise ValueError(f"gpus {gpus}: {name} {list(t.shape)} does not split along axis {axis}")
        for r, piece in zip(ranks, torch.tensor_split(t, gpus, dim=axis)):
            r["split"] += piece.nbytes
    for r in ranks:
        r["total"] = r["routed_experts"] + r["split"] + r["replicated"]
    return {"cfg": cfg.name, "rule": rule, "processed": processed, "gpus": ranks, "host": host,
            "unique": unique}


def format_placement(p: dict) -> str:
    """The table `python -m v41.loader placement` prints."""
    gib = 2**30
    head = (f"{p['cfg']} on {len(p['gpus'])} GPUs, rule {p['rule']}"
            f"{', after post-load processing' if p['processed'] else ', checkpoint formats'}: "
            f"{p['unique'] / gib:,.2f} GiB of weights, Engram tables {p['host'] / gib:,.2f} GiB on the host")
    lines = [head, f"  {'gpu':>3} {'experts':>7} {'routed GiB':>11} {'split GiB':>10} {'replicated GiB':>15} "
                   f"{'total GiB':>10}"]
    for i, r in enumerate(p["gpus"]):
        lines.append(f"  {i:>3} {r['experts']:>7} {r['routed_experts'] / gib:>11.2f} {r['split'] / gib:>10.2f} "
                     f"{r['replicated'] / gib:>15.2f} {r['total'] / gib:>10.2f}")
    return "\n".join(lines)
