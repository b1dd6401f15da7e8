"""One engine step under torch.profiler, its phases named: where a step's time goes.

`profile_step(eng, title, path)` runs `eng.step()` once under the profiler with each phase in
`phases` wrapped in a `record_function` range `step:<phase>` and appends to `path` a summary
(device busy time; per phase its host time and, from the device's side, the span of the work
it launched) and the profiler's tables sorted by device and by host time. Every profile of a run
goes to one file: a device call brings back few files. The profiler inflates host times several
fold; `phases_timed` gives the same phases' host times of ordinary steps (perf_counter, no sync).
`kernel_time` sums a call's kernels; `kernel_gaps` finds where the device sat idle between them,
`idle_by_phase` which host phase it was waiting for; `host_profile_step` the host's Python by function.
"""
from __future__ import annotations

import contextlib
import statistics
import time

import torch

# the plain step (runtime/engine.py: schedule, prepare, run, sample, logprobs, postprocess)
STEP_PHASES = ("scheduler.schedule", "runner.prepare", "runner.run", "_sample", "_logprobs",
               "scheduler.postprocess")
# DSpark's parts of a step (runtime/spec_step.py)
SPEC_PHASES = ("runner.spec.stage", "runner.spec.keep_context", "runner.spec.accept", "runner.spec.commit",
               "runner.spec.propose", "runner.spec.roll_back")


@contextlib.contextmanager
def _wrapped(eng, phases, around):
    """Each phase (an attribute path from the engine) replaced by `around(name, fn)` while the
    context is open: the wrappers are instance attributes, removed after."""
    wrapped = []
    for path in phases:
        *up, name = path.split(".")
        obj = eng
        for attr in up:
            obj = getattr(obj, attr)
        setattr(obj, name, around(path, getattr(obj, name)))
        wrapped.append((obj, name))
    try:
        yield
    finally:
        for obj, name in wrapped:
            delattr(obj, name)


@contextlib.contextmanager
def phases_named(eng, phases=STEP_PHASES):
    """Each phase as a profiler range `step:<phase>`."""
    from torch.profiler import record_function

    def around(path, fn):
        def ranged(*a, **k):
            with record_function(f"step:{path}"):
                return fn(*a, **k)
        return ranged
    with _wrapped(eng, phases, around):
        yield


@contextlib.contextmanager
def phases_timed(eng, phases=STEP_PHASES):
    """Host time of every call of each phase, ms, without the profiler and without a sync: yields
    {phase: [ms, ...]}. A phase that waits for the device (the copy of the sampled ids) counts
    the wait; nested phases (prepare inside run) count in both."""
    times: dict = {}

    def around(path, fn):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times.setdefault(path, []).append((time.perf_counter() - t) * 1e3)
        return timed
    with _wrapped(eng, phases, around):
        yield times


def median_by_phase(times: dict) -> dict:
    """{phase: median ms} of `phases_timed`'s lists, rounded to µs."""
    return {k: round(statistics.median(v), 3) for k, v in times.items()}


def device_profile(fn):
    """`fn()` under torch.profiler's device activity, synchronized: the profile, or None
    without CUDA (`fn` still runs)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    if not torch.cuda.is_available():
        fn()
        return None
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof


def kernel_time(fn) -> tuple[float, int]:
    """(device busy ms, count) of the kernels `fn` launches; (NaN, 0) without CUDA. Busy time
    merges overlapping kernels: under programmatic dependent launch a kernel starts before the
    one it follows ends and waits inside, so a sum of durations would count that time twice."""
    prof = device_profile(fn)
    if prof is None:
        return float("nan"), 0
    events = device_events(prof)
    return (busy_ms(events), len(events))


def device_events(prof) -> list:
    """(start µs, end µs, name) of the profile's device events."""
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def busy_ms(events) -> float:
    """Device busy time of (start µs, end µs, name) events in ms, overlaps merged."""
    return idle_intervals(events)[1] / 1e3 if events else 0.0


