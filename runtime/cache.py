"""The PAGE and STATE planes of `PoolGeometry`, allocated as flat row tensors so every write is
one sentinel-aware scatter and every read a gather through the block table."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.geometry import PoolGeometry
from v41 import quant


@dataclass
class OwnerPlanes:
    """One FULL owner's global rows (PAGE) and, for ratio-2 owners, its FP32 tails (STATE)."""
    main: torch.Tensor             # [pages * rows_per_page, head_dim]
    index: torch.Tensor            # fp8: [rows, index_dim] E4M3; fp4: [rows, index_dim/2] packed E2M1
    index_scale: torch.Tensor      # fp8: [rows] FP32 pow2; fp4: [rows, index_dim/32] E8M0 codes
    rows_per_page: int
    index_fmt: str
    tail_v: torch.Tensor | None = None   # [slots, head_dim]
    tail_g: torch.Tensor | None = None

    def encode_index(self, k: torch.Tensor):
        """Index keys (already on the FP4/32 grid) in the plane's storage format."""
        if self.index_fmt == "fp8":
            q, s = quant.fp8_row_quant(k)
            return q.to(torch.float8_e4m3fn), s[..., 0].to(torch.float32)
        q, s = quant.fp4_act_quant(k, 32)
        codes = quant.pack_fp4(quant.e2m1_encode(q)).view(torch.uint8)
        return codes, quant.e8m0_encode(s.float()).view(torch.uint8)


class KVCache:
    def __init__(self, geo: PoolGeometry, num_pages: int, num_slots: int, num_images: int = 0, device=None,
                 tail_staging: int = 0):
        """`tail_staging`: FP32 tail rows past the slots where DSpark's verify rows keep their
        ratio-2 tails until acceptance picks one (docs/dspark.md §2); not STATE, never imaged."""
        self.geo, self.num_pages, self.num_slots = geo, num_pages, num_slots
        planes = {p.name: p for p in geo.page_planes}

        def page_plane(name):
            p = planes[name]
            return torch.zeros((num_pages * p.shape[0],) + p.shape[1:], dtype=p.dtype, device=device)

        self.owners: dict[int, OwnerPlanes] = {}
        for o in geo.owners:
            tails = {}
            if o in geo.tail_owners:
                tails = {k: torch.zeros(num_slots + tail_staging, geo.head_dim, dtype=geo.acc, device=device)
                         for k in ("tail_v", "tail_g")}
            self.owners[o] = OwnerPlanes(page_plane(f"main.{o}"), page_plane(f"index.{o}"),
                                         page_plane(f"index_scale.{o}"), geo.rows_per_page(o),
                                         geo.index_fmt, **tails)
        # ring of layer l: rows [slot * window + p % window] (DSpark: draft stage s is layer n + s)
        self.ring = torch.zeros(geo.ring_layers, num_slots * geo.window, geo.head_dim, dtype=geo.dtype,
                                device=device)
        self.cursor = torch.zeros(num_slots, 4, dtype=torch.int64, device=device)
        # checkpoint images (StateTransfer.copy): ring rows and cursor at a PAGE boundary
        self.image_ring = torch.zeros(geo.ring_layers, num_images * geo.window, geo.head_dim, dtype=geo.dtype,
                                      device=device)
        self.image_cursor = torch.zeros(num_images, 4, dtype=torch.int64, device=device)

    def owner(self, layer: int) -> OwnerPlanes:
        return self.owners[layer]

    @property
    def nbytes(self) -> int:
        ts = [self.ring, self.cursor, self.image_ring, self.image_cursor] + [t for o in self.owners.values()
                                         for t in (o.main, o.index, o.index_scale, o.tail_v, o.tail_g)
                                         if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)
