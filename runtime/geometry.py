"""Pool geometry: every PAGE and STATE plane declared once (DESIGN.md §5 "Geometry is declared
once"). Allocation, memory sizing and checkpoint images all read these declarations, and an
image carries `layout_id`, a hash of them. Imports nothing from the model or the scheduler.

    PAGE (one block id = `page_tokens` tokens of one request) holds, for every FULL owner o,
      main.o         [page/ratio_o, head_dim]   activation dtype (the BF16 main pool)
      index.o        fp8: [page/ratio_o, index_dim] E4M3     fp4: [page/ratio_o, index_dim/2] E2M1 x2
      index_scale.o  fp8: [page/ratio_o] FP32 (a power of two) fp4: [page/ratio_o, index_dim/32] E8M0
    STATE (one slot per running request) holds
      ring           [layers (+ n_draft), window, head_dim] every SWA ring (DSpark: its draft
                     stages' context rings are layers n..n+n_draft-1, docs/dspark.md §3)
      tail_v, tail_g [ratio-2 owners, head_dim] FP32 compressor tails
      cursor         [4] int64: committed position, last three compressed Engram ids
    IMAGE (StateTransfer.copy: the state at a PAGE boundary, owned by that PAGE) holds ring and
      cursor, not the tails: a boundary is a multiple of every ratio, so no group is open there.

    python -m runtime.geometry toy --index-cache-dtype fp8 --json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass

import torch

INDEX_CACHE_DTYPES = ("fp8", "fp4")
KV_CACHE_DTYPES = ("bf16",)
ALIGN = 256


class AdmissionError(ValueError):
    """A runtime setting v41 refuses before any weight is read."""


@dataclass(frozen=True)
class Plane:
    name: str
    shape: tuple            # per unit (one PAGE or one STATE slot)
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class PoolGeometry:
    def __init__(self, cfg, page_tokens: int | None = None, index_cache_dtype: str = "fp8",
                 kv_cache_dtype: str = "bf16", dtype: torch.dtype = torch.bfloat16, n_draft: int = 0):
        from v41.config import ConfigError, validate_page
        page = page_tokens or cfg.kv_cache_block_size
        try:
            validate_page(cfg, page, "block_size")
        except ConfigError as e:
            raise AdmissionError(str(e)) from None
        if index_cache_dtype not in INDEX_CACHE_DTYPES:
            raise AdmissionError(f"index_cache_dtype: {index_cache_dtype!r} is not supported; "
                                 f"choose one of {INDEX_CACHE_DTYPES}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise AdmissionError(f"kv_cache_dtype: {kv_cache_dtype!r} is not supported; the main pool "
                                 f"takes {KV_CACHE_DTYPES} (the packed FP4 main pool is not built yet)")
        topo = cfg.topology
        self.page_tokens, self.index_fmt, self.dtype = page, index_cache_dtype, dtype
        self.acc = torch.float64 if dtype == torch.float64 else torch.float32
        self.window, self.head_dim, self.index_dim = cfg.sliding_window, cfg.head_dim, cfg.index_head_dim
        self.n_layers, self.n_draft = cfg.num_hidden_layers, n_draft
        self.ring_layers = self.n_layers + n_draft
        self.owners = {o: cfg.compress_ratios[o] for o in topo.owners}
        self.tail_owners = tuple(o for o, r in self.owners.items() if r == 2)
        self.page_planes = []
        for o, r in self.owners.items():
            rows = page // r
            self.page_planes.append(Plane(f"main.{o}", (rows, cfg.head_dim), dtype))
            if index_cache_dtype == "fp8":
                self.page_planes += [Plane(f"index.{o}", (rows, cfg.index_head_dim), torch.float8_e4m3fn),
                                     Plane(f"index_scale.{o}", (rows,), torch.float32)]
            else:
                self.page_planes += [Plane(f"index.{o}", (rows, cfg.index_head_dim // 2), torch.uint8),
                                     Plane(f"index_scale.{o}", (rows, cfg.index_head_dim // 32), torch.uint8)]
        nt = len(self.tail_owners)
        self.state_planes = [Plane("ring", (self.ring_layers, cfg.sliding_window, cfg.head_dim), dtype),
                             Plane("tail_v", (nt, cfg.head_dim), self.acc),
                             Plane("tail_g", (nt, cfg.head_dim), self.acc),
                             Plane("cursor", (4,), torch.int64)]

    @property
    def image_planes(self) -> list:
        return [p for p in self.state_planes if p.name in ("ring", "cursor")]

    @property
    def bytes_per_image(self) -> int:
        return sum(_aligned(p.nbytes) for p in self.image_planes)

    def rows_per_page(self, owner: int) -> int:
        return self.page_tokens // self.owners[owner]

    @property
    def bytes_per_page(self) -> int:
        return sum(_aligned(p.nbytes) for p in self.page_planes)

    @property
    def bytes_per_state(self) -> int:
        return sum(_aligned(p.nbytes) for p in self.state_planes)

    @property
    def global_bytes_per_token(self) -> float:
        return sum(p.nbytes for p in self.page_planes) / self.page_tokens

    @property
    def layout_id(self) -> str:
        """Identity of the image layout: any change to a plane gives another id."""
        desc = [(p.name, p.shape, str(p.dtype)) for p in self.page_planes + self.state_planes]
        return hashlib.sha256(repr((self.page_tokens, self.index_fmt, desc)).encode()).hexdigest()[:16]

    def summary(self) -> dict:
        return {"page_tokens": self.page_tokens, "index_cache_dtype": self.index_fmt,
                "bytes_per_page": self.bytes_per_page, "bytes_per_state": self.bytes_per_state,
                "bytes_per_image": self.bytes_per_image,
                "global_bytes_per_token": self.global_bytes_per_token, "layout_id": self.layout_id,
                "page_planes": {p.name: p.nbytes for p in self.page_planes},
                "state_planes": {p.name: p.nbytes for p in self.state_planes}}


def main(argv=None) -> int:
    from v41.config import ConfigError, load_config
    ap = argparse.ArgumentParser(prog="python -m runtime.geometry")
    ap.add_argument("model", help="preset name or directory with config.json")
    ap.add_argument("--index-cache-dtype", default="fp8")
    ap.add_argument("--kv-cache-dtype", default="bf16")
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        g = PoolGeometry(load_config(a.model), a.block_size, a.index_cache_dtype, a.kv_cache_dtype)
    except (ConfigError, AdmissionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = g.summary()
    if a.json:
        print(json.dumps(s, indent=1))
    else:
        for k, v in s.items():
            print(f"{k:24s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