def kernel_gaps(fn, top: int = 12) -> dict:
    """Where the device idles inside `fn`'s work (a graph replay: no host between its kernels),
    from the profiler's device events: `gaps_between` of them; {} without CUDA."""
    prof = device_profile(fn)
    if prof is None:
        return {}
    return gaps_between(device_events(prof), top)


def idle_intervals(events, start: float | None = None) -> tuple[list, float, float]:
    """Of device events (start µs, end µs, name), from `start` (default: the first event's):
    ([(idle from, idle to, event before, event after)], busy µs with overlaps merged, end µs)."""
    events = sorted(events)
    end = events[0][0] if start is None else start
    busy, idle, last = 0.0, [], None
    for a, b, name in events:
        if a > end:
            idle.append((end, a, last, name))
        busy += max(0.0, b - max(a, end))
        if b >= end:
            end, last = b, name
    return idle, busy, end


def gaps_between(events, top: int = 12) -> dict:
    """Of device events (start µs, end µs, name): their span, busy time (overlaps merged), idle
    time, and the `top` largest idle intervals with the events on either side, in ms."""
    if not events:
        return {}
    idle, busy, end = idle_intervals(events)
    span = end - min(e[0] for e in events)
    gaps = sorted(((b - a, x, y) for a, b, x, y in idle), key=lambda g: -g[0])
    return {"span_ms": round(span / 1e3, 3), "busy_ms": round(busy / 1e3, 3), "idle_ms": round((span - busy) / 1e3, 3),
            "events": len(events),
            "largest": [{"ms": round(g / 1e3, 3), "after": x[:80], "before": y[:80]} for g, x, y in gaps[:top]]}


def idle_by_phase(eng, phases=STEP_PHASES) -> dict:
    """One `eng.step()` under the profiler, host and device, its phases named: from the step's
    start on the host to its last kernel, the device's idle time, each moment of it given to the
    innermost phase the host ran then (the device waited for that phase's work), 'engine' outside
    every phase. ms; {} without CUDA. A step that starts after the one before synchronized (its
    sampled ids came back) finds the device idle: so the idle before its first kernel counts.
    The profiler slows the host several fold: compare the phases' shares, not their ms."""
    from torch.profiler import ProfilerActivity, profile as torch_profile, record_function
    if not torch.cuda.is_available():
        eng.step()
        return {}
    with phases_named(eng, phases), torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("step:engine"):
            eng.step()
        torch.cuda.synchronize()
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    ranges = [(e.time_range.start, e.time_range.end, e.name[5:]) for e in prof.events()
              if e.device_type == cpu and e.name.startswith("step:")]
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
               if e.device_type == cuda and not e.name.startswith("step:")]
    return attribute_idle(kernels, ranges)


def attribute_idle(kernels, ranges) -> dict:
    """`kernels` (start µs, end µs, name) on the device; `ranges` (start µs, end µs, phase) on
    the host, nested, the outermost 'engine' (the step): the step's span (its start to its last
    kernel's end), busy and idle ms, and the idle ms by the innermost range running then."""
    step = next(r for r in ranges if r[2] == "engine")
    if not kernels:
        return {}
    idle, busy, end = idle_intervals(kernels, start=step[0])
    by: dict = {}
    for a, b, _, _ in idle:
        cuts = sorted({a, b} | {t for r in ranges for t in r[:2] if a < t < b})
        for x, y in zip(cuts, cuts[1:]):
            inner = max((r for r in ranges if r[0] <= x and y <= r[1]), key=lambda r: (r[0], -r[1]), default=None)
            name = inner[2] if inner is not None else "engine"
            by[name] = by.get(name, 0.0) + (y - x)
    return {"span_ms": round((end - step[0]) / 1e3, 3), "busy_ms": round(busy / 1e3, 3),
            "idle_ms": round(sum(b - a for a, b, _, _ in idle) / 1e3, 3),
            "idle_ms_by_phase": {k: round(v / 1e3, 3) for k, v in sorted(by.items(), key=lambda kv: -kv[1])}}


