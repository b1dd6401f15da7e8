"""benchmarks/profiling.py's arithmetic on device events (the profiling itself needs a GPU)."""
from benchmarks.profiling import gaps_between


def test_gaps_between_merges_overlaps_and_names_the_largest_idle_intervals():
    # µs: a and b overlap (busy 0-12 ms), c and d touch (20-30), e alone (40-41)
    ev = [(20e3, 25e3, "c"), (0, 10e3, "a"), (5e3, 12e3, "b"), (25e3, 30e3, "d"), (40e3, 41e3, "e")]
    g = gaps_between(ev, top=2)
    assert (g["span_ms"], g["busy_ms"], g["idle_ms"], g["events"]) == (41.0, 23.0, 18.0, 5)
    assert g["largest"] == [{"ms": 10.0, "after": "d", "before": "e"}, {"ms": 8.0, "after": "b", "before": "c"}]


def test_an_event_inside_another_leaves_the_outer_one_as_the_last_before_a_gap():
    g = gaps_between([(0, 10e3, "outer"), (2e3, 3e3, "inner"), (15e3, 16e3, "next")])
    assert g["busy_ms"] == 11.0 and g["largest"] == [{"ms": 5.0, "after": "outer", "before": "next"}]
    assert gaps_between([]) == {}
