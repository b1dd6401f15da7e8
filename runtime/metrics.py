"""A small Prometheus text exposition (format 0.0.4): counters, gauges and histograms with
optional labels, and the serving metrics of `python -m v41.serve`.

Written here rather than taken from `prometheus_client` so the server has no extra dependency;
the output parses with any Prometheus scraper. Every metric is thread-safe: the engine thread
observes, the HTTP thread renders.
"""
from __future__ import annotations

import math
import threading

_LOCK = threading.Lock()


def _fmt(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    if v == -math.inf:
        return "-Inf"
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def _labels(names: tuple, values: tuple, extra: tuple = ()) -> str:
    pairs = list(zip(names, values)) + list(extra)
    if not pairs:
        return ""
    esc = lambda s: str(s).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')  # noqa: E731
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in pairs) + "}"


class _Metric:
    """`const` labels (the model name) are fixed for the metric's life, so callers name only the
    labels that vary; a metric with none of those shows its one series from the start."""
    kind = ""

    def __init__(self, name: str, help: str, labelnames: tuple = (), const: dict | None = None):
        self.const = dict(const or {})
        self.name, self.help, self.labelnames = name, help, tuple(self.const) + tuple(labelnames)
        self._values: dict[tuple, object] = {}
        if not labelnames:
            self.touch()

    def _zero(self):
        return 0.0

    def _key(self, labels: dict) -> tuple:
        labels = {**self.const, **labels}
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name}: labels {sorted(labels)} != {sorted(self.labelnames)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def touch(self, **labels) -> None:
        """Show the series (at zero) before its first observation."""
        k = self._key(labels)
        with _LOCK:
            self._values.setdefault(k, self._zero())

    def get(self, **labels) -> float:
        return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        with _LOCK:
            for key, v in sorted(self._values.items()):
                out += self._render_one(key, v)
        return out

    def _render_one(self, key, v) -> list[str]:
        return [f"{self.name}{_labels(self.labelnames, key)} {_fmt(v)}"]


class Counter(_Metric):
    kind = "counter"

    def inc(self, amount: float = 1.0, **labels) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        k = self._key(labels)
        with _LOCK:
            self._values[k] = self._values.get(k, 0.0) + amount


class Gauge(_Metric):
    kind = "gauge"

    def set(self, value: float, **labels) -> None:
        k = self._key(labels)
        with _LOCK:
            self._values[k] = float(value)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: list[float], labelnames: tuple = (),
                 const: dict | None = None):
        self.buckets = sorted(float(b) for b in buckets) + [math.inf]
        super().__init__(name, help, labelnames, const)

    def _zero(self):
        return [[0] * len(self.buckets), 0.0, 0]   # cumulative-free bucket counts, sum, count

    def observe(self, value: float, **labels) -> None:
        k = self._key(labels)
        with _LOCK:
            h = self._values.setdefault(k, self._zero())
            for i, b in enumerate(self.buckets):
                if value <= b:
                    h[0][i] += 1
                    break
            h[1] += value
            h[2] += 1

    def count(self, **labels) -> int:
        h = self._values.get(self._key(labels))
        return h[2] if h else 0

    def _render_one(self, key, h) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, h[0]):
            acc += c
            out.append(f"{self.name}_bucket{_labels(self.labelnames, key, (('le', _fmt(b)),))} {acc}")
        lab = _labels(self.labelnames, key)
        out += [f"{self.name}_sum{lab} {_fmt(h[1])}", f"{self.name}_count{lab} {h[2]}"]
        return out


class Registry:
    """Metrics that all carry the labels `const` (e.g. model_name), rendered in creation order."""

    def __init__(self, **const):
        self.const, self.metrics = const, []

    def _add(self, m: _Metric):
        self.metrics.append(m)
        return m

    def counter(self, name: str, help: str, labelnames: tuple = ()) -> Counter:
        return self._add(Counter(name, help, labelnames, self.const))

    def gauge(self, name: str, help: str) -> Gauge:
        return self._add(Gauge(name, help, (), self.const))

    def histogram(self, name: str, help: str, buckets: list[float]) -> Histogram:
        return self._add(Histogram(name, help, buckets, (), self.const))

    def render(self) -> str:
        return "\n".join(line for m in self.metrics for line in m.render()) + "\n"


