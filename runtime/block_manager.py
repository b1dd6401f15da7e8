"""Pages (PAGE units of owner rows, one block id per `page_tokens` tokens) and STATE slots (one
per running request), each on a free list. A request holds pages for every token it has
committed or is about to compute and one slot while it runs."""
from __future__ import annotations

from collections import deque

import numpy as np

from runtime.sequence import Sequence


class BlockManager:
    def __init__(self, num_pages: int, num_slots: int, page_tokens: int, max_pages_per_seq: int):
        self.page_tokens = page_tokens
        # block table rows live with the slot, so a step gathers them without touching pages
        self.table = np.zeros((num_slots, max_pages_per_seq), dtype=np.int64)
        self.num_pages, self.num_slots = num_pages, num_slots
        self.free_pages = deque(range(num_pages))
        self.free_slots = deque(range(num_slots))

    def allocate(self, seq: Sequence, n_tokens: int) -> bool:
        """Pages up to position num_computed + n_tokens, and a slot if the request has none;
        False (and nothing taken) when they are not free."""
        need = -(-(seq.num_computed + n_tokens) // self.page_tokens) - len(seq.pages)
        if need > len(self.free_pages) or (seq.slot is None and not self.free_slots):
            return False
        if seq.slot is None:
            seq.slot = self.free_slots.popleft()
        for _ in range(need):
            self.table[seq.slot, len(seq.pages)] = page = self.free_pages.popleft()
            seq.pages.append(page)
        return True

    def free(self, seq: Sequence) -> None:
        self.free_pages.extend(seq.pages)
        seq.pages = []
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None

    @property
    def all_free(self) -> bool:
        return len(self.free_pages) == self.num_pages and len(self.free_slots) == self.num_slots

    def check(self, live: list[Sequence]) -> None:
        """Invariants: every page and slot is free or held by exactly one live request."""
        held_pages = [p for s in live for p in s.pages]
        held_slots = [s.slot for s in live if s.slot is not None]
        pages = held_pages + list(self.free_pages)
        slots = held_slots + list(self.free_slots)
        assert sorted(pages) == list(range(self.num_pages)), "page leaked or shared"
        assert sorted(slots) == list(range(self.num_slots)), "slot leaked or shared"
