"""The layer topology of a V41Config (spec/model.md §1.2): each layer's role (WINDOW, FULL,
REINDEX, REUSE), compress ratio and owners, the encoder/decoder boundary, and the table
`python -m v41.config` prints. Reads the config's fields only; imports nothing of v41."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Role(str, Enum):
    WINDOW = "WINDOW"     # sliding-window attention only
    FULL = "FULL"         # owns a compressor, index keys and its own top-k
    REINDEX = "REINDEX"   # own index query against its kv owner's keys
    REUSE = "REUSE"       # reads the kv owner's rows and the latest top-k unchanged


@dataclass(frozen=True)
class LayerSpec:
    layer: int
    role: Role
    ratio: int
    kv_owner: int | None
    topk_owner: int | None
    candidate_owner: int | None
    draft: bool = False

    @property
    def produces_candidates(self) -> bool:
        return self.candidate_owner == self.layer

    @property
    def scores(self) -> bool:
        """Runs an index query (FULL or REINDEX)."""
        return self.role in (Role.FULL, Role.REINDEX)

    def as_json(self) -> dict:
        return {"layer": self.layer, "role": self.role.value, "ratio": self.ratio,
                "kv_owner": self.kv_owner, "topk_owner": self.topk_owner,
                "candidate_owner": self.candidate_owner}


@dataclass(frozen=True)
class Topology:
    layers: tuple            # LayerSpec for backbone layers then draft stages
    n_backbone: int
    boundary: int            # last kv source: the encoder/decoder boundary (20 in Flash)
    late_layer_start: int    # first layer after it (21)
    engram_layers: tuple
    dspark_taps: tuple

    @property
    def backbone(self) -> tuple:
        return self.layers[: self.n_backbone]

    @property
    def owners(self) -> tuple:
        return tuple(s.layer for s in self.backbone if s.role is Role.FULL)


def build_topology(cfg) -> Topology:
    n = cfg.num_hidden_layers
    kv_src, idx_src = set(cfg.kv_source_layer_ids), set(cfg.index_source_layer_ids)
    specs, kv_owner, topk_owner = [], None, None
    for i, r in enumerate(cfg.compress_ratios):
        draft = i >= n
        if r == 0 or draft:
            specs.append(LayerSpec(i, Role.WINDOW, r, None, None, None, draft))
            continue
        if i in kv_src:
            kv_owner = topk_owner = i
            role = Role.FULL
        elif i in idx_src:
            topk_owner = i
            role = Role.REINDEX
        else:
            role = Role.REUSE
        cand = cfg.candidate_source_layer_id if i >= cfg.candidate_source_layer_id else None
        specs.append(LayerSpec(i, role, r, kv_owner, topk_owner, cand))
    boundary = max(cfg.kv_source_layer_ids)
    return Topology(tuple(specs), n, boundary, boundary + 1, tuple(cfg.engram_layer_ids),
                    tuple(cfg.dspark_target_layer_ids))


# ---- the table (printed by the CLI, v41.config_cli) ----------------------------------------

def _fmt(v):
    return "–" if v is None else str(v)


def topology_table(cfg) -> str:
    topo = cfg.topology
    lines = ["layer ratio mode     kv_owner topk_owner candidates"]
    for s in topo.layers:
        mode = s.role.value + (" (draft)" if s.draft else "")
        if s.produces_candidates:
            cand = "produces"
        elif s.candidate_owner is not None:
            cand = f"from {s.candidate_owner}"
        else:
            cand = "–"
        extra = " +Engram" if s.layer in topo.engram_layers else ""
        lines.append(f"{s.layer:5d} {s.ratio:5d} {mode:8s} {_fmt(s.kv_owner):>8s} "
                     f"{_fmt(s.topk_owner):>10s} {cand}{extra}")
    lines.append(f"encoder/decoder boundary: {topo.boundary}; late layers from {topo.late_layer_start}; "
                 f"DSpark taps {list(topo.dspark_taps)}; Engram at {list(topo.engram_layers)}")
    return "\n".join(lines)
