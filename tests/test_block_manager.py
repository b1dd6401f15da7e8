"""The block manager on its own (no model): page and slot accounting, the chained prefix cache,
LRU eviction and checkpoint images, each asserted exactly. Fast, so mutation testing
(docs/mutation.md) runs it for every mutant."""
import numpy as np
import pytest

from runtime.block_manager import BlockManager
from runtime.sequence import SamplingParams, Sequence

P = 4  # page tokens


def seq(tokens) -> Sequence:
    return Sequence(list(tokens), SamplingParams())


def bm(pages=6, slots=2, images=0, caching=True) -> BlockManager:
    return BlockManager(pages, slots, P, max_pages_per_seq=4, prefix_caching=caching, num_images=images)


def computed(m: BlockManager, s: Sequence, n: int) -> None:
    """The request's first n tokens are computed: allocate, advance, publish."""
    assert m.allocate(s, n - s.num_computed)
    s.num_computed = n
    m.register(s)


def test_allocate_takes_pages_and_a_slot_and_free_returns_them():
    m = bm()
    s = seq(range(10))
    assert m.allocate(s, 5) and s.pages == [0, 1] and s.slot == 0
    assert m.table[0, :2].tolist() == [0, 1] and m.num_available_pages == 4
    s.num_computed = 5
    assert m.allocate(s, 3) and s.pages == [0, 1]          # 8 tokens still fit 2 pages
    assert m.allocate(s, 4) and s.pages == [0, 1, 2]       # 9 tokens take a third
    assert m.table[0, :3].tolist() == [0, 1, 2] and m.ref[:4] == [1, 1, 1, 0]
    m.check([s])
    m.free(s)
    assert s.pages == [] and s.slot is None and m.all_free and m.num_available_pages == 6
    assert list(m.free_pages) == [3, 4, 5, 0, 1, 2] and list(m.free_slots) == [1, 0]
    m.check([])


def test_allocate_takes_nothing_when_it_cannot_fit():
    m = bm(pages=3, slots=1)
    a, b = seq(range(9)), seq(range(3))
    assert not m.allocate(a, 13)                            # 4 pages > 3
    assert a.pages == [] and a.slot is None and m.num_available_pages == 3
    assert m.allocate(a, 12) and a.pages == [0, 1, 2]       # exactly 3 pages
    assert not m.allocate(b, 1) and b.slot is None          # no slot left
    m.free(a)
    assert m.allocate(b, 1) and b.slot == 0
    m.check([b])


def test_slot_keeps_block_table_of_shared_pages():
    m = bm()
    a = seq(range(9))
    computed(m, a, 9)
    b = seq(list(range(8)) + [99])
    pages = m.match(b)
    assert pages == a.pages[:2]
    m.share(b, pages)
    assert m.ref[pages[0]] == 2 and b.slot is None
    b.num_computed = 8
    assert m.allocate(b, 1)
    assert b.slot == 1 and m.table[1, :3].tolist() == b.pages and b.pages[:2] == pages
    m.check([a, b])


def test_page_hashes_are_chained_and_memoized():
    m = bm()
    a, b = seq([1, 2, 3, 4, 5, 6, 7, 8]), seq([9, 9, 9, 9, 5, 6, 7, 8])
    ha, hb = m.page_hashes(a, 2), m.page_hashes(b, 2)
    assert ha[0] != hb[0] and ha[1] != hb[1]               # same tokens in PAGE 1, other prefix
    assert ha == [hash((0, (1, 2, 3, 4))), hash((ha[0], (5, 6, 7, 8)))]
    assert m.page_hashes(a, 1) == ha[:1] and a.page_hashes == ha


def test_match_needs_the_whole_chain_and_never_the_last_token():
    m = bm(pages=12, slots=4)
    x, y, z = [1] * P, [2] * P, [3] * P
    a = seq(x + y + [7])
    computed(m, a, 9)
    assert m.match(seq(x + y + [8])) == a.pages[:2]
    assert m.match(seq(x + y)) == a.pages[:1]              # page-aligned: one PAGE short
    assert m.match(seq(x)) == [] and m.match(seq(x + [5])) == a.pages[:1]
    assert m.match(seq(z + y + [8])) == []                 # Y after another prefix
    b = seq(z + y + [6])
    computed(m, b, 9)
    assert m.match(seq(z + y + [5])) == b.pages[:2]        # not a's copy of Y
    assert m.stats["queries"] == 6 and m.stats["query_tokens"] == 9 + 8 + 4 + 5 + 9 + 9
    m.free(a), m.free(b)
    m.check([])


