"""Pages (PAGE units of owner rows, one block id per `page_tokens` tokens), STATE slots (one per
running request) and the prefix cache over pages.

A page is free, held (reference count > 0: one per request whose block table names it), or
cached and unreferenced: it keeps its rows and its chained hash so a later prompt can share
it, and is evicted least recently used first when pages run out. A full prompt PAGE is
hashed with the hash of the PAGE before it, so one hash names the whole prefix. Under
`StateTransfer.copy` a cached page may also own a checkpoint image of the request state at its
end boundary (`images`).
"""
from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from runtime.sequence import Sequence


class BlockManager:
    def __init__(self, num_pages: int, num_slots: int, page_tokens: int, max_pages_per_seq: int,
                 prefix_caching: bool = False, num_images: int = 0):
        self.page_tokens = page_tokens
        self.num_pages, self.num_slots, self.num_images = num_pages, num_slots, num_images
        self.prefix_caching = prefix_caching
        self.free_pages = deque(range(num_pages))
        self.free_slots = deque(range(num_slots))
        self.free_images = deque(range(num_images))
        self.ref = [0] * num_pages
        self.cached: dict[int, int] = {}           # prefix hash -> page
        self.page_key: dict[int, tuple] = {}       # page -> (hash, its tokens) for verification
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached pages with ref 0, LRU first
        self.image_of: dict[int, int] = {}         # page -> checkpoint image at its end boundary
        # block table rows live with the slot, so a step gathers them without touching pages
        self.table = np.zeros((num_slots, max_pages_per_seq), dtype=np.int64)
        self.stats = {"queries": 0, "query_tokens": 0, "hit_tokens": 0, "evictions": 0}

    # ---- allocation -------------------------------------------------------------------------
    @property
    def num_available_pages(self) -> int:
        return len(self.free_pages) + len(self.evictable)

    def _take_page(self) -> int:
        if self.free_pages:
            page = self.free_pages.popleft()
        else:
            page, _ = self.evictable.popitem(last=False)
            self._uncache(page)
            self.stats["evictions"] += 1
        self.ref[page] = 1
        return page

    def allocate(self, seq: Sequence, n_tokens: int) -> bool:
        """Pages up to position num_computed + n_tokens, and a slot if the request has none;
        False (and nothing taken) when they are not available."""
        need = -(-(seq.num_computed + n_tokens) // self.page_tokens) - len(seq.pages)
        if need > self.num_available_pages or (seq.slot is None and not self.free_slots):
            return False
        if seq.slot is None:
            seq.slot = self.free_slots.popleft()
            self.table[seq.slot, : len(seq.pages)] = seq.pages
        for _ in range(need):
            self.table[seq.slot, len(seq.pages)] = page = self._take_page()
            seq.pages.append(page)
        return True

    def free(self, seq: Sequence) -> None:
        for page in seq.pages:
            self.ref[page] -= 1
            if self.ref[page] == 0:
                if page in self.page_key:
                    self.evictable[page] = None     # most recently used last
                else:
                    self.drop_image(page)
                    self.free_pages.append(page)
        seq.pages = []
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None

    # ---- prefix cache -----------------------------------------------------------------------
    def page_hashes(self, seq: Sequence, n_pages: int) -> list[int]:
        """Chained hashes of the request's first n_pages full PAGEs (memoized on the request)."""
        hs, P = seq.page_hashes, self.page_tokens
        while len(hs) < n_pages:
            i = len(hs)
            hs.append(hash((hs[-1] if hs else 0, tuple(seq.token_ids[i * P:(i + 1) * P]))))
        return hs[:n_pages]

    def match(self, seq: Sequence) -> list[int]:
        """Pages of the longest cached prefix of the prompt, in whole PAGEs, never covering the
        last prompt token (something must be computed to sample)."""
        if not self.prefix_caching:
            return []
        P = self.page_tokens
        n = (seq.num_prompt_tokens - 1) // P
        pages = []
        for i, h in enumerate(self.page_hashes(seq, n)):
            page = self.cached.get(h)
            if page is None or self.page_key[page][1] != tuple(seq.token_ids[i * P:(i + 1) * P]):
                break
            pages.append(page)
        self.stats["queries"] += 1
        self.stats["query_tokens"] += seq.num_prompt_tokens
        return pages

    def replay_start(self, hit: int) -> int:
        """Encoder SWA bounded replay resumes one whole hash block below a hit, so the rebuilt
        rings hold at least window - 1 rows before the first uncached token."""
        return hit - self.page_tokens

    def share(self, seq: Sequence, pages: list[int]) -> None:
        """The request starts with these cached pages in its block table."""
        assert not seq.pages
        for page in pages:
            if self.ref[page] == 0:
                self.evictable.pop(page, None)
            self.ref[page] += 1
        seq.pages = list(pages)

    def register(self, seq: Sequence) -> list[tuple[int, int]]:
        """Publish the request's full prompt PAGEs whose rows are now all written. Returns the
        newly cached (page, end position) pairs."""
        if not self.prefix_caching:
            return []
        P = self.page_tokens
        n = min(seq.num_computed, seq.num_prompt_tokens) // P
        new = []
        for i, h in enumerate(self.page_hashes(seq, n)):
            page = seq.pages[i]
            if page in self.page_key:
                continue
            if h in self.cached:  # the same prefix computed twice: keep the first copy
                self.drop_image(page)
                continue
            self.cached[h] = page
            self.page_key[page] = (h, tuple(seq.token_ids[i * P:(i + 1) * P]))
            new.append((page, (i + 1) * P))
        return new

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix: the unreferenced cached pages and their images go back to
        the free lists. False, and nothing forgotten, while a request holds pages (its pages'
        hashes are what later steps register against)."""
        if any(self.ref):
            return False
        for page in self.evictable:
            self._uncache(page)
            self.free_pages.append(page)
        self.evictable.clear()
        return True

    def _uncache(self, page: int) -> None:
        h, _ = self.page_key.pop(page)
        del self.cached[h]
        self.drop_image(page)

    # ---- checkpoint images (StateTransfer.copy) ---------------------------------------------------
    def take_image(self, page: int) -> int | None:
        if page in self.image_of:
            return self.image_of[page]
        if not self.free_images:
            return None
        self.image_of[page] = img = self.free_images.popleft()
        return img

    def drop_image(self, page: int) -> None:
        img = self.image_of.pop(page, None)
        if img is not None:
            self.free_images.append(img)

    # ---- invariants -----------------------------------------------------------------------------
    @property
    def all_free(self) -> bool:
        """Nothing is held: every page is free or cached-unreferenced, every slot free."""
        return not any(self.ref) and len(self.free_slots) == self.num_slots

    def check(self, live: list[Sequence]) -> None:
        """Every page is free, cached with no reference, or referenced exactly by the live
        requests that hold it; every slot is free or held by one live request."""
        refs = [0] * self.num_pages
        for s in live:
            for p in s.pages:
                refs[p] += 1
        assert refs == self.ref, "page reference counts disagree with the live requests"
        free, ev = set(self.free_pages), set(self.evictable)
        assert len(free) == len(self.free_pages) and not free & ev, "page on two free lists"
        for p in range(self.num_pages):
            state = (p in free) + (p in ev) + (refs[p] > 0)
            assert state == 1, f"page {p} leaked or shared wrongly"
            assert p not in ev or p in self.page_key, f"evictable page {p} is not cached"
        slots = [s.slot for s in live if s.slot is not None] + list(self.free_slots)
        assert sorted(slots) == list(range(self.num_slots)), "slot leaked or shared"
        images = list(self.image_of.values()) + list(self.free_images)
        assert sorted(images) == list(range(self.num_images)), "image leaked or shared"
        assert all(p in self.page_key for p in self.image_of), "image of an uncached page"