def kernel_table(events, order: int = 0) -> str:
    """Every device kernel of a profile: calls, total and mean µs, by total; then the names of the
    first `order` kernels in start order."""
    ks = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                 and not e.name.startswith("step:")), key=lambda e: e.time_range.start)
    by: dict = {}
    for e in ks:
        n, t = by.get(e.name, (0, 0.0))
        by[e.name] = (n + 1, t + e.time_range.elapsed_us())
    busy = busy_ms([(e.time_range.start, e.time_range.end, e.name) for e in ks])
    # a kernel launched with programmatic dependent launch waits inside while the one before it
    # ends: its duration includes that wait, and the durations' sum exceeds the busy time
    lines = [f"{len(ks)} kernels, {sum(t for _, t in by.values()) / 1e3:.3f} ms summed, {busy:.3f} ms busy",
             f"{'calls':>6} {'total us':>10} {'mean us':>8}  kernel"]
    lines += [f"{n:6d} {t:10.1f} {t / n:8.2f}  {name[:110]}"
              for name, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])]
    if order:
        lines += [f"first {min(order, len(ks))} kernels in order:"]
        lines += [f"  {e.time_range.elapsed_us():8.2f}  {e.name[:110]}" for e in ks[:order]]
    return "\n".join(lines)


def phase_summary(events) -> list[str]:
    """Lines `phase: host ms, device span ms` for the `step:` ranges of a profile's events: a
    range's host event gives its host time, its device-side annotation (on CUDA) the span from
    the first to the last device work launched inside it."""
    host, span, order = {}, {}, []
    for e in sorted((e for e in events if e.name.startswith("step:")), key=lambda e: e.time_range.start):
        name = e.name[5:]
        if name not in order:
            order.append(name)
        if e.device_type == torch.autograd.DeviceType.CPU:
            host[name] = host.get(name, 0.0) + e.cpu_time_total / 1e3
        else:
            span[name] = span.get(name, 0.0) + e.device_time_total / 1e3
    return [f"  {n:28s} host {host.get(n, 0.0):8.3f} ms   device span {span.get(n, float('nan')):8.3f} ms"
            for n in order]


def profile_step(eng, title: str, path: str, phases=STEP_PHASES, rows: int = 40, order: int = 0) -> float:
    """One `eng.step()` under the profiler (CPU and, on CUDA, device activity); appends the
    summary and tables to `path`: on CUDA every kernel by device time, then the first `order`
    kernels in launch order (a layer's sequence, for fusion work). Returns the device's busy
    time, ms (NaN on the CPU)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with phases_named(eng, phases), torch_profile(activities=acts) as prof:
        eng.step()
        if cuda:
            torch.cuda.synchronize()
    avg = prof.key_averages()
    kernel_ms = busy_ms([e for e in device_events(prof) if not e[2].startswith("step:")]) if cuda else float("nan")
    with open(path, "a") as f:
        f.write(f"==== {title}\ndevice busy {kernel_ms:.3f} ms\n")
        f.write("\n".join(phase_summary(prof.events())) + "\n\n")
        if cuda:
            f.write(kernel_table(prof.events(), order) + "\n\n")
        f.write(avg.table(sort_by="cpu_time_total", row_limit=rows, max_name_column_width=70) + "\n\n")
    return kernel_ms


def host_profile_step(eng, title: str, path: str, rows: int = 40) -> None:
    """One `eng.step()` under cProfile: the host's Python by function (a wait for the device
    counts where it happens), its own time and cumulative, appended to `path`."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    eng.step()
    prof.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    with open(path, "a") as f:
        f.write(f"==== {title} (host, cProfile)\n{text.getvalue()}\n")