def test_match_checks_the_tokens_behind_a_hash():
    m = bm()
    a = seq([1, 2, 3, 4, 5])
    computed(m, a, 5)
    probe = seq([1, 2, 3, 4, 6])
    h = m.page_hashes(probe, 1)[0]
    m.page_key[a.pages[0]] = (h, (4, 3, 2, 1))             # a colliding hash with other tokens
    assert m.match(probe) == []


def test_match_is_off_without_prefix_caching():
    m = bm(caching=False)
    a = seq(range(9))
    computed(m, a, 9)
    assert m.match(seq(range(9))) == [] and m.cached == {} and m.stats["queries"] == 0


def test_register_publishes_only_full_computed_prompt_pages():
    m = bm()
    a = seq(range(10))
    assert m.allocate(a, 10)
    a.num_computed = 3
    assert m.register(a) == []
    a.num_computed = 5
    assert m.register(a) == [(a.pages[0], 4)]
    a.num_computed = 9
    assert m.register(a) == [(a.pages[1], 8)]             # past the page published before
    assert m.register(a) == []                             # already published
    a.token_ids += [50, 51, 52, 53, 54, 55]                # generated tokens are never cached
    a.num_computed = 16
    assert m.allocate(a, 0) and m.register(a) == []
    assert len(m.cached) == 2 and set(m.page_key) == set(a.pages[:2])


def test_a_prefix_computed_twice_keeps_the_first_copy():
    m = bm(images=2)
    a, b = seq(range(6)), seq(range(6))
    assert m.allocate(a, 6) and m.allocate(b, 6)
    img = m.take_image(b.pages[0])
    a.num_computed = b.num_computed = 6
    assert m.register(a) == [(a.pages[0], 4)]
    assert m.register(b) == [] and m.cached[m.page_hashes(b, 1)[0]] == a.pages[0]
    assert b.pages[0] not in m.image_of and img in m.free_images
    m.free(b)
    assert m.num_available_pages == 4 and 3 in m.free_pages  # b's copy is free again, not cached
    c = seq([0, 1, 2, 3, 9, 9, 9, 9, 9])                   # a's first PAGE, then its own
    assert m.allocate(c, 9)
    c.num_computed = 9
    assert m.register(c) == [(c.pages[1], 8)]             # past the PAGE it shares with a
    m.check([a, c])


def test_cached_pages_are_evicted_least_recently_used_first():
    m = bm(pages=4, slots=2)
    a, b = seq([1] * 5), seq([2] * 5)
    computed(m, a, 5)
    computed(m, b, 5)
    m.free(b), m.free(a)                                   # a freed last: most recently used
    assert list(m.evictable) == [2, 0] and list(m.free_pages) == [3, 1]
    assert m.num_available_pages == 4
    c = seq([3] * 9)
    assert m.allocate(c, 9) and c.pages == [3, 1, 2]       # 2 free pages, then b's cached one
    assert m.stats["evictions"] == 1 and m.match(seq([2] * 5)) == [] and m.match(seq([1] * 5)) != []
    m.check([c])
    m.free(c)
    m.check([])


def test_reused_cached_page_leaves_the_eviction_list():
    m = bm(pages=3, slots=2)
    a = seq([1] * 5)
    computed(m, a, 5)
    page = a.pages[0]
    m.free(a)
    assert page in m.evictable
    b = seq([1] * 5)
    m.share(b, m.match(b))
    assert page not in m.evictable and m.ref[page] == 1
    assert m.allocate(b, 1)
    c = seq([4] * 9)
    assert not m.allocate(c, 9)                            # the shared page is not evictable
    m.check([b])


def test_images_belong_to_cached_pages():
    m = bm(pages=4, slots=2, images=2)
    a = seq(range(9))
    assert m.allocate(a, 9)
    i0, i1 = m.take_image(a.pages[0]), m.take_image(a.pages[1])
    assert (i0, i1) == (0, 1) and m.take_image(a.pages[0]) == 0 and m.take_image(a.pages[2]) is None
    a.num_computed = 9
    m.register(a)
    m.free(a)
    assert m.image_of == {0: 0, 1: 1}                      # pages 0 and 1 stay cached with them
    m.check([])
    b = seq([7] * 13)
    assert m.allocate(b, 13)                               # evicts both cached pages
    assert m.image_of == {} and sorted(m.free_images) == [0, 1]
    m.check([b])


