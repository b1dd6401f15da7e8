"""StateTransfer: how a prefix hit gets the request state (SWA rings, cursor) that the cached
PAGEs do not hold.

    copy    checkpoint images: at every full prompt PAGE boundary the forward that crosses it
            copies the state there (every ring row of the last W positions, the cursor) into an
            image owned by that PAGE. A hit restores the newest valid image at or below it into
            a fresh slot and resumes there; the rows between the image and the hit are
            recomputed without rewriting the cached PAGEs. Exact.
    replay  (encoder SWA bounded replay, the default) no images: a hit resumes one whole hash
            block below itself in a fresh slot whose windows start there, rebuilding the rings;
            the cached global rows it reads are exact, the rebuilt rows see truncated windows.

Images carry the geometry's layout id, their boundary position and a checksum: an image of
another geometry, another position or with altered bytes is never restored.
"""
from __future__ import annotations

import torch

from runtime.cache import KVCache


class StateTransfer:
    def __init__(self, cache: KVCache, mode: str):
        if mode not in ("copy", "replay"):
            raise ValueError(f"state transfer {mode!r}: 'copy' or 'replay'")
        self.cache, self.mode = cache, mode
        self.W = cache.geo.window
        self.meta: dict[int, tuple] = {}          # image -> (layout id, position, checksum)
        self.stats = {"images_stored": 0, "images_restored": 0, "images_refused": 0}

    def _rows(self, i: int) -> slice:
        return slice(i * self.W, (i + 1) * self.W)

    def checksum(self, img: int) -> torch.Tensor:
        """The image's checksum as a 0-dim int64 tensor on the cache's device (sums wrap mod
        2**64, the same on every device). Computing it reads nothing back to the host."""
        rows = self.cache.image_ring[:, self._rows(img)]
        ints = rows.contiguous().view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[rows.element_size()])
        return ints.to(torch.int64).sum() * 1_000_003 + self.cache.image_cursor[img].sum()

    def seal(self, img: int, position: int) -> None:
        """The forward has written the image: record what it is. The checksum stays on the
        device (no read inside a step); `valid` reads it when a hit wants the image."""
        self.meta[img] = (self.cache.geo.layout_id, position, self.checksum(img))
        self.stats["images_stored"] += 1

    def valid(self, img: int, position: int) -> bool:
        """Same geometry, same position and an intact checksum (read back here: a restore is
        decided in `schedule`, before a step's device work)."""
        meta = self.meta.get(img)
        ok = (meta is not None and meta[:2] == (self.cache.geo.layout_id, position)
              and int(meta[2]) == int(self.checksum(img)))
        if not ok:
            self.stats["images_refused"] += 1
        return ok

    def restore(self, img: int, slot: int) -> None:
        """The entire state at the image's boundary into the slot (rings of every layer and the
        cursor); the slot's FP32 tails are left alone: a boundary is a multiple of every ratio,
        so the resumed forward writes a tail before it reads one."""
        c = self.cache
        c.ring[:, self._rows(slot)] = c.image_ring[:, self._rows(img)]
        c.cursor[slot] = c.image_cursor[img]
        self.stats["images_restored"] += 1

    def forget(self, img: int) -> None:
        self.meta.pop(img, None)
