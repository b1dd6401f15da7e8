"""Tensor parallelism over torch.distributed (NCCL on GPUs, gloo on the CPU): which checkpoint
tensors a rank keeps, and the one all-reduce per sublayer that sums the ranks' partial outputs.

Every rank runs the same engine on the same steps (SPMD, as gpt-fast): the scheduler's choices
and the greedy tokens are identical on all ranks because the all-reduced outputs are. The split:

* Attention: the query heads. `wq_b` rows, `attn_sink` and `wo_a`'s output groups by rank (a
  group reads its own H/G heads, so a rank's heads are whole groups), `wo_b` by its input
  columns; the rank's partial `wo_b` output is all-reduced in FP32 (spec §2.1). `wq_a`, the KV
  path (MQA: one KV head), the compressor and the indexer are replicated: the indexer's top-k
  needs every index head's scores, and an all-reduce of the [T, rows] score matrix per layer
  would move more than its weights.
* MoE: whole routed experts per rank (a rank's contiguous E/N; the others' ids become -1, which
  the expert ops skip), the shared expert split on its intermediate rows when each rank keeps
  whole A8 groups of 32 (else replicated and added by rank 0 alone); one FP32 all-reduce of the
  routed + shared sum. Splitting a routed expert's intermediate dimension instead would cut the
  32-wide activation-quant groups of w2's input on small models (the toy's I = 32).
* Everything else (embedding, LM head, mHC, Engram, norms, router, the DSpark stages) is
  replicated: the head would need an all-gather of vocabulary shards per step.

The KV cache is replicated with the KV path, so PAGE/STATE geometry is the same on every rank.
Partial sums change only the order of the additions: TP2 equals TP1 to rounding (float64 ~1e-16).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from v41.config import ConfigError, V41Config, validate_parallelism
from v41.layers import acc_dtype

GROUP = 32      # FP8 weight blocks and A8 activation groups: a split must keep them whole


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None           # torch.distributed process group (None: the default group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `x`, added in FP32 (or float64) and returned in x's dtype."""
        if self.size == 1:
            return x
        import torch.distributed as dist
        y = x.to(acc_dtype(x.dtype))
        dist.all_reduce(y, group=self.group)
        return y.to(x.dtype)


_current = TensorParallel()


def tensor_parallel() -> TensorParallel:
    """This process's rank and group (rank 0 of 1 unless `set_tensor_parallel` said otherwise)."""
    return _current


def set_tensor_parallel(tp: TensorParallel) -> None:
    """Declare this process's rank before its model is built (the layers read it)."""
    global _current
    _current = tp


_EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts\.)(\d+)(\..*)$")


def _split_axis(name: str, shared: bool) -> int | None:
    """The axis a backbone tensor splits along: the spec's TP rule (v41.loader.placement.tp_axis)
    less the embedding, head and DSpark stages (replicated here), and less the shared expert
    unless `shared_expert_split`."""
    # imported here: sharding a checkpoint is load-time work, not model code the compile traces
    from v41.loader.placement import tp_axis
    if not name.startswith("layers.") or (not shared and ".shared_experts." in name):
        return None
    return tp_axis(name)


def check_divisible(cfg: V41Config, size: int) -> None:
    """Refuse a rank count the split cannot honour, naming the field (before loading): the spec's
    rules (§1.1, `validate_parallelism`: heads, index heads, o_groups and the expert width by TP,
    experts by EP = TP here), and whole FP8 blocks in each rank's slices."""
    if size == 1:
        return
    validate_parallelism(cfg, tp=size, ep=size)
    if (cfg.num_attention_heads // size * cfg.head_dim) % GROUP:
        raise ConfigError("tensor_parallel_size", f"a rank's {cfg.num_attention_heads // size} heads x "
                          f"{cfg.head_dim} rows of wq_b are not whole {GROUP}-row FP8 blocks")
    if (cfg.o_groups // size * cfg.o_lora_rank) % GROUP:
        raise ConfigError("tensor_parallel_size", f"a rank's wo_b input columns are not whole {GROUP}-wide blocks")


def shared_expert_split(cfg: V41Config, size: int) -> bool:
    """Whether the shared expert splits on its intermediate rows (whole A8 groups per rank)."""
    rows = cfg.moe_intermediate_size * cfg.n_shared_experts
    return size > 1 and rows % size == 0 and (rows // size) % GROUP == 0


def shard_checkpoint(cfg: V41Config, weights, rank: int, size: int) -> dict:
    """Rank `rank`'s tensors of a loaded checkpoint (a name -> tensor mapping), as the module
    docstring splits them; routed experts renumbered from 0 on each rank."""
    check_divisible(cfg, size)
    if size == 1:
        return dict(weights.items())
    per = cfg.n_routed_experts // size
    shared = shared_expert_split(cfg, size)
    out = {}
    for name, t in weights.items():
        if m := _EXPERT.match(name):
            e = int(m[2])
            if rank * per <= e < (rank + 1) * per:
                out[f"{m[1]}{e - rank * per}{m[3]}"] = t
            continue
        axis = _split_axis(name, shared)
        out[name] = t if axis is None else _slice(name, t, axis, rank, size)
    return out


def _slice(name: str, t: torch.Tensor, axis: int, rank: int, size: int) -> torch.Tensor:
    n = t.shape[axis]
    if n % size:
        raise ValueError(f"{name}: {n} along axis {axis} is not divisible by {size} ranks")
    k = n // size
    return t.narrow(axis, rank * k, k).contiguous()