def test_an_uncached_page_drops_its_image_when_freed():
    m = bm(images=1)
    a = seq(range(3))
    assert m.allocate(a, 3)
    assert m.take_image(a.pages[0]) == 0
    m.free(a)
    assert m.image_of == {} and list(m.free_images) == [0]


def test_reset_prefix_cache_frees_cached_pages_and_images_only_when_nothing_is_held():
    m = bm(pages=4, slots=2, images=2)
    a = seq(range(9))
    computed(m, a, 9)
    m.take_image(a.pages[0])
    assert not m.reset_prefix_cache()                      # a holds its pages: nothing forgotten
    assert len(m.cached) == 2 and m.image_of == {0: 0}
    m.free(a)
    assert m.reset_prefix_cache()
    assert m.cached == {} and m.page_key == {} and not m.evictable and m.image_of == {}
    assert sorted(m.free_pages) == [0, 1, 2, 3] and sorted(m.free_images) == [0, 1]
    assert m.match(seq(range(9))) == []
    m.check([])


def test_replay_resumes_one_hash_block_below_the_hit():
    assert bm().replay_start(12) == 8


@pytest.mark.parametrize("corrupt, message", [
    ("ref", "page reference counts disagree with the live requests$"),
    ("held-and-free", r"page \d+ leaked or shared wrongly$"), ("free-twice", "page on two free lists$"),
    ("free-and-cached", "page on two free lists$"), ("lost", r"page \d+ leaked or shared wrongly$"),
    ("uncached-evictable", r"evictable page \d+ is not cached$"), ("slot", "slot leaked or shared$"),
    ("image", "image leaked or shared$"), ("image-of-uncached", "image of an uncached page$")])
def test_check_sees_every_leak(corrupt, message):
    m = bm(images=2)
    a = seq(range(9))
    computed(m, a, 9)
    m.take_image(a.pages[0])
    b = seq(range(20, 29))
    computed(m, b, 9)
    m.free(b)                                              # b's first two pages: cached, unreferenced
    m.check([a])
    free, cached = m.free_pages[0], next(iter(m.evictable))
    if corrupt == "ref":
        m.ref[a.pages[0]] += 1
    elif corrupt == "held-and-free":
        m.free_pages.append(a.pages[0])
    elif corrupt == "free-twice":
        m.free_pages.append(free)
    elif corrupt == "free-and-cached":
        m.free_pages.append(cached)
    elif corrupt == "lost":
        m.free_pages.remove(free)
    elif corrupt == "uncached-evictable":
        m.evictable[free] = None
        m.free_pages.remove(free)
    elif corrupt == "slot":
        m.free_slots.append(a.slot)
    elif corrupt == "image":
        m.free_images.append(0)
    else:
        m.image_of[a.pages[2]] = m.free_images.popleft()
    with pytest.raises(AssertionError, match="^" + message):
        m.check([a])


def test_all_free_needs_every_slot_back():
    m = bm()
    a = seq(range(3))
    assert m.allocate(a, 3) and not m.all_free
    a.slot, slot = None, a.slot
    m.ref[a.pages[0]] = 0
    assert not m.all_free and np.all(m.table[slot, :1] == a.pages)


def test_defaults_cache_nothing_and_keep_no_images():
    m = BlockManager(4, 1, P, max_pages_per_seq=2)
    a = seq(range(9))
    assert m.allocate(a, 8)
    a.num_computed = 8
    assert m.register(a) == [] and m.match(seq(range(9))) == [] and m.take_image(0) is None


def test_every_eviction_is_counted():
    m = bm(pages=2, slots=2)
    for tokens in ([1] * 5, [2] * 5, [3] * 5):
        s = seq(tokens)
        computed(m, s, 5)
        m.free(s)
    assert m.stats["evictions"] == 2
    s = seq([4] * 9)
    assert m.allocate(s, 8) and m.stats["evictions"] == 3


def test_a_request_with_a_slot_needs_no_free_slot():
    m = bm(pages=4, slots=1)
    a = seq(range(9))
    assert m.allocate(a, 4) and not m.free_slots
    a.num_computed = 4
    assert m.allocate(a, 4) and len(a.pages) == 2            # grows without a second slot
    assert not m.allocate(seq(range(3)), 1)                # pages free, but no slot
