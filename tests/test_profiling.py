"""benchmarks/profiling.py's arithmetic on device events (the profiling itself needs a GPU)."""
from types import SimpleNamespace

import torch

from benchmarks.profiling import attribute_idle, gaps_between, kernel_table


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


def test_idle_time_goes_to_the_innermost_host_phase_running_then():
    """The device idles before its first kernel (the step's host start at 0) and between
    kernels; each idle moment belongs to the innermost phase the host ran then, 'engine' outside
    every phase."""
    kernels = [(3e3, 10e3, "forward"), (14e3, 15e3, "scatter"), (20e3, 22e3, "draft")]
    ranges = [(0, 22e3, "engine"), (1e3, 11e3, "runner.run"), (1e3, 2e3, "runner.prepare"),
              (11e3, 13e3, "runner.spec.accept"), (15e3, 19e3, "runner.spec.propose"),
              (16e3, 18e3, "runner.spec.roll_back")]
    got = attribute_idle(kernels, ranges)
    assert (got["span_ms"], got["busy_ms"], got["idle_ms"]) == (22.0, 10.0, 12.0)
    # idle 0-3: engine 0-1, prepare 1-2, run 2-3; 10-14: run 10-11, accept 11-13, engine 13-14;
    # 15-20: propose 15-16 and 18-19, roll_back 16-18, engine 19-20
    assert got["idle_ms_by_phase"] == {"engine": 3.0, "runner.run": 2.0, "runner.spec.accept": 2.0,
                                       "runner.spec.propose": 2.0, "runner.spec.roll_back": 2.0,
                                       "runner.prepare": 1.0}
    assert sum(got["idle_ms_by_phase"].values()) == got["idle_ms"]
    assert attribute_idle([], ranges) == {}


def test_the_kernel_table_lists_every_kernel_by_total_then_the_first_in_start_order():
    def ev(name, a, b, dev=torch.autograd.DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=dev,
                               time_range=SimpleNamespace(start=a, end=b, elapsed_us=lambda: b - a))
    # the second gemv starts inside the first (a dependent launch): 16 µs summed, 14 busy
    events = [ev("gemv", 10, 14), ev("norm", 0, 2), ev("gemv", 12, 22), ev("step:runner.run", 0, 40),
              ev("aten::mm", 0, 50, torch.autograd.DeviceType.CPU)]
    lines = kernel_table(events, order=2).splitlines()
    assert lines[0] == "3 kernels, 0.016 ms summed, 0.014 ms busy"
    assert lines[2].split() == ["2", "14.0", "7.00", "gemv"] and lines[3].split() == ["1", "2.0", "2.00", "norm"]
    assert lines[4:] == ["first 2 kernels in order:", "      2.00  norm", "      4.00  gemv"]


def test_busy_time_counts_overlapping_kernels_once():
    """Under programmatic dependent launch a kernel starts inside the one before it: busy time
    merges them (kernel_time's device ms), a sum of durations would not."""
    from benchmarks.profiling import busy_ms
    assert busy_ms([(0, 4e3, "a"), (3e3, 6e3, "b"), (8e3, 9e3, "c")]) == 7.0
    assert busy_ms([]) == 0.0