_LATENCY = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_TPOT = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0]
_TOKENS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]


class ServingMetrics:
    """What `GET /metrics` shows. Names follow vLLM's with a `v41:` prefix; every series carries
    the served model name."""

    def __init__(self, model_name: str):
        r = self.registry = Registry(model_name=model_name)
        g, c, h = r.gauge, r.counter, r.histogram
        self.running = g("v41:num_requests_running", "Requests in the running batch.")
        self.waiting = g("v41:num_requests_waiting", "Requests waiting to be scheduled.")
        self.page_usage = g("v41:kv_cache_usage_perc", "Fraction of cache pages held by requests (1 = full).")
        self.slot_usage = g("v41:state_slot_usage_perc",
                            "Fraction of STATE slots held by running requests (1 = full).")
        self.pages_free = g("v41:num_free_pages", "Cache pages on the free list.")
        self.pages_total = g("v41:num_pages", "Cache pages in the pool.")
        self.slots_free = g("v41:num_free_slots", "STATE slots on the free list.")
        self.slots_total = g("v41:num_slots", "STATE slots in the pool.")
        self.prefix_hit_rate = g("v41:prefix_cache_hit_rate",
                                 "Prompt tokens served from the prefix cache / prompt tokens (since start).")
        self.prefix_queries = c("v41:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = c("v41:prefix_cache_hits_total", "Prompt tokens served from the prefix cache.")
        self.cached_pages = g("v41:prefix_cache_pages", "Cached pages no request holds (evictable).")
        self.images_stored = g("v41:checkpoint_images_stored", "Checkpoint images written (copy mode).")
        self.images_restored = g("v41:checkpoint_images_restored", "Checkpoint images restored into a slot.")
        self.images_refused = g("v41:checkpoint_images_refused",
                                "Images refused (another geometry, position or altered bytes).")
        self.replayed_rows = g("v41:prefix_replayed_rows",
                               "Rows recomputed below prefix hits (replay start or image boundary).")
        self.prompt_tokens = c("v41:prompt_tokens_total", "Prefill tokens processed.")
        self.generation_tokens = c("v41:generation_tokens_total", "Generated tokens.")
        self.preemptions = c("v41:num_preemptions_total", "Requests preempted.")
        self.steps = c("v41:engine_steps_total", "Engine steps run.")
        self.requests = c("v41:request_success_total",
                          "Finished requests by finish reason (abort = cancelled).", ("finished_reason",))
        self.invariant_failures = c("v41:block_manager_check_failures_total",
                                    "Block manager invariant checks that failed.")
        self.ttft = h("v41:time_to_first_token_seconds", "Time to first token.", _LATENCY)
        self.tpot = h("v41:time_per_output_token_seconds",
                      "Mean time per output token after the first, per request.", _TPOT)
        self.itl = h("v41:inter_token_latency_seconds", "Time between consecutive tokens of a request.", _TPOT)
        self.e2e = h("v41:e2e_request_latency_seconds",
                     "End-to-end request latency (arrival to last token).", _LATENCY)
        self.queue_time = h("v41:request_queue_time_seconds", "Arrival to first scheduled step.", _LATENCY)
        self.prompt_len = h("v41:request_prompt_tokens", "Prompt length of requests.", _TOKENS)
        self.gen_len = h("v41:request_generation_tokens", "Generated tokens per request.", _TOKENS)
        for reason in ("stop", "length", "abort"):
            self.requests.touch(finished_reason=reason)

    def render(self) -> str:
        return self.registry.render()


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}; for tests and the benchmark."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, val = line.rpartition(" ")
        out[key] = float(val)
    return out
